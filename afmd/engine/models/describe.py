"""What a model folder holds, for ``afmd show``, read without loading its weights.

Architecture, context length and quantization come from ``config.json``; the parameter
count from the safetensors headers (a quantized matrix counts as the matrix it stands for,
its scales and biases not at all). Everything about the conversation format is what the
server itself would detect: the tokenizer is loaded exactly as mlx-lm loads it for a
model (its tool-call parser, its thinking markers), FIM by :mod:`afmd.service.fim`, the kind by
:mod:`afmd.engine.models.kinds`. That costs importing mlx-lm and reading the tokenizer (a second
or two), never the weights.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from afmd.config.tables import ModelEntry
from afmd.engine.first_import import transformers_ready
from afmd.engine.models import kinds
from afmd.engine.models.loaded_model import (
    DEFAULT_CONTEXT_LENGTH,
    context_length_from,
    thinking_of,
    tool_format_of,
)
from afmd.output.formats import detect
from afmd.service import fim

#: Chat template families, by a marker only that family's template writes (first match).
TEMPLATE_FAMILIES: tuple[tuple[str, str], ...] = (
    ("<|channel|>", "harmony"),
    ("<|im_start|>", "chatml"),
    ("<|start_header_id|>", "llama3"),
    ("<start_of_turn>", "gemma"),
    ("<\uff5cUser\uff5c>", "deepseek"),
    ("[INST]", "mistral"),
    ("<|user|>", "phi"),
)

#: The safetensors format's own bound on a header's length.
_MAX_HEADER = 100 * 1024 * 1024

_DTYPE_NAMES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F8_E4M3": "fp8"}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def safetensors_headers(folder: Path) -> dict[str, dict[str, Any]]:
    """Every tensor's header entry (dtype, shape) across the folder's weight files."""
    tensors: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with path.open("rb") as fh:
                (length,) = struct.unpack("<Q", fh.read(8))
                # A length is anyone's too: one past the file (or the format's own bound)
                # would have the read allocate it.
                if length > min(_MAX_HEADER, os.fstat(fh.fileno()).st_size - 8):
                    continue
                header = json.loads(fh.read(length))
        except (OSError, ValueError, struct.error):
            continue
        if isinstance(header, dict):  # a file is anyone's: only well-formed entries count
            tensors.update({k: v for k, v in header.items()
                            if k != "__metadata__" and _well_formed(v)})
    return tensors


def _well_formed(info: Any) -> bool:
    shape = info.get("shape") if isinstance(info, dict) else None
    return isinstance(shape, list) and all(
        type(dim) is int and dim >= 0 for dim in shape)


def _bits_for(module: str, quantization: Mapping[str, Any]) -> int:
    own = quantization.get(module)
    for bits in (own.get("bits") if isinstance(own, Mapping) else None,
                 quantization.get("bits")):
        if type(bits) is int and 1 <= bits <= 32:
            return bits
    return 4  # mlx-lm's default


def count_parameters(tensors: Mapping[str, Mapping[str, Any]],
                     quantization: Mapping[str, Any] | None) -> int:
    """Parameters the weights stand for: a packed quantized matrix counts unpacked."""
    total = 0
    for name, info in tensors.items():
        shape = info["shape"]
        count = 1
        for dim in shape:
            count *= dim
        stem = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")) and f"{stem}.weight" in tensors:
            continue  # quantization metadata, not parameters
        if quantization and f"{stem}.scales" in tensors and info.get("dtype") == "U32":
            count = count * 32 // _bits_for(stem, quantization)
        total += count
    return total


def quantization_of(config: Mapping[str, Any], tensors: Mapping[str, Mapping[str, Any]]) -> str:
    quant = config.get("quantization") or config.get("quantization_config")
    if isinstance(quant, Mapping) and quant.get("bits"):
        mode = quant.get("mode")
        text = f"{quant['bits']}-bit"
        if quant.get("group_size"):
            text += f" (group {quant['group_size']})"
        return text + (f", {mode}" if mode and mode != "affine" else "")
    dtypes: dict[str, int] = {}
    for info in tensors.values():
        dtype = str(info.get("dtype"))
        dtypes[dtype] = dtypes.get(dtype, 0) + 1
    if dtypes:
        dominant = max(dtypes, key=lambda d: dtypes[d])
        return _DTYPE_NAMES.get(dominant, dominant.lower())
    return str(config.get("torch_dtype") or config.get("dtype") or "unknown")


def template_family(template: Any) -> str | None:
    if isinstance(template, Mapping):  # named templates: the default one speaks for it
        template = template.get("default") or next(iter(template.values()), None)
    if isinstance(template, list):  # the tokenizer_config.json form: [{name, template}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default") or next(iter(named.values()), None)
    if not isinstance(template, str) or not template:
        return None
    return next((family for marker, family in TEMPLATE_FAMILIES if marker in template),
                "custom")


def summary(folder: Path, entry: ModelEntry) -> dict[str, Any]:
    """The facts that need no tokenizer (fast: JSON files and weight headers)."""
    config = _read_json(folder / "config.json")
    tensors = safetensors_headers(folder)
    quant = config.get("quantization")
    arches = config.get("architectures")
    try:
        kind = kinds.resolve(entry, folder, config)[0]
    except ValueError:
        kind = kinds.EMBEDDING
    return {
        "architecture": (arches[0] if isinstance(arches, list) and arches
                         else config.get("model_type")),
        "model_type": config.get("model_type"),
        "parameters": count_parameters(tensors, quant if isinstance(quant, Mapping) else None),
        "quantization": quantization_of(config, tensors),
        "context_length": (entry.context_length or context_length_from(config)
                           or DEFAULT_CONTEXT_LENGTH),
        "kind": kind,
    }


def describe(folder: Path, entry: ModelEntry) -> dict[str, Any]:
    """:func:`summary` plus what the tokenizer says: template, tool calls, reasoning, FIM."""
    transformers_ready()
    from mlx_lm.utils import load_tokenizer

    info = summary(folder, entry)
    config = _read_json(folder / "config.json")
    try:
        tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
    except Exception:  # a folder's files are anyone's: loading it will say what is wrong
        info.update({"chat_template": None, "tool_format": None, "reasoning_format": None,
                     "fim": None, "vocab_size": None})
        return info
    fmt = fim.from_setting(entry.fim) if entry.fim is not None else fim.detect(tokenizer)
    vocab = tokenizer.get_vocab()
    info.update({
        "chat_template": template_family(getattr(tokenizer, "chat_template", None)),
        **conversation_formats(tokenizer, vocab),
        "fim": fmt.family if fmt is not None else None,
        "vocab_size": len(vocab),
    })
    return info


def conversation_formats(tokenizer: Any, vocab: Mapping[str, int]) -> dict[str, str | None]:
    """``tool_format`` and ``reasoning_format`` as generation detects them: mlx-lm's
    parser and markers, and afmd's own additions (gpt-oss's harmony channels, Llama's JSON
    calls, Mistral's ``[THINK]``), so that what a folder is said to do is what the loaded
    model does (``/api/show``'s ``tools`` and ``thinking``). None: it does not."""
    mlx_calls = tool_format_of(tokenizer)
    calls = detect.call_format(mlx_calls, vocab)
    markers = detect.thinking_markers(thinking_of(tokenizer), vocab)
    tool_format = None
    if mlx_calls is not None:
        tool_format = getattr(mlx_calls.parse, "__module__", "").rsplit(".", 1)[-1] or None
    elif calls is not None:
        tool_format = calls.family
    reasoning = None
    if markers is not None:
        reasoning = f"{markers[0]}…{markers[1]}"
    elif calls is not None and detect.thinks(calls, None):  # harmony's analysis channel
        reasoning = f"{calls.family} channels"
    return {"tool_format": tool_format, "reasoning_format": reasoning}
