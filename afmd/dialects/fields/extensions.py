"""The local-server extensions every dialect built on a chat template shares.

llama.cpp, vLLM, LM Studio and mlx_lm.server accept a few fields OpenAI never defined, and
IDE plugins send them to whichever server they are pointed at:

- ``chat_template_kwargs``: an object whose keys reach the model's chat template as
  variables (``{"enable_thinking": false}`` for Qwen3-style templates). Keys that
  ``apply_chat_template`` itself takes (``tools``, ``add_generation_prompt``, …) or that
  name the conversation are refused: they would replace what afmd renders from the
  request's own fields, or fail inside the template with a message about the wrong thing.
  The values are passed as sent (the template renders in a sandbox).
- ``repetition_penalty`` and llama.cpp's spelling of it, ``repeat_penalty``: either one;
  both with different values is a 400 (which one was meant?).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from afmd.dialects.fields.checks import Scalar, invalid, read_scalar, wrong_type

__all__ = [
    "CHAT_TEMPLATE_KWARGS",
    "REPEAT_PENALTY",
    "RESERVED_TEMPLATE_KWARGS",
    "chat_template_kwargs_of",
    "repetition_penalty_of",
]

CHAT_TEMPLATE_KWARGS = "chat_template_kwargs"

#: Names a template variable from the client may not take: ``apply_chat_template``'s own
#: parameters and the conversation's variable.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template",
    "add_generation_prompt", "continue_final_message", "tokenize", "sanitize_control_tokens",
    "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})

REPETITION_PENALTY = Scalar("repetition_penalty", "number", minimum=0.0, maximum=10.0)
#: llama.cpp's (and Ollama's) name for ``repetition_penalty``.
REPEAT_PENALTY = Scalar("repeat_penalty", "number", minimum=0.0, maximum=10.0)


def chat_template_kwargs_of(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body's ``chat_template_kwargs``, checked ({} when absent or null)."""
    value = body.get(CHAT_TEMPLATE_KWARGS)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise wrong_type(CHAT_TEMPLATE_KWARGS, "an object", value)
    for key in value:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise invalid(
                f"{CHAT_TEMPLATE_KWARGS}.{key}",
                f"'{key}' cannot be set through '{CHAT_TEMPLATE_KWARGS}': afmd renders it "
                "from the request's own fields.",
            )
    return dict(value)


def repetition_penalty_of(body: Mapping[str, Any]) -> float | None:
    """``repetition_penalty``, or ``repeat_penalty`` standing for it (None: neither)."""
    penalty = read_scalar(body, REPETITION_PENALTY)
    alias = read_scalar(body, REPEAT_PENALTY)
    if alias is None:
        return penalty
    if penalty is not None and penalty != alias:
        raise invalid(
            REPEAT_PENALTY.name,
            f"'repeat_penalty' ({alias:g}) is another name for 'repetition_penalty' "
            f"({penalty:g}) and the two differ; send one of them.",
        )
    return alias
