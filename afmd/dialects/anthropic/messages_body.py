"""An Anthropic Messages body checked into afmd's :class:`~afmd.core.request.ChatRequest`.

This module reads the top-level fields (sampling, stop sequences, ``thinking``,
``output_config``) and assembles the request; the conversation is
:mod:`afmd.dialects.anthropic.history`'s, the tools
:mod:`afmd.dialects.anthropic.tools_body`'. Every problem is a 400 naming its param.

Fields of Anthropic's API that mean nothing locally are accepted, ignored and listed in the
request's ``ignored_fields`` (``X-AFM-Ignored-Fields``). Unknown ones are ignored and listed
too (Anthropic adds fields
often, and clients send them before afmd knows them); with ``strict`` (``[api] strict``)
they are refused as Anthropic refuses them, ``<field>: Extra inputs are not permitted``,
and so is an unknown key inside the body's objects (``messages[0].bogus: …``), which
otherwise is ignored unnamed: clients send back the blocks they were answered with.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from afmd.core.request import ChatRequest, ResponseFormat
from afmd.dialects.anthropic.history import EXTRA_INPUTS, parse_messages, parse_system
from afmd.dialects.anthropic.tools_body import offered_tools, parse_tool_choice, parse_tools
from afmd.dialects.fields.body import parse_json_body
from afmd.dialects.fields.checks import (
    Scalar,
    invalid,
    not_one_of,
    optional,
    read_scalars,
    reject_unknown,
    required,
    string_list,
    unknown_keys,
    wrong_type,
)
from afmd.dialects.fields.keep_alive import keep_alive_of
from afmd.dialects.fields.messages import check_prefill, prefilled
from afmd.dialects.fields.unused import check_option_objects
from afmd.errors import InvalidRequestError

__all__ = ["parse_count_request", "parse_messages_request"]

MAX_STOP_SEQUENCES = 16
#: ``output_config.effort`` onto afmd's ``reasoning_effort`` (``max`` is afmd's highest);
#: its keys are :data:`~afmd.dialects.anthropic.history.EFFORT_LEVELS`.
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "xhigh"}
THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")
# The keys ``[api] strict`` admits, as Anthropic refuses any other: the anthropic SDK's,
# its betas' too (tests/unit/dialects/test_sdk_fields.py holds them to its TypedDicts).
THINKING_KEYS: dict[str, frozenset[str]] = {
    "enabled": frozenset({"type", "budget_tokens", "display", "block_binding"}),
    "disabled": frozenset({"type"}),
    "adaptive": frozenset({"type", "display", "block_binding"}),
    "between_tools": frozenset({"type"}),
}
OUTPUT_CONFIG_KEYS = frozenset({"effort", "format", "task_budget"})
FORMAT_KEYS = frozenset({"type", "schema"})

_MODEL = Scalar("model", "string", required=True)
_CREATE = (
    _MODEL,
    # 0: the prompt into the prefix cache, no answer (Anthropic's cache pre-warming).
    Scalar("max_tokens", "integer", minimum=0, required=True),
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
#: Fields Anthropic's API acts on and a local model has nothing to do with (caching
#: breakpoints, context editing, billing, routing, metadata): accepted, even under
#: ``[api] strict``, and named in ``X-AFM-Ignored-Fields`` so a client can tell.
UNUSED_FIELDS = frozenset({
    "cache_control", "context_management", "mcp_servers", "speed", "compaction",
    "billing_policy", "user_profile_id", "workspace_id", "metadata", "service_tier",
    "container", "diagnostics", "inference_geo", "fallbacks", "fallback_credit_token",
})
#: The unused fields held to the types Anthropic's SDK gives them (a tier, a region or a
#: speed to being a string, since Anthropic adds values to them; option objects to being
#: objects, their keys unread): a client's wrong value is Anthropic's 400 here too, not
#: a bug that surfaces only against Anthropic.
_UNUSED_SCALARS = (Scalar("service_tier", "string"), Scalar("inference_geo", "string"),
                   Scalar("speed", "string"))
_UNUSED_OBJECTS = ("cache_control", "context_management", "diagnostics")
#: A create body's: the above, generation's own fields, and afmd's ``seed``.
CREATE_FIELDS = COUNT_FIELDS | {
    "max_tokens", "stream", "temperature", "top_p", "top_k", "stop_sequences", "metadata",
    "service_tier", "container", "diagnostics", "inference_geo", "fallbacks",
    "fallback_credit_token", "thread", "seed",
}


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
        raise InvalidRequestError(EXTRA_INPUTS, code="unknown_parameter", param=ignored[0])
    if ignored:  # a field ignored is not checked either (count_tokens reads create's parts)
        body = {key: value for key, value in body.items() if key not in ignored}
    ignored = (*ignored, *(key for key in body if key in UNUSED_FIELDS))
    if body.get("thread") is not None:
        # Threads hold the conversation on the server, a ``continue`` sending only its new
        # turn: answered without that state, it would be answered out of context. This
        # refusal is the one Anthropic's clients recover from by sending the whole
        # conversation without ``thread`` (the SDK's tool runner, Claude Code).
        raise InvalidRequestError(
            "Threads (server-held conversation state) are not supported: afmd keeps no "
            "conversation between requests. Send the whole conversation in 'messages', "
            "without 'thread'.", code="thread_unsupported_request", param="thread")
    values = read_scalars(body, scalars)
    _check_unused(body)
    max_tokens: int | None = values.get("max_tokens")
    system = parse_system(body.get("system"), strict=strict)
    messages, images, changes, turn_effort = parse_messages(body.get("messages"),
                                                            strict=strict)
    tools, withheld = offered_tools(body.get("tools"),
                                    parse_tools(body.get("tools"), strict=strict), changes,
                                    strict=strict)
    choice, parallel = parse_tool_choice(body.get("tool_choice"), tools, server_tools,
                                         strict=strict, withheld=withheld)
    stop = body.get("stop_sequences")
    if stop is not None and not isinstance(stop, list):
        raise wrong_type("stop_sequences", "an array of strings", stop)
    kind, budget = _thinking(body.get("thinking"), max_tokens, strict)
    if kind not in (None, "disabled") and choice.mode == "required":
        # Anthropic's rule and words: a call forced before the model thinks leaves its
        # thinking nothing to decide, so thinking on allows only ``auto`` and ``none``.
        raise invalid("tool_choice.type", "Thinking may not be enabled when tool_choice "
                      "forces tool use.")
    effort, response_format = _output_config(body.get("output_config"), strict)
    if turn_effort is not None:  # set since, by a system message
        effort = EFFORTS[turn_effort]
    format_param = "output_config.format"
    if response_format is None:  # the structured-outputs beta's spelling
        response_format = _format(body.get("output_format"), "output_format", strict)
        format_param = "output_format"
    if max_tokens == 0:
        _check_warm_up(values.get("stream", False), response_format, format_param)
    messages, prefill = prefilled(messages)
    if prefill:
        if kind in ("enabled", "adaptive"):
            # As Anthropic: thinking comes before the answer, which a prefill has begun.
            raise invalid("thinking", "Thinking cannot be enabled with a prefilled "
                          "assistant message: the thinking would come after the answer "
                          "began. Disable thinking, or end the conversation with a user "
                          "message.")
        check_prefill(response_format, format_param, choice, "tool_choice")
    stops = string_list(stop, "stop_sequences", MAX_STOP_SEQUENCES)
    if strict:
        # Anthropic refuses a stop of whitespace only (a "\n" some clients send), in its
        # words; locally such a stop is useful, so only a strict server holds to that.
        for i, sequence in enumerate(stop or ()):
            if not sequence.strip():
                raise invalid(f"stop_sequences[{i}]",
                              "each stop sequence must contain non-whitespace")
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
        stop=stops,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        response_format=response_format,
        reasoning_effort=reasoning_effort,
        thinking_budget=budget if kind == "enabled" else None,
        continue_final=prefill,
        max_tokens_shrinks=True,  # a cap, as Anthropic's: the context window may lower it
        has_images=images,
        keep_alive=keep_alive_of(body),
        ignored_fields=ignored,
    )


# ---------------------------------------------------------------------------- output


def _check_unused(body: dict[str, Any]) -> None:
    """The fields afmd accepts without acting on, held to their types (the SDK's)."""
    read_scalars(body, _UNUSED_SCALARS)
    check_option_objects(body, _UNUSED_OBJECTS)
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise wrong_type("metadata", "an object", metadata)
        optional(metadata, "user_id", "metadata.user_id", str, "a string")
    container = body.get("container")
    if container is not None and not isinstance(container, str | dict):
        raise wrong_type("container", "a string or an object", container)
    servers = body.get("mcp_servers")
    if servers is not None:
        if not isinstance(servers, list):
            raise wrong_type("mcp_servers", "an array", servers)
        for i, server in enumerate(servers):
            if not isinstance(server, dict):
                raise wrong_type(f"mcp_servers[{i}]", "an object", server)


def _check_warm_up(stream: bool, response_format: ResponseFormat | None,
                   format_param: str) -> None:
    """``max_tokens: 0`` writes nothing: as Anthropic, a stream of no content or a format
    for no answer is a request that misunderstood it (thinking is refused by its budget,
    which must be less than ``max_tokens``)."""
    if stream:
        raise invalid("stream", "'max_tokens' 0 only fills the prompt cache and answers "
                      "nothing, so it cannot be streamed; set 'stream' to false.")
    if response_format is not None:
        raise invalid(format_param, "'max_tokens' 0 only fills the prompt cache and "
                      "answers nothing: a format has no answer to shape.")


def _thinking(
    value: Any, max_tokens: int | None, strict: bool
) -> tuple[str | None, int | None]:
    """``thinking``'s type and, when enabled, its budget (``strict``: no key its type does
    not have)."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise wrong_type("thinking", "an object", value)
    kind = required(value, "type", "thinking.type", str, "a string")
    if kind not in THINKING_TYPES:
        raise not_one_of("thinking.type", kind, THINKING_TYPES)
    if strict:
        reject_unknown(value, THINKING_KEYS[kind], prefix="thinking.", message=EXTRA_INPUTS)
    # How a client shows thinking ("summarized", "omitted", Claude Code's "updates", more
    # to come): afmd returns its thinking as it was written whatever this says.
    optional(value, "display", "thinking.display", str, "a string")
    if kind != "enabled":
        return kind, None
    (budget,) = read_scalars(value, (Scalar("budget_tokens", "integer", minimum=1,
                                            required=True),), "thinking.").values()
    if max_tokens is not None and budget >= max_tokens:
        raise invalid("thinking.budget_tokens", f"'thinking.budget_tokens' ({budget}) must be "
                      f"less than 'max_tokens' ({max_tokens}): thinking counts toward it.")
    return kind, budget


def _output_config(value: Any, strict: bool) -> tuple[str | None, ResponseFormat | None]:
    """``output_config``: the effort as afmd's ``reasoning_effort``, and the format."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise wrong_type("output_config", "an object", value)
    if strict:
        reject_unknown(value, OUTPUT_CONFIG_KEYS, prefix="output_config.",
                       message=EXTRA_INPUTS)
    effort = optional(value, "effort", "output_config.effort", str, "a string")
    if effort is not None and effort not in EFFORTS:
        raise not_one_of("output_config.effort", effort, tuple(EFFORTS))
    return (EFFORTS[effort] if effort else None,
            _format(value.get("format"), "output_config.format", strict))


def _format(value: Any, param: str, strict: bool) -> ResponseFormat | None:
    """A JSON schema the answer must match: the grammar enforces it, as chat's
    ``response_format``."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise wrong_type(param, "an object", value)
    if strict:
        reject_unknown(value, FORMAT_KEYS, prefix=f"{param}.", message=EXTRA_INPUTS)
    kind = required(value, "type", f"{param}.type", str, "a string")
    if kind != "json_schema":
        raise not_one_of(f"{param}.type", kind, ("json_schema",))
    schema = required(value, "schema", f"{param}.schema", dict, "an object")
    return ResponseFormat("json_schema", schema, "output", strict=True)
