"""Validation of a Chat Completions request body into typed values.

OpenAI answers every malformed field with a 400 whose ``param`` points at it (for example
``messages[2].content``); clients and agents rely on that to fix their requests, so each
check here names the exact path of the offending value. Nothing past this module ever sees
an unchecked field.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections.abc import Collection
from typing import Any

import orjson

from afmd.core.request import (
    ChatRequest,
    Message,
    ResponseFormat,
    ToolCall,
    ToolChoice,
    ToolSpec,
)
from afmd.errors import InvalidRequestError
from afmd.protocol.nesting import (
    MAX_NESTING,
    Segment,
    nesting_path,
    nesting_path_in_text,
    nests_deeper_than,
    param_of,
)

ROLES = ("system", "developer", "user", "assistant", "tool")

# Fields OpenAI defines that afmd accepts without acting on them: they change nothing a
# local model could honour, and rejecting them would break stock clients.
IGNORED_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "service_tier",
        "reasoning_effort",
        "prediction",
        "modalities",
        "safety_identifier",
        "prompt_cache_key",
        "verbosity",
        "web_search_options",
        "top_logprobs",
    }
)

KNOWN_FIELDS = IGNORED_FIELDS | {
    "model",
    "messages",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "n",
    "stop",
    "logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    # Common extensions of local servers (mlx_lm.server, llama.cpp, vLLM).
    "top_k",
    "min_p",
    "repetition_penalty",
}

MAX_STOP_SEQUENCES = 4


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


#: Characters of a client's value an error message repeats: enough to recognise it, while
#: a megabyte-long value still gets a small error.
MAX_ECHO_CHARS = 100


def _clip(text: str) -> str:
    if len(text) <= MAX_ECHO_CHARS:
        return text
    return f"{text[:MAX_ECHO_CHARS]}… ({len(text)} characters)"


def _quoted(value: Any) -> str:
    """A client's value as an error message quotes it: a string as is, anything else as
    JSON, cut short with its full length noted."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = orjson.dumps(value).decode()
        except orjson.JSONEncodeError:
            text = _type_name(value)
    if len(text) <= MAX_ECHO_CHARS:
        return f"'{text}'"
    return f"'{text[:MAX_ECHO_CHARS]}…' ({len(text)} characters)"


def _wrong_type(param: str, expected: str, value: Any) -> InvalidRequestError:
    return InvalidRequestError(
        f"Invalid type for '{param}': expected {expected}, but got {_type_name(value)}.",
        code="invalid_type",
        param=param,
    )


def _missing(param: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"Missing required parameter: '{param}'.",
        code="missing_required_parameter",
        param=param,
    )


def _invalid(param: str | None, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, code="invalid_value", param=param)


def _required(obj: dict[str, Any], key: str, param: str, kind: type, expected: str) -> Any:
    """A field that must be present and of one JSON type (``param`` is its full path)."""
    value = obj.get(key)
    if value is None:
        raise _missing(param)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _wrong_type(param, expected, value)
    return value


def _function_object(container: dict[str, Any], p: str) -> tuple[dict[str, Any], str]:
    """``container["function"]`` and its ``name``, both checked."""
    function = _required(container, "function", f"{p}.function", dict, "an object")
    name = _required(function, "name", f"{p}.function.name", str, "a string")
    return function, name


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _wrong_type(key, "a boolean", value)
    return value


def _int(value: Any, param: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        # 5.0 is what some JSON encoders produce for 5; accept exact integral floats.
        if isinstance(value, float) and value.is_integer() and not isinstance(value, bool):
            value = int(value)
        else:
            raise _wrong_type(param, "an integer", value)
    if minimum is not None and value < minimum:
        raise _invalid(param, f"Invalid '{param}': {value} is less than the minimum of {minimum}.")
    return value


def _number(value: Any, param: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _wrong_type(param, "a number", value)
    value = float(value)
    if math.isnan(value) or value < lo or value > hi:
        raise _invalid(
            param, f"Invalid '{param}': {value:g} is outside the allowed range [{lo:g}, {hi:g}]."
        )
    return value


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode the body; only a JSON object is a request, and only one nested at most
    ``MAX_NESTING`` levels deep (see :mod:`afmd.protocol.nesting`)."""
    if not raw:
        raise InvalidRequestError(
            "The request body is empty; send a JSON object.", code="invalid_json"
        )
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        # orjson's own depth limit: the text before it parsed, so name what is too deep.
        path = nesting_path_in_text(raw) if "depth limit" in str(exc) else None
        if path is None:
            raise InvalidRequestError(
                f"The request body is not valid JSON: {exc}.", code="invalid_json"
            ) from None
        raise _too_deep(path) from None
    # A body with no more brackets than levels allowed cannot nest too deep (most chats).
    if raw.count(b"[") + raw.count(b"{") > MAX_NESTING and nests_deeper_than(body):
        raise _too_deep(nesting_path_in_text(raw) or nesting_path(body) or [])
    if not isinstance(body, dict):
        raise InvalidRequestError(
            f"The request body must be a JSON object, but got {_type_name(body)}.",
            code="invalid_type",
        )
    return body


def _too_deep(path: list[Segment]) -> InvalidRequestError:
    return _invalid(
        param_of(path) if path else None,
        f"The value is nested more than {MAX_NESTING} levels deep (arrays and objects, the "
        f"body counting as one); afmd accepts at most {MAX_NESTING} levels.",
    )


_DATA_URL = re.compile(r"data:image/[A-Za-z0-9.+-]+;base64,([A-Za-z0-9+/]*={0,2})", re.ASCII)


def _check_image_part(part: dict[str, Any], p: str) -> None:
    """Only inline ``data:`` images: afmd never fetches a URL on a client's behalf."""
    image = part.get("image_url")
    if image is None:
        raise _missing(f"{p}.image_url")
    if not isinstance(image, dict):
        raise _wrong_type(f"{p}.image_url", "an object", image)
    url = image.get("url")
    if url is None:
        raise _missing(f"{p}.image_url.url")
    if not isinstance(url, str):
        raise _wrong_type(f"{p}.image_url.url", "a string", url)
    if not url.startswith("data:"):
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
        base64.b64decode(match.group(1), validate=True)
    except binascii.Error:
        raise InvalidRequestError(
            "Malformed image data URL: the base64 payload does not decode.",
            code="invalid_image_url",
            param=f"{p}.image_url.url",
        ) from None


def _text_content(
    value: Any, param: str, *, allow_null: bool = False
) -> tuple[str | None, bool]:
    """The text of a message's content, and whether it carried image parts."""
    """Content is a string or a list of text parts; parts are joined without separators."""
    if value is None:
        if allow_null:
            return None, False
        raise _missing(param)
    if isinstance(value, str):
        return value, False
    if not isinstance(value, list):
        raise _wrong_type(param, "a string or an array of content parts", value)
    texts: list[str] = []
    images: list[int] = []
    for i, part in enumerate(value):
        p = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise _wrong_type(p, "an object", part)
        kind = part.get("type")
        if kind is None:
            raise _missing(f"{p}.type")
        if kind == "text":
            text = part.get("text")
            if text is None:
                raise _missing(f"{p}.text")
            if not isinstance(text, str):
                raise _wrong_type(f"{p}.text", "a string", text)
            texts.append(text)
        elif kind == "image_url":
            _check_image_part(part, p)
            images.append(i)
        elif kind in ("input_audio", "file"):
            raise _invalid(
                f"{p}.type",
                f"Content part type {_quoted(kind)} is not supported: afmd accepts text and "
                "images.",
            )
        else:
            raise _invalid(
                f"{p}.type",
                f"Invalid content part type {_quoted(kind)}; supported: 'text' and 'image_url'.",
            )
    return "".join(texts), bool(images)


def _tool_calls(value: Any, param: str) -> tuple[ToolCall, ...]:
    if not isinstance(value, list):
        raise _wrong_type(param, "an array", value)
    calls: list[ToolCall] = []
    for i, call in enumerate(value):
        p = f"{param}[{i}]"
        if not isinstance(call, dict):
            raise _wrong_type(p, "an object", call)
        call_id = call.get("id")
        if call_id is None:
            raise _missing(f"{p}.id")
        if not isinstance(call_id, str):
            raise _wrong_type(f"{p}.id", "a string", call_id)
        if not call_id:
            raise _invalid(f"{p}.id", "A tool call id must not be empty.")
        kind = call.get("type", "function")
        if kind != "function":
            raise _invalid(
                f"{p}.type", f"Invalid tool call type {_quoted(kind)}; expected 'function'."
            )
        function, name = _function_object(call, p)
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise _wrong_type(f"{p}.function.arguments", "a string", arguments)
        calls.append(ToolCall(id=call_id, name=name, arguments=arguments))
    return tuple(calls)


def _message(value: Any, index: int) -> Message:
    param = f"messages[{index}]"
    if not isinstance(value, dict):
        raise _wrong_type(param, "an object", value)
    role = value.get("role")
    if role is None:
        raise _missing(f"{param}.role")
    if not isinstance(role, str):
        raise _wrong_type(f"{param}.role", "a string", role)
    if role not in ROLES:
        raise _invalid(
            f"{param}.role",
            f"Invalid value for '{param}.role': {_quoted(role)}. Supported values are: "
            + ", ".join(f"'{r}'" for r in ROLES)
            + ".",
        )
    name = value.get("name")
    if name is not None and not isinstance(name, str):
        raise _wrong_type(f"{param}.name", "a string", name)
    if role == "assistant":
        tool_calls: tuple[ToolCall, ...] = ()
        if value.get("tool_calls") is not None:
            tool_calls = _tool_calls(value["tool_calls"], f"{param}.tool_calls")
        if value.get("function_call") is not None:
            raise _invalid(
                f"{param}.function_call",
                "'function_call' is deprecated and not supported; use 'tool_calls'.",
            )
        content, images = _text_content(
            value.get("content"), f"{param}.content", allow_null=True
        )
        if content is None and not tool_calls:
            raise _missing(f"{param}.content")
        return Message(
            role=role, content=content, name=name, tool_calls=tool_calls, has_images=images
        )
    if "content" not in value:
        raise _missing(f"{param}.content")
    content, images = _text_content(value["content"], f"{param}.content")
    if role == "tool":
        call_id = value.get("tool_call_id")
        if call_id is None:
            raise _missing(f"{param}.tool_call_id")
        if not isinstance(call_id, str):
            raise _wrong_type(f"{param}.tool_call_id", "a string", call_id)
        if not call_id:
            raise _invalid(f"{param}.tool_call_id", "A tool_call_id must not be empty.")
        return Message(
            role=role, content=content, name=name, tool_call_id=call_id, has_images=images
        )
    return Message(role=role, content=content, name=name, has_images=images)


def _messages(value: Any) -> tuple[Message, ...]:
    if value is None:
        raise _missing("messages")
    if not isinstance(value, list):
        raise _wrong_type("messages", "an array", value)
    if not value:
        raise _invalid("messages", "'messages' must contain at least one message.")
    messages = tuple(_message(m, i) for i, m in enumerate(value))
    if not any(m.role == "user" for m in messages):
        raise InvalidRequestError(
            "The conversation has no user message; add at least one message with role 'user'.",
            code="missing_user_message",
            param="messages",
        )
    if messages[-1].role == "assistant" and messages[-1].tool_calls:
        raise InvalidRequestError(
            f"Tool call {_quoted(messages[-1].tool_calls[0].id)} of the last message has no tool "
            "message answering it; add a 'tool' message with its output.",
            code="missing_tool_output",
            param=f"messages[{len(messages) - 1}].tool_calls[0]",
        )
    if messages[-1].role == "assistant":
        raise InvalidRequestError(
            "The last message is from the assistant; end the conversation with a user or "
            "tool message so there is something to answer.",
            code="invalid_last_message",
            param=f"messages[{len(messages) - 1}].role",
        )
    return messages


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        values = [value]
    elif isinstance(value, list):
        values = value
    else:
        raise _wrong_type("stop", "a string or an array of strings", value)
    if len(values) > MAX_STOP_SEQUENCES:
        raise _invalid(
            "stop", f"'stop' accepts at most {MAX_STOP_SEQUENCES} sequences, got {len(values)}."
        )
    for i, s in enumerate(values):
        if not isinstance(s, str):
            raise _wrong_type(f"stop[{i}]", "a string", s)
        if not s:
            raise _invalid(f"stop[{i}]", "A stop sequence must not be empty.")
    return tuple(dict.fromkeys(values))


def _tools(value: Any) -> tuple[ToolSpec, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _wrong_type("tools", "an array", value)
    tools: list[ToolSpec] = []
    seen: set[str] = set()
    for i, tool in enumerate(value):
        p = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _wrong_type(p, "an object", tool)
        kind = tool.get("type")
        if kind is None:
            raise _missing(f"{p}.type")
        if kind != "function":
            raise _invalid(
                f"{p}.type", f"Invalid tool type {_quoted(kind)}; supported: 'function'."
            )
        function, name = _function_object(tool, p)
        if not name or len(name) > 64 or not all(c.isascii() and (c.isalnum() or c in "_-")
                                                 for c in name):
            raise _invalid(
                f"{p}.function.name",
                f"Invalid tool name {_quoted(name)}: use 1-64 characters among a-z, A-Z, "
                "0-9, _ and -.",
            )
        if name in seen:
            raise _invalid(f"{p}.function.name", f"Duplicate tool name '{name}'.")
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _wrong_type(f"{p}.function.description", "a string", description)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _wrong_type(f"{p}.function.parameters", "an object", parameters)
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _wrong_type(f"{p}.function.strict", "a boolean", strict)
        tools.append(ToolSpec(name, description, parameters, bool(strict)))
    return tuple(tools)


def _function_name(value: Any, param: str) -> str:
    if not isinstance(value, dict):
        raise _wrong_type(param, "an object", value)
    if value.get("type", "function") != "function":
        raise _invalid(f"{param}.type", "Only tools of type 'function' are supported.")
    function = value.get("function")
    if function is None:
        # The Responses-style flat shape {"type": "function", "name": ...} is accepted too.
        name = value.get("name")
        if name is None:
            raise _missing(f"{param}.function")
        if not isinstance(name, str):
            raise _wrong_type(f"{param}.name", "a string", name)
        return name
    return _function_object(value, param)[1]


def _unknown_tool(name: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"'{param}' names the tool {_quoted(name)}, which is not in 'tools'.",
        code="unknown_tool",
        param=param,
    )


def _tool_choice(
    value: Any, tools: tuple[ToolSpec, ...], server_tools: Collection[str] = ()
) -> ToolChoice:
    names = {t.name for t in tools} | set(server_tools)
    has_tools = bool(names)
    if value is None:
        return ToolChoice("auto" if has_tools else "none")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise _invalid(
                "tool_choice",
                f"Invalid value for 'tool_choice': {_quoted(value)}. Supported values are: "
                "'none', 'auto', 'required', or an object naming a function.",
            )
        if value == "required" and not has_tools:
            raise _invalid("tool_choice", "'tool_choice' is 'required' but no 'tools' are given.")
        return ToolChoice(value if has_tools else "none")
    if not isinstance(value, dict):
        raise _wrong_type("tool_choice", "a string or an object", value)
    kind = value.get("type")
    if kind is None:
        raise _missing("tool_choice.type")
    if kind == "function":
        name = _function_name(value, "tool_choice")
        param = "tool_choice.function.name" if "function" in value else "tool_choice.name"
        if name not in names:
            raise _unknown_tool(name, param)
        return ToolChoice("required", (name,), named=True)
    if kind == "allowed_tools":
        spec = value.get("allowed_tools")
        if spec is None:
            raise _missing("tool_choice.allowed_tools")
        if not isinstance(spec, dict):
            raise _wrong_type("tool_choice.allowed_tools", "an object", spec)
        mode = spec.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise _invalid(
                "tool_choice.allowed_tools.mode",
                f"Invalid value {_quoted(mode)}; supported values are 'auto' and 'required'.",
            )
        listed = spec.get("tools")
        if listed is None:
            raise _missing("tool_choice.allowed_tools.tools")
        if not isinstance(listed, list) or not listed:
            raise _invalid(
                "tool_choice.allowed_tools.tools", "'tools' must be a non-empty array."
            )
        allowed: list[str] = []
        for i, item in enumerate(listed):
            p = f"tool_choice.allowed_tools.tools[{i}]"
            name = _function_name(item, p)
            if name not in names:
                raise _unknown_tool(name, p + (".function.name" if "function" in item
                                                else ".name"))
            allowed.append(name)
        return ToolChoice(mode, tuple(dict.fromkeys(allowed)))
    raise _invalid(
        "tool_choice.type",
        f"Invalid value for 'tool_choice.type': {_quoted(kind)}. Supported values are 'function' "
        "and 'allowed_tools'.",
    )


def _response_format(value: Any) -> ResponseFormat | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _wrong_type("response_format", "an object", value)
    kind = value.get("type")
    if kind is None:
        raise _missing("response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind != "json_schema":
        raise _invalid(
            "response_format.type",
            f"Invalid value for 'response_format.type': {_quoted(kind)}. Supported values are: "
            "'text', 'json_object' and 'json_schema'.",
        )
    spec = value.get("json_schema")
    if spec is None:
        raise _missing("response_format.json_schema")
    if not isinstance(spec, dict):
        raise _wrong_type("response_format.json_schema", "an object", spec)
    name = spec.get("name")
    if name is None:
        raise _missing("response_format.json_schema.name")
    if not isinstance(name, str):
        raise _wrong_type("response_format.json_schema.name", "a string", name)
    schema = spec.get("schema")
    if schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise _wrong_type("response_format.json_schema.schema", "an object", schema)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _wrong_type("response_format.json_schema.strict", "a boolean", strict)
    return ResponseFormat("json_schema", schema, name, bool(strict))


def _check_tool_history(messages: tuple[Message, ...]) -> tuple[Message, ...]:
    """Every call answered exactly once, right after its assistant message; tool outputs in
    the order of the calls (whatever order the client sent them in)."""
    seen_ids: dict[str, str] = {}
    out: list[Message] = []
    i = 0
    while i < len(messages):
        message = messages[i]
        if message.role == "tool":
            raise InvalidRequestError(
                f"messages[{i}] answers tool call {_quoted(message.tool_call_id)}, which no "
                "preceding assistant message made (tool messages must directly follow the "
                "assistant message whose calls they answer).",
                code="unknown_tool_call_id",
                param=f"messages[{i}].tool_call_id",
            )
        out.append(message)
        i += 1
        if message.role != "assistant" or not message.tool_calls:
            continue
        a = i - 1
        order: dict[str, int] = {}
        for k, call in enumerate(message.tool_calls):
            if call.id in seen_ids or call.id in order:
                raise InvalidRequestError(
                    f"The tool call id {_quoted(call.id)} is used more than once.",
                    code="duplicate_tool_call_id",
                    param=f"messages[{a}].tool_calls[{k}].id",
                )
            order[call.id] = k
        outputs: dict[str, Message] = {}
        while i < len(messages) and messages[i].role == "tool":
            tool = messages[i]
            call_id = tool.tool_call_id or ""
            if call_id not in order:
                raise InvalidRequestError(
                    f"messages[{i}] answers tool call {_quoted(call_id)}, which messages[{a}] did "
                    "not make.",
                    code="unknown_tool_call_id",
                    param=f"messages[{i}].tool_call_id",
                )
            if call_id in outputs:
                raise InvalidRequestError(
                    f"Tool call {_quoted(call_id)} is answered more than once.",
                    code="duplicate_tool_output",
                    param=f"messages[{i}].tool_call_id",
                )
            outputs[call_id] = tool
            i += 1
        for k, call in enumerate(message.tool_calls):
            if call.id not in outputs:
                raise InvalidRequestError(
                    f"Tool call {_quoted(call.id)} of messages[{a}] has no tool message answering "
                    "it; each call needs exactly one 'tool' message right after the "
                    "assistant message.",
                    code="missing_tool_output",
                    param=f"messages[{a}].tool_calls[{k}]",
                )
            seen_ids[call.id] = call.name
            out.append(outputs[call.id])
    return tuple(out)


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def parse_chat_request(
    body: dict[str, Any], *, server_tools: Collection[str] = ()
) -> ChatRequest:
    """Check every field of a Chat Completions body; raise on the first problem.

    ``server_tools`` are the names of tools the server itself provides: a ``tool_choice``
    may name them although the client's ``tools`` do not list them.
    """
    for key in body:
        if key in ("functions", "function_call"):
            raise _invalid(
                key, f"'{key}' is deprecated and not supported; use 'tools' and 'tool_choice'."
            )
        if key not in KNOWN_FIELDS:
            raise InvalidRequestError(
                f"Unrecognized request argument supplied: {_clip(key)}",
                code="unknown_parameter",
                param=key,
            )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _wrong_type("model", "a string", model)

    messages = _messages(body.get("messages"))
    stream = _bool(body, "stream", False)

    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise _wrong_type("stream_options", "an object", options)
        if not stream:
            raise _invalid(
                "stream_options",
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            )
        for key in options:
            if key not in ("include_usage", "include_obfuscation"):
                raise InvalidRequestError(
                    f"Unrecognized stream option: {_clip(key)}",
                    code="unknown_parameter",
                    param=f"stream_options.{key}",
                )
        usage = options.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise _wrong_type("stream_options.include_usage", "a boolean", usage)
        include_usage = bool(usage)

    max_tokens: int | None = None
    for key in ("max_tokens", "max_completion_tokens"):
        if body.get(key) is not None:
            value = _int(body[key], key, minimum=1)
            max_tokens = value if max_tokens is None else min(max_tokens, value)

    temperature = 1.0
    if body.get("temperature") is not None:
        temperature = _number(body["temperature"], "temperature", 0.0, 2.0)
    top_p = 1.0
    if body.get("top_p") is not None:
        top_p = _number(body["top_p"], "top_p", 0.0, 1.0)
    top_k = 0
    if body.get("top_k") is not None:
        top_k = _int(body["top_k"], "top_k", minimum=0)
    min_p = 0.0
    if body.get("min_p") is not None:
        min_p = _number(body["min_p"], "min_p", 0.0, 1.0)
    repetition_penalty = None
    if body.get("repetition_penalty") is not None:
        repetition_penalty = _number(body["repetition_penalty"], "repetition_penalty", 0.0, 10.0)
    seed = None
    if body.get("seed") is not None:
        seed = _int(body["seed"], "seed")
    if body.get("n") is not None:
        n = _int(body["n"], "n", minimum=1)
        if n != 1:
            raise _invalid("n", f"Invalid 'n': {n}. afmd generates one choice per request; use 1.")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if not isinstance(logprobs, bool):
            raise _wrong_type("logprobs", "a boolean", logprobs)
        if logprobs:
            raise _invalid("logprobs", "'logprobs' is not supported; set it to false or omit it.")

    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools, server_tools)
    parallel = _bool(body, "parallel_tool_calls", True)

    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise _wrong_type("reasoning_effort", "a string", effort)
        if effort not in REASONING_EFFORTS:
            raise _invalid(
                "reasoning_effort",
                f"Invalid value for 'reasoning_effort': {_quoted(effort)}. Supported values are: "
                + ", ".join(f"'{e}'" for e in REASONING_EFFORTS) + ".",
            )

    return ChatRequest(
        messages=_check_tool_history(messages),
        model=model,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        stop=_stop(body.get("stop")),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        response_format=_response_format(body.get("response_format")),
        reasoning_effort=effort,
        has_images=any(m.has_images for m in messages),
    )
