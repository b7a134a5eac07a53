"""Each model family's call (and channel) markup, read into the turn's output events.

``registry`` maps mlx-lm's tool-parser names to the readers here; ``base`` holds what all
of them share. Importing this package imports none of them (``toolcalls`` uses ``base``).
"""
