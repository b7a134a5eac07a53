"""Stop sequences over streamed text.

A stop string can arrive split across tokens ("</an" + "swer>"), so text that could still
become a stop sequence is held back until it either completes one (then it and everything
after are dropped) or can no longer match (then it is released). Nothing of a partial stop
string ever reaches the client.

Each stop is followed by a Knuth-Morris-Pratt automaton: its state is how much of the stop
the text's tail already spells, advanced once per character whatever the stop's length.
Searching the held text again on every token instead costs the square of the held length
per stop, and a client choosing the stops chooses that length: long stop sequences over an
output that keeps matching their beginning stalled the server for every request.
"""

from __future__ import annotations

from array import array


def _borders(stop: str) -> array[int]:
    """``borders[j]``: length of the longest proper prefix of ``stop[:j + 1]`` that is also
    its suffix (Knuth-Morris-Pratt's failure function)."""
    borders = array("l", [0]) * len(stop)
    k = 0
    for j in range(1, len(stop)):
        while k and stop[j] != stop[k]:
            k = borders[k - 1]
        if stop[j] == stop[k]:
            k += 1
        borders[j] = k
    return borders


class StopScanner:
    __slots__ = ("_borders", "_firsts", "_held", "_states", "_stops", "matched", "stopped")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stops if s))
        self._borders = tuple(_borders(s) for s in self._stops)
        self._firsts = tuple({s[0] for s in self._stops})
        self._states = [0] * len(self._stops)  # characters of each stop the tail spells
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
        base = len(self._held)
        states, stops, borders = self._states, self._stops, self._borders
        at, end = 0, len(text)
        while at < end:
            if not any(states):
                # No stop begun: skip to where one could begin (str.find, not a step per
                # character).
                at = min((i for i in (text.find(f, at) for f in self._firsts) if i != -1),
                         default=end)
                if at == end:
                    break
            char = text[at]
            ended: str | None = None
            for i, stop in enumerate(stops):
                k = states[i]
                while k and stop[k] != char:
                    k = borders[i][k - 1]
                if stop[k] == char:
                    k += 1
                states[i] = k
                # Text arrives left to right, so the stop that *ends* first is the one a
                # stream meets first ("c" within "abcd" over "xabcd"); of those ending
                # here, the longest started first.
                if k == len(stop) and (ended is None or k > len(ended)):
                    ended = stop
            if ended is not None:
                self.stopped = True
                self.matched = ended
                self._held = ""
                return buffer[: base + at + 1 - len(ended)]
            at += 1
        keep = max(states)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Release held text once nothing can complete a stop with it: generation ended,
        or a thinking block came between it and what follows."""
        held, self._held = self._held, ""
        self._states = [0] * len(self._stops)
        return "" if self.stopped else held
