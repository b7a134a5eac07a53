"""A conversation's messages, their content parts and their tool-call history, checked.

OpenAI-shaped messages (Chat Completions, and the message items other dialects map onto
them) are parsed here into :class:`afmd.core.request.Message`, every problem named by its
exact param (``messages[2].content[0].image_url.url``). The tool history is checked as a
whole afterwards: a call without its answer, or an answer without its call, would render a
prompt the model was never trained on.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

import orjson

from afmd.core.request import ImageInput, Message, ResponseFormat, ToolCall, ToolChoice
from afmd.dialects.fields.checks import (
    invalid,
    missing,
    not_one_of,
    optional,
    quoted,
    reject_unknown,
    required,
    wrong_type,
)
from afmd.errors import InvalidRequestError

ROLES = ("system", "developer", "user", "assistant", "tool")
_ROLE_SET = frozenset(ROLES)
_NO_IMAGES: tuple[ImageInput, ...] = ()

# The keys ``[api] strict`` admits in each object, as OpenAI refuses any other: every key
# the openai SDK types there (a strict server must not break the official client;
# tests/unit/dialects/test_sdk_fields.py holds these to the SDK's TypedDicts), and what
# afmd's own answers carry, which clients send back as they came (``annotations``,
# ``reasoning_content``). ``name`` is read on every role, a tool message's too.
_SPOKEN = frozenset({"role", "content", "name"})
MESSAGE_KEYS: dict[str, frozenset[str]] = {
    "system": _SPOKEN,
    "developer": _SPOKEN,
    "user": _SPOKEN,
    "assistant": _SPOKEN | {"refusal", "tool_calls", "function_call", "audio", "annotations",
                            "reasoning_content"},
    "tool": _SPOKEN | {"tool_call_id"},
}
PART_KEYS: dict[str, frozenset[str]] = {
    "text": frozenset({"type", "text", "prompt_cache_breakpoint"}),
    "image_url": frozenset({"type", "image_url", "prompt_cache_breakpoint"}),
    "refusal": frozenset({"type", "refusal"}),
}
IMAGE_URL_KEYS = frozenset({"url", "detail"})
#: OpenAI's levels of an image's ``detail`` (the openai SDK's), in chat as in Responses.
IMAGE_DETAILS = ("auto", "low", "high", "original")
TOOL_CALL_KEYS = frozenset({"id", "type", "function"})
CALL_FUNCTION_KEYS = frozenset({"name", "arguments"})
CUSTOM_CALL_KEYS = frozenset({"id", "type", "custom"})
CALL_CUSTOM_KEYS = frozenset({"name", "input"})

# RFC 2397: the scheme, media type and ``;base64`` are case-insensitive, and parameters
# (``;charset=utf-8``, ``;name=x.png``) may come before ``;base64``; only images, and only
# base64 payloads (the payload itself is case-sensitive, so it is matched apart).
_DATA_URL = re.compile(r"(?i:data:image/[a-z0-9.+-]+(?:;[^;,=]+=[^;,]*)*;base64),"
                       r"([A-Za-z0-9+/]*={0,2})", re.ASCII)


def _check_image_part(part: dict[str, Any], p: str, strict: bool) -> bytes:
    """The image's bytes; only inline ``data:`` images: afmd never fetches a URL on a
    client's behalf."""
    image = required(part, "image_url", f"{p}.image_url", dict, "an object")
    if strict:
        reject_unknown(image, IMAGE_URL_KEYS, prefix=f"{p}.image_url.")
    url = required(image, "url", f"{p}.image_url.url", str, "a string")
    # Never acted on (the model sees the image as it came), but held to OpenAI's levels
    # as the Responses API holds its own ``detail``: a typo there is OpenAI's 400 too.
    detail = optional(image, "detail", f"{p}.image_url.detail", str, "a string")
    if detail is not None and detail not in IMAGE_DETAILS:
        raise not_one_of(f"{p}.image_url.detail", detail, IMAGE_DETAILS)
    if url[:5].lower() != "data:":
        raise InvalidRequestError(
            "Only base64 'data:' image URLs are accepted; afmd does not fetch remote URLs.",
            code="unsupported_image_url",
            param=f"{p}.image_url.url",
        )
    match = _DATA_URL.fullmatch(url)
    if match is None or len(match.group(1)) % 4 != 0:
        raise InvalidRequestError(
            "Malformed image data URL: expected 'data:image/<type>;base64,<data>'.",
            code="invalid_image_url",
            param=f"{p}.image_url.url",
        )
    try:
        return base64.b64decode(match.group(1), validate=True)
    except binascii.Error:
        raise InvalidRequestError(
            "Malformed image data URL: the base64 payload does not decode.",
            code="invalid_image_url",
            param=f"{p}.image_url.url",
        ) from None


def text_content(
    value: Any, param: str, *, allow_null: bool = False, refusals: bool = False,
    strict: bool = False,
) -> tuple[str | None, tuple[ImageInput, ...]]:
    """The text of a message's content, and its image parts.

    Content is a string or a list of text and image parts; text parts are joined without
    separators, and each image keeps its place in that text. ``refusals`` admits an
    assistant's ``refusal`` parts, read as its text. ``strict`` refuses a part's unknown
    keys (:data:`PART_KEYS`).
    """
    if value is None:
        if allow_null:
            return None, ()
        raise missing(param)
    if isinstance(value, str):
        return value, ()
    if not isinstance(value, list):
        raise wrong_type(param, "a string or an array of content parts", value)
    texts: list[str] = []
    images: list[ImageInput] = []
    length = 0
    for i, part in enumerate(value):
        p = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise wrong_type(p, "an object", part)
        kind = part.get("type")
        if kind is None:
            raise missing(f"{p}.type")
        if strict and type(kind) is str and kind in PART_KEYS:
            reject_unknown(part, PART_KEYS[kind], prefix=f"{p}.")
        if kind == "text":
            texts.append(required(part, "text", f"{p}.text", str, "a string"))
            length += len(texts[-1])
        elif kind == "image_url":
            images.append(ImageInput(_check_image_part(part, p, strict), f"{p}.image_url",
                                     length))
        elif kind == "refusal" and refusals:
            # An assistant's refusal (OpenAI's own answers carry them) was what it said.
            texts.append(required(part, "refusal", f"{p}.refusal", str, "a string"))
            length += len(texts[-1])
        elif kind in ("input_audio", "file"):
            raise invalid(
                f"{p}.type",
                f"Content part type {quoted(kind)} is not supported: afmd accepts text and "
                "images.",
            )
        else:
            raise invalid(
                f"{p}.type",
                f"Invalid content part type {quoted(kind)}; supported: 'text', 'image_url'"
                + (" and 'refusal'." if refusals else " and, in an assistant's, 'refusal'."),
            )
    return "".join(texts), tuple(images)


# The hot paths below accept a well-formed value inline and hand anything else to the
# primitive that names the problem: parsing runs on the event loop for every request.


def function_object(container: dict[str, Any], p: str) -> tuple[dict[str, Any], str]:
    """``container["function"]`` and its ``name``, both checked."""
    function = container.get("function")
    if type(function) is not dict:
        function = required(container, "function", f"{p}.function", dict, "an object")
    name = function.get("name")
    if type(name) is not str:
        name = required(function, "name", f"{p}.function.name", str, "a string")
    return function, name


def _nonempty_id(obj: dict[str, Any], key: str, param: str, what: str) -> str:
    value = obj.get(key)
    if type(value) is str and value:
        return value
    value = required(obj, key, param, str, "a string")
    if not value:
        raise invalid(param, f"{what} must not be empty.")
    return value


def _custom_call(call: dict[str, Any], p: str, strict: bool) -> ToolCall:
    """A custom tool's call (``{"custom": {"name", "input"}}``) as the model wrote it: the
    one string of the function the tool is offered as."""
    if strict:
        reject_unknown(call, CUSTOM_CALL_KEYS, prefix=f"{p}.")
    call_id = _nonempty_id(call, "id", f"{p}.id", "A tool call id")
    custom = required(call, "custom", f"{p}.custom", dict, "an object")
    if strict:
        reject_unknown(custom, CALL_CUSTOM_KEYS, prefix=f"{p}.custom.")
    name = required(custom, "name", f"{p}.custom.name", str, "a string")
    text = required(custom, "input", f"{p}.custom.input", str, "a string")
    return ToolCall(id=call_id, name=name, arguments=orjson.dumps({"input": text}).decode())


def tool_calls(value: Any, param: str, *, strict: bool = False) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` (``strict``: no unknown key in a call or its
    function)."""
    if not isinstance(value, list):
        raise wrong_type(param, "an array", value)
    calls: list[ToolCall] = []
    for i, call in enumerate(value):
        p = f"{param}[{i}]"
        if not isinstance(call, dict):
            raise wrong_type(p, "an object", call)
        kind = call.get("type", "function")
        if kind == "custom":
            calls.append(_custom_call(call, p, strict))
            continue
        if strict:
            reject_unknown(call, TOOL_CALL_KEYS, prefix=f"{p}.")
        call_id = _nonempty_id(call, "id", f"{p}.id", "A tool call id")
        if kind != "function":
            raise invalid(
                f"{p}.type",
                f"Invalid tool call type {quoted(kind)}; expected 'function' or 'custom'.",
            )
        function, name = function_object(call, p)
        if strict:
            reject_unknown(function, CALL_FUNCTION_KEYS, prefix=f"{p}.function.")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise wrong_type(f"{p}.function.arguments", "a string", arguments)
        calls.append(ToolCall(id=call_id, name=name, arguments=arguments))
    return tuple(calls)


def _user_images_only(role: str, images: tuple[ImageInput, ...], param: str) -> None:
    """OpenAI's refusal of an image in a system, developer or assistant message (its
    schema gives those roles text parts only): a client that works here then works there.
    A tool message's images are read, beyond OpenAI, as a vision model's agent sends a
    screenshot back as a tool's result."""
    if images and role != "user":
        raise InvalidRequestError(
            f"Invalid '{param}'. Image URLs are only allowed for messages with role 'user', "
            f"but this message with role '{role}' contains an image URL.",
            code="invalid_value", param=images[0].param)


def message(value: Any, param: str, *, strict: bool = False) -> Message:
    """One message; ``param`` is its path (``messages[3]``). ``strict`` refuses a key its
    role does not have (:data:`MESSAGE_KEYS`), in it and in its parts and calls."""
    if not isinstance(value, dict):
        raise wrong_type(param, "an object", value)
    role = value.get("role")
    if type(role) is not str or role not in _ROLE_SET:
        role = required(value, "role", f"{param}.role", str, "a string")
        if role == "function":  # OpenAI's deprecated answer to a `function_call`
            raise invalid(f"{param}.role", "'function' messages are deprecated and not "
                          "supported (as 'functions' and 'function_call'); send the result "
                          "as a 'tool' message answering the assistant's 'tool_calls'.")
        if role not in ROLES:
            raise not_one_of(f"{param}.role", role, ROLES)
    if strict:
        reject_unknown(value, MESSAGE_KEYS[role], prefix=f"{param}.")
    name = value.get("name")
    if name is not None and not isinstance(name, str):
        raise wrong_type(f"{param}.name", "a string", name)
    if role == "assistant":
        calls: tuple[ToolCall, ...] = ()
        if value.get("tool_calls") is not None:
            calls = tool_calls(value["tool_calls"], f"{param}.tool_calls", strict=strict)
        if value.get("function_call") is not None:
            raise invalid(
                f"{param}.function_call",
                "'function_call' is deprecated and not supported; use 'tool_calls'.",
            )
        content, images = value.get("content"), _NO_IMAGES
        if type(content) is not str:
            content, images = text_content(content, f"{param}.content", allow_null=True,
                                           refusals=True, strict=strict)
            _user_images_only(role, images, param)
        refusal = value.get("refusal")
        if refusal is not None and not isinstance(refusal, str):
            raise wrong_type(f"{param}.refusal", "a string", refusal)
        if content is None:
            content = refusal  # an answer that was a refusal is sent back as one
        if content is None and not calls:
            raise missing(f"{param}.content")
        # The turn's thinking as afmd's answer carried it: rendered back for templates that
        # know it, as a Responses reasoning item, an Anthropic thinking block and Ollama's
        # ``thinking`` are, so the prompt is what the model wrote whichever API sent it.
        reasoning = optional(value, "reasoning_content", f"{param}.reasoning_content", str,
                             "a string")
        return Message(role=role, content=content, name=name, tool_calls=calls,
                       has_images=bool(images), images=images, reasoning=reasoning or None)
    if "content" not in value:
        raise missing(f"{param}.content")
    content, images = value["content"], _NO_IMAGES
    if type(content) is not str:
        content, images = text_content(content, f"{param}.content", strict=strict)
        if role != "tool":
            _user_images_only(role, images, param)
    if role == "tool":
        call_id = _nonempty_id(value, "tool_call_id", f"{param}.tool_call_id", "A tool_call_id")
        return Message(role=role, content=content, name=name, tool_call_id=call_id,
                       has_images=bool(images), images=images)
    return Message(role=role, content=content, name=name, has_images=bool(images),
                   images=images)


def parse_messages(
    value: Any, param: str = "messages", *, strict: bool = False, prefill: bool = False
) -> tuple[Message, ...]:
    """The conversation, which must have something for the model to answer: a user or
    tool message last, or with ``prefill`` an assistant's text to continue.

    Each message is checked on its own (``strict``: see :func:`message`);
    :func:`check_tool_history` then checks the calls and their answers across messages.
    """
    if value is None:
        raise missing(param)
    if not isinstance(value, list):
        raise wrong_type(param, "an array", value)
    if not value:
        raise invalid(param, f"'{param}' must contain at least one message.")
    messages = tuple(message(m, f"{param}[{i}]", strict=strict) for i, m in enumerate(value))
    if not any(m.role == "user" for m in messages):
        raise InvalidRequestError(
            "The conversation has no user message; add at least one message with role 'user'.",
            code="missing_user_message",
            param=param,
        )
    last = messages[-1]
    if last.role == "assistant" and last.tool_calls:
        raise InvalidRequestError(
            f"Tool call {quoted(last.tool_calls[0].id)} of the last message has no tool "
            "message answering it; add a 'tool' message with its output.",
            code="missing_tool_output",
            param=f"{param}[{len(messages) - 1}].tool_calls[0]",
        )
    if last.role == "assistant" and not prefill:
        raise InvalidRequestError(
            "The last message is from the assistant; end the conversation with a user or "
            "tool message so there is something to answer, or set "
            "'continue_final_message' to continue it.",
            code="invalid_last_message",
            param=f"{param}[{len(messages) - 1}].role",
        )
    return messages


def prefilled(messages: tuple[Message, ...]) -> tuple[tuple[Message, ...], bool]:
    """The conversation, and whether it ends in an assistant's text for the answer to
    continue (a prefill). An empty one is dropped: there is nothing to continue, so the
    answer starts as it would without it (Anthropic accepts the last message empty)."""
    last = messages[-1] if messages else None
    if last is None or last.role != "assistant" or last.tool_calls:
        return messages, False
    if not last.content:
        return messages[:-1], False
    return messages, True


def check_prefill(
    response_format: ResponseFormat | None, format_param: str,
    tool_choice: ToolChoice, choice_param: str,
) -> None:
    """A prefill and a grammar from the answer's first token do not go together: the
    grammar would start over where the prefill left off (a JSON object after a prefilled
    ``{``), so the request is refused rather than answered with output that fits
    neither."""
    if response_format is not None:
        raise invalid(format_param, f"'{format_param}' cannot be combined with a prefilled "
                      "assistant message: the format applies to the whole answer, and the "
                      "answer would continue the prefill. Put the prefill in the format, or "
                      "send one of the two.")
    if tool_choice.mode == "required":
        raise invalid(choice_param, f"'{choice_param}' cannot force a tool call after a "
                      "prefilled assistant message: the answer continues the prefill's "
                      "text. Use 'auto', or end the conversation with a user message.")


def check_tool_history(
    messages: tuple[Message, ...], param: str = "messages"
) -> tuple[Message, ...]:
    """Every call answered exactly once, right after its assistant message; tool outputs in
    the order of the calls (whatever order the client sent them in)."""
    seen_ids: set[str] = set()
    out: list[Message] = []
    i = 0
    while i < len(messages):
        current = messages[i]
        if current.role == "tool":
            raise InvalidRequestError(
                f"{param}[{i}] answers tool call {quoted(current.tool_call_id)}, which no "
                "preceding assistant message made (tool messages must directly follow the "
                "assistant message whose calls they answer).",
                code="unknown_tool_call_id",
                param=f"{param}[{i}].tool_call_id",
            )
        out.append(current)
        i += 1
        if current.role != "assistant" or not current.tool_calls:
            continue
        a = i - 1
        order: dict[str, int] = {}
        for k, call in enumerate(current.tool_calls):
            if call.id in seen_ids or call.id in order:
                raise InvalidRequestError(
                    f"The tool call id {quoted(call.id)} is used more than once.",
                    code="duplicate_tool_call_id",
                    param=f"{param}[{a}].tool_calls[{k}].id",
                )
            order[call.id] = k
        outputs: dict[str, Message] = {}
        while i < len(messages) and messages[i].role == "tool":
            tool = messages[i]
            call_id = tool.tool_call_id or ""
            if call_id not in order:
                raise InvalidRequestError(
                    f"{param}[{i}] answers tool call {quoted(call_id)}, which {param}[{a}] did "
                    "not make.",
                    code="unknown_tool_call_id",
                    param=f"{param}[{i}].tool_call_id",
                )
            if call_id in outputs:
                raise InvalidRequestError(
                    f"Tool call {quoted(call_id)} is answered more than once.",
                    code="duplicate_tool_output",
                    param=f"{param}[{i}].tool_call_id",
                )
            outputs[call_id] = tool
            i += 1
        for k, call in enumerate(current.tool_calls):
            if call.id not in outputs:
                raise InvalidRequestError(
                    f"Tool call {quoted(call.id)} of {param}[{a}] has no tool message "
                    "answering it; each call needs exactly one 'tool' message right after the "
                    "assistant message.",
                    code="missing_tool_output",
                    param=f"{param}[{a}].tool_calls[{k}]",
                )
            seen_ids.add(call.id)
            out.append(outputs[call.id])
    return tuple(out)
