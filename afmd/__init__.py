"""afmd: the local AI daemon for Apple Silicon.

Serves MLX models behind the OpenAI Chat Completions API.
"""

__version__ = "0.1.0"
