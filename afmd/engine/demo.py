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

from afmd.engine.demo_template import CHAT_TEMPLATE
from afmd.paths import cache_dir

__all__ = ["CHAT_TEMPLATE", "DEMO_VARIANTS", "EMBEDDING_VARIANT", "build", "materialize"]

#: The embedding variant: a Qwen3-style decoder whose last token's hidden state, L2
#: normalized, is the embedding (as Qwen3-Embedding); afmd serves it on /v1/embeddings.
EMBEDDING_VARIANT = "demo-embedding"
DEMO_VARIANTS = ("demo", "demo-32k", EMBEDDING_VARIANT)
#: The vision variant (a Qwen2-VL for mlx-vlm), built by afmd.engine.demo_vision.
VISION_VARIANT = "demo-vision"

# Bump whenever build() changes in a way the parameters below do not capture, so that
# cached folders built by the old code are not reused.
_BUILDER_VERSION = 1

_TOKENIZER_FILES = {
    "demo": "demo_tokenizer.json",
    "demo-32k": "demo_32k_tokenizer.json",
    EMBEDDING_VARIANT: "demo_tokenizer.json",
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

# The embedding variant's shape: Qwen3 (q/k norms, no attention biases), its output
# projection tied to the embedding table (an embedding model never uses it), and a
# short context so that "input too long" is cheap to reach.
_EMBEDDING_ARCHITECTURE: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "attention_dropout": 0.0,
    "torch_dtype": "float32",
}

# The marker afmd's model-kind detection reads (afmd/engine/kinds.py): pooling, L2
# normalization, and whether a prefix of the vector is itself an embedding (Matryoshka),
# which is what lets a request ask for fewer `dimensions`.
EMBEDDING_MARKER: dict[str, Any] = {"pooling": "last", "normalize": True, "matryoshka": True}

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
# Qwen2.5-Coder's fill-in-the-middle tokens (plain added tokens there too), appended to
# the chat variants' trained vocabulary so /v1/completions with a suffix works on them.
# Their output rows are zero: the model never predicts them, so its greedy output is
# what it was without them (a FIM end marker for tests comes from a model's fim setting).
_FIM_TOKENS = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>")
_FIM_SEED = _SEED + 1

_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

# Stale temporary build folders (from a killed process) older than this are removed.
_STALE_TMP_S = 3600.0


def materialize(variant: str = "demo", cache_root: Path | None = None) -> Path:
    """Return a folder holding a loadable MLX model for the variant, building it on first use.

    The folder is ``<cache_root>/models/<variant>-<fingerprint>``. It only ever appears
    by an atomic rename of a complete build, so concurrent callers (threads or
    processes) each build privately and whoever renames second simply adopts the
    winner's identical folder.
    """
    if variant == VISION_VARIANT:  # its builder needs mlx-vlm: imported on demand
        from afmd.engine import demo_vision

        return demo_vision.materialize(cache_root)
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

    extra = 0 if variant == EMBEDDING_VARIANT else len(_FIM_TOKENS)
    shapes = _weight_shapes(vocab_size - extra, _architecture(variant))
    weights = {name: mx.array(array) for name, array in
               _with_fim_rows(_weights(shapes), extra).items()}
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})

    eos_ids = [vocab["<|im_end|>"], vocab["<|endoftext|>"]]
    config = {
        **_architecture(variant),
        "vocab_size": vocab_size,
        "bos_token_id": None,
        "eos_token_id": eos_ids,
        "pad_token_id": vocab["<|endoftext|>"],
        "afmd_demo": {"variant": variant, "fingerprint": _fingerprint(variant)},
    }
    if variant == EMBEDDING_VARIANT:
        config["afmd_embedding"] = EMBEDDING_MARKER
    _write_json(dest / "config.json", config)
    (dest / "tokenizer.json").write_bytes(tokenizer_bytes)
    _write_json(dest / "tokenizer_config.json", _tokenizer_config(vocab))
    for name in _MODEL_FILES:
        _fsync(dest / name)


def _tokenizer_bytes(variant: str) -> bytes:
    """Read the shipped tokenizer; importlib.resources also finds it inside a frozen app."""
    raw = resources.files("afmd").joinpath("data", _TOKENIZER_FILES[variant]).read_bytes()
    return _with_end_token(raw) if variant == EMBEDDING_VARIANT else _with_fim_tokens(raw)


def _with_fim_tokens(tokenizer_bytes: bytes) -> bytes:
    """The tokenizer with the FIM tokens added after every trained id."""
    spec = json.loads(tokenizer_bytes)
    next_id = _vocab_size(tokenizer_bytes)
    for i, token in enumerate(_FIM_TOKENS):
        spec["added_tokens"].append({
            "id": next_id + i, "content": token, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": False,
        })
    return json.dumps(spec, ensure_ascii=False).encode()


def _with_fim_rows(weights: dict[str, np.ndarray], extra: int) -> dict[str, np.ndarray]:
    """Weights grown by ``extra`` vocabulary rows: input embeddings from their own seeded
    stream (the trained tokens' weights stay exactly as without them), output rows zero."""
    if not extra:
        return weights
    embed = weights["model.embed_tokens.weight"]
    rows = _weights([("rows", (extra, embed.shape[1]), _EMBED_STD)], seed=_FIM_SEED)["rows"]
    weights["model.embed_tokens.weight"] = np.concatenate([embed, rows])
    if "lm_head.weight" in weights:
        head = weights["lm_head.weight"]
        weights["lm_head.weight"] = np.concatenate(
            [head, np.zeros((extra, head.shape[1]), dtype=head.dtype)]
        )
    return weights


def _with_end_token(tokenizer_bytes: bytes) -> bytes:
    """The tokenizer, appending ``<|endoftext|>`` to every encoded text.

    Last-token pooling wants one fixed final token whose hidden state has attended to the
    whole input; Qwen3-Embedding's tokenizer appends ``<|endoftext|>`` the same way (a
    post-processor, so any client of the tokenizer gets the same ids afmd does).
    """
    spec = json.loads(tokenizer_bytes)
    end = "<|endoftext|>"
    end_id = _added_token_ids(tokenizer_bytes)[end]
    special = {"id": end, "type_id": 0}
    spec["post_processor"] = {"type": "Sequence", "processors": [
        spec["post_processor"],
        {
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": special}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}, {"SpecialToken": special}],
            "special_tokens": {end: {"id": end, "ids": [end_id], "tokens": [end]}},
        },
    ]}
    return json.dumps(spec, ensure_ascii=False).encode()


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


def _architecture(variant: str) -> dict[str, Any]:
    return _EMBEDDING_ARCHITECTURE if variant == EMBEDDING_VARIANT else _ARCHITECTURE


def _parameters(variant: str) -> dict[str, Any]:
    """Everything build() depends on besides the tokenizer bytes, for the fingerprint."""
    extra = {"embedding": EMBEDDING_MARKER} if variant == EMBEDDING_VARIANT else {}
    return {
        **extra,
        "builder_version": _BUILDER_VERSION,
        "architecture": _architecture(variant),
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
        digest.update(json.dumps(_parameters(variant), sort_keys=True).encode())
        digest.update(variant.encode() + b"\0")
        digest.update(_tokenizer_bytes(variant))
        _FINGERPRINTS[variant] = digest.hexdigest()[:12]
    return _FINGERPRINTS[variant]


def _weight_shapes(
    vocab_size: int, arch: dict[str, Any]
) -> list[tuple[str, tuple[int, ...], float]]:
    """(name, shape, std) for every Qwen2 / Qwen3 tensor, in the fixed order they are drawn.

    Qwen3 differs by norms on the query and key heads instead of attention biases, and
    by an explicit head size; a tied output projection has no tensor of its own.
    """
    qwen3 = arch["model_type"] == "qwen3"
    hidden = arch["hidden_size"]
    inter = arch["intermediate_size"]
    head_dim = arch.get("head_dim") or hidden // arch["num_attention_heads"]
    kv_dim = arch["num_key_value_heads"] * head_dim
    q_dim = arch["num_attention_heads"] * head_dim

    def linear_std(fan_in: int) -> float:
        return fan_in**-0.5 / 3**0.5  # std of uniform(±1/sqrt(fan_in))

    def projection(name: str, rows: int) -> list[tuple[str, tuple[int, ...], float]]:
        weight = (f"{name}.weight", (rows, hidden), linear_std(hidden))
        return [weight] if qwen3 else [weight, (f"{name}.bias", (rows,), linear_std(hidden))]

    shapes: list[tuple[str, tuple[int, ...], float]] = [
        ("model.embed_tokens.weight", (vocab_size, hidden), _EMBED_STD)
    ]
    for i in range(arch["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (hidden,), 0.0),
            *projection(f"{p}.self_attn.q_proj", q_dim),
            *projection(f"{p}.self_attn.k_proj", kv_dim),
            *projection(f"{p}.self_attn.v_proj", kv_dim),
            (f"{p}.self_attn.o_proj.weight", (hidden, q_dim), linear_std(q_dim)),
        ]
        if qwen3:
            shapes += [
                (f"{p}.self_attn.q_norm.weight", (head_dim,), 0.0),
                (f"{p}.self_attn.k_norm.weight", (head_dim,), 0.0),
            ]
        shapes += [
            (f"{p}.post_attention_layernorm.weight", (hidden,), 0.0),
            (f"{p}.mlp.gate_proj.weight", (inter, hidden), linear_std(hidden)),
            (f"{p}.mlp.up_proj.weight", (inter, hidden), linear_std(hidden)),
            (f"{p}.mlp.down_proj.weight", (hidden, inter), linear_std(inter)),
        ]
    shapes.append(("model.norm.weight", (hidden,), 0.0))
    if not arch["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (vocab_size, hidden), _LM_HEAD_STD))
    return shapes


def _weights(
    shapes: list[tuple[str, tuple[int, ...], float]], seed: int = _SEED
) -> dict[str, np.ndarray]:
    """Draw every tensor from one seeded stream; norms (std 0) are ones.

    Values are uniform with the wanted standard deviation, made from the raw PCG64 bit
    stream with exact float32 arithmetic only: numpy promises that stream (unlike
    Generator's distributions) stays the same across versions, and no libm call is
    involved whose last bit could differ between platforms.
    """
    bits = np.random.default_rng(seed).bit_generator
    weights: dict[str, np.ndarray] = {}
    for name, shape, std in shapes:
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
        for token in _CONTROL_TOKENS + _MARKUP_TOKENS + tuple(t for t in _FIM_TOKENS if t in vocab)
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
