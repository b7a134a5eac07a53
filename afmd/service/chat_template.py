"""Validated messages and tools → the lists a model's chat template expects.

OpenAI clients send conversations templates were never written for: several system or
developer messages, runs of user messages, tool arguments as JSON strings. This module
normalises them into the shape Hugging Face chat templates handle (one leading system
message, alternating turns, tool-call arguments as objects) so every model sees a
conversation its template renders correctly. Anthropic's system messages inside the
conversation (``Message.in_place``) stay where they stand; :func:`folded_system_turns` is
the shape for a template that refuses a system turn there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from afmd.core.request import Message, ToolCall, ToolSpec


def _arguments(call: ToolCall) -> Any:
    # Templates render arguments with `tojson`; a JSON string would be double-encoded.
    try:
        return orjson.loads(call.arguments)
    except orjson.JSONDecodeError:
        return call.arguments


def template_tools(tools: tuple[ToolSpec, ...]) -> list[dict[str, Any]]:
    """Tools as templates (and mlx-lm's call parsers) take them: OpenAI's function shape."""
    return [tool.as_template_tool() for tool in tools]


def _content(message: Message, images: bool) -> str | list[dict[str, Any]]:
    """The text, or with ``images`` and image parts, the parts in order: text parts and
    ``{"type": "image", "image": ImageInput}`` where each image sat."""
    text = message.content or ""
    if not images or not message.images:
        return text
    parts: list[dict[str, Any]] = []
    at = 0
    for image in message.images:
        if image.offset > at:
            parts.append({"type": "text", "text": text[at:image.offset]})
            at = image.offset
        parts.append({"type": "image", "image": image})
    if at < len(text):
        parts.append({"type": "text", "text": text[at:]})
    return parts


def _joined(first: Any, second: Any) -> Any:
    """Two user turns as one (templates expect alternating turns)."""
    if isinstance(first, str) and isinstance(second, str):
        return first + "\n\n" + second
    listed = [p if isinstance(p, list) else [{"type": "text", "text": p}]
              for p in (first, second)]
    return [*listed[0], {"type": "text", "text": "\n\n"}, *listed[1]]


def template_messages(
    messages: tuple[Message, ...], *, instructions: str = "", images: bool = False
) -> list[dict[str, Any]]:
    """The conversation as chat-template messages; with ``images`` (a vision model) a
    message with images has a list of parts as its content."""
    # An in-place system message before the first turn is part of the leading prompt.
    first_turn = next((i for i, m in enumerate(messages)
                       if m.role not in ("system", "developer")), len(messages))
    leading = [m.content for i, m in enumerate(messages) if m.role in ("system", "developer")
               and m.content and (not m.in_place or i < first_turn)]
    system_parts = [instructions] if instructions else []
    system_parts += leading
    out: list[dict[str, Any]] = []
    if system_parts:
        out.append({"role": "system", "content": "\n\n".join(system_parts)})
    call_names: dict[str, str] = {}
    for i, message in enumerate(messages):
        if message.role in ("system", "developer"):
            if message.in_place and i > first_turn and message.content:
                out.append({"role": "system", "content": message.content})
            continue
        if message.role == "user":
            content = _content(message, images)
            if out and out[-1]["role"] == "user":
                out[-1]["content"] = _joined(out[-1]["content"], content)
            else:
                out.append({"role": "user", "content": content})
        elif message.role == "assistant":
            item: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
            if message.reasoning:
                item["reasoning_content"] = message.reasoning
            if message.tool_calls:
                item["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": _arguments(call)},
                    }
                    for call in message.tool_calls
                ]
                for call in message.tool_calls:
                    call_names[call.id] = call.name
            out.append(item)
        else:  # tool
            item = {"role": "tool", "content": _content(message, images)}
            if message.tool_call_id is not None:
                item["tool_call_id"] = message.tool_call_id
                name = call_names.get(message.tool_call_id)
                if name:
                    item["name"] = name
            out.append(item)
    return out


def folded_system_turns(
    messages: Sequence[Mapping[str, Any]],
) -> list[dict[str, Any]] | None:
    """``messages`` with every system turn after the first message folded into the nearest
    user turn (the next one, else the one before), for templates that accept a system
    message only first, as Anthropic folds them for models without mid-conversation
    system support; None when there is none to fold."""
    late = [i for i, m in enumerate(messages) if i > 0 and m["role"] == "system"]
    if not late:
        return None
    out = [dict(m) for m in messages]
    for i in late:
        text = out[i]["content"]
        after = next((j for j in range(i + 1, len(out)) if out[j]["role"] == "user"), None)
        if after is not None:
            out[after]["content"] = _joined(text, out[after]["content"])
            continue
        before = next((j for j in range(i - 1, -1, -1) if out[j]["role"] in ("user", "tool")),
                      None)
        if before is not None:
            out[before]["content"] = _joined(out[before]["content"], text)
        else:  # nothing to fold into: the leading system prompt takes it
            out[0]["content"] = _joined(out[0]["content"], text)
    dropped = set(late)
    return [m for i, m in enumerate(out) if i not in dropped]


def continuation_kwargs(continue_final: bool) -> dict[str, bool]:
    """``apply_chat_template``'s arguments for a prompt that opens the answer's turn, or
    with ``continue_final`` that ends inside the last message (transformers cuts the
    render right after that message's text)."""
    if continue_final:
        return {"add_generation_prompt": False, "continue_final_message": True}
    return {"add_generation_prompt": True}
