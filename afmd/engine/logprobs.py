"""Log-probabilities of the tokens a model generates or is given, for the rows that ask.

The decode step normalises only the rows that asked (a greedy row that did not ask keeps
taking the argmax of raw logits), computes the sampled token's log-probability and the
top alternatives in the same lazy graph as the next tokens, so they are evaluated with
them and reading them back never waits behind the next forward pass. Values are
``log_softmax`` of the logits the sampler saw (after grammar masks and penalties, before
temperature and top-p), in float32, as mlx-lm reports them.

A prompt's own log-probabilities (``echo``) need the logits of every prompt position,
which a prefill throws away; :func:`prompt_logprobs` runs the model over the prompt once
more, in chunks through a KV cache, keeping only the numbers asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from afmd.engine.base import TokenLogprob

#: The most alternatives a position reports (OpenAI's chat maximum).
MAX_TOP = 20
# Prompt positions evaluated per forward pass: bounds the float32 logits held at once.
_PROMPT_CHUNK = 256


@dataclass(slots=True)
class StepLogprobs:
    """One decode step's numbers for the rows that asked, read back once for all rows."""

    chosen: mx.array  # (rows,)
    top_ids: mx.array | None  # (rows, k) unordered, or None when no row wants any
    top_values: mx.array | None
    _lists: tuple[list[Any], list[Any], list[Any]] | None = field(default=None, init=False)

    @property
    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.top_ids, self.top_values) if a is not None]

    def lists(self) -> tuple[list[Any], list[Any], list[Any]]:
        if self._lists is None:
            self._lists = (
                self.chosen.tolist(),
                self.top_ids.tolist() if self.top_ids is not None else [],
                self.top_values.tolist() if self.top_values is not None else [],
            )
        return self._lists


@dataclass(frozen=True, slots=True)
class RowLogprobs:
    """A row's share of a :class:`StepLogprobs`: its index there and how many it wants."""

    step: StepLogprobs
    index: int
    k: int


def step_logprobs(logits: mx.array, tokens: mx.array, wants: list[tuple[int, int]]) -> StepLogprobs:
    """The sampled tokens' log-probabilities and top alternatives of rows ``wants`` ((row,
    k) pairs), lazily: the caller evaluates them together with ``tokens``."""
    rows = [row for row, _ in wants]
    if len(rows) < logits.shape[0]:
        index = mx.array(rows)
        logits, tokens = logits[index], tokens[index]
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, tokens.reshape(-1, 1), axis=-1)[:, 0]
    k = min(max(k for _, k in wants), logprobs.shape[-1])
    if k <= 0:
        return StepLogprobs(chosen, None, None)
    top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    return StepLogprobs(chosen, top_ids, mx.take_along_axis(logprobs, top_ids, axis=-1))


def resolve(entry: Any, token: int, k: int) -> TokenLogprob:
    """A handed-out token's numbers from what the decode step kept for its row.

    ``entry`` is a :class:`RowLogprobs`, or, for a row's first token (sampled by mlx-lm's
    own step when the row joined the batch), that step's full log-probability vector.
    """
    if isinstance(entry, RowLogprobs):
        chosen, ids, values = entry.step.lists()
        i = entry.index
        top = list(zip(ids[i][: entry.k], values[i][: entry.k], strict=True)) if ids else []
        return TokenLogprob(token, float(chosen[i]), _ordered(top))
    vector = np.array(entry.astype(mx.float32)).reshape(-1)
    return TokenLogprob(token, float(vector[token]), _top(vector, k))


def _top(vector: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    k = min(k, vector.shape[-1])
    if k <= 0:
        return ()
    ids = np.argpartition(-vector, k - 1)[:k]
    return _ordered([(int(i), float(vector[i])) for i in ids])


def _ordered(pairs: list[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """Most likely first (ties: lower id first); masked-out tokens (-inf) left out."""
    return tuple(sorted(((i, v) for i, v in pairs if v != float("-inf")),
                        key=lambda p: (-p[1], p[0])))


def prompt_logprobs(model: Any, prompt: list[int], k: int) -> tuple[TokenLogprob, ...]:
    """Each prompt token's log-probability given the tokens before it (the first: None),
    with the ``k`` most likely tokens at its position."""
    out = [TokenLogprob(prompt[0], None, ())] if prompt else []
    cache = make_prompt_cache(model)
    inputs = prompt[:-1]
    for start in range(0, len(inputs), _PROMPT_CHUNK):
        chunk = inputs[start : start + _PROMPT_CHUNK]
        targets = mx.array(prompt[start + 1 : start + 1 + len(chunk)])
        logits = model(mx.array([chunk]), cache=cache)[0]
        step = step_logprobs(logits, targets, [(row, k) for row in range(len(chunk))])
        mx.eval(step.arrays)
        chosen, ids, values = step.lists()
        for row, token in enumerate(prompt[start + 1 : start + 1 + len(chunk)]):
            top = list(zip(ids[row], values[row], strict=True)) if ids else []
            out.append(TokenLogprob(token, float(chosen[row]), _ordered(top)))
    return tuple(out)
