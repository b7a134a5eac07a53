"""A model's raw text read into the turn: stops, reasoning, tool calls."""
