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


_SEPARATOR = {"type": "text", "text": "\n\n"}


def _parts(content: Any) -> list[Any]:
    return content if isinstance(content, list) else [{"type": "text", "text": content}]


def _joined(contents: Sequence[Any]) -> Any:
    """Several turns' contents as one (templates expect alternating turns), a blank line
    between two: one string while they are strings, parts from the first list of parts on.

    Joined in one pass: joined two at a time, each join copied everything joined before
    it, and a body of a few hundred thousand one-letter user messages took minutes to
    render (past the request's deadline, until the server's response timeout)."""
    strings = 0
    while strings < len(contents) and isinstance(contents[strings], str):
        strings += 1
    if strings == len(contents):
        return "\n\n".join(contents)
    parts: list[Any] = []
    if strings:
        parts.append({"type": "text", "text": "\n\n".join(contents[:strings])})
    for content in contents[strings:]:
        if parts:
            parts.append(dict(_SEPARATOR))
        parts.extend(_parts(content))
    return parts


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
    runs: dict[int, list[Any]] = {}  # a user turn's place in out: the contents it joins
    for i, message in enumerate(messages):
        if message.role in ("system", "developer"):
            if message.in_place and i > first_turn and message.content:
                out.append({"role": "system", "content": message.content})
            continue
        if message.role == "user":
            content = _content(message, images)
            if out and out[-1]["role"] == "user":
                runs.setdefault(len(out) - 1, [out[-1]["content"]]).append(content)
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
    for index, contents in runs.items():
        out[index]["content"] = _joined(contents)
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
    # Each turn's texts folded in before and after it, found in one pass each way (a
    # search per system turn took the square of the conversation's length).
    next_user: list[int | None] = [None] * len(out)
    upcoming: int | None = None
    for j in range(len(out) - 1, -1, -1):
        next_user[j] = upcoming
        if out[j]["role"] == "user":
            upcoming = j
    before: dict[int, list[str]] = {}  # in the order they came: the last is put first
    after: dict[int, list[str]] = {}
    last_turn: int | None = None  # the nearest user or tool turn before
    for i, message in enumerate(out):
        if i > 0 and message["role"] == "system":
            target = next_user[i]
            if target is not None:
                before.setdefault(target, []).append(message["content"])
            else:  # else the one before; with none, the leading system prompt takes it
                after.setdefault(0 if last_turn is None else last_turn,
                                 []).append(message["content"])
        elif message["role"] in ("user", "tool"):
            last_turn = i
    for j in before.keys() | after.keys():
        content = out[j]["content"]
        prepended, appended = before.get(j, [])[::-1], after.get(j, [])
        if isinstance(content, str):
            out[j]["content"] = "\n\n".join([*prepended, content, *appended])
            continue
        # Each text its own part, as when they were folded in one at a time.
        parts: list[Any] = []
        for text in prepended:
            parts += [*_parts(text), dict(_SEPARATOR)]
        parts += content
        for text in appended:
            parts += [dict(_SEPARATOR), *_parts(text)]
        out[j]["content"] = parts
    dropped = set(late)
    return [m for i, m in enumerate(out) if i not in dropped]


def continuation_kwargs(continue_final: bool) -> dict[str, bool]:
    """``apply_chat_template``'s arguments for a prompt that opens the answer's turn, or
    with ``continue_final`` that ends inside the last message (transformers cuts the
    render right after that message's text)."""
    if continue_final:
        return {"add_generation_prompt": False, "continue_final_message": True}
    return {"add_generation_prompt": True}
