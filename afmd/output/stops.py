"""Stop sequences over streamed text.

A stop string can arrive split across tokens ("</an" + "swer>"), so text that could still
become a stop sequence is held back until it either completes one (then it and everything
after are dropped) or can no longer match (then it is released). Nothing of a partial stop
string ever reaches the client.
"""

from __future__ import annotations


class StopScanner:
    __slots__ = ("_held", "_longest", "_stops", "stopped")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of ``text`` that is safe to emit now."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buffer = self._held + text
        # The stop that *completes* first wins (ties: the one starting first), because that
        # is where generation stops; "earliest start" would make the result depend on how
        # the text was chunked ("c" vs "abcd" over "xabc" + "d" versus "xabcd").
        cut = -1
        cut_end = -1
        for stop in self._stops:
            i = buffer.find(stop)
            if i == -1:
                continue
            end = i + len(stop)
            if cut == -1 or end < cut_end or (end == cut_end and i < cut):
                cut, cut_end = i, end
        if cut != -1:
            self.stopped = True
            self._held = ""
            return buffer[:cut]
        keep = self._holdback(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep]

    def _holdback(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that starts some stop sequence."""
        upto = min(len(buffer), self._longest - 1)
        for n in range(upto, 0, -1):
            tail = buffer[-n:]
            if any(stop.startswith(tail) for stop in self._stops):
                return n
        return 0

    def flush(self) -> str:
        """Release held text once generation ended without completing a stop."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
