"""Weight layout for MLX's CPU backend: the output projection, stored the way GEMM reads it.

A model's output projection (``lm_head``, vocabulary × hidden) is applied as
``x @ weight.T``. MLX's Metal kernels read a transposed operand natively; its CPU backend,
for more than one row, first copies the transposed view into a contiguous buffer, every
decode step. With a 32k vocabulary that copy was a third of a batch-of-8 decode step here
(bench/run.py; the CPU GEMM itself is the reference BLAS the ``mlx[cpu]`` wheel ships).
Storing the projection already transposed, once at load, removes the copy and changes no
result: the logits are bit for bit the same (tests/unit/engine/test_layout.py).

Only a plain floating-point ``nn.Linear`` head without a bias, on the CPU path
(:mod:`afmd.engine.batch.backend`), is re-laid out: quantized heads have their own kernels, a
head tied to the embedding table would need a second copy of it, ``addmm`` with a bias
rounds differently once the operand is contiguous, and on a GPU there is nothing to gain.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from afmd.engine.batch import backend

_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


class TransposedLinear(nn.Module):
    """A bias-free ``nn.Linear`` with its weight stored as (input, output)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight_t = mx.contiguous(linear.weight.T)
        mx.eval(self.weight_t)

    def __call__(self, x: mx.array) -> mx.array:
        return x @ self.weight_t


def relayout_for_cpu(model: Any) -> bool:
    """Re-lay out ``model.lm_head`` on the CPU path; True when it did."""
    if not backend.current().host_layout:
        return False
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear or "bias" in head or head.weight.dtype not in _FLOATS:
        return False
    model.lm_head = TransposedLinear(head)
    return True
