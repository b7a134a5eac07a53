"""The HTTP edge without I/O: bytes in, decisions out (no Sanic, no asyncio)."""
