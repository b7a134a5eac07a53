"""Loading one configured model into memory: weights, tokenizer and its worker thread.

Blocking and slow (seconds to minutes), so :mod:`afmd.engine.models.model_registry` runs it off the
event
loop; the heavy imports wait inside the function, so importing this module costs nothing.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from afmd.config.load import BUILTIN_SYSTEM_PATH, Config, ModelEntry
from afmd.engine.models import kinds
from afmd.engine.models.kinds import BUILTIN_PREFIX, CHAT
from afmd.engine.models.loaded import DEFAULT_CONTEXT_LENGTH, LoadedModel, context_length_from

log = logging.getLogger("afmd.engine")


def load_sync(entry: ModelEntry, config: Config) -> LoadedModel:
    """The model in memory with its worker started; blocking, so the registry runs it in
    a thread."""
    if entry.path == BUILTIN_SYSTEM_PATH:  # Apple's model: no weights, no MLX
        return _load_system(entry, config)
    # Fail before the heavy imports: mlx-lm drags in transformers (~45 MB resident, a second
    # or two), which a server whose model folder is missing would otherwise carry forever.
    if kinds.missing_local_path(entry.path):
        raise FileNotFoundError(f"'{entry.path}' does not exist")

    # Heavy imports stay here so `afmd --help`, `check-config` and a server that has not
    # loaded a model yet start fast and small; PyInstaller still sees them statically.
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load as mlx_load

    from afmd.engine.batch import backend
    from afmd.engine.batch.cpu_layout import relayout_for_cpu
    from afmd.engine.batch.generation_thread import BatchWorker
    from afmd.engine.demo import builtin as demo
    from afmd.engine.embedding_thread import Embedder
    from afmd.engine.kvcache import folder as kv_folder
    from afmd.engine.kvcache.identity import model_identity
    from afmd.engine.models.memory import apply_memory_bounds
    from afmd.engine.sharded import lockstep
    from afmd.engine.sharded.sharding import load_shard
    from afmd.engine.speculative.draft import load_draft

    path = backend.current()  # an AFMD_BACKEND_LAYOUT that is not a choice fails the load
    backend.prepare_mlx()
    apply_memory_bounds(config.cache.mlx_buffer_cache_bytes)

    is_demo = entry.path.startswith(BUILTIN_PREFIX)
    if kinds.is_vision(entry, kinds.model_folder(entry.path)):
        variant = entry.path[len(BUILTIN_PREFIX):]
        local = demo.materialize(variant) if is_demo else Path(entry.path).expanduser()
        source = str(local) if local.exists() else entry.path
        return _load_vision(entry, config, source, is_demo)
    if is_demo:
        variant = entry.path[len(BUILTIN_PREFIX):]
        folder: Path | None = demo.materialize(variant)
        source = str(folder)
    else:
        candidate = Path(entry.path).expanduser()
        folder = candidate if candidate.exists() else None
        source = str(candidate) if folder else entry.path
    group = lockstep.current()
    shard = None
    if group is not None and entry == config.resolve_model(None):
        # A launched group's model: this rank's share of it, in step with the others.
        model, tokenizer, model_config, shard = load_shard(
            folder or Path(source), group, config.distributed.strategy
        )
    else:
        group = None
        model, tokenizer, model_config = mlx_load(source, return_config=True)  # type: ignore[misc]  # mlx-lm types load() 2- or 3-tuple whatever return_config says
    # A repo's files are on disk now: its folder can say what kind of model it is.
    kind, spec = kinds.resolve(entry, folder or kinds.model_folder(entry.path), model_config)
    if shard is not None and kind != CHAT:
        raise ValueError("only a chat model can be sharded over a launched group")
    if kind == CHAT and shard is None:
        relayout_for_cpu(model)  # an embedding model never runs its output projection
    # Loading and re-laying out weights freed buffers a serving process never reuses.
    mx.clear_cache()
    context_length = (
        entry.context_length or context_length_from(model_config) or DEFAULT_CONTEXT_LENGTH
    )
    worker: BatchWorker | None = None
    embedder: Embedder | None = None
    if spec is not None:
        embedder = Embedder(model, spec, name=entry.id)
        embedder.start()
    else:
        worker = BatchWorker(
            model,
            tokenizer,
            name=entry.id,
            max_batch=config.queue.max_concurrent_requests,
            prompt_cache_bytes=config.cache.prompt_cache_bytes,
            prompt_cache_entries=config.cache.prompt_cache_entries,
            identity=model_identity(folder or kinds.model_folder(entry.path), entry.id),
            block_tokens=config.cache.block_tokens,
            # A sharded model's ranks keep RAM tiers in step; a disk tier each would not
            # stay so (what one rank's writer dropped, another's wrote): off for them.
            disk_dir=None if shard else kv_folder.resolve(config.cache.disk_dir),
            disk_bytes=config.cache.disk_bytes,
            prompt_lookup=config.engine.prompt_lookup,
            draft_model=None if shard else load_draft(entry, config, tokenizer),
            lockstep=group,
        )
        worker.start()
        worker.ready()  # the GPU path's warm-up is part of loading
        log.info("model %s serves on the %s", entry.id, path.describe())
    return LoadedModel(
        entry=entry,
        folder=folder,
        model=model,
        tokenizer=tokenizer,
        context_length=context_length,
        worker=worker,
        is_demo=is_demo,
        weights_bytes=sum(v.nbytes for _, v in tree_flatten(model.parameters())),  # type: ignore[str-unpack, union-attr]  # mlx types tree_flatten list-or-dict alike
        kind=kind,
        embedder=embedder,
        shard=shard,
    )


def _load_system(entry: ModelEntry, config: Config) -> LoadedModel:
    """Apple's model as a loaded model: nothing is loaded, its generations get threads."""
    from afmd.engine.apple import framework
    from afmd.engine.apple.worker import SystemWorker

    found = framework.availability()
    if found.reason is not None:
        raise RuntimeError(f"{found.reason}: {found.detail}")
    return LoadedModel(
        entry=entry, folder=None, model=None, tokenizer=None,
        context_length=entry.context_length or framework.CONTEXT_LENGTH,
        worker=SystemWorker(entry.id, debounce=config.system.tool_call_debounce),
        kind=CHAT, reads_conversation=True,
    )


def _load_vision(entry: ModelEntry, config: Config, source: str, is_demo: bool) -> LoadedModel:
    """Load a vision model with mlx-vlm and start its generation thread."""
    try:
        from mlx_vlm.utils import get_model_path
        from mlx_vlm.utils import load as vlm_load
    except ImportError:
        raise RuntimeError(
            "this is a vision model, and vision support is not installed: "
            "pip install 'afmd[vision]'"
        ) from None
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from afmd.engine.vision.vision_model import VisionSupport
    from afmd.engine.vision.vision_thread import VisionWorker

    folder = Path(get_model_path(source))
    model, processor = vlm_load(str(folder))
    model_config = model.config
    eos = getattr(model_config, "eos_token_id", None)
    tokenizer = load_tokenizer(folder, eos_token_ids=[eos] if isinstance(eos, int) else eos)
    mx.clear_cache()
    raw = _config_json(folder)
    context_length = (
        entry.context_length or context_length_from(raw) or DEFAULT_CONTEXT_LENGTH
    )
    worker = VisionWorker(model, tokenizer, name=entry.id)
    worker.start()
    return LoadedModel(
        entry=entry,
        folder=folder,
        model=model,
        tokenizer=tokenizer,
        context_length=context_length,
        worker=worker,
        is_demo=is_demo,
        weights_bytes=sum(v.nbytes for _, v in tree_flatten(model.parameters())),  # type: ignore[str-unpack, union-attr]  # mlx types tree_flatten list-or-dict alike
        vision=VisionSupport(model, processor, tokenizer, config.models.max_image_pixels),
    )


def _config_json(folder: Path) -> dict[str, Any]:
    """The folder's config.json (its text side may sit under ``text_config``)."""
    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


__all__ = ["load_sync"]
