"""What the output processors emit: the fragments of the assistant's turn.

They are the first kinds of :mod:`afmd.core.events` (the run adds each call's end, the
finish and the usage), kept free of any wire format so streamed and non-streamed
responses, in every dialect, are built from the very same sequence.
"""

from __future__ import annotations

from afmd.core.events import Content, Piece, Reasoning, ToolCallArguments, ToolCallStart

__all__ = ["Content", "Piece", "Reasoning", "ToolCallArguments", "ToolCallStart"]
