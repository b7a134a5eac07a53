"""Sockets and connections: listeners, the connection gate's caps, healing."""
