"""An OpenAI Chat Completions body checked into a :class:`ChatRequest`.

Its scalar fields are a table (:data:`CHAT_SCALARS`: type, bounds, default) read by the
walker of :mod:`afmd.dialects.fields.checks`; messages and their tool history come from
:mod:`afmd.dialects.fields.messages`, tools, ``tool_choice`` and ``response_format`` from
:mod:`afmd.dialects.fields.tool_specs`. Every problem is a 400 naming the exact param, and nothing
past
this module ever sees an unchecked field.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from afmd.core.request import ChatRequest
from afmd.dialects.fields.checks import (
    Scalar,
    invalid,
    names,
    optional,
    read_scalar,
    read_scalars,
    reject_unknown,
    string_list,
    unknown_keys,
    wrong_type,
)
from afmd.dialects.fields.extensions import (
    ADD_GENERATION_PROMPT,
    CHAT_TEMPLATE_KWARGS,
    CONTINUE_FINAL_MESSAGE,
    REPEAT_PENALTY,
    REPETITION_PENALTY,
    chat_template_kwargs_of,
    continue_final_message_of,
    repetition_penalty_of,
)
from afmd.dialects.fields.keep_alive import keep_alive_of
from afmd.dialects.fields.messages import (
    check_prefill,
    check_tool_history,
    parse_messages,
    prefilled,
)
from afmd.dialects.fields.prediction import parse_prediction
from afmd.dialects.fields.sampling import (
    FREQUENCY_PENALTY,
    PRESENCE_PENALTY,
    choices_scalar,
    logit_bias_of,
)
from afmd.dialects.fields.tool_specs import (
    CustomFormat,
    parse_response_format,
    parse_tool_choice,
    parse_tools,
)
from afmd.dialects.fields.unused import (
    PROMPT_CACHE_RETENTION,
    SAFETY_IDENTIFIER,
    SERVICE_TIER,
    STORE,
    VERBOSITY,
    check_modalities,
    check_option_objects,
    metadata_of,
)

__all__ = [
    "CHAT_SCALARS",
    "IGNORED_FIELDS",
    "KNOWN_FIELDS",
    "parse_chat_request",
    "parse_stream_options",
    "stop_limit",
]

# Fields OpenAI defines that afmd accepts without acting on them: they change nothing a
# local model could honour, and rejecting them would break stock clients.
IGNORED_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "modalities",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "moderation",
        "audio",
        "verbosity",
        "web_search_options",
    }
)

#: OpenAI's (the openai SDK's ``ReasoningEffort``), as the Responses API takes them.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
#: OpenAI's limit on stop sequences, which ``[api] strict`` keeps.
MAX_STOP_SEQUENCES = 4
#: The limit otherwise, as afmd's Anthropic and Ollama dialects have: editors send every
#: stop of their fill-in-the-middle template (Continue, with ``provider: openai``, cuts the
#: list to four only for api.openai.com and a few hosts it knows), and a stop sequence
#: costs nothing here that would justify refusing the fifth.
LOCAL_MAX_STOP_SEQUENCES = 16


def stop_limit(strict: bool) -> int:
    """How many stop sequences a Chat Completions or Completions body may hold."""
    return MAX_STOP_SEQUENCES if strict else LOCAL_MAX_STOP_SEQUENCES


# The scalar fields in groups, each read where it stands in the order the body is checked
# (the first problem in that order is the one reported).
_MODEL = Scalar("model", "string")
_STREAM = Scalar("stream", "boolean", default=False)
_SAMPLING = (
    Scalar("max_tokens", "integer", minimum=1),
    Scalar("max_completion_tokens", "integer", minimum=1),
    Scalar("temperature", "number", default=1.0, minimum=0.0, maximum=2.0),
    Scalar("top_p", "number", default=1.0, minimum=0.0, maximum=1.0),
    # Common extensions of local servers (mlx_lm.server, llama.cpp, vLLM); the repetition
    # penalty (and its alias) is read by afmd.dialects.fields.extensions.
    Scalar("top_k", "integer", default=0, minimum=0),
    Scalar("min_p", "number", default=0.0, minimum=0.0, maximum=1.0),
    PRESENCE_PENALTY,
    FREQUENCY_PENALTY,
    Scalar("seed", "integer"),
    choices_scalar("choices"),
    Scalar("logprobs", "boolean", default=False),
    Scalar("top_logprobs", "integer", minimum=0, maximum=20),
)
_TOOL_USE = (
    Scalar("parallel_tool_calls", "boolean", default=True),
    Scalar("reasoning_effort", "string", choices=REASONING_EFFORTS),
)
# Ignored, but held to OpenAI's type: a number there is a client's bug worth telling.
_UNUSED = (Scalar("user", "string"), SAFETY_IDENTIFIER,
                    Scalar("prompt_cache_key", "string"), STORE, SERVICE_TIER,
                    PROMPT_CACHE_RETENTION, VERBOSITY)

#: Every scalar field of a chat body.
CHAT_SCALARS = (_MODEL, _STREAM, *_SAMPLING, REPETITION_PENALTY, REPEAT_PENALTY, *_TOOL_USE,
                *_UNUSED, CONTINUE_FINAL_MESSAGE, ADD_GENERATION_PROMPT)

KNOWN_FIELDS = (
    IGNORED_FIELDS
    | names(CHAT_SCALARS)
    | {"prediction", "logit_bias"}
    | {"messages", "stream_options", "stop", "tools", "tool_choice", "response_format",
       "keep_alive", CHAT_TEMPLATE_KWARGS}
)

_DEPRECATED = {
    key: f"'{key}' is deprecated and not supported; use 'tools' and 'tool_choice'."
    for key in ("functions", "function_call")
}
_STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})


def parse_stream_options(value: Any, stream: bool) -> bool:
    """``stream_options``, which only a streamed request may send; whether the stream
    ends with a usage chunk."""
    if value is None:
        return False
    if not isinstance(value, dict):
        raise wrong_type("stream_options", "an object", value)
    if not stream:
        raise invalid(
            "stream_options",
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
        )
    reject_unknown(
        value, _STREAM_OPTIONS, what="Unrecognized stream option", prefix="stream_options."
    )
    usage = optional(
        value, "include_usage", "stream_options.include_usage", bool, "a boolean"
    )
    # Read for its type only: afmd's chunks carry no obfuscation padding to switch off.
    optional(value, "include_obfuscation", "stream_options.include_obfuscation", bool,
             "a boolean")
    return bool(usage)


def parse_chat_request(
    body: dict[str, Any], *, server_tools: Collection[str] = (), strict: bool = False,
    custom: CustomFormat | None = None,
) -> ChatRequest:
    """Check every field of a Chat Completions body; raise on the first problem.

    ``server_tools`` are the names of tools the server itself provides: a ``tool_choice``
    may name them although the client's ``tools`` do not list them. An unknown top-level
    field is ignored (listed in the request's ``ignored_fields``), or with ``strict`` a
    400 ``unknown_parameter`` as OpenAI answers; ``strict`` also refuses an unknown key
    inside messages, their parts and calls, tools, ``tool_choice`` and
    ``response_format``, which otherwise are ignored unnamed (clients echo back fields
    of what they were sent). ``custom`` reads a ``custom`` tool's format (the adapter's:
    grammars are above this layer); without it such a tool is refused.
    """
    ignored = unknown_keys(body, KNOWN_FIELDS, strict=strict, deprecated=_DEPRECATED)
    model = read_scalar(body, _MODEL)
    prefill = continue_final_message_of(body)
    messages = parse_messages(body.get("messages"), strict=strict, prefill=prefill)
    stream = read_scalar(body, _STREAM)
    include_usage = parse_stream_options(body.get("stream_options"), stream)
    sampling = read_scalars(body, _SAMPLING)
    repetition_penalty = repetition_penalty_of(body)
    tools = parse_tools(body.get("tools"), strict=strict, custom=custom)
    tool_choice = parse_tool_choice(body.get("tool_choice"), tools, server_tools,
                                    strict=strict)
    tool_use = read_scalars(body, _TOOL_USE)
    read_scalars(body, _UNUSED)  # checked only: afmd does not act on them
    metadata_of(body.get("metadata"))
    check_modalities(body.get("modalities"))
    check_option_objects(body)

    if sampling["top_logprobs"] is not None and not sampling["logprobs"]:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs' set to true.")
    # Both limits may be sent (old and new clients alike); the stricter one holds.
    max_tokens, limit = sampling["max_tokens"], sampling["max_completion_tokens"]
    if limit is not None and (max_tokens is None or limit < max_tokens):
        max_tokens = limit
    response_format = parse_response_format(body.get("response_format"), strict=strict)
    if prefill:
        if messages[-1].role != "assistant":
            raise invalid(f"messages[{len(messages) - 1}].role", "'continue_final_message' "
                          "continues the last message, which must be the assistant's.")
        messages, prefill = prefilled(messages)
        if prefill:
            check_prefill(response_format, "response_format", tool_choice, "tool_choice")
    return ChatRequest(
        messages=check_tool_history(messages),
        model=model,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        temperature=sampling["temperature"],
        top_p=sampling["top_p"],
        top_k=sampling["top_k"],
        min_p=sampling["min_p"],
        repetition_penalty=repetition_penalty,
        presence_penalty=sampling["presence_penalty"],
        frequency_penalty=sampling["frequency_penalty"],
        logit_bias=logit_bias_of(body),
        seed=sampling["seed"],
        n=sampling["n"],
        stop=string_list(body.get("stop"), "stop", stop_limit(strict)),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=tool_use["parallel_tool_calls"],
        response_format=response_format,
        reasoning_effort=tool_use["reasoning_effort"],
        continue_final=prefill,
        has_images=any(m.has_images for m in messages),
        logprobs=(sampling["top_logprobs"] or 0) if sampling["logprobs"] else None,
        prediction=parse_prediction(body.get("prediction")),
        keep_alive=keep_alive_of(body),
        chat_template_kwargs=chat_template_kwargs_of(body),
        ignored_fields=ignored,
    )
