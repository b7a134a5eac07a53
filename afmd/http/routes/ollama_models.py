"""afmd's models as Ollama describes its own: ``/api/tags``, ``/api/show``, ``/api/ps``.

Models are the configured ones (the built-in demos among them, aliases too) and the
complete downloads in the Hugging Face cache, which serve under their repo id; names carry
Ollama's default tag (``demo:latest``), which requests may send or leave out. What Ollama
reads from a GGUF file is read here from the model folder without loading the weights:
``config.json`` (architecture, sizes, context length), the safetensors headers
(parameter count, quantization) and, for ``/api/show``'s ``capabilities`` and
``template``, the tokenizer as mlx-lm loads it (once per model; a loaded model's own is
used when there is one).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from afmd.config.sections import BUILTIN_SYSTEM_PATH
from afmd.config.tables import ModelEntry
from afmd.engine.models import kinds
from afmd.engine.models.describe import describe, summary
from afmd.engine.models.residency import FOR_GOOD
from afmd.http.app_state import AppState
from afmd.hub import cache as hubcache
from afmd.service import fim
from afmd.service.output_plan import model_formats

__all__ = ["listed", "loaded_models", "show", "tag_object", "tagged", "thinks"]

#: What a folder's tokenizer says, per (model id, folder): reading it takes a second.
_described: dict[tuple[str, str], dict[str, Any]] = {}
_lock = threading.Lock()


def tagged(name: str) -> str:
    """``name`` with a tag, as Ollama lists it (``demo:latest``)."""
    return name if ":" in name.rsplit("/", 1)[-1] else name + hubcache.LATEST_TAG


def _timestamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="microseconds").replace(
        "+00:00", "Z")


def folder_of(state: AppState, entry: ModelEntry) -> Path | None:
    """Where ``entry``'s files are (a built-in demo is built if it is not yet)."""
    loaded = state.registry.loaded(entry.id)
    if loaded is not None and loaded.folder is not None:
        return Path(loaded.folder)
    if entry.path == BUILTIN_SYSTEM_PATH:  # Apple's model: the system's, no folder
        return None
    if entry.path.startswith(kinds.BUILTIN_PREFIX):
        from afmd.engine.demo import builtin as demo

        return demo.materialize(entry.path[len(kinds.BUILTIN_PREFIX):])
    return kinds.model_folder(entry.path)


def listed(state: AppState) -> list[tuple[str, ModelEntry]]:
    """(name, entry) of every model a client may name: configured, aliases, downloaded."""
    config = state.config
    out = [(e.id, e) for e in config.models.model]
    for alias in config.models.aliases:
        target = config.resolve_model(alias)
        if target is not None:
            out.append((alias, target))
    paths = {e.path for e in config.models.model}
    for cached in hubcache.cached_repos():
        if cached.complete and cached.repo not in paths:
            out.append((cached.repo, ModelEntry(id=cached.repo, path=cached.repo)))
    return out


def _parameter_size(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def _quantization_level(config: dict[str, Any], quantization: str) -> str:
    quant = config.get("quantization") or config.get("quantization_config")
    if isinstance(quant, dict) and quant.get("bits"):
        return f"Q{quant['bits']}"
    level = quantization.upper()
    return {"FP32": "F32", "FP16": "F16"}.get(level, level)


def _config(folder: Path) -> dict[str, Any]:
    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _facts(
    state: AppState, entry: ModelEntry
) -> tuple[Path | None, dict[str, Any], dict[str, Any]]:
    """(folder, config.json, summary) of a model, what is known without its tokenizer."""
    folder = folder_of(state, entry)
    if folder is None:
        return None, {}, {}
    return folder, _config(folder), summary(folder, entry)


def _details(config: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    family = str(config.get("model_type") or info.get("model_type") or "unknown")
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": family,
        "families": [family],
        "parameter_size": _parameter_size(int(info.get("parameters") or 0)),
        "quantization_level": _quantization_level(config, str(info.get("quantization", ""))),
    }


def _digest(entry: ModelEntry, folder: Path | None) -> str:
    """A stable identifier of the model's files (Ollama's is its manifest's sha256)."""
    seed = f"{entry.path}\0{folder}".encode()
    if folder is not None:
        with contextlib.suppress(OSError):
            seed += (folder / "config.json").read_bytes()
    return hashlib.sha256(seed).hexdigest()


def _modified(folder: Path | None) -> str:
    try:
        return _timestamp((folder / "config.json").stat().st_mtime) if folder else _timestamp(0)
    except OSError:
        return _timestamp(0)


def tag_object(state: AppState, name: str, entry: ModelEntry) -> dict[str, Any]:
    """One ``/api/tags`` entry (blocking: reads the folder)."""
    folder, config, info = _facts(state, entry)
    details = (_system_show(name)["details"] if entry.path == BUILTIN_SYSTEM_PATH
               else _details(config, info))
    return {
        "name": tagged(name),
        "model": tagged(name),
        "modified_at": _modified(folder),
        "size": hubcache.snapshot_size(folder) if folder is not None else 0,
        "digest": _digest(entry, folder),
        "details": details,
    }


def _template(folder: Path) -> str:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), "")
    return template if isinstance(template, str) else ""


#: Said after the template of a model that fills in the middle, as a Jinja comment (it
#: renders nothing). Clients read ``.Suffix`` in an Ollama template as that model taking
#: ``/api/generate``'s ``suffix`` (Continue's Ollama provider sends its autocomplete so
#: only then, and otherwise a FIM prompt of its own guessing, sent raw); afmd's template
#: is the model's Jinja one, which never names Ollama's variables.
FIM_NOTE = ("\n{#- afmd: /api/generate fills in the middle of {{ .Prompt }} and "
            "{{ .Suffix }} (its prompt and suffix) with the model's own FIM tokens #}\n")


def _capabilities(state: AppState, entry: ModelEntry, folder: Path) -> list[str]:
    """Ollama's capability words, from the loaded model, else from the folder's tokenizer
    (by the same detection: ``thinking`` is what ``think: true`` is refused without)."""
    kind = state.registry.kind_of(entry)
    if kind == kinds.EMBEDDING:
        return ["embedding"]
    vision = kinds.is_vision(entry, folder)
    loaded = state.registry.loaded(entry.id)
    if loaded is not None:  # what generation reads the model's output with
        formats = model_formats(loaded)
        tools = formats.tool_format is not None
        thinking = formats.thinks
        insert = fim.plan_for(loaded.tokenizer, entry.fim) is not None
        vision = loaded.supports_vision
    else:
        key = (entry.id, str(folder))
        with _lock:
            said = _described.get(key)
        if said is None:
            said = describe(folder, entry)
            with _lock:
                _described[key] = said
        tools = said.get("tool_format") is not None
        thinking = said.get("reasoning_format") is not None
        insert = said.get("fim") is not None
    words = ["completion"]
    words += [w for w, has in (("tools", tools), ("thinking", thinking), ("vision", vision),
                               ("insert", insert)) if has]
    return words


def thinks(state: AppState, entry: ModelEntry) -> bool:
    """Whether ``/api/show`` lists ``thinking`` for the model (blocking: may read the
    tokenizer), for a request that must be refused before its model loads."""
    if entry.path == BUILTIN_SYSTEM_PATH:
        return "thinking" in _system_show(entry.id)["capabilities"]
    folder = folder_of(state, entry)
    return folder is not None and "thinking" in _capabilities(state, entry, folder)


def show(state: AppState, name: str, entry: ModelEntry) -> dict[str, Any]:
    """The ``/api/show`` object (blocking: reads the folder and maybe the tokenizer)."""
    folder, config, info = _facts(state, entry)
    if entry.path == BUILTIN_SYSTEM_PATH:
        return _system_show(name)
    if folder is None:
        return {"details": _details({}, {}), "model_info": {}, "capabilities": [],
                "template": "", "parameters": "", "license": "", "modified_at": _modified(None)}
    loaded = state.registry.loaded(entry.id)
    context = loaded.context_length if loaded is not None else int(info["context_length"])
    details = _details(config, info)
    arch = details["family"]
    text_config = config.get("text_config")
    text: dict[str, Any] = text_config if isinstance(text_config, dict) else config
    model_info: dict[str, Any] = {
        "general.architecture": arch,
        "general.basename": name.removesuffix(hubcache.LATEST_TAG),
        "general.parameter_count": int(info.get("parameters") or 0),
        f"{arch}.context_length": context,
    }
    for key, field in (("embedding_length", "hidden_size"), ("block_count", "num_hidden_layers"),
                       ("feed_forward_length", "intermediate_size"),
                       ("attention.head_count", "num_attention_heads"),
                       ("attention.head_count_kv", "num_key_value_heads"),
                       ("rope.freq_base", "rope_theta"), ("vocab_size", "vocab_size")):
        if isinstance(text.get(field), int | float):
            model_info[f"{arch}.{key}"] = text[field]
    template = (loaded.tokenizer.chat_template if loaded is not None
                and isinstance(getattr(loaded.tokenizer, "chat_template", None), str)
                else _template(folder))
    capabilities = _capabilities(state, entry, folder)
    if "insert" in capabilities:
        template += FIM_NOTE
    return {
        "license": "",
        "modelfile": f"# afmd model {entry.id}\nFROM {entry.path}\n",
        "parameters": f"num_ctx {context}",
        "template": template,
        "details": details,
        "model_info": model_info,
        "capabilities": capabilities,
        "modified_at": _modified(folder),
    }


def _system_show(name: str) -> dict[str, Any]:
    """Apple's on-device model: what the framework says of itself (no folder to read)."""
    from afmd.engine.apple.framework import context_length

    family = "apple-foundation"
    window = context_length()
    return {
        "license": "", "modelfile": "", "template": "",
        "parameters": f"num_ctx {window}",
        "details": {"parent_model": "", "format": "apple", "family": family,
                    "families": [family], "parameter_size": "", "quantization_level": ""},
        "model_info": {"general.architecture": family,
                       "general.basename": name.removesuffix(hubcache.LATEST_TAG),
                       f"{family}.context_length": window},
        "capabilities": ["completion", "tools"],
        "modified_at": _modified(None),
    }


def loaded_models(state: AppState) -> list[dict[str, Any]]:
    """The ``/api/ps`` entries: every loaded model, its memory, when its keep-alive ends."""
    out: list[dict[str, Any]] = []
    residency = state.registry.residency
    for model_id, model in list(residency.loaded.items()):
        usage = residency.usage(model_id)
        entry = model.entry
        folder = Path(model.folder) if model.folder is not None else None
        config = _config(folder) if folder is not None else {}
        info = summary(folder, entry) if folder is not None else {}
        expires = usage.expires_at if usage is not None else None
        if expires is None and usage is not None and usage.idle_since is not None:
            expires = time.time() + FOR_GOOD  # idle with no clock: kept for good
        elif expires is None:  # busy: its clock has not started
            keep = state.config.models.keep_alive_of(entry)
            expires = time.time() + (keep if 0 <= keep <= FOR_GOOD else FOR_GOOD)
        size = usage.memory_bytes if usage is not None else model.weights_bytes
        out.append({
            "name": tagged(model_id),
            "model": tagged(model_id),
            "size": size,
            "digest": _digest(entry, folder),
            "details": _details(config, info),
            "expires_at": _timestamp(expires),
            "size_vram": size,
            "context_length": model.context_length,
        })
    return out
