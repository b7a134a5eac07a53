"""The HTTP edge: the strict gate, sockets and connections, Sanic's routes."""
