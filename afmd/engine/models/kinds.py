"""Where a configured model's files are, what a model serves (chat or embeddings) and, for
an embedding model, how it pools.

A request for the wrong kind of model should be refused before minutes of loading, and
``/v1/models`` should say each model's kind without loading anything, so the kind is read
from small JSON files in the model's folder (never from weights). The rule, first match:

1. ``kind`` in the model's ``[[models.model]]`` entry.
2. ``config.json`` holds an ``afmd_embedding`` object: an embedding model, pooled and
   normalized as it says (``{"pooling": "last" | "mean" | "cls", "normalize": true,
   "matryoshka": false}``); the built-in ``demo-embedding`` carries one.
3. A sentence-transformers folder: ``modules.json`` lists a ``Pooling`` module. Its
   ``config.json`` gives the pooling (``pooling_mode_lasttoken``, ``…_mean_tokens``,
   ``…_cls_token``) and a ``Normalize`` module means L2 normalization.
4. Otherwise a chat model. A Hugging Face repo that is not downloaded yet counts as what
   its entry says (chat by default) until it loads and its folder can be read.

A chat model is a vision model, loaded through mlx-vlm instead of mlx-lm, when its entry
says ``kind = "vision"``, or when it says nothing and its ``config.json`` has a
``vision_config`` (as every mlx-vlm conversion of an image-text model has) while mlx-vlm
is installed (the ``vision`` extra); the built-in ``demo-vision`` is one. It serves chat
and completions like any chat model, and takes images.

An embedding model with no statement of its own (``kind = "embedding"`` on a plain
mlx-lm folder, as mlx-community's Qwen3-Embedding conversions are) pools the last token
and normalizes, which is how Qwen3-Embedding is meant to be used. ``matryoshka`` (a prefix
of the vector is itself an embedding) is what allows a request's ``dimensions``; no
standard file states it, so only the ``afmd_embedding`` object can.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from afmd.config.tables import ModelEntry
from afmd.hub import cache as hubcache
from afmd.paths import huggingface_hub_cache

log = logging.getLogger("afmd.engine")

CHAT = "chat"
EMBEDDING = "embedding"
VISION = "vision"  # an entry's kind: a chat model loaded through mlx-vlm
POOLINGS = ("last", "mean", "cls")
BUILTIN_PREFIX = "afmd:"
#: The built-in variants that are embedding models (afmd.engine.demo.builtin builds them).
EMBEDDING_VARIANTS = frozenset({"demo-embedding"})
#: The built-in variants that are vision models (afmd.engine.demo.vision_demo builds them).
VISION_VARIANTS = frozenset({"demo-vision"})


@dataclass(frozen=True, slots=True)
class EmbeddingSpec:
    pooling: str = "last"
    normalize: bool = True
    matryoshka: bool = False


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _from_marker(marker: Mapping[str, Any]) -> EmbeddingSpec:
    pooling = marker.get("pooling", "last")
    if pooling not in POOLINGS:
        raise ValueError(
            f"afmd_embedding.pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}"
        )
    return EmbeddingSpec(
        pooling=pooling,
        normalize=bool(marker.get("normalize", True)),
        matryoshka=bool(marker.get("matryoshka", False)),
    )


def _from_sentence_transformers(folder: Path) -> EmbeddingSpec | None:
    modules = _read_json(folder / "modules.json")
    if not isinstance(modules, list):
        return None
    types = [m.get("type", "") for m in modules if isinstance(m, dict)]
    pooling_module = next(
        (m for m in modules if isinstance(m, dict) and m.get("type", "").endswith("Pooling")),
        None,
    )
    if pooling_module is None:
        return None
    settings = _read_json(folder / str(pooling_module.get("path", "")) / "config.json")
    settings = settings if isinstance(settings, dict) else {}
    if settings.get("pooling_mode_lasttoken"):
        pooling = "last"
    elif settings.get("pooling_mode_cls_token"):
        pooling = "cls"
    else:
        pooling = "mean"  # sentence-transformers' own default
    normalize = any(t.endswith("Normalize") for t in types)
    return EmbeddingSpec(pooling=pooling, normalize=normalize)


def folder_spec(folder: Path, config: Mapping[str, Any] | None = None) -> EmbeddingSpec | None:
    """The folder's own statement that it holds an embedding model (None: it makes none)."""
    if config is None:
        loaded = _read_json(folder / "config.json")
        config = loaded if isinstance(loaded, dict) else {}
    marker = config.get("afmd_embedding")
    if isinstance(marker, Mapping):
        return _from_marker(marker)
    return _from_sentence_transformers(folder)


def hub_snapshot(repo: str) -> Path | None:
    """The downloaded snapshot of a Hugging Face repo, if there is one (no network)."""
    root = huggingface_hub_cache() / ("models--" + repo.replace("/", "--"))
    ref = root / "refs" / "main"
    try:
        if ref.is_file():
            snapshot = root / "snapshots" / ref.read_text().strip()
            if snapshot.is_dir():
                return snapshot
        snapshots = sorted((root / "snapshots").iterdir(), key=lambda p: p.stat().st_mtime)
    except OSError:
        return None
    return snapshots[-1] if snapshots else None


def looks_like_repo(path: str) -> bool:
    """``owner/name``: a Hugging Face id that mlx-lm may download, not a local path."""
    return path.count("/") == 1 and not path.startswith((".", "/", "~"))


def load_source(path: str) -> str:
    """What a load reads a configured model ``path`` (not a built-in) from: its local
    folder; for a Hugging Face id, the snapshot in the cache that ``refs/main`` names,
    pulled first (as ``afmd pull`` pulls it) where it is not complete; offline, the id
    itself, which mlx-lm then finds in the cache or reports missing.

    Given the id, mlx-lm (and mlx-vlm) ask the hub at every load whether the revision
    moved, and fetch what changed: a model loaded for a request (``keep_alive: 0`` loads
    one each time) waited on the network, up to ``HF_HUB_ETAG_TIMEOUT`` where it was slow,
    and a repo updated upstream was downloaded anew, unverified, behind a request. A model
    on disk changes only when it is pulled, as in Ollama. A repo not on disk yet is pulled
    by afmd's own pull, whose listing and files are bounded and verified, where mlx-lm's
    download wrote whatever the hub sent."""
    local = Path(path).expanduser()
    if os.path.exists(local):
        return str(local)
    if looks_like_repo(path) and hubcache.REPO_ID.match(path):
        snapshot = hubcache.complete_snapshot(path)
        if snapshot is not None:
            return str(snapshot)
        from afmd.hub.download import offline, pull

        if not offline():
            log.info("pulling %s for its first load", path)
            return str(pull(path, out=io.StringIO(), terminal=False).snapshot)
    return path


def local_path_problem(path: str) -> str | None:
    """Why a path that names a local folder cannot be loaded, if it cannot (built-in models
    and Hugging Face ids are not local paths).

    The OS may refuse to look as well as find nothing there: a name longer than it takes, a
    folder the daemon may not enter (macOS's protected folders under launchd). That is the
    model's failure to name, never an exception out of a listing or a request.
    """
    if path.startswith(BUILTIN_PREFIX) or looks_like_repo(path):
        return None
    try:
        Path(path).expanduser().stat()
    except (FileNotFoundError, NotADirectoryError):
        return f"'{path}' does not exist"
    except OSError as exc:
        return f"'{path}' cannot be read: {exc.strerror or exc}"
    return None


def model_folder(path: str) -> Path | None:
    """Where a configured model path's files are on disk now, if anywhere."""
    if path.startswith(BUILTIN_PREFIX):
        return None
    local = Path(path).expanduser()
    if os.path.isdir(local):  # False where the OS refuses to look, as Path.is_dir is not
        return local
    if looks_like_repo(path):
        return hub_snapshot(path)
    return None


def resolve(
    entry: ModelEntry, folder: Path | None, config: Mapping[str, Any] | None = None
) -> tuple[str, EmbeddingSpec | None]:
    """The entry's kind and, for an embedding model, its pooling (rule in the module doc)."""
    if entry.kind in (CHAT, VISION):
        return CHAT, None
    variant = entry.path[len(BUILTIN_PREFIX):] if entry.path.startswith(BUILTIN_PREFIX) else None
    spec = folder_spec(folder, config) if folder is not None else None
    if spec is None and variant in EMBEDDING_VARIANTS:
        spec = EmbeddingSpec()
    if spec is None and entry.kind == EMBEDDING:
        spec = EmbeddingSpec()
    return (EMBEDDING, spec) if spec is not None else (CHAT, None)


def declared_kind(entry: ModelEntry) -> str:
    """The entry's kind as far as is known without loading it."""
    if entry.kind is not None:
        return CHAT if entry.kind == VISION else entry.kind
    if entry.path.startswith(BUILTIN_PREFIX):
        return EMBEDDING if entry.path[len(BUILTIN_PREFIX):] in EMBEDDING_VARIANTS else CHAT
    folder = model_folder(entry.path)
    try:
        return resolve(entry, folder)[0] if folder is not None else CHAT
    except ValueError:
        return EMBEDDING  # a malformed afmd_embedding marker still says "embedding"


def is_vision(entry: ModelEntry, folder: Path | None) -> bool:
    """Whether the chat model loads through mlx-vlm (rule in the module doc)."""
    if entry.kind is not None:
        return entry.kind == VISION
    if entry.path.startswith(BUILTIN_PREFIX):
        return entry.path[len(BUILTIN_PREFIX):] in VISION_VARIANTS
    if folder is None:
        return False
    config = _read_json(folder / "config.json")
    if not isinstance(config, dict) or not isinstance(config.get("vision_config"), dict):
        return False
    import importlib.util

    return importlib.util.find_spec("mlx_vlm") is not None


def describe_load_failure(entry: ModelEntry, exc: BaseException) -> str:
    path = entry.path
    local = Path(path).expanduser()
    if not path.startswith(BUILTIN_PREFIX) and not os.path.exists(local):
        if looks_like_repo(path):
            return (
                f"'{path}' is not a local folder and could not be downloaded from Hugging Face "
                f"({type(exc).__name__}: {exc})"
            )
        return local_path_problem(path) or f"'{path}' does not exist"
    if os.path.isdir(local) and not os.path.exists(local / "config.json"):
        return f"'{path}' has no config.json; is it an MLX model folder?"
    return f"{type(exc).__name__}: {exc}"
