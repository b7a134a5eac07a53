"""A model's share on one rank of a distributed group: which strategy, which weights.

mlx-lm's ``sharded_load`` does this for hub repos and needs a
``model.safetensors.index.json``; afmd's models are local folders (pulled or built), some
with a single weights file, so the same steps are taken here on the folder: build the
model lazily, shard it (tensor parallel: every layer's projections split across ranks) or
cut it into pipeline stages (each rank a run of layers), and only then materialize the
weights, so a rank reads just its part.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from afmd.engine.first_import import transformers_ready
from afmd.engine.sharded.lockstep import Lockstep

TENSOR = "tensor"
PIPELINE = "pipeline"


@dataclass(frozen=True, slots=True)
class Shard:
    """What a rank holds: reported by ``/health`` and ``afmd doctor``."""

    strategy: str
    rank: int
    size: int
    #: Pipeline: the rank's layers as [first, last) (rank 0 runs the last ones);
    #: tensor: every layer, split.
    layers: tuple[int, int]
    weights_bytes: int

    def describe(self) -> str:
        first, last = self.layers
        if self.strategy == PIPELINE:
            return f"pipeline: layers {first}-{last - 1} of rank {self.rank}/{self.size}"
        return f"tensor: 1/{self.size} of layers {first}-{last - 1}"


def choose(model: Any, wanted: str) -> str:
    """The strategy to use: ``wanted``, or for ``auto`` tensor where the model can
    (it splits every step's work), else pipeline; ValueError if it can do neither."""
    tensor = hasattr(model, "shard")
    pipeline = hasattr(model, "model") and hasattr(model.model, "pipeline")
    if wanted == TENSOR and not tensor:
        raise ValueError("this model does not support tensor-parallel sharding")
    if wanted == PIPELINE and not pipeline:
        raise ValueError("this model does not support pipeline sharding")
    if wanted in (TENSOR, PIPELINE):
        return wanted
    if tensor:
        return TENSOR
    if pipeline:
        return PIPELINE
    raise ValueError("this model supports neither tensor nor pipeline sharding")


def load_shard(folder: Path, lockstep: Lockstep, wanted: str) -> tuple[Any, Any, dict, Shard]:
    """This rank's model, tokenizer, model config and :class:`Shard`; every rank of the
    group calls it together (it ends in a collective, so no rank starts serving early)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    transformers_ready()
    from mlx_lm.utils import load_model

    from afmd.engine.models.kept_tokenizers import tokenizer_for

    model, config = load_model(folder, lazy=True, strict=False)
    strategy = choose(model, wanted)
    layers = len(model.layers)
    first, last = 0, layers
    if strategy == TENSOR:
        model.shard(lockstep.group)
    else:
        model.model.pipeline(lockstep.group)
        first, last = model.model.start_idx, model.model.end_idx
    # The one an earlier load of these files made, where there was one: building it again
    # holds the GIL long enough to stall this rank's serving loop.
    tokenizer = tokenizer_for(folder, config.get("eos_token_id"))
    mx.eval(model.parameters())
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))  # type: ignore[str-unpack, union-attr]  # mlx types tree_flatten list-or-dict alike
    lockstep.share(b"" if lockstep.leads else None)  # everyone has loaded
    shard = Shard(strategy, lockstep.rank, lockstep.size, (first, last), weights)
    return model, tokenizer, config, shard


def folder_of(entry: Any) -> Path:
    """Where a configured model's files are: a built-in demo is built on first use, a
    repo id must be pulled already (a rank never downloads)."""
    from afmd.engine.demo import builtin as demo
    from afmd.engine.models import kinds

    if entry.path.startswith(kinds.BUILTIN_PREFIX):
        return demo.materialize(entry.path[len(kinds.BUILTIN_PREFIX):])
    folder = kinds.model_folder(entry.path)
    if folder is None:
        raise FileNotFoundError(f"'{entry.path}' is not on this machine (run afmd pull)")
    return folder


def memory() -> dict[str, int]:
    """This rank's MLX memory, as its heartbeat reports it."""
    import mlx.core as mx

    return {"active_bytes": int(mx.get_active_memory()),
            "peak_bytes": int(mx.get_peak_memory())}


def drop_output_projection(model: Any) -> bool:
    """On a rank other than 0, replace the output projection by nothing worth computing.

    Only rank 0 samples, so the other ranks' logits are never read; yet every rank would
    compute the whole vocabulary's projection each step (a large share of a small model's
    work, and its weights' memory). What stays is a dependency on the last hidden state,
    so the layers' collectives still run in order. A model whose projection is its tied
    embeddings keeps it (the embeddings are still needed). Whether it was dropped.
    """
    import mlx.core as mx
    import mlx.nn as nn

    args = getattr(model, "args", None)
    if getattr(model, "lm_head", None) is None or getattr(args, "tie_word_embeddings", True):
        return False

    class _Unprojected(nn.Module):
        def __call__(self, h: Any) -> Any:
            return mx.depends(mx.zeros((*h.shape[:-1], 1), dtype=h.dtype), h)

    model.lm_head = _Unprojected()
    return True
