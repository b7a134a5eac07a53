"""Log-probabilities of the tokens a model generates or is given, for the rows that ask.

The decode step normalises only the rows that asked (a greedy row that did not ask keeps
taking the argmax of raw logits). Values are ``log_softmax`` of the logits the sampler saw
(after grammar masks and penalties, before temperature and top-p), in float32, as mlx-lm
reports them, with the most likely alternatives.

Where the normalisation runs depends on the path (:mod:`afmd.engine.batch.backend`). On the GPU
path it joins the step's lazy graph (evaluated with the next tokens, so reading it back
never waits behind the next forward pass). MLX's CPU backend computes ``exp`` one element
at a time, which made a 32k-vocabulary row's log-softmax and top-k cost several decode
steps; on the CPU path the step keeps the row's logits (a copy, evaluated with the tokens)
and numpy's vectorised routines normalise it when the token is handed out.

A prompt's own log-probabilities (``echo``) need the logits of every prompt position,
which a prefill throws away; :func:`prompt_logprobs` runs the model over the prompt once
more, in chunks through a KV cache, keeping only the numbers asked for.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from afmd.engine.batch import backend
from afmd.engine.generation import TokenIdLogprob

#: The most alternatives a position reports (OpenAI's chat maximum).
MAX_TOP = 20
# Prompt positions evaluated per forward pass: bounds the float32 logits held at once.
_PROMPT_CHUNK = 64
#: Prompt positions a scored prompt runs per engine step, beside the batch's other rows.
#: A scored position costs a row of logits over the whole vocabulary (its log-softmax and
#: best alternatives, on the CPU layout in numpy), where a prefilled one costs none of
#: it: a prefill step's worth of positions held every stream in the batch for seconds,
#: and a cancel waited as long.
SCORE_STEP_POSITIONS = 2 * _PROMPT_CHUNK
# A row's alternatives are bounded by the column maxima of a (_STRIDES, vocab / _STRIDES)
# view: numpy's element-wise max over its rows is vectorised, a full-row partition is not.
_STRIDES = 64
# Candidates beyond which a row's alternatives are sorted by numpy rather than in Python.
_FEW = 64
_SCRATCH = threading.local()  # each thread's buffer for a row's exp (the engine's, tests')


def _on_host() -> bool:
    return backend.current().host_layout


class StepLogprobs:
    """One step's numbers for the rows that asked (``wants``: (row, k) pairs), computed
    lazily; :attr:`arrays` is what to evaluate together with the step's tokens."""

    __slots__ = ("_lists", "_logits", "_on_host", "arrays")

    def __init__(self, logits: mx.array, tokens: mx.array, wants: list[tuple[int, int]]
                 ) -> None:
        rows = [row for row, _ in wants]
        if len(rows) < logits.shape[0]:
            index = mx.array(rows)
            logits, tokens = logits[index], tokens[index]
        logits = logits.astype(mx.float32)
        self._on_host = _on_host()
        self._lists: tuple[list[float], list[list[int]], list[list[float]]] | None = None
        self._logits: np.ndarray | mx.array = logits
        if self._on_host:
            self.arrays = [logits]
            return
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(logprobs, tokens.reshape(-1, 1), axis=-1)[:, 0]
        k = min(max(k for _, k in wants), logprobs.shape[-1])
        if k <= 0:
            self.arrays = [chosen]
            return
        top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
        self.arrays = [chosen, top_ids, mx.take_along_axis(logprobs, top_ids, axis=-1)]

    @classmethod
    def projected(cls, logits: np.ndarray) -> StepLogprobs:
        """Rows whose logits numpy already holds (a verification pass projected on the
        host), normalised the same way when a token is handed out."""
        step = cls.__new__(cls)
        step._on_host, step._lists, step._logits, step.arrays = True, None, logits, []
        return step

    def row(self, index: int, token: int, k: int) -> TokenIdLogprob:
        """Row ``index``'s numbers (the arrays evaluated)."""
        if self._on_host:
            if not isinstance(self._logits, np.ndarray):
                # A view of MLX's buffer (kept alive by it): nothing writes to either.
                self._logits = np.asarray(self._logits)
            return _from_logits(self._logits[index], token, k, normalised=False)
        if self._lists is None:
            chosen, *top = self.arrays
            self._lists = (cast("list[float]", chosen.tolist()),
                           cast("list[list[int]]", top[0].tolist()) if top else [],
                           cast("list[list[float]]", top[1].tolist()) if top else [])
        chosen_l, ids, values = self._lists
        pairs = list(zip(ids[index][:k], values[index][:k], strict=True)) if ids else []
        return TokenIdLogprob(token, float(chosen_l[index]), _ordered(pairs))


@dataclass(frozen=True, slots=True)
class RowLogprobs:
    """A row's share of a :class:`StepLogprobs`: its index there and how many it wants."""

    step: StepLogprobs
    index: int
    k: int


def step_logprobs(logits: mx.array, tokens: mx.array, wants: list[tuple[int, int]]
                  ) -> StepLogprobs:
    return StepLogprobs(logits, tokens, wants)


def resolve(entry: Any, token: int, k: int) -> TokenIdLogprob:
    """A handed-out token's numbers from what the decode step kept for its row.

    ``entry`` is a :class:`RowLogprobs`, or, for a row's first token (sampled by mlx-lm's
    own step when the row joined the batch), that step's full log-probability vector.
    """
    if isinstance(entry, RowLogprobs):
        return entry.step.row(entry.index, token, entry.k)
    return _from_logits(np.array(entry.astype(mx.float32)).reshape(-1), token, k,
                        normalised=True)


def _from_logits(vector: np.ndarray, token: int, k: int, *, normalised: bool
                 ) -> TokenIdLogprob:
    """Normalised with numpy's vectorised routines, in as few passes over the row and as
    few calls as they allow (next to a forward pass each costs several times its
    arithmetic): the log-sum-exp accumulated in float64 over float32 ``exp`` written into
    a reused buffer, the row's maximum taken from the column maxima that also bound the
    alternatives (a full-row partition costs several passes)."""
    n = vector.shape[-1]
    k = min(k, n)
    columns = n // _STRIDES
    body = _STRIDES * columns
    maxima = None
    if columns >= 4 * max(k, 1):
        maxima = vector[:body].reshape(_STRIDES, columns).max(axis=0)
    if normalised:
        lse = 0.0
    else:
        if maxima is None:
            top = float(vector.max())
        else:  # the same value as the row's maximum
            top = float(maxima.max())
            if body < n:
                top = max(top, float(vector[body:].max()))
        scratch = _scratch(n)
        np.subtract(vector, top, out=scratch)
        np.exp(scratch, out=scratch)
        lse = top + float(np.log(scratch.sum(dtype=np.float64)))
    best = _best(vector, k, maxima, lse) if k > 0 else ()
    return TokenIdLogprob(token, float(vector[token]) - lse, best)


def _scratch(n: int) -> np.ndarray:
    buffer: np.ndarray | None = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.shape[0] != n:
        buffer = _SCRATCH.buffer = np.empty(n, dtype=np.float32)
    return buffer


def _best(vector: np.ndarray, k: int, maxima: np.ndarray | None, lse: float
          ) -> tuple[tuple[int, float], ...]:
    """The ``k`` largest values of ``vector`` as (id, value - lse), best first (a tie cut
    at the lower ids), -inf left out.

    ``maxima``, when given, are the column maxima of the row viewed as ``_STRIDES`` rows.
    Their k-th largest bounds the k best from below (those k maxima are k distinct values
    of the row), so the values at least as large are the candidates: a few, usually.
    """
    ids: np.ndarray | None = None
    if maxima is not None:
        columns = maxima.shape[0]
        bound = np.partition(maxima, columns - k)[columns - k]
        ids = np.flatnonzero(vector > bound if bound == -np.inf else vector >= bound)
    if ids is None or ids.size > _FEW:
        values = vector if ids is None else vector[ids]
        order = np.argsort(-values, kind="stable")[:k]  # ties keep the ids' order
        ids = order if ids is None else ids[order]
    pairs = [(i, v - lse) for i, v in zip(ids.tolist(), vector[ids].tolist(), strict=True)]
    return _ordered(pairs)[:k]


def _ordered(pairs: list[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """Most likely first (ties: lower id first); masked-out tokens (-inf) left out."""
    return tuple(sorted(((i, v) for i, v in pairs if v != float("-inf")),
                        key=lambda p: (-p[1], p[0])))


def prompt_pass(model: Any, prompt: list[int]) -> None:
    """The forward passes :func:`prompt_logprobs` makes, chunk for chunk, without their
    numbers: what a rank other than 0 of a sharded model runs alongside it."""
    cache = make_prompt_cache(model)
    inputs = prompt[:-1]
    for start in range(0, len(inputs), _PROMPT_CHUNK):
        mx.eval(model(mx.array([inputs[start : start + _PROMPT_CHUNK]]), cache=cache))


class PromptScorer:
    """A prompt's own log-probabilities (:func:`prompt_logprobs`), computed a few chunks
    at a time, so that the engine can run them beside the batch's steps and stop them on
    a cancel; its ``cache`` then holds the prompt but its last token, which the row can
    resume from instead of running the prompt a second time."""

    __slots__ = ("_k", "_model", "_prompt", "cache", "done", "scores")

    def __init__(self, model: Any, prompt: list[int], k: int) -> None:
        self._model = model
        self._prompt = prompt
        self._k = k
        self.cache: Any = make_prompt_cache(model)
        #: Prompt tokens run into ``cache`` (each scored the token after it).
        self.done = 0
        self.scores: list[TokenIdLogprob] = (
            [TokenIdLogprob(prompt[0], None, ())] if prompt else [])

    @property
    def finished(self) -> bool:
        return self.done >= len(self._prompt) - 1

    def advance(self, positions: int) -> None:
        """Score ``positions`` more tokens or a little more: whole chunks, as
        :func:`prompt_pass` runs them."""
        prompt, k = self._prompt, self._k
        for _ in range(max(-(-positions // _PROMPT_CHUNK), 1)):
            if self.finished:
                return
            start = self.done
            chunk = prompt[start : min(start + _PROMPT_CHUNK, len(prompt) - 1)]
            targets = prompt[start + 1 : start + 1 + len(chunk)]
            logits = self._model(mx.array([chunk]), cache=self.cache)[0]
            step = StepLogprobs(logits, mx.array(targets),
                                [(row, k) for row in range(len(chunk))])
            mx.eval(step.arrays)
            self.scores += [step.row(row, token, k) for row, token in enumerate(targets)]
            self.done += len(chunk)


def prompt_logprobs(model: Any, prompt: list[int], k: int) -> tuple[TokenIdLogprob, ...]:
    """Each prompt token's log-probability given the tokens before it (the first: None),
    with the ``k`` most likely tokens at its position."""
    scorer = PromptScorer(model, prompt, k)
    scorer.advance(len(prompt))
    return tuple(scorer.scores)
