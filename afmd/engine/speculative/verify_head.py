"""The output projection of a verification pass, and the tokens it picks.

On the GPU path (:mod:`afmd.engine.batch.backend`) the whole pass stays in MLX. On MLX's CPU
backend the GEMM is the reference BLAS the ``mlx[cpu]`` wheel ships, which costs about one
single-token decode step per extra row of a large output projection: verifying 16
positions would cost 16 steps. On the CPU path the pass stops at the hidden states and
numpy's BLAS (one thread: the engine thread is one thread, and a busy machine made
OpenBLAS's own threads slower, not faster) projects them.

numpy rounds differently than MLX. A position whose best token leads the runner-up by
less than the rounding bound of the two dot products is projected again by MLX alone,
exactly as the decode step projects a single row, so the pick is always the one a step
at a time would have made.

A row that reports log-probabilities keeps the pass's logits (masked, before temperature,
as the decode step keeps them): the numbers of the tokens that held come from the pass
that verified them, as mlx-lm's own reference computes a sequence's in one pass.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
from collections.abc import Callable, Iterator
from typing import Any, Protocol, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from afmd.engine.batch import backend
from afmd.engine.batch.cpu_layout import TransposedLinear
from afmd.engine.batch.logprobs import StepLogprobs, step_logprobs

_NEG_INF = float("-inf")
_EPS32 = 2.0**-24

#: Draws a sampled row's noise for a vocabulary of the given width.
Noise = Callable[[int], mx.array]


class Processed(Protocol):
    """A pass's logits through the row's history-reading processors
    (:class:`afmd.engine.speculative.verification.Replay`): all positions, or one."""

    def __call__(self, logits: mx.array) -> mx.array: ...

    def row(self, i: int, logits: mx.array) -> mx.array: ...


class _Hidden(nn.Module):
    """Stands in for the output projection: the pass returns the hidden states."""

    def __call__(self, x: mx.array) -> mx.array:
        return x


_HIDDEN = _Hidden()


class VerifyHead:
    """One pass: :meth:`start` builds it lazily, :meth:`targets` reads the picks."""

    @staticmethod
    def of(model: Any) -> VerifyHead:
        head = getattr(model, "lm_head", None)
        if (isinstance(head, TransposedLinear) and head.weight_t.dtype == mx.float32
                and backend.current().host_layout and _head_is_last(model, head)):
            return HostHead(head)
        return DeviceHead(model)

    def start(self, model: Any, inputs: mx.array, cache: list[Any], mask: np.ndarray | None,
              sampler: Any, noise: Noise, logprobs: int | None = None,
              replay: Processed | None = None, spread: float = 1.0) -> None:
        """Build the pass; ``noise(vocab)`` draws a sampled row's noise (unused when
        ``sampler`` is None: greedy); ``logprobs``: the alternatives the row reports, if
        it reports log-probabilities (:meth:`logprobs` then has them); ``replay``: the
        row's penalties and biases, after the mask as a step applies them, and
        ``spread``, how much they can widen a gap between two logits."""
        raise NotImplementedError

    def targets(self) -> list[int]:
        raise NotImplementedError

    def logprobs(self) -> StepLogprobs:
        """Every position's numbers (after :meth:`targets`), for a pass started with
        ``logprobs``."""
        raise NotImplementedError


class DeviceHead(VerifyHead):
    """The whole pass in MLX, picks included (evaluated with the pass)."""

    def __init__(self, model: Any) -> None:
        self._picks: mx.array | None = None
        self._logprobs: StepLogprobs | None = None

    def start(self, model: Any, inputs: mx.array, cache: list[Any], mask: np.ndarray | None,
              sampler: Any, noise: Noise, logprobs: int | None = None,
              replay: Processed | None = None, spread: float = 1.0) -> None:
        logits = model(inputs, cache=cache)[0]
        if mask is not None:
            logits = mx.where(mx.array(mask), logits, _NEG_INF)
        if replay is not None:
            logits = replay(logits)
        drawn = noise(logits.shape[-1]) if sampler is not None else None
        self._picks = _pick(logits, sampler, drawn)
        if logprobs is None:
            mx.async_eval(self._picks)
            return
        rows = [(i, logprobs) for i in range(logits.shape[0])]
        self._logprobs = step_logprobs(logits, self._picks, rows)
        mx.async_eval(self._picks, self._logprobs.arrays)

    def targets(self) -> list[int]:
        assert self._picks is not None
        return cast("list[int]", self._picks.tolist())

    def logprobs(self) -> StepLogprobs:
        assert self._logprobs is not None, "a pass started with logprobs"
        return self._logprobs


class HostHead(VerifyHead):
    """Hidden states from MLX, the projection by numpy, near-ties by MLX."""

    def __init__(self, head: TransposedLinear) -> None:
        self._head = head
        self._hidden: mx.array | None = None
        self._mask: np.ndarray | None = None
        self._sampler: Any = None
        self._noise: mx.array | None = None
        self._keep = False
        self._logprobs: StepLogprobs | None = None
        self._replay: Processed | None = None
        self._spread = 1.0

    def start(self, model: Any, inputs: mx.array, cache: list[Any], mask: np.ndarray | None,
              sampler: Any, noise: Noise, logprobs: int | None = None,
              replay: Processed | None = None, spread: float = 1.0) -> None:
        model.lm_head = _HIDDEN
        try:
            self._hidden = model(inputs, cache=cache)[0]
        finally:
            model.lm_head = self._head
        self._mask, self._sampler, self._keep = mask, sampler, logprobs is not None
        self._replay, self._spread = replay, spread
        self._noise = noise(self._head.weight_t.shape[-1]) if sampler is not None else None
        mx.async_eval(self._hidden)

    def _weight(self) -> tuple[np.ndarray, float]:
        """numpy's view of the projection (no copy) and its largest magnitude, kept on
        the head itself so that they live and go with the model."""
        got: tuple[np.ndarray, float] | None = getattr(self._head, "_afmd_host", None)
        if got is None:
            w = np.array(self._head.weight_t, copy=False)
            got = (w, float(np.abs(w).max()))
            self._head._afmd_host = got
        return got

    def targets(self) -> list[int]:
        assert self._hidden is not None
        hidden = np.array(self._hidden, copy=False)
        weight, w_max = self._weight()
        with _one_blas_thread():
            logits = hidden @ weight
        if self._mask is not None:
            logits = np.where(self._mask, logits, _NEG_INF)
        if self._replay is not None:
            logits = np.array(self._replay(mx.array(logits)))
        if self._keep:
            self._logprobs = StepLogprobs.projected(logits)
        # |numpy - MLX| for one logit is at most about 2·H·eps·Σ|h||w| (sequential sums),
        # widened by what the replayed processors multiply a logit by.
        tol = (2.0 * hidden.shape[-1] * _EPS32 * np.abs(hidden).sum(axis=-1) * w_max
               * self._spread)
        sampler = self._sampler
        if sampler is None:
            scores = logits
        else:
            lg = mx.array(logits)
            logprobs = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
            scores = np.array(sampler.scores(logprobs) + self._noise)
            tol = 4.0 * tol * sampler.inv_temp
        picks = scores.argmax(axis=-1)
        best = scores[np.arange(scores.shape[0]), picks]
        # A runner-up within the bound (the best itself always counts once).
        close = np.flatnonzero((scores >= (best - tol)[:, None]).sum(axis=-1) > 1)
        out = picks.tolist()
        for i in close.tolist():
            out[i] = self._exact(i)
        return out

    def logprobs(self) -> StepLogprobs:
        assert self._logprobs is not None, "a pass started with logprobs, its targets read"
        return self._logprobs

    def _exact(self, i: int) -> int:
        """Row ``i`` as the decode step picks it: MLX's projection of that row alone."""
        assert self._hidden is not None
        logits = self._head(self._hidden[i : i + 1])
        if self._mask is not None:
            logits = mx.where(mx.array(self._mask[i : i + 1]), logits, _NEG_INF)
        if self._replay is not None:
            logits = self._replay.row(i, logits)
        noise = self._noise[i : i + 1] if self._noise is not None else None
        return int(_pick(logits, self._sampler, noise))


def _head_is_last(model: Any, head: TransposedLinear) -> bool:
    """Whether the model's logits are its output projection of the hidden states, nothing
    after (a logit scale or soft cap would be skipped by projecting on the host): checked
    once per model, on one token."""
    known: bool | None = getattr(model, "_afmd_head_last", None)
    if known is None:
        probe = mx.array([[0]])
        logits = model(probe)[0]
        model.lm_head = _HIDDEN
        try:
            hidden = model(probe)[0]
        finally:
            model.lm_head = head
        known = bool(mx.allclose(head(hidden), logits, rtol=1e-4, atol=1e-4).item())
        model._afmd_head_last = known
    return known


def _pick(logits: mx.array, sampler: Any, noise: mx.array | None) -> mx.array:
    if sampler is None:
        return mx.argmax(logits, axis=-1)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.argmax(sampler.scores(logprobs) + noise, axis=-1)


def _openblas() -> Any:
    paths = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs",
                                   "libscipy_openblas*"))
    for path in paths:
        with contextlib.suppress(OSError):
            lib = ctypes.CDLL(path)
            if hasattr(lib, "scipy_openblas_set_num_threads64_"):
                return lib
    return None


_BLAS: Any = _openblas()


@contextlib.contextmanager
def _one_blas_thread() -> Iterator[None]:
    if _BLAS is None:
        yield
        return
    before = _BLAS.scipy_openblas_get_num_threads64_()
    _BLAS.scipy_openblas_set_num_threads64_(1)
    try:
        yield
    finally:
        _BLAS.scipy_openblas_set_num_threads64_(before)
