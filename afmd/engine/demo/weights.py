"""The demo models' shapes and weights: drawn, not trained, and the same on every platform.

The weights come from a fixed seed through numpy's PCG64 bit stream (not ``mx.random``,
whose streams differ between backends and versions), with exact float32 arithmetic only,
so a demo folder is byte-identical wherever it is built (:mod:`afmd.engine.demo.builtin`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "ARCHITECTURE",
    "EMBEDDING_ARCHITECTURE",
    "EMBED_STD",
    "FIM_SEED",
    "LM_HEAD_STD",
    "SEED",
    "draw_weights",
    "weight_shapes",
    "with_fim_rows",
]

# The model shape; vocab_size is taken from the tokenizer.
ARCHITECTURE: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 131072,
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
EMBEDDING_ARCHITECTURE: dict[str, Any] = {
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

# Weight initialisation. The standard deviations follow mlx's default init (embedding
# normal(0, 1/sqrt(dims)), linear layers uniform(±1/sqrt(fan_in))), except the untied
# lm_head: with a default-size head the logits are nearly uniform and sampling is
# noise, while std 0.4 (logit std ≈ 0.4·sqrt(hidden)) gives peaky distributions whose
# greedy path still wanders over many tokens.
SEED = 2  # of seeds 0-39, one whose greedy output wanders most on sample chats
EMBED_STD = 64**-0.5
LM_HEAD_STD = 0.4
FIM_SEED = SEED + 1  # the FIM tokens' rows: their own stream


def weight_shapes(
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
        ("model.embed_tokens.weight", (vocab_size, hidden), EMBED_STD)
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
        shapes.append(("lm_head.weight", (vocab_size, hidden), LM_HEAD_STD))
    return shapes


def draw_weights(
    shapes: list[tuple[str, tuple[int, ...], float]], seed: int = SEED
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


def with_fim_rows(weights: dict[str, np.ndarray], extra: int) -> dict[str, np.ndarray]:
    """Weights grown by ``extra`` vocabulary rows: input embeddings from their own seeded
    stream (the trained tokens' weights stay exactly as without them), output rows zero."""
    if not extra:
        return weights
    embed = weights["model.embed_tokens.weight"]
    rows = draw_weights([("rows", (extra, embed.shape[1]), EMBED_STD)], seed=FIM_SEED)["rows"]
    weights["model.embed_tokens.weight"] = np.concatenate([embed, rows])
    if "lm_head.weight" in weights:
        head = weights["lm_head.weight"]
        weights["lm_head.weight"] = np.concatenate(
            [head, np.zeros((extra, head.shape[1]), dtype=head.dtype)]
        )
    return weights
