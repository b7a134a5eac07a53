"""Anthropic's Messages API on the wire."""
