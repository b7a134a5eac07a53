"""OpenAI's Responses API on the wire, and its stored responses."""
