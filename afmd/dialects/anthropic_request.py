"""An Anthropic Messages body checked into afmd's :class:`~afmd.core.request.ChatRequest`.

Anthropic's conversation is blocks inside two roles: a user turn carries text, images and
the results of the previous turn's tool calls; an assistant turn carries thinking, text
and ``tool_use`` blocks. Inside afmd a tool result is its own ``tool`` message right after
the call it answers, so each user turn becomes its tool messages (in the order of the
calls) followed by its text; consecutive turns of one role are one turn, as Anthropic
merges them. Every problem is a 400 naming its param (``messages[2].content[0].source``).

Fields of Anthropic's API that mean nothing locally are accepted and ignored. Unknown ones
are ignored too and listed in the request's ``ignored_fields`` (Anthropic adds fields
often, and clients send them before afmd knows them); with ``strict`` (``[api] strict``)
they are refused as Anthropic refuses them, ``<field>: Extra inputs are not permitted``.
``thinking`` blocks sent back become that assistant turn's reasoning (templates that know
``reasoning_content`` render it, others drop it); their signatures are opaque to afmd, and
``redacted_thinking`` has no text.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import orjson

from afmd.core.request import (
    ChatRequest,
    ImageInput,
    Message,
    ResponseFormat,
    ToolCall,
    ToolChoice,
    ToolSpec,
)
from afmd.errors import InvalidRequestError
from afmd.protocol.body import parse_json_body
from afmd.protocol.fields import (
    Scalar,
    invalid,
    missing,
    not_one_of,
    optional,
    quoted,
    read_scalars,
    required,
    string_list,
    unknown_keys,
    wrong_type,
)
from afmd.protocol.keep_alive import keep_alive_of

__all__ = ["parse_count_request", "parse_messages_request"]

#: Anthropic's rule for a tool name.
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}", re.ASCII)
_IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}", re.ASCII)
MAX_STOP_SEQUENCES = 16
#: ``output_config.effort`` onto afmd's ``reasoning_effort`` (``max`` is afmd's highest).
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "xhigh"}
THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")
TOOL_CHOICES = ("auto", "any", "tool", "none")

_MODEL = Scalar("model", "string", required=True)
_CREATE = (
    _MODEL,
    Scalar("max_tokens", "integer", minimum=1, required=True),
    Scalar("stream", "boolean", default=False),
    # Anthropic's ranges (temperature up to 1). The current client passes these three in
    # extra_body; they are plain fields on the wire.
    Scalar("temperature", "number", default=1.0, minimum=0.0, maximum=1.0),
    Scalar("top_p", "number", default=1.0, minimum=0.0, maximum=1.0),
    Scalar("top_k", "integer", default=0, minimum=0),
    Scalar("seed", "integer"),  # afmd's own, as on chat: reproducible sampling
)

#: The fields of a count_tokens body, Anthropic's (the SDK's, its betas included) and
#: afmd's ``keep_alive``; those afmd does not act on are accepted all the same.
COUNT_FIELDS = frozenset({
    "model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
    "output_format", "cache_control", "context_management", "mcp_servers", "speed",
    "compaction", "billing_policy", "user_profile_id", "workspace_id", "keep_alive",
})
#: A create body's: the above, generation's own fields, and afmd's ``seed``.
CREATE_FIELDS = COUNT_FIELDS | {
    "max_tokens", "stream", "temperature", "top_p", "top_k", "stop_sequences", "metadata",
    "service_tier", "container", "diagnostics", "inference_geo", "fallbacks",
    "fallback_credit_token", "thread", "seed",
}


@dataclass(slots=True)
class _Turn:
    """Consecutive messages of one role: one turn, its blocks with their params."""

    role: str
    index: int  # the first message's index, for errors about the turn as a whole
    blocks: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def parse_messages_request(
    raw: bytes, *, server_tools: Collection[str] = (), strict: bool = False
) -> ChatRequest:
    """A ``POST /v1/messages`` body; the first problem is a 400 naming its param."""
    return _parse(parse_json_body(raw), _CREATE, CREATE_FIELDS, server_tools, strict)


def parse_count_request(
    raw: bytes, *, server_tools: Collection[str] = (), strict: bool = False
) -> ChatRequest:
    """A ``POST /v1/messages/count_tokens`` body: a create body without ``max_tokens``."""
    return _parse(parse_json_body(raw), (_MODEL,), COUNT_FIELDS, server_tools, strict)


def _parse(
    body: dict[str, Any],
    scalars: tuple[Scalar, ...],
    known: frozenset[str],
    server_tools: Collection[str],
    strict: bool,
) -> ChatRequest:
    ignored = unknown_keys(body, known, strict=False)
    if strict and ignored:
        # Anthropic's own words for it (the envelope puts the field first).
        raise InvalidRequestError("Extra inputs are not permitted", code="unknown_parameter",
                                  param=ignored[0])
    if ignored:  # a field ignored is not checked either (count_tokens reads create's parts)
        body = {key: value for key, value in body.items() if key not in ignored}
    values = read_scalars(body, scalars)
    max_tokens: int | None = values.get("max_tokens")
    system = _system(body.get("system"))
    messages, images = _messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    choice, parallel = _tool_choice(body.get("tool_choice"), tools, server_tools)
    stop = body.get("stop_sequences")
    if stop is not None and not isinstance(stop, list):
        raise wrong_type("stop_sequences", "an array of strings", stop)
    kind, budget = _thinking(body.get("thinking"), max_tokens)
    effort, response_format = _output_config(body.get("output_config"))
    if response_format is None:  # the structured-outputs beta's spelling
        response_format = _format(body.get("output_format"), "output_format")
    reasoning_effort = effort
    if kind == "disabled":
        reasoning_effort = "none"
    elif kind == "enabled":
        reasoning_effort = effort or "medium"
    return ChatRequest(
        messages=(*system, *messages),
        model=values["model"],
        stream=values.get("stream", False),
        max_tokens=max_tokens,
        temperature=values.get("temperature", 1.0),
        top_p=values.get("top_p", 1.0),
        top_k=values.get("top_k", 0),
        seed=values.get("seed"),
        stop=string_list(stop, "stop_sequences", MAX_STOP_SEQUENCES),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        response_format=response_format,
        reasoning_effort=reasoning_effort,
        thinking_budget=budget if kind == "enabled" else None,
        max_tokens_shrinks=True,  # a cap, as Anthropic's: the context window may lower it
        has_images=images,
        keep_alive=keep_alive_of(body),
        ignored_fields=ignored,
    )


# ---------------------------------------------------------------------------- system


def _system(value: Any) -> tuple[Message, ...]:
    """The system prompt: a string or text blocks (joined by blank lines)."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (Message("system", value),) if value else ()
    if not isinstance(value, list):
        raise wrong_type("system", "a string or an array of text blocks", value)
    texts = []
    for i, block in enumerate(value):
        p = f"system[{i}]"
        if not isinstance(block, dict):
            raise wrong_type(p, "an object", block)
        kind = required(block, "type", f"{p}.type", str, "a string")
        if kind != "text":
            raise invalid(f"{p}.type", f"Invalid system block type {quoted(kind)}; "
                          "the system prompt is text blocks.")
        texts.append(required(block, "text", f"{p}.text", str, "a string"))
    text = "\n\n".join(t for t in texts if t)
    return (Message("system", text),) if text else ()


# ---------------------------------------------------------------------------- messages


def _turns(value: Any) -> list[_Turn]:
    if value is None:
        raise missing("messages")
    if not isinstance(value, list):
        raise wrong_type("messages", "an array", value)
    if not value:
        raise invalid("messages", "'messages' must contain at least one message.")
    turns: list[_Turn] = []
    for i, message in enumerate(value):
        p = f"messages[{i}]"
        if not isinstance(message, dict):
            raise wrong_type(p, "an object", message)
        role = required(message, "role", f"{p}.role", str, "a string")
        if role not in ("user", "assistant"):
            raise not_one_of(f"{p}.role", role, ("user", "assistant"))
        content = message.get("content")
        if content is None:
            raise missing(f"{p}.content")
        if isinstance(content, str):
            blocks = [(f"{p}.content", {"type": "text", "text": content})]
        elif isinstance(content, list):
            if not content:
                raise invalid(f"{p}.content", f"'{p}.content' must not be empty.")
            blocks = [(f"{p}.content[{k}]", b) for k, b in enumerate(content)]
        else:
            raise wrong_type(f"{p}.content", "a string or an array of content blocks", content)
        if turns and turns[-1].role == role:
            turns[-1].blocks.extend(blocks)
        else:
            turns.append(_Turn(role, i, blocks))
    return turns


def _messages(value: Any) -> tuple[tuple[Message, ...], bool]:
    """The conversation as afmd's messages, and whether it holds images."""
    out: list[Message] = []
    images = False
    calls: tuple[ToolCall, ...] = ()  # the previous assistant turn's, to be answered now
    calls_at = 0
    turns = _turns(value)
    for turn in turns:
        if turn.role == "assistant":
            message = _assistant(turn)
            out.append(message)
            calls, calls_at = message.tool_calls, turn.index
            continue
        texts: list[str] = []
        results: dict[str, Message] = {}
        pictures: list[ImageInput] = []  # this turn's images, placed in its text
        for p, block in turn.blocks:
            kind = _block_type(block, p)
            if kind == "text":
                texts.append(required(block, "text", f"{p}.text", str, "a string"))
            elif kind == "image":
                pictures.append(ImageInput(_image(block, p), f"{p}.source",
                                           len("\n\n".join(texts))))
                images = True
            elif kind == "tool_result":
                call_id, message, has_image = _tool_result(block, p)
                if not any(c.id == call_id for c in calls):
                    raise InvalidRequestError(
                        f"{p} answers tool_use {quoted(call_id)}, which the assistant turn "
                        "right before it did not make.",
                        code="unknown_tool_call_id", param=f"{p}.tool_use_id")
                if call_id in results:
                    raise InvalidRequestError(
                        f"tool_use {quoted(call_id)} has more than one tool_result.",
                        code="duplicate_tool_output", param=f"{p}.tool_use_id")
                results[call_id] = message
                images = images or has_image
            else:
                raise _unsupported_block(kind, p, "user")
        for call in calls:
            if call.id not in results:
                raise InvalidRequestError(
                    f"tool_use ids were found without tool_result blocks immediately after: "
                    f"{quoted(call.id)}. Each tool_use block must have a corresponding "
                    "tool_result block in the next message.",
                    code="missing_tool_output", param=f"messages[{calls_at}].content")
            out.append(results[call.id])
        if texts or not results:
            out.append(Message("user", "\n\n".join(texts), has_images=bool(pictures),
                               images=tuple(pictures)))
        calls = ()
    last = turns[-1]
    if last.role == "assistant":
        if calls:
            raise InvalidRequestError(
                f"tool_use {quoted(calls[0].id)} of the last message has no tool_result; "
                "add a user message with its result.",
                code="missing_tool_output", param=f"messages[{last.index}].content")
        raise InvalidRequestError(
            "The last message is from the assistant: afmd does not continue a prefilled "
            "assistant turn; end the conversation with a user message.",
            code="invalid_last_message", param=f"messages[{last.index}].role")
    if not any(m.role == "user" for m in out):
        raise InvalidRequestError(
            "The conversation has no user message.", code="missing_user_message",
            param="messages")
    return tuple(out), images


def _block_type(block: Any, p: str) -> str:
    if not isinstance(block, dict):
        raise wrong_type(p, "an object", block)
    kind = block.get("type")
    if type(kind) is not str:
        kind = required(block, "type", f"{p}.type", str, "a string")
    return kind


def _unsupported_block(kind: str, p: str, role: str) -> InvalidRequestError:
    supported = ("'text', 'image' and 'tool_result'" if role == "user"
                 else "'text', 'thinking', 'redacted_thinking' and 'tool_use'")
    return invalid(f"{p}.type", f"Content block type {quoted(kind)} is not supported in a "
                   f"{role} message; supported: {supported}.")


def _assistant(turn: _Turn) -> Message:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for p, block in turn.blocks:
        kind = _block_type(block, p)
        if kind == "text":
            texts.append(required(block, "text", f"{p}.text", str, "a string"))
        elif kind == "thinking":
            thoughts.append(required(block, "thinking", f"{p}.thinking", str, "a string"))
        elif kind == "tool_use":
            call_id = required(block, "id", f"{p}.id", str, "a string")
            if not call_id:
                raise invalid(f"{p}.id", "A tool_use id must not be empty.")
            if any(c.id == call_id for c in calls):
                raise InvalidRequestError(f"The tool_use id {quoted(call_id)} is used more "
                                          "than once.", code="duplicate_tool_call_id",
                                          param=f"{p}.id")
            name = required(block, "name", f"{p}.name", str, "a string")
            arguments = required(block, "input", f"{p}.input", dict, "an object")
            calls.append(ToolCall(call_id, name, orjson.dumps(arguments).decode()))
        elif kind == "redacted_thinking":
            continue  # see the module docstring
        else:
            raise _unsupported_block(kind, p, "assistant")
    text = "\n\n".join(t for t in texts if t)
    return Message("assistant", text or (None if calls else ""), tool_calls=tuple(calls),
                   reasoning="\n\n".join(t for t in thoughts if t) or None)


def _image(block: dict[str, Any], p: str) -> bytes:
    """The image's bytes; only inline base64 images: afmd never fetches a URL on a
    client's behalf."""
    source = required(block, "source", f"{p}.source", dict, "an object")
    kind = required(source, "type", f"{p}.source.type", str, "a string")
    if kind != "base64":
        raise InvalidRequestError(
            f"Image source type {quoted(kind)} is not supported: afmd accepts base64 images "
            "only and does not fetch URLs or files.",
            code="unsupported_image_url", param=f"{p}.source.type")
    media = required(source, "media_type", f"{p}.source.media_type", str, "a string")
    if media not in _IMAGE_TYPES:
        raise not_one_of(f"{p}.source.media_type", media, _IMAGE_TYPES)
    data = required(source, "data", f"{p}.source.data", str, "a string")
    try:
        if not _BASE64.fullmatch(data) or len(data) % 4:
            raise binascii.Error
        return base64.b64decode(data, validate=True)
    except binascii.Error:
        raise InvalidRequestError("The image data is not valid base64.",
                                  code="invalid_image_url", param=f"{p}.source.data") from None


def _tool_result(block: dict[str, Any], p: str) -> tuple[str, Message, bool]:
    """A result as afmd's tool message (text only; an error says so first)."""
    call_id = required(block, "tool_use_id", f"{p}.tool_use_id", str, "a string")
    is_error = optional(block, "is_error", f"{p}.is_error", bool, "a boolean")
    content = block.get("content")
    images: list[ImageInput] = []
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            q = f"{p}.content[{k}]"
            kind = _block_type(part, q)
            if kind == "text":
                texts.append(required(part, "text", f"{q}.text", str, "a string"))
            elif kind == "image":
                images.append(ImageInput(_image(part, q), f"{q}.source",
                                         len("\n\n".join(texts))))
            else:
                raise invalid(f"{q}.type", f"Content block type {quoted(kind)} is not "
                              "supported in a tool_result; supported: 'text' and 'image'.")
        text = "\n\n".join(texts)
    else:
        raise wrong_type(f"{p}.content", "a string or an array of content blocks", content)
    if is_error:
        prefix = "Error: " if text else "Error"
        text = prefix + text
        images = [ImageInput(i.data, i.param, i.offset + len(prefix)) for i in images]
    message = Message("tool", text, tool_call_id=call_id, has_images=bool(images),
                      images=tuple(images))
    return call_id, message, bool(images)


# ---------------------------------------------------------------------------- tools


def _tools(value: Any) -> tuple[ToolSpec, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise wrong_type("tools", "an array", value)
    tools: list[ToolSpec] = []
    seen: set[str] = set()
    for i, tool in enumerate(value):
        p = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise wrong_type(p, "an object", tool)
        kind = optional(tool, "type", f"{p}.type", str, "a string")
        if kind not in (None, "custom"):
            raise InvalidRequestError(
                f"The tool type {quoted(kind)} is one Anthropic runs or defines itself; afmd "
                "has no such tool. Declare it as a custom tool (name, description, "
                "input_schema) and run it in your client.",
                code="unsupported_tool", param=f"{p}.type")
        name = required(tool, "name", f"{p}.name", str, "a string")
        if _TOOL_NAME.fullmatch(name) is None:
            raise invalid(f"{p}.name", f"Invalid tool name {quoted(name)}: use 1-128 "
                          "characters among a-z, A-Z, 0-9, _ and -.")
        if name in seen:
            raise invalid(f"{p}.name", f"Duplicate tool name '{name}'.")
        seen.add(name)
        description = optional(tool, "description", f"{p}.description", str, "a string")
        schema = required(tool, "input_schema", f"{p}.input_schema", dict, "an object")
        strict = optional(tool, "strict", f"{p}.strict", bool, "a boolean")
        tools.append(ToolSpec(name, description, schema, bool(strict)))
    return tuple(tools)


def _tool_choice(
    value: Any, tools: tuple[ToolSpec, ...], server_tools: Collection[str]
) -> tuple[ToolChoice, bool]:
    """``tool_choice`` as afmd's choice, and whether parallel calls are allowed."""
    names = {t.name for t in tools} | set(server_tools)
    if value is None:
        return ToolChoice("auto" if names else "none"), True
    if not isinstance(value, dict):
        raise wrong_type("tool_choice", "an object", value)
    kind = required(value, "type", "tool_choice.type", str, "a string")
    if kind not in TOOL_CHOICES:
        raise not_one_of("tool_choice.type", kind, TOOL_CHOICES)
    single = optional(value, "disable_parallel_tool_use",
                      "tool_choice.disable_parallel_tool_use", bool, "a boolean")
    parallel = not single
    if kind == "none" or (kind == "auto" and not names):
        return ToolChoice("none"), parallel
    if kind == "auto":
        return ToolChoice("auto"), parallel
    if not names:
        raise invalid("tool_choice.type", f"'tool_choice' is {quoted(kind)} but no 'tools' "
                      "are given.")
    if kind == "any":
        return ToolChoice("required"), parallel
    name = required(value, "name", "tool_choice.name", str, "a string")
    if name not in names:
        raise InvalidRequestError(f"'tool_choice.name' names the tool {quoted(name)}, which "
                                  "is not in 'tools'.", code="unknown_tool",
                                  param="tool_choice.name")
    return ToolChoice("required", (name,), named=True), parallel


# ---------------------------------------------------------------------------- output


def _thinking(value: Any, max_tokens: int | None) -> tuple[str | None, int | None]:
    """``thinking``'s type and, when enabled, its budget."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise wrong_type("thinking", "an object", value)
    kind = required(value, "type", "thinking.type", str, "a string")
    if kind not in THINKING_TYPES:
        raise not_one_of("thinking.type", kind, THINKING_TYPES)
    display = optional(value, "display", "thinking.display", str, "a string")
    if display is not None and display not in ("summarized", "omitted"):
        raise not_one_of("thinking.display", display, ("summarized", "omitted"))
    if kind != "enabled":
        return kind, None
    (budget,) = read_scalars(value, (Scalar("budget_tokens", "integer", minimum=1,
                                            required=True),), "thinking.").values()
    if max_tokens is not None and budget >= max_tokens:
        raise invalid("thinking.budget_tokens", f"'thinking.budget_tokens' ({budget}) must be "
                      f"less than 'max_tokens' ({max_tokens}): thinking counts toward it.")
    return kind, budget


def _output_config(value: Any) -> tuple[str | None, ResponseFormat | None]:
    """``output_config``: the effort as afmd's ``reasoning_effort``, and the format."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise wrong_type("output_config", "an object", value)
    effort = optional(value, "effort", "output_config.effort", str, "a string")
    if effort is not None and effort not in EFFORTS:
        raise not_one_of("output_config.effort", effort, tuple(EFFORTS))
    return (EFFORTS[effort] if effort else None,
            _format(value.get("format"), "output_config.format"))


def _format(value: Any, param: str) -> ResponseFormat | None:
    """A JSON schema the answer must match: the grammar enforces it, as chat's
    ``response_format``."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise wrong_type(param, "an object", value)
    kind = required(value, "type", f"{param}.type", str, "a string")
    if kind != "json_schema":
        raise not_one_of(f"{param}.type", kind, ("json_schema",))
    schema = required(value, "schema", f"{param}.schema", dict, "an object")
    return ResponseFormat("json_schema", schema, "output", strict=True)
