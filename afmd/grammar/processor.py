"""Grammar enforcement as an mlx-lm logits processor, one per sequence in the batch.

mlx-lm's ``BatchGenerator`` takes a list of processors per sequence and calls them with
that sequence's tokens so far and its logits row; the processor feeds the last sampled
token to the request's own llguidance matcher and masks every token the grammar forbids.
Reading the sampled token forces that one row's evaluation — the unavoidable cost of
constrained decoding — but the mask itself is a cheap bit unpack.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher

_NEG_INF = float("-inf")


class GrammarProcessor:
    __slots__ = ("_matcher", "_started", "error")

    def __init__(self, matcher: LLMatcher) -> None:
        self._matcher = matcher
        self._started = False
        self.error: str | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        matcher = self._matcher
        if self._started:
            matcher.consume_token(int(tokens[-1].item()))
        else:
            self._started = True
        if matcher.is_error() and self.error is None:
            self.error = matcher.get_error()
        vocab = logits.shape[-1]
        bits = np.unpackbits(
            np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little"
        )
        if bits.shape[0] < vocab:
            bits = np.pad(bits, (0, vocab - bits.shape[0]))
        allowed = mx.array(bits[:vocab].astype(np.bool_))
        return mx.where(allowed, logits, _NEG_INF)

    @property
    def accepting(self) -> bool:
        return self._matcher.is_accepting()


class BanTokens:
    """Forbid a few token ids (e.g. the tool-call opener when tools are off), lazily."""

    __slots__ = ("_ids",)

    def __init__(self, ids: Sequence[int]) -> None:
        self._ids = mx.array(list(ids))

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        logits[..., self._ids] = _NEG_INF
        return logits
