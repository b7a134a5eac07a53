"""Which call and reasoning formats a model writes, beyond what mlx-lm detects.

mlx-lm names the call format of most families (its tool parser, from the chat template
or the vocabulary) and finds ``<think>``-style markers; afmd attaches its own reader to
that name. Two families mlx-lm 0.32.2 does not know are recognised here from the
vocabulary alone: gpt-oss's harmony (its channel tokens), whose channels carry both the
reasoning and the calls, Llama 3.1-3.3's JSON calls (``<|python_tag|>``, ``<|eom_id|>``),
and Mistral's ``[THINK]``/``[/THINK]`` reasoning (Magistral,
Devstral).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from afmd.output.formats.registry import FAMILIES

if TYPE_CHECKING:
    from afmd.output.processor import ToolFormat

HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>")
LLAMA_TOKENS = ("<|python_tag|>", "<|eom_id|>")
MISTRAL_THINK = ("[THINK]", "[/THINK]")


def call_format(detected: ToolFormat | None, vocab: Mapping[str, int]) -> ToolFormat | None:
    """mlx-lm's call format with afmd's reader named; harmony where mlx-lm saw none."""
    from afmd.output.processor import ToolFormat

    if detected is not None:
        name = detected.family or _parser_name(detected.parse)
        return dataclasses.replace(detected, family=name if name in FAMILIES else None)
    if all(token in vocab for token in HARMONY_TOKENS):
        return ToolFormat(start="", end="", parse=None, incremental_json=False,
                          family="harmony")
    if all(token in vocab for token in LLAMA_TOKENS):
        return ToolFormat(start="<|python_tag|>", end="", parse=None, incremental_json=False,
                          family="llama3_json")
    return None


def thinking_markers(
    detected: tuple[str, str] | None, vocab: Mapping[str, int]
) -> tuple[str, str] | None:
    if detected is not None:
        return detected
    if all(token in vocab for token in MISTRAL_THINK):
        return MISTRAL_THINK
    return None


def thinks(call: ToolFormat | None, markers: tuple[str, str] | None) -> bool:
    """Whether a model can set its reasoning apart: thinking markers, or harmony's
    analysis channel. One rule for what generation does and for what ``/api/show``
    promises, so that a model listed as ``thinking`` never refuses ``think: true``."""
    return markers is not None or (call is not None and call.channels)


def array_calls(vocab: Mapping[str, int]) -> bool:
    """Mistral tokenizers without ``[ARGS]`` write calls as one JSON array."""
    return "[ARGS]" not in vocab


def _parser_name(parse: Any) -> str | None:
    module = getattr(parse, "__module__", "") or ""
    return module.rsplit(".", 1)[-1] or None
