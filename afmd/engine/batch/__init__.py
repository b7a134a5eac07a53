"""The batch engine: one generation thread per model, its rows decoded together."""
