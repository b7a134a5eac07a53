"""The Hugging Face hub: verified pulls into the shared cache, and what is on disk."""
