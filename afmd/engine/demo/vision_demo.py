"""The built-in "demo-vision" model: a tiny random-weight Qwen2-VL that mlx-vlm serves.

It exists for the same reason as the text demos (:mod:`afmd.engine.demo.builtin`): so that image
input can be exercised and tested end to end, offline, on any machine. Qwen2-VL is the
family chosen because mlx-vlm ships a torch-free processor for it (numpy resizing and
patching), its text side is the Qwen2 the demos already are, and its image tokens are
plain added tokens of a ChatML tokenizer. Its output is gibberish, but it depends on the
image: the pixels pass through a real (random) vision tower whose features replace the
image placeholder tokens the language model attends to.

The folder is built the way the text demos are (seeded PCG64 weights, the shipped demo
tokenizer plus Qwen2-VL's vision tokens) and placed the same way, by
``afmd.engine.demo.builtin.materialize("demo-vision")`` (a fingerprinted cache folder,
:mod:`afmd.engine.demo.demo_folder`); it holds every file mlx-vlm's loader reads, so it never
asks the hub for one. mlx-vlm itself is imported only to build it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from afmd.engine.demo import tokenizer as demo_tokenizer
from afmd.engine.demo import weights as demo_weights
from afmd.engine.demo.demo_folder import write_json
from afmd.engine.demo.template import CHAT_TEMPLATE as TEXT_TEMPLATE
from afmd.engine.first_import import transformers_ready

VARIANT = "demo-vision"

_BUILDER_VERSION = 1
_SEED = 5
_FEATURE_STD = 1.0

_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Small images: a 28x28 pixel cell is one image token after the 2x2 merge, so these
# bounds keep an image between 4 and 16 tokens.
_MIN_PIXELS = 56 * 56
_MAX_PIXELS = 112 * 112

_TEXT: dict[str, Any] = {
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
    "sliding_window": 8192,
    # head size 16: 8 rotary frequencies split over (time, height, width)
    "rope_scaling": {"type": "mrope", "mrope_section": [4, 2, 2]},
    "torch_dtype": "float32",
}

_VISION: dict[str, Any] = {
    "model_type": "qwen2_vl",
    "depth": 1,
    "embed_dim": 32,
    "hidden_size": 64,  # the merger's output: the language model's width
    "num_heads": 2,
    "mlp_ratio": 2,
    "patch_size": 14,
    "spatial_patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "in_channels": 3,
}

_IMAGE_PROCESSOR: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_pixels": _MIN_PIXELS,
    "max_pixels": _MAX_PIXELS,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
}

# The demo template, with an image part rendered as Qwen2-VL renders one.
_IMAGE_PART = (
    "{%- elif part.type == 'image' %}\n"
    "                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}\n"
    "            "
)
_TEXT_PART = "{%- elif part.type == 'text' %}"
if TEXT_TEMPLATE.count(_TEXT_PART) != 1:
    raise RuntimeError("the demo chat template changed: update demo_vision's image part")
CHAT_TEMPLATE = TEXT_TEMPLATE.replace(_TEXT_PART, _IMAGE_PART + _TEXT_PART)

#: What the folder holds: every file mlx-vlm's loader reads.
MODEL_FILES = (
    "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    "preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
    "chat_template.jinja",
)


def build(dest: Path) -> None:
    """Write the model folder into ``dest``; byte-for-byte deterministic."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer_bytes = _tokenizer_bytes()
    spec = json.loads(tokenizer_bytes)
    vocab = {t["content"]: t["id"] for t in spec["added_tokens"]}
    vocab_size = demo_tokenizer.vocab_size(tokenizer_bytes)
    config = _config(vocab, vocab_size)
    weights = _weights(config)
    mx.save_safetensors(str(dest / "model.safetensors"),
                        {k: mx.array(v) for k, v in weights.items()},
                        metadata={"format": "mlx"})
    write_json(dest / "config.json", config)
    (dest / "tokenizer.json").write_bytes(tokenizer_bytes)
    tokenizer_config = demo_tokenizer.tokenizer_config(vocab)
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    for token in _VISION_TOKENS:
        tokenizer_config["added_tokens_decoder"][str(vocab[token])] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
    write_json(dest / "tokenizer_config.json", tokenizer_config)
    write_json(dest / "preprocessor_config.json", _IMAGE_PROCESSOR)
    write_json(dest / "video_preprocessor_config.json", _IMAGE_PROCESSOR)
    write_json(dest / "processor_config.json", {"processor_class": "Qwen2VLProcessor"})
    (dest / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def _tokenizer_bytes() -> bytes:
    """The chat demo's tokenizer (with its FIM tokens) and Qwen2-VL's vision tokens."""
    raw = demo_tokenizer.with_fim_tokens(demo_tokenizer.shipped("demo_tokenizer.json"))
    spec = json.loads(raw)
    next_id = demo_tokenizer.vocab_size(raw)
    for i, token in enumerate(_VISION_TOKENS):
        spec["added_tokens"].append({
            "id": next_id + i, "content": token, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True,
        })
    return json.dumps(spec, ensure_ascii=False).encode()


def _config(vocab: dict[str, int], vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        **_TEXT,
        "vocab_size": vocab_size,
        "vision_config": _VISION,
        "image_token_id": vocab["<|image_pad|>"],
        "video_token_id": vocab["<|video_pad|>"],
        "vision_start_token_id": vocab["<|vision_start|>"],
        "vision_end_token_id": vocab["<|vision_end|>"],
        "bos_token_id": None,
        "eos_token_id": [vocab["<|im_end|>"], vocab["<|endoftext|>"]],
        "pad_token_id": vocab["<|endoftext|>"],
        "afmd_demo": {"variant": VARIANT, "fingerprint": fingerprint()},
    }


def _weight_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...], float]]:
    """(name, shape, std) of every tensor, read from mlx-vlm's own model class so the
    names and layouts are the ones its loader expects; drawn in sorted name order."""
    from mlx.utils import tree_flatten

    transformers_ready()
    from mlx_vlm.models import qwen2_vl

    model_config = qwen2_vl.ModelConfig.from_dict(json.loads(json.dumps(config)))
    model_config.text_config = qwen2_vl.TextConfig.from_dict(model_config.text_config)
    model_config.vision_config = qwen2_vl.VisionConfig.from_dict(config["vision_config"])
    model = qwen2_vl.Model(model_config)
    shapes: list[tuple[str, tuple[int, ...], float]] = []
    for name, value in sorted(tree_flatten(model.parameters())):  # type: ignore[misc]  # mlx types tree_flatten list-or-dict alike
        shape = tuple(value.shape)
        if name.endswith("embed_tokens.weight"):
            std = demo_weights.EMBED_STD
        elif name.endswith("lm_head.weight"):
            std = demo_weights.LM_HEAD_STD
        elif "norm" in name.rsplit(".", 2)[-2] and name.endswith(".weight"):
            std = 0.0  # a norm's scale: ones
        elif name.endswith(".bias"):
            std = 0.02
        else:
            fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
            std = fan_in**-0.5 / 3**0.5
            if name.startswith("vision_tower.merger.mlp.2"):
                # The features that replace the image tokens: as strong as the token
                # embeddings they stand in for, so the image visibly steers the output.
                std = _FEATURE_STD * fan_in**-0.5
        shapes.append((name, shape, std))
    return shapes


def _weights(config: dict[str, Any]) -> dict[str, np.ndarray]:
    return demo_weights.draw_weights(_weight_shapes(config), seed=_SEED)


_FINGERPRINT: list[str] = []


def fingerprint() -> str:
    """Short hash naming the cache folder: changes whenever the built bytes would."""
    if not _FINGERPRINT:
        digest = hashlib.sha256()
        digest.update(json.dumps({
            "builder_version": _BUILDER_VERSION, "text": _TEXT, "vision": _VISION,
            "image_processor": _IMAGE_PROCESSOR, "seed": _SEED, "feature_std": _FEATURE_STD,
            "embed_std": demo_weights.EMBED_STD, "lm_head_std": demo_weights.LM_HEAD_STD,
            "chat_template": CHAT_TEMPLATE, "files": MODEL_FILES,
        }, sort_keys=True).encode())
        digest.update(_tokenizer_bytes())
        _FINGERPRINT.append(digest.hexdigest()[:12])
    return _FINGERPRINT[0]
