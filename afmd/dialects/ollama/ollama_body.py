"""Ollama's ``/api/chat`` and ``/api/generate`` bodies checked into afmd's requests.

A chat body becomes a :class:`~afmd.core.request.ChatRequest`; so does a generate body
(its ``prompt`` the user's message, ``system`` the system's, through the model's chat
template) unless it is ``raw`` or has a ``suffix``: those are a
:class:`~afmd.core.request.CompletionRequest` (the prompt as given, or fill-in-the-middle).
What Ollama spells differently:

- ``options`` carry the sampling settings (:data:`OPTIONS`); those that change nothing
  here (``num_gpu``, ``num_thread``, ``mirostat``, …) are accepted, and unknown ones are
  named in ``X-AFM-Ignored-Fields`` as ``options.<name>``. Ollama's defaults for sampling
  are its models' Modelfiles'; afmd's are the model's own (as on every endpoint), so a
  greedy ``/api/chat`` writes what ``/v1/chat/completions`` writes.
- ``num_predict`` is a cap (negative: none), as Anthropic's ``max_tokens``: the context
  window lowers it; ``num_ctx`` shrinks the window (never widens it); ``truncate`` (on by
  default, as Ollama) drops the oldest turns of a conversation too long for it.
- messages carry ``images`` (base64), ``thinking``, and tool calls whose ``arguments``
  are objects; a ``tool`` message names its tool (``tool_name``) instead of a call id, and
  is matched to the call it answers.
- ``format`` is ``"json"`` or a JSON schema, ``think`` a boolean or a level.
- a templated generate's ``context`` (an earlier answer's ids) is the prompt's prefix,
  ids before the rendered turn (:mod:`afmd.service.prompt_prefix`).
"""

from __future__ import annotations

import base64
import binascii
import itertools
import math
from collections.abc import Collection
from typing import Any

import orjson

from afmd.core.request import (
    ChatRequest,
    CompletionRequest,
    ImageInput,
    Message,
    ResponseFormat,
    ToolCall,
    ToolChoice,
)
from afmd.dialects.fields.body import parse_json_body
from afmd.dialects.fields.checks import (
    Scalar,
    invalid,
    missing,
    names,
    optional,
    read_scalars,
    required,
    string_list,
    unknown_keys,
    wrong_type,
)
from afmd.dialects.fields.keep_alive import keep_alive_of
from afmd.dialects.fields.messages import check_prefill, prefilled
from afmd.dialects.fields.tool_specs import ToolNames, parse_tool_choice, parse_tools
from afmd.output.formats.base import NAME

__all__ = ["OPTIONS", "is_load_request", "parse_chat", "parse_generate", "wants_thinking"]

#: Stop sequences ``options.stop`` may hold. Ollama sets no limit, and editors' autocomplete
#: sends its template's stops with its language's stop words added; a stop costs the scan
#: one automaton step a character, so the bound only keeps a body from making that large.
MAX_STOP_SEQUENCES = 64
#: Tokens "no cap" stands for: the context window lowers it to what is left.
UNCAPPED = 1 << 30
#: The seed Ollama (and llama.cpp) read as "none": sample from a fresh seed, as without
#: one. Any other value, negative ones included, is a seed that reproduces its answer.
RANDOM_SEED = -1
THINK_LEVELS = {"low": "low", "medium": "medium", "high": "high", "max": "xhigh"}
ROLES = ("system", "user", "assistant", "tool")
#: A tool's name: Ollama takes any, and its clients pass MCP servers' tools on as named
#: (``calendar.read``, ``docs/search``: the MCP spec allows dots and slashes), where
#: OpenAI's rule refuses them. What the models' call readers read as a name is taken;
#: a name they could never read back from a model's call is refused, not left uncalled.
OLLAMA_TOOL_NAMES = ToolNames(
    NAME, "1-128 characters among a-z, A-Z, 0-9, _, -, ., : and /")

#: The options afmd acts on, with afmd's bounds. ``temperature`` has none above, as in
#: Ollama (OpenAI's is 2): role-play front ends (SillyTavern) offer up to 5.
OPTIONS = (
    Scalar("temperature", "number", minimum=0.0, maximum=math.inf),
    Scalar("top_k", "integer", minimum=0),
    Scalar("top_p", "number", minimum=0.0, maximum=1.0),
    Scalar("min_p", "number", minimum=0.0, maximum=1.0),
    Scalar("num_predict", "integer"),
    Scalar("seed", "integer"),
    Scalar("repeat_penalty", "number", minimum=0.0, maximum=10.0),
    Scalar("repeat_last_n", "integer", minimum=-1),
    Scalar("presence_penalty", "number", minimum=-2.0, maximum=2.0),
    Scalar("frequency_penalty", "number", minimum=-2.0, maximum=2.0),
    Scalar("num_ctx", "integer", minimum=1),
)
#: Options that change nothing here (loading, threads, other samplers): accepted, but
#: typed as Ollama's ``Options`` types them (a boolean or a number), so that a value
#: Ollama refuses is a 400 naming it here too rather than passing unseen. Number bounds
#: are Ollama's (none).
NO_OP_OPTIONS = (
    *(Scalar(name, "boolean") for name in (
        "numa", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mmap", "use_mlock",
        "embedding_only", "penalize_newline")),
    # Ollama reads a number into an integer option by truncating it: any number passes.
    *(Scalar(name, "number", minimum=-math.inf, maximum=math.inf) for name in (
        "num_batch", "num_gpu", "main_gpu", "num_thread", "num_keep", "mirostat",
        "draft_num_predict", "tfs_z", "typical_p", "mirostat_tau", "mirostat_eta")),
)
_KNOWN_OPTIONS = names(OPTIONS) | {"stop"} | names(NO_OP_OPTIONS)

_COMMON = frozenset({"model", "stream", "format", "options", "keep_alive", "think",
                     "truncate", "shift", "logprobs", "top_logprobs"})
CHAT_FIELDS = _COMMON | {"messages", "tools"}
GENERATE_FIELDS = _COMMON | {"prompt", "suffix", "system", "raw", "images", "context"}

_TOP = (
    Scalar("model", "string", required=True),
    Scalar("stream", "boolean", default=True),
    Scalar("truncate", "boolean", default=True),
    Scalar("logprobs", "boolean", default=False),
    Scalar("top_logprobs", "integer", minimum=0, maximum=20),
)
_GENERATE = (
    Scalar("prompt", "string", default=""),
    Scalar("suffix", "string"),
    Scalar("system", "string"),
    Scalar("raw", "boolean", default=False),
)


def is_load_request(body: dict[str, Any], *, chat: bool) -> bool:
    """Whether a body only loads (or, with ``keep_alive`` 0, unloads) its model: Ollama's
    clients preload a model with an empty prompt or no messages. Only an absent, null or
    empty value of the right type is that: ``{}``, ``0`` or ``""`` for ``messages`` is a
    body to refuse, as Ollama refuses it, so it goes on to the full parse's 400."""
    if chat:
        return body.get("messages") in (None, [])
    return all(body.get(name) in (None, "") for name in ("prompt", "suffix"))


def _options(body: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``options``: afmd's values, and the unknown names as ``options.<name>``."""
    value = body.get("options")
    if value is None:
        return {name: None for name in names(OPTIONS)} | {"stop": ()}, ()
    if not isinstance(value, dict):
        raise wrong_type("options", "an object", value)
    unknown = tuple(f"options.{key}" for key in value if key not in _KNOWN_OPTIONS)
    values = read_scalars(value, OPTIONS, "options.")
    read_scalars(value, NO_OP_OPTIONS, "options.")  # checked only: they change nothing
    values["stop"] = string_list(value.get("stop"), "options.stop", MAX_STOP_SEQUENCES)
    return values, unknown


def _sampling(options: dict[str, Any]) -> dict[str, Any]:
    """The request fields ``options`` set (only those given: the rest keep afmd's)."""
    fields: dict[str, Any] = {}
    for option, field in (("temperature", "temperature"), ("top_k", "top_k"),
                          ("top_p", "top_p"), ("min_p", "min_p"), ("seed", "seed"),
                          ("presence_penalty", "presence_penalty"),
                          ("frequency_penalty", "frequency_penalty"),
                          ("num_ctx", "context_window")):
        if options[option] is not None:
            fields[field] = options[option]
    if options["seed"] == RANDOM_SEED:
        del fields["seed"]  # Ollama's default: a fresh seed each time, not seed -1
    penalty, window = options["repeat_penalty"], options["repeat_last_n"]
    if penalty is not None and window != 0:  # a window of 0 turns the penalty off
        fields["repetition_penalty"] = penalty
        if window is not None:
            fields["repetition_context"] = UNCAPPED if window < 0 else window
    if options["stop"]:
        fields["stop"] = options["stop"]
    return fields


def _num_predict(options: dict[str, Any]) -> int | None:
    """The cap on generated tokens (None: none; Ollama's -1 and -2 mean none)."""
    value = options["num_predict"]
    return value if value is not None and value > 0 else None


def _format(value: Any) -> ResponseFormat | None:
    if value is None or value == "":
        return None
    if value == "json":
        return ResponseFormat("json_object")
    if isinstance(value, dict):
        return ResponseFormat("json_schema", value, "format", strict=True)
    if isinstance(value, str):
        raise invalid("format", f"Invalid 'format': '{value[:40]}'. Use \"json\" or a JSON "
                                "schema object.")
    raise wrong_type("format", "\"json\" or a JSON schema object", value)


def _think(value: Any) -> str | None:
    """``think`` as afmd's ``reasoning_effort`` (None: the model's default)."""
    if value is None:
        return None
    if value is True:
        return "medium"
    if value is False:
        return "none"
    if isinstance(value, str) and value in THINK_LEVELS:
        return THINK_LEVELS[value]
    if isinstance(value, str):
        raise invalid("think", f"Invalid 'think': '{value[:40]}'. Use true, false, or one of "
                               + ", ".join(f"'{k}'" for k in THINK_LEVELS) + ".")
    raise wrong_type("think", "a boolean or a thinking level", value)


def wants_thinking(value: Any) -> bool:
    """Whether ``think`` asks for reasoning (``true`` or a level, as Ollama's
    ``ThinkValue.Bool``): then a model that cannot think is a 400, as in Ollama."""
    _think(value)  # a value Ollama's decoder refuses is a 400 here too
    return value is True or (isinstance(value, str) and value in THINK_LEVELS)


def _images(value: Any, param: str) -> tuple[ImageInput, ...]:
    """Base64 images (as Ollama takes them; a ``data:`` URL's payload is read too), placed
    before the message's text, as Ollama's templates place them. Line breaks are skipped,
    as Go's base64 decoder (Ollama's) skips them: ``base64`` writes 76 columns a line."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise wrong_type(param, "an array of base64 strings", value)
    out: list[ImageInput] = []
    for i, item in enumerate(value):
        p = f"{param}[{i}]"
        if not isinstance(item, str):
            raise wrong_type(p, "a base64 string", item)
        if item.startswith("data:") and ";base64," not in item:
            raise invalid(p, f"'{p}' is a data: URL without a base64 payload; send "
                          "'data:image/<type>;base64,<data>' or the base64 data alone.")
        payload = item.partition(";base64,")[2] if item.startswith("data:") else item
        if "\n" in payload or "\r" in payload:
            payload = payload.replace("\r", "").replace("\n", "")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise invalid(p, f"'{p}' is not base64-encoded image data.") from None
        if not data:
            raise invalid(p, f"'{p}' is empty.")
        out.append(ImageInput(data, p, 0))
    return tuple(out)


def _context(value: Any) -> tuple[int, ...]:
    """``context``: the token ids an earlier generate answered with (its prompt and
    answer), which this prompt continues. Not a list of integers is a 400, as Ollama's own
    decoder makes it; an id the model does not have is the pipeline's (it knows the
    vocabulary). Empty or absent: no earlier turn."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise wrong_type("context", "an array of integers", value)
    for i, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int):
            raise wrong_type(f"context[{i}]", "an integer", token)
    return tuple(value)


def _arguments(function: dict[str, Any], param: str) -> str:
    """A call's ``arguments`` (an object in Ollama's shape; a JSON string is read too) as
    the JSON text afmd keeps."""
    value = function.get("arguments")
    if value is None:
        return "{}"
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise wrong_type(param, "an object", value)
    return orjson.dumps(value).decode()


class _CallIds:
    """The ids given to the calls a client sent without one (Ollama's own shape has
    none), remembered: a ``tool_call_id`` the client made up for its tool message cannot
    name one of them, so such a message is matched by its tool's name or its place."""

    __slots__ = ("_count", "made_up")

    def __init__(self) -> None:
        self._count = itertools.count()
        self.made_up: set[str] = set()

    def new(self) -> str:
        call_id = f"call_{next(self._count)}"
        self.made_up.add(call_id)
        return call_id


def _tool_calls(value: Any, param: str, ids: _CallIds) -> tuple[ToolCall, ...]:
    if not isinstance(value, list):
        raise wrong_type(param, "an array", value)
    calls: list[ToolCall] = []
    for i, call in enumerate(value):
        p = f"{param}[{i}]"
        if not isinstance(call, dict):
            raise wrong_type(p, "an object", call)
        function = required(call, "function", f"{p}.function", dict, "an object")
        name = required(function, "name", f"{p}.function.name", str, "a string")
        call_id = optional(call, "id", f"{p}.id", str, "a string") or ids.new()
        calls.append(ToolCall(call_id, name, _arguments(function, f"{p}.function.arguments")))
    return tuple(calls)


def _message(value: Any, param: str, ids: _CallIds) -> Message:
    if not isinstance(value, dict):
        raise wrong_type(param, "an object", value)
    # Ollama lowercases a role as it reads it: "User" is a user's message there.
    role = required(value, "role", f"{param}.role", str, "a string").lower()
    if role not in ROLES:
        raise invalid(f"{param}.role", f"Invalid role '{role[:40]}'; use one of "
                                       + ", ".join(f"'{r}'" for r in ROLES) + ".")
    content = optional(value, "content", f"{param}.content", str, "a string") or ""
    images = _images(value.get("images"), f"{param}.images")
    if role == "assistant":
        calls: tuple[ToolCall, ...] = ()
        if value.get("tool_calls") is not None:
            calls = _tool_calls(value["tool_calls"], f"{param}.tool_calls", ids)
        thinking = optional(value, "thinking", f"{param}.thinking", str, "a string")
        return Message(role, content, tool_calls=calls, reasoning=thinking or None,
                       has_images=bool(images), images=images)
    if role == "tool":
        name = optional(value, "tool_name", f"{param}.tool_name", str, "a string")
        call_id = optional(value, "tool_call_id", f"{param}.tool_call_id", str, "a string")
        return Message(role, content, name=name, tool_call_id=call_id or None,
                       has_images=bool(images), images=images)
    return Message(role, content, has_images=bool(images), images=images)


#: The schema keywords of Ollama's ``ToolFunctionParameters`` and ``ToolProperty`` (its
#: api/types.go): Go decodes ``null`` in any of them as the field left out.
_GO_SCHEMA_KEYWORDS = frozenset({"type", "$defs", "items", "required", "properties",
                                 "anyOf", "description", "enum"})


#: JSON Schema's type names, which a ``type`` written as a comma-separated list holds.
_JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array",
                         "null"})


def _listed_types(value: str) -> list[str] | None:
    """The types of a ``type`` written as ``"integer, string"``, or None for any other
    string. The official Python client writes a function's ``Union``-typed argument so
    (``convert_function_to_tool`` joins the union's types), and Ollama takes it, its
    decoder reading any string as a type name; a JSON schema validator refuses it."""
    names = [name.strip() for name in value.split(",")]
    if len(names) < 2 or not set(names) <= _JSON_TYPES:
        return None
    return list(dict.fromkeys(names))


def _schema_as_go_reads_it(schema: Any) -> Any:
    """A tool's parameter schema with the nulls Ollama's decoder reads as absent left out:
    Go clients built on Ollama's own ``api`` package send ``"properties": null`` for a
    tool without parameters (and, before it was ``omitempty``, ``"required": null``),
    which a JSON schema validator refuses. A ``type`` written as a list in one string
    is that list (:func:`_listed_types`), and an empty one, Go's zero value (what the
    Python client writes for an argument typed ``None``), is none: any value. Other
    keywords are kept as they are."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if value is None and key in _GO_SCHEMA_KEYWORDS:
            continue
        if key == "type" and isinstance(value, str):
            if value == "":
                continue
            value = _listed_types(value) or value
        if key in ("properties", "$defs") and isinstance(value, dict):
            # (a null property is Go's zero ``ToolProperty``: any value)
            value = {name: _schema_as_go_reads_it({} if v is None else v)
                     for name, v in value.items()}
        elif key == "items":
            value = _schema_as_go_reads_it(value)
        elif key == "anyOf" and isinstance(value, list):
            value = [_schema_as_go_reads_it(v) for v in value]
        out[key] = value
    return out


def _tools_as_go_reads_them(value: Any) -> Any:
    """``tools`` as Ollama's decoder reads them: a tool's ``type`` Go left empty (or out)
    is a function, Ollama's only kind, and each schema as
    :func:`_schema_as_go_reads_it`; a parameters object of Go's zero value (``"type":
    ""``) is an object, as every call's arguments are. Anything else is left for
    :func:`~afmd.dialects.fields.tool_specs.parse_tools` to check."""
    if not isinstance(value, list):
        return value
    tools: list[Any] = []
    for tool in value:
        if isinstance(tool, dict):
            tool = dict(tool)
            if tool.get("type") in (None, "") and isinstance(tool.get("function"), dict):
                tool["type"] = "function"
            function = tool.get("function")
            if isinstance(function, dict) and isinstance(function.get("parameters"), dict):
                parameters = _schema_as_go_reads_it(function["parameters"])
                if function["parameters"].get("type") == "":
                    parameters["type"] = "object"
                tool["function"] = {**function, "parameters": parameters}
        tools.append(tool)
    return tools


def _answered(messages: list[Message], made_up: Collection[str]) -> tuple[Message, ...]:
    """Each ``tool`` message given the id of the call it answers: its own
    ``tool_call_id``, else the first unanswered call of the assistant message before it
    with its ``tool_name``, else that message's first unanswered call. A ``tool_call_id``
    is only read as naming a call where the client gave those calls ids: one of its own
    beside calls without any names none of them (ids are afmd's ``made_up`` ones).

    Nothing else is asked of the history, as Ollama asks nothing of it (its template
    renders the messages as they come): a call may go unanswered (a user who declined
    it), and a tool message may answer no call (clients that keep an assistant's text
    but not its calls, as Continue's Ollama provider did), in the order sent."""
    out: list[Message] = []
    open_calls: list[ToolCall] = []
    for m in messages:
        if m.role == "assistant":
            open_calls = list(m.tool_calls)
        elif m.role == "tool":
            call = next((c for c in open_calls if c.id == m.tool_call_id), None)
            by_id = m.tool_call_id is not None and any(c.id not in made_up
                                                       for c in open_calls)
            if call is None and not by_id:
                call = next((c for c in open_calls if c.name == m.name), None)
                if call is None and open_calls and m.name is None:
                    call = open_calls[0]
            if call is not None:
                open_calls.remove(call)
                m = Message(m.role, m.content, name=m.name, tool_call_id=call.id,
                            has_images=m.has_images, images=m.images)
        else:
            open_calls = []
        out.append(m)
    return tuple(out)


def _messages(value: Any) -> tuple[Message, ...]:
    if value is None:
        raise missing("messages")
    if not isinstance(value, list):
        raise wrong_type("messages", "an array", value)
    ids = _CallIds()
    messages = [_message(m, f"messages[{i}]", ids) for i, m in enumerate(value)]
    if not messages:
        raise invalid("messages", "'messages' must contain at least one message.")
    return _answered(messages, ids.made_up)


def _common(body: dict[str, Any], known: frozenset[str], strict: bool
            ) -> tuple[dict[str, Any], dict[str, Any], tuple[str, ...]]:
    ignored = unknown_keys(body, known, strict=strict)
    top = read_scalars(body, _TOP)
    options, unknown_options = _options(body)
    if top["top_logprobs"] is not None and not top["logprobs"]:
        top["logprobs"] = True  # Ollama reads top_logprobs alone as asking for them
    return top, options, (*ignored, *unknown_options)


def parse_chat(raw: bytes, *, server_tools: Collection[str] = (), strict: bool = False
               ) -> ChatRequest:
    """A ``POST /api/chat`` body (with messages: one without only loads the model)."""
    return chat_request(parse_json_body(raw), server_tools=server_tools, strict=strict)


def chat_request(body: dict[str, Any], *, server_tools: Collection[str] = (),
                 strict: bool = False) -> ChatRequest:
    top, options, ignored = _common(body, CHAT_FIELDS, strict)
    messages, prefill = prefilled(_messages(body.get("messages")))
    tools = parse_tools(_tools_as_go_reads_them(body.get("tools")),
                        names=OLLAMA_TOOL_NAMES)
    response_format = _format(body.get("format"))
    if prefill:  # as Ollama: the answer continues the last assistant message
        check_prefill(response_format, "format", ToolChoice(), "tools")
    return ChatRequest(
        messages=messages,
        model=top["model"],
        stream=top["stream"],
        max_tokens=_num_predict(options),
        max_tokens_shrinks=True,
        trim_context=top["truncate"],
        tools=tools,
        tool_choice=parse_tool_choice(None, tools, server_tools),
        response_format=response_format,
        reasoning_effort=_think(body.get("think")),
        require_thinking=wants_thinking(body.get("think")),
        continue_final=prefill,
        has_images=any(m.has_images for m in messages),
        logprobs=(top["top_logprobs"] or 0) if top["logprobs"] else None,
        keep_alive=keep_alive_of(body),
        ignored_fields=ignored,
        **_sampling(options),
    )


def generate_request(body: dict[str, Any], *, strict: bool = False
                     ) -> ChatRequest | CompletionRequest:
    """A ``POST /api/generate`` body (with a prompt: one without only loads the model)."""
    top, options, ignored = _common(body, GENERATE_FIELDS, strict)
    values = read_scalars(body, _GENERATE)
    prompt, suffix, system, raw = (values["prompt"], values["suffix"], values["system"],
                                   values["raw"])
    images = _images(body.get("images"), "images")
    response_format = _format(body.get("format"))
    sampling = _sampling(options)
    limit = _num_predict(options)
    context = _context(body.get("context"))
    if raw:
        # Ollama refuses these with raw too: a client sending them expects a template or
        # an earlier turn to shape the prompt, and raw mode would silently drop both.
        for name in ("template", "context"):
            if body.get(name):
                raise invalid(name, f"'{name}' cannot be combined with raw mode: raw mode "
                                    "does not support template, system, or context.")
    if suffix and context:
        # Ollama puts the earlier conversation's text before the fill-in-the-middle
        # prompt, where the model reads it as what precedes the file: the code around the
        # cursor is what a completion continues, and the editor sends it whole each time.
        raise invalid("context", "'context' cannot be combined with a 'suffix' (fill in "
                                 "the middle): an earlier answer's tokens do not continue "
                                 "a file; send the text before the cursor as 'prompt'.")
    if raw or suffix:
        # The prompt as given (or the model's fill-in-the-middle prompt): no template.
        # Given means not empty, as Ollama checks it: a client that sends every field
        # of the body, ``"system": ""`` among them, is asking for no system message.
        for name, given in (("system", bool(system)), ("images", bool(images)),
                            ("format", response_format is not None)):
            if given:
                why = "raw mode" if raw else "a 'suffix' (fill in the middle)"
                raise invalid(name, f"'{name}' cannot be combined with {why}: the prompt "
                                    "is not rendered through the model's template.")
        return CompletionRequest(
            prompts=(prompt,),
            model=top["model"],
            suffix=suffix or None,
            stream=top["stream"],
            max_tokens=limit if limit is not None else UNCAPPED,
            max_tokens_shrinks=True,
            require_thinking=wants_thinking(body.get("think")),
            logprobs=(top["top_logprobs"] or 0) if top["logprobs"] else None,
            keep_alive=keep_alive_of(body),
            ignored_fields=ignored,
            **sampling,
        )
    messages = [Message("user", prompt, has_images=bool(images), images=images)]
    if system:
        messages.insert(0, Message("system", system))
    return ChatRequest(
        messages=tuple(messages),
        model=top["model"],
        stream=top["stream"],
        max_tokens=limit,
        max_tokens_shrinks=True,
        trim_context=top["truncate"],
        response_format=response_format,
        reasoning_effort=_think(body.get("think")),
        require_thinking=wants_thinking(body.get("think")),
        has_images=bool(images),
        prompt_prefix=context,
        logprobs=(top["top_logprobs"] or 0) if top["logprobs"] else None,
        keep_alive=keep_alive_of(body),
        ignored_fields=ignored,
        **sampling,
    )


def parse_generate(raw: bytes, *, strict: bool = False) -> ChatRequest | CompletionRequest:
    return generate_request(parse_json_body(raw), strict=strict)
