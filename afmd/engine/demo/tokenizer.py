"""The demo models' tokenizers: the shipped trained ones, with the tokens each variant adds.

The tokenizers were trained once by ``build/train_demo_tokenizers.py`` and ship as package
data (a frozen binary has no corpus to train on); this module grows them (FIM tokens, an
end token for pooling) and writes transformers' view of them, as Qwen2.5 / Qwen3 do.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from afmd.engine.demo.template import CHAT_TEMPLATE
from afmd.engine.demo.weights import ARCHITECTURE

__all__ = [
    "CONTROL_TOKENS",
    "FIM_TOKENS",
    "MARKUP_TOKENS",
    "added_token_ids",
    "shipped",
    "tokenizer_config",
    "vocab_size",
    "with_end_token",
    "with_fim_tokens",
]

CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
# Qwen2.5-Coder's fill-in-the-middle tokens (plain added tokens there too), appended to
# the chat variants' trained vocabulary so /v1/completions with a suffix works on them.
# Their output rows are zero: the model never predicts them, so its greedy output is
# what it was without them (a FIM end marker for tests comes from a model's fim setting).
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>")


def shipped(filename: str) -> bytes:
    """A shipped tokenizer, as trained; importlib.resources also finds it inside a frozen
    app."""
    return resources.files("afmd").joinpath("data", filename).read_bytes()


def with_fim_tokens(tokenizer_bytes: bytes) -> bytes:
    """The tokenizer with the FIM tokens added after every trained id."""
    spec = json.loads(tokenizer_bytes)
    next_id = vocab_size(tokenizer_bytes)
    for i, token in enumerate(FIM_TOKENS):
        spec["added_tokens"].append({
            "id": next_id + i, "content": token, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": False,
        })
    return json.dumps(spec, ensure_ascii=False).encode()


def with_end_token(tokenizer_bytes: bytes) -> bytes:
    """The tokenizer, appending ``<|endoftext|>`` to every encoded text.

    Last-token pooling wants one fixed final token whose hidden state has attended to the
    whole input; Qwen3-Embedding's tokenizer appends ``<|endoftext|>`` the same way (a
    post-processor, so any client of the tokenizer gets the same ids afmd does).
    """
    spec = json.loads(tokenizer_bytes)
    end = "<|endoftext|>"
    end_id = added_token_ids(tokenizer_bytes)[end]
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


def added_token_ids(tokenizer_bytes: bytes) -> dict[str, int]:
    """Ids of the seven added tokens, read from the file rather than assumed."""
    added = {t["content"]: t["id"] for t in json.loads(tokenizer_bytes)["added_tokens"]}
    missing = set(CONTROL_TOKENS + MARKUP_TOKENS) - added.keys()
    if missing:
        raise ValueError(f"demo tokenizer lacks {sorted(missing)}")
    return added


def vocab_size(tokenizer_bytes: bytes) -> int:
    """Embedding rows = every token id, so no id can decode to nothing."""
    spec = json.loads(tokenizer_bytes)
    ids = list(spec["model"]["vocab"].values()) + [t["id"] for t in spec["added_tokens"]]
    return max(ids) + 1


def tokenizer_config(vocab: dict[str, int]) -> dict[str, Any]:
    """transformers' view of the tokenizer; the split into special and plain added
    tokens follows Qwen2.5/Qwen3 so tool-call and think markup survive decoding."""
    added = {
        str(vocab[token]): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in CONTROL_TOKENS,
        }
        for token in CONTROL_TOKENS + MARKUP_TOKENS + tuple(t for t in FIM_TOKENS if t in vocab)
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
        "model_max_length": ARCHITECTURE["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
