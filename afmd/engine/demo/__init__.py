"""The built-in demo models: tiny random weights that need no download."""
