"""Hold-back of text that may be the start of a marker.

Stop sequences, ``<think>`` tags and tool-call markers all arrive split across tokens, so
every scanner needs the same primitive: how much of the buffer's tail could still grow
into one of the markers, and so must not be released yet.
"""

from __future__ import annotations

from collections.abc import Iterable


def partial_suffix(buffer: str, markers: Iterable[str]) -> int:
    """Length of the longest tail of ``buffer`` that is a proper prefix of some marker."""
    best = 0
    for marker in markers:
        upto = min(len(buffer), len(marker) - 1)
        for n in range(upto, best, -1):
            if buffer.endswith(marker[:n]):
                best = n
                break
    return best


def earliest(buffer: str, markers: Iterable[str]) -> tuple[int, str]:
    """Start and text of the marker occurrence in ``buffer`` that completes first.

    Text arrives left to right, so the marker that *ends* first is the one a stream meets
    first ("c" within "abcd" over "xabcd"); ties go to the one starting earlier. Cutting
    there makes the result independent of how the text was chunked.
    """
    best: tuple[int, int] | None = None
    which = ""
    for marker in markers:
        i = buffer.find(marker)
        if i != -1 and (best is None or (i + len(marker), i) < best):
            best, which = (i + len(marker), i), marker
    return (-1, "") if best is None else (best[1], which)
