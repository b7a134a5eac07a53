"""A request's sampler: its filters, its temperature and its own chain of PRNG keys.

Global MLX randomness would make a seeded request's output depend on whatever else is in
the batch; a key owned by the request, split once per generated token, makes ``seed``
reproducible however requests interleave. The draw is the Gumbel-max form of sampling
(``argmax(scores + gumbel)``, which is what a categorical draw is) written out, so that
speculative verification (:mod:`afmd.engine.speculative.verification`) can draw the noise of several
positions at once from the same keys and pick, position by position, the very token
this sampler would have picked one step at a time: a seeded request writes the same text
with speculation or without, alone or in a batch.
"""

from __future__ import annotations

import os

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from afmd.engine.generation import SamplingParams


class RowSampler:
    """Samples one sequence's tokens (called by the decode step with ``(1, vocab)``
    log-probabilities, or ``(rows, vocab)`` when several rows share it)."""

    __slots__ = ("_inv_temp", "_min_p", "_top_k", "_top_p", "key")

    def __init__(self, params: SamplingParams, seed: int) -> None:
        self.key = mx.random.key(seed & 0xFFFF_FFFF_FFFF_FFFF)
        self._inv_temp = 1.0 / params.temperature
        self._top_p, self._top_k, self._min_p = params.top_p, params.top_k, params.min_p

    @classmethod
    def of(cls, params: SamplingParams) -> RowSampler | None:
        """``None`` for greedy requests: the batch samples those with one argmax."""
        if params.greedy:
            return None
        # Unseeded: a fresh draw for every sequence, so the choices of one request (made
        # in the same instant on the same thread) never share a stream.
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8),
                                                                            "little")
        return cls(params, seed)

    @property
    def inv_temp(self) -> float:
        return self._inv_temp

    def scores(self, logprobs: mx.array) -> mx.array:
        """What the noise is added to: the filtered log-probabilities over temperature."""
        if 0.0 < self._top_p < 1.0:
            logprobs = apply_top_p(logprobs, self._top_p)
        if self._min_p > 0.0:
            logprobs = apply_min_p(logprobs, self._min_p)
        if 0 < self._top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, self._top_k)
        return logprobs * self._inv_temp

    def __call__(self, logprobs: mx.array) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        scores = self.scores(logprobs)
        return mx.argmax(scores + mx.random.gumbel(scores.shape, key=sub), axis=-1)

    def noise(self, positions: int, vocab: int) -> tuple[mx.array, list[mx.array]]:
        """The noise of the next ``positions`` tokens, one ``(1, vocab)`` draw each as
        :meth:`__call__` makes it, and the key after each (for :meth:`commit`)."""
        key = self.key
        draws, keys = [], []
        for _ in range(positions):
            key, sub = mx.random.split(key)
            draws.append(mx.random.gumbel((1, vocab), key=sub))
            keys.append(key)
        return mx.concatenate(draws, axis=0), keys

    def commit(self, keys: list[mx.array], used: int) -> None:
        """``used`` of the positions :meth:`noise` drew for became tokens."""
        if used > 0:
            self.key = keys[used - 1]
