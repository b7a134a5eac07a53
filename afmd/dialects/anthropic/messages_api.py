"""Anthropic's Messages API on the wire: its body in, its message and SSE events out, its
errors in its envelope and statuses.

A run's events become content blocks in the order the model wrote them: reasoning is a
``thinking`` block, text a ``text`` block, each tool call a ``tool_use`` block whose
``input`` streams as ``input_json_delta`` fragments. A stream is ``message_start``, each
block's ``content_block_start`` / ``_delta`` / ``_stop``, then ``message_delta`` (stop
reason and usage) and ``message_stop``; ``ping`` keeps a quiet stream alive (queued, a long
prefill), and a failure after the stream began is an ``error`` event.

Choices where afmd and Anthropic differ (docs/anthropic.md says the same):

* ``usage.input_tokens`` is the prompt's tokens the prefix cache did not hold,
  ``cache_read_input_tokens`` those it did, ``cache_creation_input_tokens`` is 0 (afmd
  caches every prompt by itself; nothing is written at a client's breakpoint). Their sum
  is the whole prompt, as Anthropic's is. ``message_start`` counts the whole prompt as
  ``input_tokens`` (many clients read the input there alone): what the cache held is known
  once the run is admitted, and ``message_delta``'s usage, the totals, splits it.
* ``stop_reason`` is ``cancelled`` for a run cancelled by its ``X-Request-ID`` (Anthropic
  has no such end; afmd's chat says ``finish_reason: "cancelled"`` alike).
* ``max_tokens`` is a cap, as Anthropic's: a prompt that leaves less room in the context
  window still runs, and ends with ``model_context_window_exceeded`` when it fills it.
* A ``thinking`` block's ``signature`` is empty: afmd does not sign its reasoning (and
  takes thinking blocks sent back whatever their signature).
* Errors: afmd's 503 (overloaded, a model still loading, shutting down) is Anthropic's
  529 ``overloaded_error``; 429 and 529 carry ``Retry-After``. The message starts with
  the param the problem is in (``max_tokens: …``), as Anthropic's do; a prompt over the
  context window is Anthropic's ``prompt is too long: N tokens > M maximum``, the wording
  Claude Code parses to compact a conversation.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import orjson

from afmd.core.events import (
    Content,
    Event,
    Finish,
    Profile,
    Reasoning,
    Refusal,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
    Usage,
    profile_payload,
)
from afmd.core.ids import alphanumerics
from afmd.core.request import ChatRequest
from afmd.dialects.anthropic.messages_body import parse_count_request, parse_messages_request
from afmd.errors import APIError, ContextLengthError

__all__ = ["ANTHROPIC_MESSAGES", "AnthropicMessages", "MessageReply", "tool_use_id"]

#: Seconds a stream may stay quiet before a ``ping`` shows it is alive.
PING_INTERVAL = 5.0
PING = b'event: ping\ndata: {"type":"ping"}\n\n'
MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'

#: afmd's finish reasons as Anthropic's stop reasons ("stop" depends on the stop sequence).
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "cancelled": "cancelled"}

#: Anthropic's error types by (Anthropic's) status; others by who is at fault.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}

#: afmd's error codes that are Anthropic's machine-readable ones too, sent as the error's
#: ``details.error_code``, which clients act on (the SDK's threads recover from these).
_DETAILED_CODES = frozenset({"thread_unsupported_request"})

#: Params afmd's shared checks name in Chat Completions' terms, in Anthropic's.
_PARAMS = (
    (re.compile(r"tools\[(\d+)\]\.function\.parameters(.*)"), r"tools[\1].input_schema\2"),
    (re.compile(r"tools\[(\d+)\]\.function\.name"), r"tools[\1].name"),
    (re.compile(r"response_format\.json_schema\.schema(.*)"), r"output_config.format.schema\1"),
    (re.compile(r"response_format(\..+)?"), "output_config.format.schema"),
)


def new_message_id() -> str:
    return "msg_" + alphanumerics(24)


def tool_use_id(call_id: str) -> str:
    """A call's id as Anthropic writes it (``toolu_…``): afmd's ``call_…`` id renamed, so
    the mapping needs no state and ids sent back are taken as they come."""
    return "toolu_" + call_id.removeprefix("call_")


def sse(event: str, payload: Mapping[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def usage_object(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"thinking_tokens": usage.reasoning_tokens},
    }


def stop_reason(finish: Finish, usage: Usage | None = None,
                max_tokens: int | None = None) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence`` for the run's end; a length end short of
    ``max_tokens`` is the context window's."""
    if finish.reason == "stop":
        if finish.stop_sequence is not None:
            return "stop_sequence", finish.stop_sequence
        return "end_turn", None
    if (finish.reason == "length" and usage is not None and max_tokens is not None
            and usage.completion_tokens < max_tokens):
        return "model_context_window_exceeded", None
    return _STOP_REASONS.get(finish.reason, finish.reason), None


def tool_input(arguments: str) -> Any:
    """A complete call's arguments as its ``input`` object; a call cut short by
    ``max_tokens`` whose JSON does not parse has an empty input."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageReply:
    """One ``message``, or its stream of events."""

    keepalive_interval = PING_INTERVAL

    __slots__ = ("_block", "_finish", "_index", "_prompt_tokens", "_refused", "max_tokens",
                 "message_id", "model")

    def __init__(self, *, model: str, max_tokens: int | None = None) -> None:
        self.message_id = new_message_id()
        self.model = model
        self.max_tokens = max_tokens
        self._index = -1  # the last block opened
        self._block: str | None = None  # the open block's type
        self._finish = Finish("stop")
        self._refused = False  # the model declined: stop_reason "refusal", its text shown
        self._prompt_tokens = 0  # what message_start reports (prompt_counted)

    def _message(self, content: list[dict[str, Any]], usage: Usage | None,
                 stop: tuple[str | None, str | None]) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": usage_object(usage or Usage(0, 0)),
        }

    def body(self, events: Sequence[Event]) -> bytes:
        # A text or thinking block's pieces are joined once at the end: added to its
        # string one by one, the block was copied again at every token.
        content: list[dict[str, Any]] = []
        pieces: list[list[str]] = []  # per block of text or thinking: its pieces
        usage = Usage(0, 0)
        finish = Finish("stop")
        refused = False
        for event in events:
            last = content[-1]["type"] if content else None
            if isinstance(event, Reasoning):
                if last == "thinking":
                    pieces[-1].append(event.text)
                else:
                    content.append({"type": "thinking", "thinking": "", "signature": ""})
                    pieces.append([event.text])
            elif isinstance(event, Content | Refusal):
                if isinstance(event, Refusal):
                    refused = True
                if last == "text":
                    pieces[-1].append(event.text)
                else:
                    content.append({"type": "text", "text": ""})
                    pieces.append([event.text])
            elif isinstance(event, ToolCallEnd):
                call = event.call
                content.append({"type": "tool_use", "id": tool_use_id(call.id),
                                "name": call.name, "input": tool_input(call.arguments)})
            elif isinstance(event, Finish):
                finish = event
            elif isinstance(event, Usage):
                usage = event
        texts = iter(pieces)
        for block in content:
            if block["type"] != "tool_use":
                block[block["type"]] = "".join(next(texts))
        stop = ("refusal", None) if refused else stop_reason(finish, usage, self.max_tokens)
        return orjson.dumps({**self._message(content, usage, stop), **profile_payload(events)})

    # -- the stream --
    def prompt_counted(self, tokens: int) -> None:
        self._prompt_tokens = tokens

    def stream_start(self) -> bytes:
        # The whole prompt as input: how much of it the prefix cache holds is known only
        # once the run is admitted, and message_delta's usage then splits it.
        usage = Usage(self._prompt_tokens, 0)
        return sse("message_start", {"type": "message_start",
                                     "message": self._message([], usage, (None, None))})

    def keepalive(self) -> bytes:
        return PING

    def _open(self, block: dict[str, Any]) -> bytes:
        out = self._close()
        self._index += 1
        self._block = block["type"]
        return out + sse("content_block_start", {"type": "content_block_start",
                                                 "index": self._index,
                                                 "content_block": block})

    def _close(self) -> bytes:
        if self._block is None:
            return b""
        self._block = None
        return sse("content_block_stop", {"type": "content_block_stop", "index": self._index})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta",
                                           "index": self._index, "delta": delta})

    def stream(self, events: Sequence[Event]) -> bytes:
        out: list[bytes] = []
        for event in events:
            if isinstance(event, Reasoning):
                if self._block != "thinking":
                    out.append(self._open({"type": "thinking", "thinking": "",
                                           "signature": ""}))
                out.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
            elif isinstance(event, Content | Refusal):
                if isinstance(event, Refusal):
                    self._refused = True
                if self._block != "text":
                    out.append(self._open({"type": "text", "text": ""}))
                out.append(self._delta({"type": "text_delta", "text": event.text}))
            elif isinstance(event, ToolCallStart):
                out.append(self._open({"type": "tool_use", "id": tool_use_id(event.id),
                                       "name": event.name, "input": {}}))
                if event.arguments:
                    out.append(self._delta({"type": "input_json_delta",
                                            "partial_json": event.arguments}))
            elif isinstance(event, ToolCallArguments):
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": event.fragment}))
            elif isinstance(event, ToolCallEnd):
                out.append(self._close())
            elif isinstance(event, Finish):
                out.append(self._close())
                self._finish = event
            elif isinstance(event, Usage):
                reason, sequence = ("refusal", None) if self._refused else \
                    stop_reason(self._finish, event, self.max_tokens)
                out.append(sse("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage_object(event),
                }))
            elif isinstance(event, Profile):
                # afmd's X-AFM-Profile, as an event of its own type (clients skip types
                # they do not know): {"type": "afm_profile", "afm_profile": {...}}.
                name = next(iter(event.payload), "afm_profile")
                out.append(sse(name, {"type": name, **event.payload}))
        return b"".join(out)

    def stream_end(self) -> bytes:
        return MESSAGE_STOP

    def stream_error(self, error: APIError) -> bytes:
        return sse("error", ANTHROPIC_MESSAGES.error_envelope(error))

    def stream_abandoned(self) -> None:
        pass  # nothing outlives the request


class AnthropicMessages:
    """The ``/v1/messages`` adapter (and ``/v1/messages/count_tokens``'s parser)."""

    name = "anthropic_messages"
    request_id_header = "request-id"

    def parse(self, raw: bytes, *, server_tools: Collection[str] = (),
              strict: bool = False) -> ChatRequest:
        return parse_messages_request(raw, server_tools=server_tools, strict=strict)

    def parse_count(self, raw: bytes, *, server_tools: Collection[str] = (),
                    strict: bool = False) -> ChatRequest:
        return parse_count_request(raw, server_tools=server_tools, strict=strict)

    def reply(self, request: ChatRequest, *, model: str, fingerprint: str) -> MessageReply:
        return MessageReply(model=model, max_tokens=request.max_tokens)

    def error_status(self, error: APIError) -> tuple[int, Mapping[str, str]]:
        status = 529 if error.status == 503 else error.status
        headers = dict(error.headers)
        if status in (429, 529):
            headers.setdefault("Retry-After", "1")
        return status, headers

    def error_envelope(self, error: APIError) -> dict[str, Any]:
        status, _ = self.error_status(error)
        kind = _ERROR_TYPES.get(status)
        if kind is None:
            client = status < 500 or error.error_type == "invalid_request_error"
            kind = "invalid_request_error" if client else "api_error"
        if isinstance(error, ContextLengthError):  # the wording Claude Code compacts on
            return {"type": "error", "error": {"type": kind, "message": (
                f"prompt is too long: {error.prompt_tokens} tokens > {error.limit} maximum")}}
        param = _param(error)
        # Anthropic names the field at the start of the message; one that starts with it
        # already (a header's own rule) is not named twice.
        named = param is None or error.message.startswith(param)
        message = error.message if named else f"{param}: {error.message}"
        body: dict[str, Any] = {"type": kind, "message": message}
        if error.code in _DETAILED_CODES:
            body["details"] = {"error_code": error.code}
        return {"type": "error", "error": body}

    def error_param(self, error: APIError) -> str | None:
        return _param(error)


def _param(error: APIError) -> str | None:
    param = error.param
    if param is None:
        return None
    if error.code == "unknown_parameter":
        return param  # the client's own field, whatever it is called
    for pattern, replacement in _PARAMS:
        if pattern.fullmatch(param):
            return pattern.sub(replacement, param)
    return param


ANTHROPIC_MESSAGES = AnthropicMessages()
