"""Tiny random models for the call-format suite, built like the demo model.

The demo's trained byte-level vocabulary, its added tokens replaced by the family's own
(special, so text can never produce them, as in the real tokenizers), random Qwen2
weights from the demo's seeded stream, and the family's test template. The thinking
opener's output row copies the call opener's, so a sampled model opens either about as
often. Built once per test session into a folder of the caller's choosing.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import mlx.core as mx
from tokenizers import Tokenizer

from afmd.engine.demo import weights as demo_weights

from helpers.formats import SPECS, Spec

_SEED = 1000


def _base_tokenizer() -> dict[str, Any]:
    raw = resources.files("afmd").joinpath("data", "demo_tokenizer.json").read_bytes()
    return json.loads(raw)


def build(spec: Spec, dest: Path) -> Path:
    """Write the spec's model folder into ``dest`` (created) and return it."""
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = _base_tokenizer()
    first = max(tokenizer["model"]["vocab"].values()) + 1
    ids = {token: first + i for i, token in enumerate(spec.tokens)}
    tokenizer["added_tokens"] = [
        {"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for token, i in ids.items()
    ]
    vocab_size = first + len(spec.tokens)
    shapes = demo_weights.weight_shapes(vocab_size, demo_weights.ARCHITECTURE)
    seed = _SEED + sorted(SPECS).index(spec.id)
    weights = demo_weights.draw_weights(shapes, seed=seed)
    if spec.think and spec.think_rival:
        # The first tokens where the thinking opener and its rival differ get one row.
        encoder = Tokenizer.from_str(json.dumps(tokenizer))
        mine = encoder.encode(spec.think[0], add_special_tokens=False).ids
        rival = encoder.encode(spec.think_rival, add_special_tokens=False).ids
        k = next(i for i, (a, b) in enumerate(zip(mine, rival, strict=False)) if a != b)
        head = weights["lm_head.weight"]
        head[mine[k]] = head[rival[k]]
    mx.save_safetensors(str(dest / "model.safetensors"),
                        {k: mx.array(v) for k, v in weights.items()}, metadata={"format": "mlx"})
    config = {**demo_weights.ARCHITECTURE, "vocab_size": vocab_size, "bos_token_id": None,
              "eos_token_id": [ids[e] for e in spec.eos], "pad_token_id": ids[spec.eos[0]]}
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for token, i in ids.items()
        },
        "bos_token": None,
        "eos_token": spec.eos[0],
        "pad_token": spec.eos[0],
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": demo_weights.ARCHITECTURE["max_position_embeddings"],
        "chat_template": spec.template,
    }, indent=2, ensure_ascii=False))
    return dest


class FormatModels:
    """Model folders per spec, built on first use (one session's cache)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[str, Path] = {}

    def folder(self, spec_id: str) -> Path:
        if spec_id not in self._built:
            self._built[spec_id] = build(SPECS[spec_id], self.root / spec_id)
        return self._built[spec_id]
