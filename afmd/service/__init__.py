"""The request path between the HTTP edge and the engine: no wire format here."""
