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
- ``continue_final_message`` (vLLM's): the last message is an assistant's text the answer
  continues, rendered without the end of its turn; with it, ``add_generation_prompt``
  may only be false, as vLLM requires (a new assistant turn would follow the old one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from afmd.dialects.fields.checks import Scalar, invalid, read_scalar, wrong_type

__all__ = [
    "ADD_GENERATION_PROMPT",
    "CHAT_TEMPLATE_KWARGS",
    "CONTINUE_FINAL_MESSAGE",
    "REPEAT_PENALTY",
    "RESERVED_TEMPLATE_KWARGS",
    "chat_template_kwargs_of",
    "continue_final_message_of",
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


CONTINUE_FINAL_MESSAGE = Scalar("continue_final_message", "boolean", default=False)
ADD_GENERATION_PROMPT = Scalar("add_generation_prompt", "boolean")


def continue_final_message_of(body: Mapping[str, Any]) -> bool:
    """Whether the answer continues the last message (``continue_final_message``)."""
    cont = read_scalar(body, CONTINUE_FINAL_MESSAGE)
    header = read_scalar(body, ADD_GENERATION_PROMPT)
    if cont and header:
        raise invalid(ADD_GENERATION_PROMPT.name, "'add_generation_prompt' and "
                      "'continue_final_message' cannot both be true: the answer either "
                      "starts a new assistant turn or continues the last message.")
    if header is False and not cont:
        raise invalid(ADD_GENERATION_PROMPT.name, "'add_generation_prompt' may be false only "
                      "with 'continue_final_message': afmd answers as the assistant, in a "
                      "new turn or continuing the last message.")
    return bool(cont)


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
