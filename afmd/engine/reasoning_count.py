"""Which generated tokens are reasoning: the count behind usage's ``reasoning_tokens``.

The output layer splits reasoning from the answer by text; the engine counts it by token,
as it generates. The markers are found in the text, not as token ids: most families'
markers are several tokens (Gemma 4's ``<|channel>thought``, Kimi K3's
``<|open|>think<|sep|>``, gpt-oss's ``<|channel|>analysis<|message|>``), and a model
decoding under a grammar may spell one in tokens other than the tokenizer's own, or end it
inside a token that goes on with the thought. A token is reasoning from the one that
starts the opening marker's text to the one that completes the closing marker's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReasoningMarkers:
    """The text that opens a reasoning block and the text that closes it."""

    start: str
    end: str

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise ValueError("reasoning markers need a start and an end")

    def within(self, text: str) -> bool:
        """``text`` could be part of a marker: nothing a client reads as said."""
        return text in self.start or text in self.end


class ReasoningCount:
    """One sequence's reasoning tokens, counted as its text is generated."""

    __slots__ = ("_lengths", "_since_close", "_text", "inside", "markers", "tokens")

    def __init__(self, markers: ReasoningMarkers, *, inside: bool = False) -> None:
        self.markers = markers
        #: In a block now (the prompt may open one: ``inside`` from the start).
        self.inside = inside
        self.tokens = 0
        # The text not yet ruled out as the start of the marker looked for, and the
        # length of each token's share of it, most recent last.
        self._text = ""
        self._lengths: list[int] = []
        # Tokens taken since the one that closed a block, which is counted already even
        # where the rest of its text opens the next.
        self._since_close = 1 << 62

    def take(self, text: str) -> None:
        """The next generated token, by the text it added."""
        self._text += text
        self._lengths.append(len(text))
        if self.inside:
            self.tokens += 1
            at = self._text.find(self.markers.end)
            if at != -1:
                self.inside = False
                self._since_close = 0
                self._restart(at + len(self.markers.end))
            else:
                self._keep(len(self.markers.end) - 1)
            return
        self._since_close += 1
        at = self._text.find(self.markers.start)
        if at == -1:
            self._keep(len(self.markers.start) - 1)
            return
        # The tokens whose text reaches into the marker are the block's first.
        reach, count = len(self._text) - at, 0
        for length in reversed(self._lengths):
            count += 1
            reach -= length
            if reach <= 0:
                break
        self.tokens += min(count, self._since_close)
        self.inside = True
        self._restart(at + len(self.markers.start))
        closed = self._text.find(self.markers.end)
        if closed != -1:  # opened and closed in one token
            self.inside = False
            self._since_close = 0
            self._restart(closed + len(self.markers.end))

    def _restart(self, cut: int) -> None:
        """Look for the other marker in what follows ``cut`` (the current token's rest)."""
        self._text = self._text[cut:]
        self._lengths = [len(self._text)]

    def _keep(self, chars: int) -> None:
        """Forget text too far back to be part of a marker not yet complete."""
        if len(self._text) <= chars:
            return
        self._text = self._text[len(self._text) - chars:] if chars > 0 else ""
        total, kept = 0, 0
        for length in reversed(self._lengths):
            if total >= len(self._text):
                break
            total += length
            kept += 1
        self._lengths = self._lengths[len(self._lengths) - kept:] if kept else []
