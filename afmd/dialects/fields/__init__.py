"""The field checks every dialect's body parser is built from."""
