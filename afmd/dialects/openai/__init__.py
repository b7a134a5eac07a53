"""OpenAI's Chat Completions, Completions and Embeddings on the wire."""
