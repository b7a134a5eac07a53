"""Validation of a Chat Completions request body into typed values.

OpenAI answers every malformed field with a 400 whose ``param`` points at it (for example
``messages[2].content``); clients and agents rely on that to fix their requests, so each
check here names the exact path of the offending value. Nothing past this module ever sees
an unchecked field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from afmd.errors import InvalidRequestError

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


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str | None
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool = False

    def as_template_tool(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: tuple[Message, ...]
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


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


def _invalid(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, code="invalid_value", param=param)


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
    """Decode the body; only a JSON object is a request."""
    if not raw:
        raise InvalidRequestError(
            "The request body is empty; send a JSON object.", code="invalid_json"
        )
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"The request body is not valid JSON: {exc}.", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise InvalidRequestError(
            f"The request body must be a JSON object, but got {_type_name(body)}.",
            code="invalid_type",
        )
    return body


def _text_content(value: Any, param: str, *, allow_null: bool = False) -> str | None:
    """Content is a string or a list of text parts; parts are joined without separators."""
    if value is None:
        if allow_null:
            return None
        raise _missing(param)
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _wrong_type(param, "a string or an array of content parts", value)
    texts: list[str] = []
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
        elif kind in ("image_url", "input_audio", "file"):
            raise _invalid(
                f"{p}.type",
                f"Content part type '{kind}' is not supported by this model: it accepts text only.",
            )
        else:
            raise _invalid(
                f"{p}.type",
                f"Invalid content part type '{kind}'; supported: 'text'.",
            )
    return "".join(texts)


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
            raise _invalid(f"{p}.type", f"Invalid tool call type '{kind}'; expected 'function'.")
        function = call.get("function")
        if function is None:
            raise _missing(f"{p}.function")
        if not isinstance(function, dict):
            raise _wrong_type(f"{p}.function", "an object", function)
        name = function.get("name")
        if name is None:
            raise _missing(f"{p}.function.name")
        if not isinstance(name, str):
            raise _wrong_type(f"{p}.function.name", "a string", name)
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
            f"Invalid value for '{param}.role': '{role}'. Supported values are: "
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
        content = _text_content(value.get("content"), f"{param}.content", allow_null=True)
        if content is None and not tool_calls:
            raise _missing(f"{param}.content")
        return Message(role=role, content=content, name=name, tool_calls=tool_calls)
    if "content" not in value:
        raise _missing(f"{param}.content")
    content = _text_content(value["content"], f"{param}.content")
    if role == "tool":
        call_id = value.get("tool_call_id")
        if call_id is None:
            raise _missing(f"{param}.tool_call_id")
        if not isinstance(call_id, str):
            raise _wrong_type(f"{param}.tool_call_id", "a string", call_id)
        if not call_id:
            raise _invalid(f"{param}.tool_call_id", "A tool_call_id must not be empty.")
        return Message(role=role, content=content, name=name, tool_call_id=call_id)
    return Message(role=role, content=content, name=name)


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
            raise _invalid(f"{p}.type", f"Invalid tool type '{kind}'; supported: 'function'.")
        function = tool.get("function")
        if function is None:
            raise _missing(f"{p}.function")
        if not isinstance(function, dict):
            raise _wrong_type(f"{p}.function", "an object", function)
        name = function.get("name")
        if name is None:
            raise _missing(f"{p}.function.name")
        if not isinstance(name, str):
            raise _wrong_type(f"{p}.function.name", "a string", name)
        if not name or len(name) > 64 or not all(c.isascii() and (c.isalnum() or c in "_-")
                                                 for c in name):
            raise _invalid(
                f"{p}.function.name",
                f"Invalid tool name '{name}': use 1-64 characters among a-z, A-Z, 0-9, _ and -.",
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


def _tool_choice(value: Any, tools: tuple[ToolSpec, ...]) -> Any:
    if value is None:
        return None
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise _invalid(
                "tool_choice",
                f"Invalid value for 'tool_choice': '{value}'. Supported values are: "
                "'none', 'auto', 'required', or an object naming a function.",
            )
        if value == "required" and not tools:
            raise _invalid("tool_choice", "'tool_choice' is 'required' but no 'tools' are given.")
        return value
    if not isinstance(value, dict):
        raise _wrong_type("tool_choice", "a string or an object", value)
    kind = value.get("type")
    if kind is None:
        raise _missing("tool_choice.type")
    if kind != "function":
        raise _invalid(
            "tool_choice.type", f"Invalid value for 'tool_choice.type': '{kind}'; expected "
            "'function'."
        )
    function = value.get("function")
    if function is None:
        raise _missing("tool_choice.function")
    if not isinstance(function, dict):
        raise _wrong_type("tool_choice.function", "an object", function)
    name = function.get("name")
    if name is None:
        raise _missing("tool_choice.function.name")
    if not isinstance(name, str):
        raise _wrong_type("tool_choice.function.name", "a string", name)
    if all(tool.name != name for tool in tools):
        raise _invalid(
            "tool_choice.function.name",
            f"'tool_choice' names the function '{name}', which is not among 'tools'.",
        )
    return value


def _response_format(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _wrong_type("response_format", "an object", value)
    kind = value.get("type")
    if kind is None:
        raise _missing("response_format.type")
    if kind not in ("text", "json_object", "json_schema"):
        raise _invalid(
            "response_format.type",
            f"Invalid value for 'response_format.type': '{kind}'. Supported values are: "
            "'text', 'json_object' and 'json_schema'.",
        )
    return None if kind == "text" else value


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    """Check every field of a Chat Completions body; raise on the first problem."""
    for key in body:
        if key in ("functions", "function_call"):
            raise _invalid(
                key, f"'{key}' is deprecated and not supported; use 'tools' and 'tool_choice'."
            )
        if key not in KNOWN_FIELDS:
            raise InvalidRequestError(
                f"Unrecognized request argument supplied: {key}",
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
                    f"Unrecognized stream option: {key}",
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
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    parallel = _bool(body, "parallel_tool_calls", True)

    return ChatRequest(
        messages=messages,
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
    )
