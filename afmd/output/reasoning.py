"""Thinking kept apart from the answer.

Models with a thinking format wrap their reasoning in markers such as ``<think>`` …
``</think>``, sometimes with the opening marker already in the prompt (the chat template
opens it). This splitter routes text between the markers to the reasoning channel and the
rest to the content channel, holding back any tail that could be a split marker, so the
two never mix whatever the token boundaries.
"""

from __future__ import annotations

from afmd.core.events import Content, Piece, Reasoning
from afmd.output.markers import partial_suffix


class ReasoningSplitter:
    __slots__ = ("_at", "_end", "_held", "_start", "in_reasoning")

    def __init__(self, start: str, end: str, *, in_reasoning: bool = False) -> None:
        self._start = start
        self._end = end
        self._held = ""
        self._at = 0  # where the held text starts in the whole output
        self.in_reasoning = in_reasoning

    @property
    def held(self) -> int:
        """Characters held back while they could still be a split marker."""
        return len(self._held)

    def feed(self, text: str) -> list[tuple[int, Piece]]:
        """The pieces ``text`` completes, each with where it starts in the whole output
        (markers counted): stop sequences are matched in the answer only, and what they
        cut is told in the output's own characters."""
        buffer = self._held + text
        out: list[tuple[int, Piece]] = []
        pos = 0
        while pos < len(buffer):
            marker = self._end if self.in_reasoning else self._start
            i = buffer.find(marker, pos)
            if i == -1:
                end = len(buffer) - partial_suffix(buffer[pos:], (marker,))
                if end > pos:
                    out.append((self._at + pos, self._piece(buffer[pos:end])))
                pos = end
                break
            if i > pos:
                out.append((self._at + pos, self._piece(buffer[pos:i])))
            pos = i + len(marker)
            self.in_reasoning = not self.in_reasoning
        self._held = buffer[pos:]
        self._at += pos
        return out

    def flush(self) -> list[tuple[int, Piece]]:
        held, self._held = self._held, ""
        if not held:
            return []
        at, self._at = self._at, self._at + len(held)
        return [(at, self._piece(held))]

    def _piece(self, text: str) -> Piece:
        return Reasoning(text) if self.in_reasoning else Content(text)
