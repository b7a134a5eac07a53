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
reuses a stale cache entry. The weights are :mod:`afmd.engine.demo.weights`', the
tokenizers :mod:`afmd.engine.demo.tokenizer`'s, the vision variant
:mod:`afmd.engine.demo.vision_demo`'s; this module names the variants, builds and fingerprints
the text ones, and places every variant's folder (:mod:`afmd.engine.demo.demo_folder`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from afmd.engine.demo import demo_folder
from afmd.engine.demo import tokenizer as demo_tokenizer
from afmd.engine.demo import vision_demo as demo_vision
from afmd.engine.demo import weights as demo_weights
from afmd.engine.demo.template import CHAT_TEMPLATE
from afmd.paths import cache_dir

__all__ = ["DEMO_VARIANTS", "EMBEDDING_VARIANT", "VISION_VARIANT", "build", "materialize"]

#: The embedding variant: a Qwen3-style decoder whose last token's hidden state, L2
#: normalized, is the embedding (as Qwen3-Embedding); afmd serves it on /v1/embeddings.
EMBEDDING_VARIANT = "demo-embedding"
DEMO_VARIANTS = ("demo", "demo-32k", EMBEDDING_VARIANT)
#: The vision variant (a Qwen2-VL for mlx-vlm), built by afmd.engine.demo.vision_demo.
VISION_VARIANT = demo_vision.VARIANT

# Bump whenever build() changes in a way the parameters below do not capture, so that
# cached folders built by the old code are not reused.
_BUILDER_VERSION = 1

_TOKENIZER_FILES = {
    "demo": "demo_tokenizer.json",
    "demo-32k": "demo_32k_tokenizer.json",
    EMBEDDING_VARIANT: "demo_tokenizer.json",
}

# The marker afmd's model-kind detection reads (afmd/engine/models/kinds.py): pooling, L2
# normalization, and whether a prefix of the vector is itself an embedding (Matryoshka),
# which is what lets a request ask for fewer `dimensions`.
EMBEDDING_MARKER: dict[str, Any] = {"pooling": "last", "normalize": True, "matryoshka": True}

_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def materialize(variant: str = "demo", cache_root: Path | None = None) -> Path:
    """Return a folder holding a loadable MLX model for the variant, building it on first use.

    The folder is ``<cache_root>/models/<variant>-<fingerprint>``, placed whole by
    :func:`afmd.engine.demo.demo_folder.place`.
    """
    models_dir = Path(cache_dir() if cache_root is None else cache_root) / "models"
    if variant == VISION_VARIANT:
        return demo_folder.place(models_dir / f"{variant}-{demo_vision.fingerprint()}",
                                 demo_vision.build, demo_vision.MODEL_FILES)
    if variant not in DEMO_VARIANTS:
        raise ValueError(f"unknown demo variant {variant!r}; expected one of {DEMO_VARIANTS}")
    return demo_folder.place(models_dir / f"{variant}-{_fingerprint(variant)}",
                             lambda dest: build(variant, dest), _MODEL_FILES)


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
    vocab = demo_tokenizer.added_token_ids(tokenizer_bytes)
    vocab_size = demo_tokenizer.vocab_size(tokenizer_bytes)

    extra = 0 if variant == EMBEDDING_VARIANT else len(demo_tokenizer.FIM_TOKENS)
    shapes = demo_weights.weight_shapes(vocab_size - extra, _architecture(variant))
    weights = {name: mx.array(array) for name, array in
               demo_weights.with_fim_rows(demo_weights.draw_weights(shapes), extra).items()}
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
    demo_folder.write_json(dest / "config.json", config)
    (dest / "tokenizer.json").write_bytes(tokenizer_bytes)
    demo_folder.write_json(dest / "tokenizer_config.json", demo_tokenizer.tokenizer_config(vocab))


def _tokenizer_bytes(variant: str) -> bytes:
    raw = demo_tokenizer.shipped(_TOKENIZER_FILES[variant])
    if variant == EMBEDDING_VARIANT:
        return demo_tokenizer.with_end_token(raw)
    return demo_tokenizer.with_fim_tokens(raw)


def _architecture(variant: str) -> dict[str, Any]:
    if variant == EMBEDDING_VARIANT:
        return demo_weights.EMBEDDING_ARCHITECTURE
    return demo_weights.ARCHITECTURE


def _parameters(variant: str) -> dict[str, Any]:
    """Everything build() depends on besides the tokenizer bytes, for the fingerprint."""
    extra = {"embedding": EMBEDDING_MARKER} if variant == EMBEDDING_VARIANT else {}
    markup = demo_tokenizer.CONTROL_TOKENS + demo_tokenizer.MARKUP_TOKENS
    return {
        **extra,
        "builder_version": _BUILDER_VERSION,
        "architecture": _architecture(variant),
        "seed": demo_weights.SEED,
        "embed_std": demo_weights.EMBED_STD,
        "lm_head_std": demo_weights.LM_HEAD_STD,
        "chat_template": CHAT_TEMPLATE,
        "tokenizer_config": demo_tokenizer.tokenizer_config({t: 0 for t in markup}),
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
