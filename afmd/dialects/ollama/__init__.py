"""Ollama's native API on the wire: chat, generate and embed bodies."""
