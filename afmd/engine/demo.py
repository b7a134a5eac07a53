"""The built-in "demo" models: tiny random-weight Qwen2 models that need no download.

They exist so that afmd can be installed, started, exercised and tested end to end
(chat template, tool calls, thinking, streaming, grammars, batching) on any machine,
offline, in a fraction of a second. Their output is gibberish by design.

Everything is deterministic: the weights come from a fixed seed through numpy's PCG64
bit stream (not ``mx.random``, whose streams differ between backends and versions), and
the tokenizers were trained once by ``build/train_demo_tokenizers.py`` and ship as
package data, because a frozen binary has no corpus to train on. The same afmd version
therefore produces byte-identical model folders on every platform, and the folder name
carries a fingerprint of everything that goes into it, so a changed builder never
reuses a stale cache entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from afmd.paths import cache_dir

__all__ = ["DEMO_VARIANTS", "build", "materialize"]

DEMO_VARIANTS = ("demo", "demo-32k")

# Bump whenever build() changes in a way the parameters below do not capture, so that
# cached folders built by the old code are not reused.
_BUILDER_VERSION = 1

_TOKENIZER_FILES = {
    "demo": "demo_tokenizer.json",
    "demo-32k": "demo_32k_tokenizer.json",
}

# The model shape; vocab_size is taken from the tokenizer.
_ARCHITECTURE: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 8192,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "attention_dropout": 0.0,
    "torch_dtype": "float32",
}

# Weight initialisation. The standard deviations follow mlx's default init (embedding
# normal(0, 1/sqrt(dims)), linear layers uniform(±1/sqrt(fan_in))), except the untied
# lm_head: with a default-size head the logits are nearly uniform and sampling is
# noise, while std 0.4 (logit std ≈ 0.4·sqrt(hidden)) gives peaky distributions whose
# greedy path still wanders over many tokens.
_SEED = 2  # of seeds 0-39, one whose greedy output wanders most on sample chats
_EMBED_STD = 64**-0.5
_LM_HEAD_STD = 0.4

_CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")

_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

# Stale temporary build folders (from a killed process) older than this are removed.
_STALE_TMP_S = 3600.0

# Qwen2.5-style ChatML with Hermes tool calls (Qwen3's system layout: no default system
# prompt). Every tag strips whitespace before it and all output is in string literals,
# so the result is the same with or without trim_blocks/lstrip_blocks; in particular no
# `{%-` can eat the newline after `<|im_end|>`. mlx-lm picks its "json_tools" parser
# because the template contains "<tool_call>" and "tool_call.name".
CHAT_TEMPLATE = r"""{%- macro content_text(content) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is mapping %}
        {{- content | tojson }}
    {%- elif content is iterable %}
        {%- for part in content %}
            {%- if part is string %}
                {{- part }}
            {%- elif part.type == 'text' %}
                {{- part.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- set has_system = messages and messages[0].role == 'system' %}
{%- if tools or has_system %}
    {{- '<|im_start|>system\n' }}
    {%- if has_system %}
        {{- content_text(messages[0].content) }}
        {%- if tools %}
            {{- '\n\n' }}
        {%- endif %}
    {%- endif %}
    {%- if tools %}
        {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
        {{- 'You are provided with function signatures within <tools></tools> XML tags:\n' }}
        {{- '<tools>' }}
        {%- for tool in tools %}
            {{- '\n' }}
            {{- tool | tojson }}
        {%- endfor %}
        {{- '\n</tools>\n\nFor each function call, return a json object with function name ' }}
        {{- 'and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
        {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = content_text(message.content) %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.tool_calls %}
            {%- if content %}
                {{- '\n' + content }}
            {%- endif %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '\n<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- elif tool_call.arguments is defined and tool_call.arguments is not none %}
                    {{- tool_call.arguments | tojson }}
                {%- else %}
                    {{- '{}' }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- else %}
            {{- '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""


def materialize(variant: str = "demo", cache_root: Path | None = None) -> Path:
    """Return a folder holding a loadable MLX model for the variant, building it on first use.

    The folder is ``<cache_root>/models/<variant>-<fingerprint>``. It only ever appears
    by an atomic rename of a complete build, so concurrent callers (threads or
    processes) each build privately and whoever renames second simply adopts the
    winner's identical folder.
    """
    if variant not in DEMO_VARIANTS:
        raise ValueError(f"unknown demo variant {variant!r}; expected one of {DEMO_VARIANTS}")
    models_dir = Path(cache_dir() if cache_root is None else cache_root) / "models"
    target = models_dir / f"{variant}-{_fingerprint(variant)}"
    if _is_complete(target):
        return target

    models_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(models_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=models_dir))
    try:
        build(variant, tmp)
        for _ in range(3):
            try:
                os.rename(tmp, target)
                return target
            except OSError:
                if _is_complete(target):
                    return target  # Lost a race to an identical build.
                if target.exists():
                    _discard(target, models_dir)  # Damaged (files deleted by hand).
        raise OSError(f"could not place the demo model at {target}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build(variant: str, dest: Path) -> None:
    """Write the complete model folder for ``variant`` into ``dest`` (created if missing).

    Exposed separately from materialize() so tests and tools can build into a folder
    of their choosing; the output is byte-for-byte deterministic.
    """
    if variant not in DEMO_VARIANTS:
        raise ValueError(f"unknown demo variant {variant!r}; expected one of {DEMO_VARIANTS}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer_bytes = _tokenizer_bytes(variant)
    vocab = _added_token_ids(tokenizer_bytes)
    vocab_size = _vocab_size(tokenizer_bytes)

    weights = {name: mx.array(array) for name, array in _weights(vocab_size).items()}
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})

    eos_ids = [vocab["<|im_end|>"], vocab["<|endoftext|>"]]
    config = {
        **_ARCHITECTURE,
        "vocab_size": vocab_size,
        "bos_token_id": None,
        "eos_token_id": eos_ids,
        "pad_token_id": vocab["<|endoftext|>"],
        "afmd_demo": {"variant": variant, "fingerprint": _fingerprint(variant)},
    }
    _write_json(dest / "config.json", config)
    (dest / "tokenizer.json").write_bytes(tokenizer_bytes)
    _write_json(dest / "tokenizer_config.json", _tokenizer_config(vocab))
    for name in _MODEL_FILES:
        _fsync(dest / name)


def _tokenizer_bytes(variant: str) -> bytes:
    """Read the shipped tokenizer; importlib.resources also finds it inside a frozen app."""
    return resources.files("afmd").joinpath("data", _TOKENIZER_FILES[variant]).read_bytes()


def _added_token_ids(tokenizer_bytes: bytes) -> dict[str, int]:
    """Ids of the seven added tokens, read from the file rather than assumed."""
    added = {t["content"]: t["id"] for t in json.loads(tokenizer_bytes)["added_tokens"]}
    missing = set(_CONTROL_TOKENS + _MARKUP_TOKENS) - added.keys()
    if missing:
        raise ValueError(f"demo tokenizer lacks {sorted(missing)}")
    return added


def _vocab_size(tokenizer_bytes: bytes) -> int:
    """Embedding rows = every token id, so no id can decode to nothing."""
    spec = json.loads(tokenizer_bytes)
    ids = list(spec["model"]["vocab"].values()) + [t["id"] for t in spec["added_tokens"]]
    return max(ids) + 1


def _parameters() -> dict[str, Any]:
    """Everything build() depends on besides the tokenizer bytes, for the fingerprint."""
    return {
        "builder_version": _BUILDER_VERSION,
        "architecture": _ARCHITECTURE,
        "seed": _SEED,
        "embed_std": _EMBED_STD,
        "lm_head_std": _LM_HEAD_STD,
        "chat_template": CHAT_TEMPLATE,
        "tokenizer_config": _tokenizer_config({t: 0 for t in _CONTROL_TOKENS + _MARKUP_TOKENS}),
        "files": _MODEL_FILES,
    }


_FINGERPRINTS: dict[str, str] = {}


def _fingerprint(variant: str) -> str:
    """Short hash naming the cache folder: changes whenever the built bytes would."""
    if variant not in _FINGERPRINTS:
        digest = hashlib.sha256()
        digest.update(json.dumps(_parameters(), sort_keys=True).encode())
        digest.update(variant.encode() + b"\0")
        digest.update(_tokenizer_bytes(variant))
        _FINGERPRINTS[variant] = digest.hexdigest()[:12]
    return _FINGERPRINTS[variant]


def _weight_shapes(vocab_size: int) -> list[tuple[str, tuple[int, ...], float]]:
    """(name, shape, std) for every Qwen2 tensor, in the fixed order they are drawn."""
    arch = _ARCHITECTURE
    hidden = arch["hidden_size"]
    inter = arch["intermediate_size"]
    head_dim = hidden // arch["num_attention_heads"]
    kv_dim = arch["num_key_value_heads"] * head_dim
    q_dim = arch["num_attention_heads"] * head_dim

    def linear_std(fan_in: int) -> float:
        return fan_in**-0.5 / 3**0.5  # std of uniform(±1/sqrt(fan_in))

    shapes: list[tuple[str, tuple[int, ...], float]] = [
        ("model.embed_tokens.weight", (vocab_size, hidden), _EMBED_STD)
    ]
    for i in range(arch["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (hidden,), 0.0),
            (f"{p}.self_attn.q_proj.weight", (q_dim, hidden), linear_std(hidden)),
            (f"{p}.self_attn.q_proj.bias", (q_dim,), linear_std(hidden)),
            (f"{p}.self_attn.k_proj.weight", (kv_dim, hidden), linear_std(hidden)),
            (f"{p}.self_attn.k_proj.bias", (kv_dim,), linear_std(hidden)),
            (f"{p}.self_attn.v_proj.weight", (kv_dim, hidden), linear_std(hidden)),
            (f"{p}.self_attn.v_proj.bias", (kv_dim,), linear_std(hidden)),
            (f"{p}.self_attn.o_proj.weight", (hidden, q_dim), linear_std(q_dim)),
            (f"{p}.post_attention_layernorm.weight", (hidden,), 0.0),
            (f"{p}.mlp.gate_proj.weight", (inter, hidden), linear_std(hidden)),
            (f"{p}.mlp.up_proj.weight", (inter, hidden), linear_std(hidden)),
            (f"{p}.mlp.down_proj.weight", (hidden, inter), linear_std(inter)),
        ]
    shapes += [
        ("model.norm.weight", (hidden,), 0.0),
        ("lm_head.weight", (vocab_size, hidden), _LM_HEAD_STD),
    ]
    return shapes


def _weights(vocab_size: int) -> dict[str, np.ndarray]:
    """Draw every tensor from one seeded stream; norms (std 0) are ones.

    Values are uniform with the wanted standard deviation, made from the raw PCG64 bit
    stream with exact float32 arithmetic only: numpy promises that stream (unlike
    Generator's distributions) stays the same across versions, and no libm call is
    involved whose last bit could differ between platforms.
    """
    bits = np.random.default_rng(_SEED).bit_generator
    weights: dict[str, np.ndarray] = {}
    for name, shape, std in _weight_shapes(vocab_size):
        if std == 0.0:
            weights[name] = np.ones(shape, dtype=np.float32)
            continue
        count = int(np.prod(shape))
        raw = bits.random_raw(count)  # uint64
        unit = (raw >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)  # [0, 1)
        bound = np.float32(std * 3**0.5)
        weights[name] = ((unit * np.float32(2.0) - np.float32(1.0)) * bound).reshape(shape)
    return weights


def _tokenizer_config(vocab: dict[str, int]) -> dict[str, Any]:
    """transformers' view of the tokenizer; the split into special and plain added
    tokens follows Qwen2.5/Qwen3 so tool-call and think markup survive decoding."""
    added = {
        str(vocab[token]): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in _CONTROL_TOKENS,
        }
        for token in _CONTROL_TOKENS + _MARKUP_TOKENS
    }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": _ARCHITECTURE["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _fsync(path: Path) -> None:
    """Flush before the rename publishes the folder, so a crash cannot leave it truncated."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _MODEL_FILES)


def _discard(folder: Path, models_dir: Path) -> None:
    """Move a folder aside atomically before deleting it, so it never looks half-gone."""
    trash = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=models_dir))
    with contextlib.suppress(OSError):
        os.rename(folder, trash / "old")
    shutil.rmtree(trash, ignore_errors=True)


def _remove_stale_builds(models_dir: Path) -> None:
    """Delete temporary folders left by killed builds; recent ones may be in progress."""
    cutoff = time.time() - _STALE_TMP_S
    for entry in models_dir.glob(".*.tmp-*"):
        try:
            if entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            pass
