"""A Responses API body (``POST /v1/responses``) checked into the internal request.

The turn itself becomes the same :class:`~afmd.core.request.ChatRequest` chat builds, so
tools, ``tool_choice``, grammars, reasoning, queueing and cancelling behave alike; what the
response object repeats of its request (instructions, tools as sent, ``text``, metadata,
the canonical input items) rides along in :class:`Echo`. Every problem is a 400 naming the
exact param, as in chat; hosted tools are left out and named (``unsupported_tool`` under
``[api] strict``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from afmd.core.request import ChatRequest, Message
from afmd.dialects.fields.checks import (
    Scalar,
    invalid,
    missing,
    names,
    optional,
    quoted,
    read_scalars,
    reject_unknown,
    unknown_keys,
    wrong_type,
)
from afmd.dialects.fields.extensions import (
    CHAT_TEMPLATE_KWARGS,
    REPEAT_PENALTY,
    REPETITION_PENALTY,
    chat_template_kwargs_of,
    repetition_penalty_of,
)
from afmd.dialects.fields.keep_alive import keep_alive_of
from afmd.dialects.fields.prediction import parse_prediction
from afmd.dialects.fields.unused import (
    PROMPT_CACHE_RETENTION,
    RESPONSES_OPTION_OBJECTS,
    SAFETY_IDENTIFIER,
    SERVICE_TIER,
    check_context_management,
    check_option_objects,
    metadata_of,
)
from afmd.dialects.responses.client_tools import ClientTool
from afmd.dialects.responses.items import (
    Item,
    ItemParams,
    canonical_items,
    check_unique_ids,
    to_messages,
)
from afmd.dialects.responses.options import (
    LOGPROBS,
    parse_include,
    parse_reasoning,
    parse_text,
    parse_tool_choice,
    parse_tools,
)
from afmd.errors import InvalidRequestError, NotFoundError

# Fields of the API that change nothing a local model could honour: accepted, unused.
IGNORED_FIELDS = frozenset({
    "service_tier", "prompt_cache_retention", "prompt_cache_options", "top_logprobs",
    "client_metadata", "context_management", "moderation", "background_options",
    "access_programs", "image",
})

_SCALARS = (
    Scalar("model", "string"),
    Scalar("instructions", "string"),
    Scalar("previous_response_id", "string"),
    Scalar("stream", "boolean", default=False),
    Scalar("max_output_tokens", "integer", minimum=16),  # as OpenAI
    Scalar("temperature", "number", default=1.0, minimum=0.0, maximum=2.0),
    Scalar("top_p", "number", default=1.0, minimum=0.0, maximum=1.0),
    # The local-server extensions chat accepts too.
    Scalar("top_k", "integer", default=0, minimum=0),
    Scalar("min_p", "number", default=0.0, minimum=0.0, maximum=1.0),
    REPETITION_PENALTY,
    REPEAT_PENALTY,
    Scalar("seed", "integer"),
    Scalar("parallel_tool_calls", "boolean", default=True),
    Scalar("store", "boolean", default=True),
    Scalar("truncation", "string", default="disabled", choices=("auto", "disabled")),
    Scalar("user", "string"),
    Scalar("background", "boolean", default=False),
    # Ignored (afmd writes no log-probabilities here), but held to OpenAI's bounds: a
    # value OpenAI refuses is refused here too, not taken silently.
    Scalar("top_logprobs", "integer", minimum=0, maximum=20),
    # Not acted on (no cache is keyed by them), but of OpenAI's type and echoed, as the
    # response object repeats them.
    SAFETY_IDENTIFIER,
    Scalar("prompt_cache_key", "string"),
    # Ignored, but of OpenAI's type.
    SERVICE_TIER,
    PROMPT_CACHE_RETENTION,
    # OpenAI's bound on the calls of the tools it runs itself (never the client's): here
    # the server tools' (``[[tools.server]]``). OpenAI refuses less than one.
    Scalar("max_tool_calls", "integer", minimum=1),
)
_STRUCTURED = frozenset({"input", "tools", "tool_choice", "text", "reasoning", "include",
                         "metadata", "stream_options", "conversation", "prompt", "prediction",
                         "keep_alive", CHAT_TEMPLATE_KWARGS})
KNOWN_FIELDS = IGNORED_FIELDS | names(_SCALARS) | _STRUCTURED

#: ``POST /v1/responses/input_tokens`` takes a subset (TokenCountsBody), and the template's
#: variables, which change the count.
COUNT_FIELDS = frozenset({"conversation", "input", "instructions", "model",
                          "parallel_tool_calls", "personality", "previous_response_id",
                          "reasoning", "text", "tool_choice", "tools", "truncation",
                          CHAT_TEMPLATE_KWARGS})

#: ``previous_response_id`` (or ``conversation``) -> the items before the input, or None if
#: unknown.
Lookup = Callable[[str], Sequence[Item] | None]
#: An ``item_reference``'s id -> the stored item (any stored response's input or output).
ItemLookup = Callable[[str], Item | None]

_Found = TypeVar("_Found")


class Through(Protocol):
    """How the parse calls a lookup: the stores belong to the event loop, and a large body
    is parsed on another thread (afmd.http.routes.large_bodies), which must not read them
    itself (a lookup also expires entries)."""

    def __call__(self, lookup: Callable[[str], _Found], /) -> Callable[[str], _Found]: ...


def direct(lookup: Callable[[str], _Found], /) -> Callable[[str], _Found]:
    """The lookup called as it is, by a parse on the stores' own thread."""
    return lookup


@dataclass(frozen=True, slots=True)
class Echo:
    """What the response object repeats of its request, in the API's own shapes."""

    instructions: str | None = None
    tools: tuple[dict[str, Any], ...] = ()
    #: The offered names whose calls are custom_tool_call items (their text as ``input``).
    custom_tools: frozenset[str] = frozenset()
    #: Offered function names that belong to a namespace tool, and its name.
    namespaces: dict[str, str] = field(default_factory=dict)
    #: The offered names of client-run tools (``shell``, …), whose calls are their own items.
    client_tools: dict[str, ClientTool] = field(default_factory=dict)
    tool_choice: str | dict[str, Any] = "auto"
    text: dict[str, Any] = field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] = field(
        default_factory=lambda: {"effort": None, "summary": None})
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    parallel_tool_calls: bool = True
    metadata: dict[str, str] = field(default_factory=dict)
    previous_response_id: str | None = None
    #: The conversation this turn continues, and whose items it appends at its end.
    conversation: str | None = None
    store: bool = True
    #: Run detached from its connection (``/v1/responses/{id}`` follows it).
    background: bool = False
    truncation: str = "disabled"
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    max_tool_calls: int | None = None
    #: Echoed as sent (no log-probabilities are written: see docs/responses.md).
    top_logprobs: int = 0
    include: tuple[str, ...] = ()
    #: This request's input items, canonical (what ``input_items`` lists).
    input_items: tuple[Item, ...] = ()
    #: The conversation before them (``previous_response_id``'s or ``conversation``'s items).
    history: tuple[Item, ...] = ()


@dataclass(frozen=True, slots=True)
class ResponsesRequest(ChatRequest):
    """The turn, plus what its response object echoes."""

    echo: Echo = field(default_factory=Echo)


def _refuse(body: dict[str, Any]) -> None:
    """What afmd cannot do (stored prompts), and a background response that would not be
    stored: its client reads it from the store, so it would be lost the moment it ended."""
    if body.get("background") and body.get("store") is False:
        raise invalid("background", "Background mode requires 'store' to be true: a "
                      "background response is read from the store ('store': false was "
                      "given).")
    if body.get("prompt") is not None:
        raise InvalidRequestError("afmd has no stored prompts; send 'instructions' and "
                                  "'input' instead.", code="unsupported_value", param="prompt")


def _conversation_id(value: Any, strict: bool) -> str | None:
    """``conversation``: an id, or ``{"id": ...}``."""
    if value is None:
        return None
    if isinstance(value, dict):
        if strict:
            reject_unknown(value, frozenset({"id"}), prefix="conversation.")
        value = value.get("id")
        if value is None:
            raise missing("conversation.id")
        if not isinstance(value, str):
            raise wrong_type("conversation.id", "a string", value)
    elif not isinstance(value, str):
        raise wrong_type("conversation", "a string or an object with an 'id'", value)
    if not value.startswith("conv_"):
        raise invalid("conversation", f"Invalid 'conversation': {quoted(value)}. Expected an "
                      "ID that begins with 'conv_'.")
    return value


def _history(previous: str | None, conversation: str | None, lookup: Lookup,
             conversations: Lookup) -> tuple[Item, ...]:
    """The items before ``input``: a stored response's conversation, or a conversation's."""
    if previous is not None and conversation is not None:
        raise InvalidRequestError(
            "Mutually exclusive parameters. Ensure you are only providing one of: "
            "'previous_response_id' or 'conversation'.",
            code="mutually_exclusive_parameters", param=None)
    if previous is not None:
        found = lookup(previous)
        if found is None:  # OpenAI's 400 and code, which clients read to start afresh
            raise InvalidRequestError(
                f"Previous response with id {quoted(previous)} not found (it was never stored, "
                "was deleted, or expired).", code="previous_response_not_found",
                param="previous_response_id")
        return tuple(found)
    if conversation is not None:
        found = conversations(conversation)
        if found is None:
            raise NotFoundError(
                f"Conversation with id {quoted(conversation)} not found (it was never made, "
                "was deleted, or expired).", code="conversation_not_found",
                param="conversation")
        return tuple(found)
    return ()


def _check_turn(messages: tuple[Message, ...], params: ItemParams, count: int) -> None:
    if not any(m.role == "user" for m in messages):
        raise InvalidRequestError(
            "The conversation has no user message; add an input item with role 'user'.",
            code="missing_user_message", param="input")
    if messages[-1].role == "assistant":
        raise InvalidRequestError(
            "The input ends with an assistant message; end it with a user message or a "
            "function_call_output so there is something to answer.",
            code="invalid_last_message", param=params(count - 1))


def parse_responses_request(
    body: dict[str, Any],
    *,
    lookup: Lookup,
    conversations: Lookup = lambda _: None,
    find_item: ItemLookup = lambda _: None,
    server_tools: Collection[str] = (),
    counting: bool = False,
    strict: bool = False,
    truncation: str = "disabled",
) -> ResponsesRequest:
    """Check every field of a Responses body (``counting``: an ``input_tokens`` body). An
    unknown top-level field is ignored and listed (``strict``: a 400, as OpenAI's, and so
    is an unknown key inside input items, their parts, tools and ``tool_choice``).
    ``truncation`` is the strategy of a body that names none (the server's ``[context]
    policy``), which the response reports: a client reading "disabled" there would take it
    that nothing of its input was dropped."""
    ignored = unknown_keys(body, COUNT_FIELDS if counting else KNOWN_FIELDS, strict=strict)
    if ignored:  # a field ignored is not checked either (a count reads create's scalars)
        body = {key: value for key, value in body.items() if key not in ignored}
    scalars = read_scalars(body, _SCALARS)
    # Ignored, but held to OpenAI's types as chat holds its own option objects.
    check_option_objects(body, RESPONSES_OPTION_OBJECTS)
    check_context_management(body.get("context_management"))
    _refuse(body)
    previous = scalars["previous_response_id"]
    conversation_id = _conversation_id(body.get("conversation"), strict)
    history = _history(previous, conversation_id, lookup, conversations)
    items = canonical_items(body.get("input"), find_item=find_item, strict=strict)
    check_unique_ids(body.get("input"), items)
    params = ItemParams(len(history), "previous_response_id" if conversation_id is None
                        else "conversation")
    conversation = to_messages((*history, *items), params)
    instructions = scalars["instructions"]
    messages = conversation
    if instructions:
        messages = (Message(role="system", content=instructions), *conversation)
    _check_turn(conversation, params, len(history) + len(items))
    if not counting and body.get("stream_options") is not None:
        options = body["stream_options"]
        if not isinstance(options, dict):
            raise wrong_type("stream_options", "an object", options)
        if not scalars["stream"]:
            raise invalid("stream_options", "The 'stream_options' parameter is only allowed "
                          "when 'stream' is enabled.")
        reject_unknown(options, frozenset({"include_obfuscation"}), prefix="stream_options.")
        optional(options, "include_obfuscation", "stream_options.include_obfuscation", bool,
                 "a boolean")
    tools = parse_tools(body.get("tools"), strict=strict)
    choice, choice_echo = parse_tool_choice(body.get("tool_choice"), tools.specs,
                                            server_tools, strict=strict,
                                            left_out=tools.ignored, client=tools.client)
    response_format, text_echo = parse_text(body.get("text"), strict=strict)
    reasoning = parse_reasoning(body.get("reasoning"))
    echo = Echo(
        instructions=instructions,
        tools=tools.echo,
        custom_tools=tools.custom,
        namespaces=tools.namespaces,
        client_tools=tools.client,
        tool_choice=choice_echo,
        text=text_echo,
        reasoning=reasoning,
        max_output_tokens=scalars["max_output_tokens"],
        temperature=scalars["temperature"],
        top_p=scalars["top_p"],
        parallel_tool_calls=scalars["parallel_tool_calls"],
        metadata=metadata_of(body.get("metadata")),
        previous_response_id=previous,
        conversation=conversation_id,
        store=scalars["store"],
        background=scalars["background"],
        truncation=truncation if body.get("truncation") is None else scalars["truncation"],
        user=scalars["user"],
        safety_identifier=scalars["safety_identifier"],
        prompt_cache_key=scalars["prompt_cache_key"],
        max_tool_calls=scalars["max_tool_calls"],
        top_logprobs=scalars["top_logprobs"] or 0,
        include=parse_include(body.get("include")),
        input_items=tuple(items),
        history=history,
    )
    return ResponsesRequest(
        messages=messages,
        model=scalars["model"],
        stream=scalars["stream"],
        max_tokens=scalars["max_output_tokens"],
        temperature=scalars["temperature"],
        top_p=scalars["top_p"],
        top_k=scalars["top_k"],
        min_p=scalars["min_p"],
        repetition_penalty=repetition_penalty_of(body),
        seed=scalars["seed"],
        tools=tools.specs,
        tool_choice=choice,
        parallel_tool_calls=scalars["parallel_tool_calls"],
        response_format=response_format,
        reasoning_effort=reasoning["effort"],
        has_images=any(m.has_images for m in messages),
        # OpenAI writes log-probabilities into output_text parts when include asks.
        logprobs=(scalars["top_logprobs"] or 0) if LOGPROBS in echo.include else None,
        prediction=None if counting else parse_prediction(body.get("prediction")),
        keep_alive=None if counting else keep_alive_of(body),
        chat_template_kwargs=chat_template_kwargs_of(body),
        max_server_tool_calls=scalars["max_tool_calls"],
        # "auto" drops the oldest turns to fit, "disabled" fails as OpenAI does; a
        # request that says neither follows the server's [context] policy.
        trim_context=None if body.get("truncation") is None else (
            scalars["truncation"] == "auto"),
        ignored_fields=(*ignored, *tools.ignored),
        echo=echo,
    )
