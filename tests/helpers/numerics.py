"""Comparing the engine's numbers with mlx-lm's on whatever device the tests run on.

On MLX's CPU backend a row's numbers do not depend on what else shares its forward pass,
nor on how many positions the pass has: afmd's batched, speculative or cached paths give
bit for bit what mlx-lm computes one row and one token at a time, and the tests demand
exactly that there. A GPU picks its matrix kernels by shape, so the same logit computed by
a pass of one row and by a pass of eight (or of a prompt and of a prompt resumed from a
cached prefix) can differ in its last bits. Two consequences, handled here:

- log-probabilities agree within :data:`LOGPROB_TOLERANCE` of the device, not 1e-4 of
  the CPU's float32 alone, and alternatives within it of each other may swap places;
- a greedy pick can differ where the two best tokens are within :data:`LOGIT_TOLERANCE`
  of each other (a near-tie), after which the two texts go their own ways legitimately:
  :func:`assert_greedy_agrees` accepts that, and only that, and only off the CPU.

MLX's CUDA backend multiplies float32 matrices in TF32 by default (10-bit mantissas);
conftest turns that off for the tests (``MLX_ENABLE_TF32=0``), as they check afmd's
logic, not the precision a deployment chooses. The tolerances still follow the switch.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from afmd.engine.batch import backend

#: The device MLX computes on here: "cpu", "metal", "cuda" (or "gpu").
DEVICE = backend.device_kind()
#: Float32 matrix products run in TF32 (MLX's CUDA default).
TF32 = DEVICE == "cuda" and os.environ.get("MLX_ENABLE_TF32", "1") != "0"


def tolerance(on_cpu: float) -> float:
    """A float32 comparison's tolerance on this device, from the one it has on the CPU
    (where only the order of float32 sums differs): a few times wider on a GPU, whose
    kernels differ by shape, and at TF32's rounding (2**-11) when it is on."""
    if DEVICE == "cpu":
        return on_cpu
    return max(on_cpu * 100, 3e-2) if TF32 else on_cpu * 5


#: How far apart two computations of one logit may be when their passes differ in shape
#: (none on the CPU: there they are the same bits).
LOGIT_TOLERANCE = 0.0 if DEVICE == "cpu" else tolerance(2e-4)
#: How far a reported log-probability may be from mlx-lm's reference computation.
LOGPROB_TOLERANCE = tolerance(1e-4)


@contextlib.contextmanager
def layout(name: str) -> Iterator[None]:
    """The engine's path forced (``AFMD_BACKEND_LAYOUT``) while the block runs, in this
    process; ``"auto"`` follows the device."""
    old = os.environ.get(backend.ENV)
    os.environ[backend.ENV] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(backend.ENV, None)
        else:
            os.environ[backend.ENV] = old


def assert_same_logits(a: mx.array, b: mx.array) -> None:
    """Two computations of the same logits: bit for bit on the CPU, within
    :data:`LOGIT_TOLERANCE` on a GPU (another layout is another kernel there)."""
    if DEVICE == "cpu":
        assert mx.array_equal(a, b).item()
    else:
        assert mx.abs(a - b).max().item() <= LOGIT_TOLERANCE


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (one ending early counts)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def next_logits(model: Any, ids: Sequence[int]) -> np.ndarray:
    """The model's float32 logits for the token after ``ids`` (one pass, mlx-lm's way)."""
    logits = model(mx.array([list(ids)]))[0, -1].astype(mx.float32)
    return np.array(logits)


def greedy(lm: tuple[Any, Any], ids: list[int], n: int,
           stop_ids: tuple[int, ...] = ()) -> list[int]:
    """The model's greedy continuation of ``ids``: up to ``n`` tokens, none of its EOS or
    ``stop_ids``."""
    model, tokenizer = lm
    ends = set(tokenizer.eos_token_ids) | set(stop_ids)
    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)[0, -1]
    out: list[int] = []
    while len(out) < n:
        token = int(mx.argmax(logits).item())
        if token in ends:
            break
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return out


def assert_greedy_agrees(model: Any, prompt: Sequence[int], got: Sequence[int],
                         want: Sequence[int], *, tolerance: float | None = None) -> None:
    """``got`` is ``want`` token for token, or, off the CPU, both are the same until a
    position where the model's two candidates are a near-tie (and nothing is checked
    after it: each text follows its own token from there)."""
    tolerance = LOGIT_TOLERANCE if tolerance is None else tolerance
    i = first_difference(got, want)
    if i is None:
        return
    assert i < len(got) and i < len(want), (
        f"one output ends early at token {i}: {list(got)} against {list(want)}")
    context = f"token {i} differs: {got[i]} against {want[i]} ({list(got)} / {list(want)})"
    assert tolerance > 0, context
    logits = next_logits(model, [*prompt, *want[:i]])
    gap = abs(float(logits[got[i]]) - float(logits[want[i]]))
    assert gap <= tolerance, f"{context}; logit gap {gap:.3g} > {tolerance:.3g}"


def assert_top_agrees(top: Sequence[tuple[int, float]], row: np.ndarray, k: int,
                      *, tolerance: float | None = None) -> None:
    """``top`` (id, log-probability), best first, is the ``k`` best of the reference
    ``row``: values within tolerance, ids the reference's except where a value ties the
    reference's ``k``-th within tolerance (on the CPU: the same ids, in order)."""
    tolerance = LOGPROB_TOLERANCE if tolerance is None else tolerance
    expected = [int(i) for i in np.argsort(-row, kind="stable")[:k]]
    ids = [t for t, _ in top]
    for token, value in top:
        assert abs(value - float(row[token])) <= tolerance, (token, value, float(row[token]))
    if DEVICE == "cpu":
        assert ids == expected
        return
    assert len(ids) == len(expected)
    floor = float(row[expected[-1]]) if expected else 0.0
    for token in set(ids) ^ set(expected):
        assert abs(float(row[token]) - floor) <= 2 * tolerance, (ids, expected)
    values = [v for _, v in top]
    assert all(a >= b - 2 * tolerance for a, b in itertools.pairwise(values))
