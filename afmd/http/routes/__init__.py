"""The handlers: HTTP framing around the service and the dialects."""
