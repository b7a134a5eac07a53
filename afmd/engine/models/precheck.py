"""What can be told of a model folder that cannot load without reading its weights, told
before its load unloads other models to make room for it.

A folder with no ``config.json`` (or one that does not parse), no weight files, no
tokenizer files, or a ``model_type`` that mlx-lm (mlx-vlm for a vision model) has no module
for fails its load all the same; found only by the load, each request for it first
unloaded idle models that were serving, and every retry cost them a reload. The checks
read the folder's listing and its ``config.json``, nothing more. They are lenient: what
they cannot tell (a Hugging Face id, a built-in model, a custom ``model_file``) is left
to the load, whose own checks stay. A failure here is the load's failure: the same
``model_load_failed``, naming the folder and what is wrong.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from afmd.config.sections import BUILTIN_SYSTEM_PATH
from afmd.config.tables import ModelEntry
from afmd.engine.models import kinds

#: Files that hold a tokenizer's vocabulary: any of them, and the load has a tokenizer to
#: read (a folder with none gets an empty one from transformers).
_VOCAB_NAMES = ("tokenizer.json", "tokenizer.model", "tekken.json")
_VOCAB_PREFIXES = ("vocab", "merges", "spiece", "sentencepiece")


def tokenizer_missing(source: str) -> str:
    """The load's words for a folder with no tokenizer files (:func:`loading._check_tokenizer`
    says the same of the empty tokenizer it would get)."""
    return (f"its tokenizer is empty (no tokenizer files in {source}: tokenizer.json, "
            "tokenizer.model or vocab.json and merges.txt, with tokenizer_config.json)")


def _has_vocabulary(names: list[str]) -> bool:
    for name in names:
        lower = name.lower()
        if lower in _VOCAB_NAMES or lower.startswith(_VOCAB_PREFIXES) \
                or "tiktoken" in lower or lower.endswith(".model"):
            return True
    return False


def _has_weights(names: list[str], vision: bool) -> bool:
    """As the loaders look for them: mlx-lm ``model*.safetensors``, mlx-vlm any
    ``*.safetensors`` but ``consolidated.safetensors``."""
    if vision:
        return any(n.endswith(".safetensors") and n != "consolidated.safetensors"
                   for n in names)
    return any(n.startswith("model") and n.endswith(".safetensors") for n in names)


def check(entry: ModelEntry) -> None:
    """Raise what the load of ``entry`` would fail with, where the folder tells it; return
    when it tells nothing wrong. Blocking (a listing, a small file, maybe importing
    mlx-lm to ask it of an architecture): run it off the event loop."""
    path = entry.path
    if path == BUILTIN_SYSTEM_PATH or path.startswith(kinds.BUILTIN_PREFIX):
        return
    problem = kinds.local_path_problem(path)
    if problem is not None:
        raise OSError(problem)
    folder = Path(path).expanduser()
    if not os.path.isdir(folder):
        return  # a Hugging Face id: its files may yet be downloaded
    source = str(folder)
    try:
        names = os.listdir(folder)
    except OSError as exc:
        raise OSError(f"'{path}' cannot be read: {exc.strerror or exc}") from None
    if "config.json" not in names:
        raise FileNotFoundError(f"no config.json in {source}")
    try:
        config: Any = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{source}/config.json cannot be read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{source}/config.json is not a JSON object")
    vision = kinds.is_vision(entry, folder)
    if not _has_weights(names, vision):
        raise FileNotFoundError(f"no weight files (*.safetensors) in {source}")
    if not _has_vocabulary(names):
        raise ValueError(tokenizer_missing(source))
    if "model_file" in config:
        return  # the folder's own model code: the load says whether it may run
    from afmd.engine.first_import import transformers_ready

    transformers_ready()  # importing mlx-lm imports transformers: once, on one thread
    from afmd.engine import mlx_compat

    unsupported = mlx_compat.unsupported_model_type(config, vision=vision)
    if unsupported is not None:
        raise ValueError(f"{source}/config.json: {unsupported}")


__all__ = ["check", "tokenizer_missing"]
