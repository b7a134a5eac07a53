"""Grammar enforcement for sequences decoded in a batch.

Two ways in, one state. A sequence's first token is sampled by mlx-lm's own step, which
calls each sequence's processors one row at a time (``GrammarProcessor.__call__``). Every
later step is afmd's (``afmd.engine.batch.decode``): it hands all constrained rows of the batch
to one ``MaskBuilder.build`` call, which advances every matcher by the token its row just
sampled and fills all masks with one llguidance call (Rust, GIL released) while MLX runs
the model's forward pass. Per-row slicing, one ``.item()`` sync per row and a mask upload
per row were what made constrained rows slow inside a batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np
from llguidance import LLExecutor, LLMatcher
from llguidance.numpy import fill_next_token_bitmask_par

_NEG_INF = float("-inf")


def _words(vocab: int) -> int:
    return (vocab + 31) // 32


class GrammarProcessor:
    """One sequence's llguidance matcher."""

    __slots__ = ("_started", "error", "matcher", "vocab_size")

    def __init__(self, matcher: LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the grammar tokenizer's; the model's may be larger
        self._started = False
        self.error: str | None = None

    def advance(self, token: int) -> None:
        """Feed the token the sequence just sampled (the first call sees the prompt's)."""
        if not self._started:
            self._started = True
            return
        self.matcher.consume_token(token)
        if self.error is None and self.matcher.is_error():
            self.error = self.matcher.get_error()

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self.advance(int(tokens[-1]) if self._started else -1)
        bitmask = np.empty((1, _words(self.vocab_size)), dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
        allowed = _unpack(bitmask, logits.shape[-1], (0,))
        return mx.where(mx.array(allowed.view(np.bool_)), logits, _NEG_INF)

    def failure(self) -> str | None:
        """Why the matcher stopped following its grammar, if it did.

        Consuming a token finds most failures; computing a mask finds the rest. A grammar
        that admits no output at all (a schema that only refers to itself) fails at its
        first mask, which then allows nothing but the end: the row ends at once, with no
        token consumed."""
        if self.error is None and self.matcher.is_error():
            self.error = self.matcher.get_error()
        return self.error

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()


class BanTokens:
    """Forbid a few token ids (e.g. the tool-call opener when tools are off)."""

    __slots__ = ("_ids", "ids")

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = tuple(ids)
        self._ids = mx.array(list(self.ids), dtype=mx.int32)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        logits[..., self._ids] = _NEG_INF
        return logits


#: Processors ``MaskBuilder`` applies for a whole batch at once.
MASKING = (GrammarProcessor, BanTokens)


class MaskBuilder:
    """Every constrained row's mask for one decode step, as one boolean array.

    Owned by one decode thread; the bitmask buffer is reused from step to step.
    """

    def __init__(self) -> None:
        self._executor = LLExecutor()
        self._buffer = np.zeros((0, 0), dtype=np.int32)

    def build(
        self,
        rows: Sequence[tuple[int, Sequence[object]]],
        tokens: Sequence[int],
        batch: int,
        vocab: int,
    ) -> mx.array:
        """A ``(batch, vocab)`` mask: True where a token may be sampled.

        ``rows`` pairs a row index with its masking processors; rows not listed are
        unconstrained. ``tokens`` are the tokens each row sampled last step.
        """
        grammar_vocab = 0
        matchers: list[tuple[LLMatcher, int]] = []
        bans: list[tuple[int, tuple[int, ...]]] = []
        for row, procs in rows:
            for proc in procs:
                if isinstance(proc, GrammarProcessor):
                    proc.advance(tokens[row])
                    matchers.append((proc.matcher, row))
                    grammar_vocab = max(grammar_vocab, proc.vocab_size)
                elif isinstance(proc, BanTokens):
                    bans.append((row, proc.ids))
        # llguidance writes masks of exactly its vocabulary's width (one tokenizer per model).
        words = _words(grammar_vocab or vocab)
        if self._buffer.shape[0] < batch or self._buffer.shape[1] != words:
            self._buffer = np.empty((max(batch, self._buffer.shape[0]), words), dtype=np.int32)
        bitmask = self._buffer[:batch]
        bitmask.fill(-1)
        if matchers:
            fill_next_token_bitmask_par(self._executor, matchers, bitmask)
        allowed = _unpack(bitmask, vocab, [row for _, row in matchers])
        for row, ids in bans:
            allowed[row, list(ids)] = 0
        return mx.array(allowed.view(np.bool_))


def _unpack(bitmask: np.ndarray, vocab: int, grammar_rows: Sequence[int]) -> np.ndarray:
    """Bits to a ``uint8`` row per sequence; ids past the bitmask (a model vocabulary
    padded beyond its tokenizer's) are never valid under a grammar, always otherwise."""
    width = min(vocab, bitmask.shape[1] * 32)
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=width, bitorder="little")
    if width < vocab:
        tail = np.ones((bitmask.shape[0], vocab - width), dtype=np.uint8)
        tail[list(grammar_rows)] = 0
        bits = np.concatenate([bits, tail], axis=1)
    return bits
