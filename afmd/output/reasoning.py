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
    __slots__ = ("_end", "_held", "_start", "in_reasoning")

    def __init__(self, start: str, end: str, *, in_reasoning: bool = False) -> None:
        self._start = start
        self._end = end
        self._held = ""
        self.in_reasoning = in_reasoning

    def feed(self, text: str) -> list[Piece]:
        buffer = self._held + text
        self._held = ""
        out: list[Piece] = []
        while buffer:
            marker = self._end if self.in_reasoning else self._start
            i = buffer.find(marker)
            if i == -1:
                keep = partial_suffix(buffer, (marker,))
                head, self._held = buffer[: len(buffer) - keep], buffer[len(buffer) - keep:]
                if head:
                    out.append(Reasoning(head) if self.in_reasoning else Content(head))
                break
            if i:
                head = buffer[:i]
                out.append(Reasoning(head) if self.in_reasoning else Content(head))
            buffer = buffer[i + len(marker):]
            self.in_reasoning = not self.in_reasoning
        return out

    def flush(self) -> list[Piece]:
        held, self._held = self._held, ""
        if not held:
            return []
        return [Reasoning(held) if self.in_reasoning else Content(held)]
