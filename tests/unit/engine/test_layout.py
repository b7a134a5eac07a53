"""The CPU layout of the output projection: faster, and bit for bit the same logits.

It is the CPU path's (afmd/engine/batch/backend.py): forced here, so the checks hold on a GPU
machine too, where the GPU path leaves the projection as it is.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest

from afmd.engine.batch.cpu_layout import TransposedLinear, relayout_for_cpu
from afmd.engine.demo import builtin as demo

from helpers.numerics import assert_same_logits, layout


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return mlx_lm.load(str(demo.materialize("demo", tmp_path_factory.mktemp("layout"))))


@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_transposed_head_gives_identical_logits(rows: int) -> None:
    linear = nn.Linear(64, 2048, bias=False)
    mx.eval(linear.parameters())
    x = mx.random.normal((rows, 1, 64))
    assert_same_logits(linear(x), TransposedLinear(linear)(x))


def test_model_is_relaid_out_on_cpu_with_identical_logits(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    tokens = mx.array([tokenizer.encode("hello there, how are you")] * 4)
    before = model(tokens)
    with layout("gpu"):
        assert not relayout_for_cpu(model)  # the GPU path keeps MLX's own layout
    assert isinstance(model.lm_head, nn.Linear)
    with layout("cpu"):
        assert relayout_for_cpu(model)
        assert isinstance(model.lm_head, TransposedLinear)
        assert "weight" not in model.lm_head  # re-laid out, not copied
        assert_same_logits(before, model(tokens))
        assert not relayout_for_cpu(model)  # once only


@layout("cpu")
def test_heads_left_alone() -> None:
    class Tied(nn.Module):
        pass

    assert not relayout_for_cpu(Tied())  # tied embeddings: no lm_head
    biased = Tied()
    biased.lm_head = nn.Linear(8, 16, bias=True)
    assert not relayout_for_cpu(biased)
    quantized = Tied()
    quantized.lm_head = nn.QuantizedLinear(64, 64, bias=False)
    assert not relayout_for_cpu(quantized)
