"""Stop sequences over streamed text.

A stop string can arrive split across tokens ("</an" + "swer>"), so text that could still
become a stop sequence is held back until it either completes one (then it and everything
after are dropped) or can no longer match (then it is released). Nothing of a partial stop
string ever reaches the client.
"""

from __future__ import annotations

from afmd.output.markers import earliest, partial_suffix


class StopScanner:
    __slots__ = ("_held", "_stops", "matched", "stopped")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop sequence that ended the text

    @property
    def held(self) -> int:
        """Characters held back while they could still begin a stop sequence."""
        return len(self._held)

    def feed(self, text: str) -> str:
        """The part of ``text`` that is safe to emit now."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buffer = self._held + text
        cut, which = earliest(buffer, self._stops)
        if cut != -1:
            self.stopped = True
            self.matched = which
            self._held = ""
            return buffer[:cut]
        keep = partial_suffix(buffer, self._stops)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Release held text once nothing can complete a stop with it: generation ended,
        or a thinking block came between it and what follows."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
