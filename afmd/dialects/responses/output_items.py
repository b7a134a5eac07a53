"""A run's events as a Responses API response: its output items and its semantic events.

The events of a turn (:mod:`afmd.core.events`) become output items in the order the model
wrote them: thinking as a ``reasoning`` item (its text as ``reasoning_text`` content; the
API's ``summary`` is for summaries, which afmd does not write, so it stays empty), text as
an assistant ``message`` with one ``output_text`` part, each call as a ``function_call``
(with its ``namespace`` when a namespace tool's function made it) or, for a custom tool, a
``custom_tool_call`` whose ``input`` is the text the model wrote (streamed once, whole),
or for a client-run tool its own item (``shell_call``, ``local_shell_call``,
``apply_patch_call``: :mod:`afmd.dialects.responses.client_tools`), built once its
arguments are whole; a shell call's commands stream as ``shell_call_command`` events as
they are written.
Streamed, each item opens (``output_item.added``, ``content_part.added``), grows by deltas
and closes (``….done``, ``content_part.done``, ``output_item.done``), every event numbered
by ``sequence_number``; the non-streamed body is the same items, built from the same
events. Deltas are the per-token path: their JSON is spliced into a pre-encoded head.
With log-probabilities asked for, a message's deltas wait for the numbers of their tokens,
which the run sends after the text they made, at the end of the same batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from afmd.core.events import (
    Content,
    Event,
    Finish,
    Logprobs,
    Profile,
    Reasoning,
    Refusal,
    TokenLogprob,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from afmd.dialects.responses import client_tools
from afmd.dialects.responses.client_tools import ClientTool, CommandEvent, CommandStream
from afmd.dialects.responses.items import Item, item_id
from afmd.dialects.responses.options import LOGPROBS
from afmd.dialects.responses.responses_body import Echo
from afmd.errors import APIError

#: How a run that ended by itself or was cut short reads in a response's ``status``.
STATUS = {"stop": "completed", "tool_calls": "completed", "length": "incomplete",
          "cancelled": "cancelled"}
#: The event that ends a stream, by status (a cancelled run is incomplete too).
TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete",
            "cancelled": "response.incomplete", "failed": "response.failed"}


#: The statuses of a response whose run has not ended: no output or usage to show yet.
UNDER_WAY = frozenset({"queued", "in_progress"})


def usage_object(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        # afmd's prefix cache keeps prompts as a side effect; it reports no writes.
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"event: " + payload["type"].encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def _output_text(text: str, logprobs: list[Item] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [],
            "logprobs": logprobs or []}


def _part_logprob(t: TokenLogprob) -> Item:
    """A token of an ``output_text`` part (OpenAI's ``LogProb``: with its bytes)."""
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes),
            "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": list(a.bytes)}
                             for a in t.top]}


def _event_logprobs(entries: list[Item]) -> list[Item]:
    """The same tokens as the text events carry them (OpenAI's ``ResponseLogProb``: no
    bytes)."""
    return [{"token": e["token"], "logprob": e["logprob"], "top_logprobs": [
        {"token": a["token"], "logprob": a["logprob"]} for a in e["top_logprobs"]]}
        for e in entries]


def response_object(echo: Echo, *, id: str, created_at: int, model: str, status: str,
                    output: list[Item], usage: Usage | None,
                    error: APIError | None = None) -> dict[str, Any]:
    """The response as every event that carries it and the non-streamed body show it: the
    request's settings echoed back, the output and usage only once the run is under way."""
    body: dict[str, Any] = {
        "id": id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": echo.background,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": None if error is None else {
            "code": "rate_limit_exceeded" if error.status == 429 else "server_error",
            "message": error.message},
        "incomplete_details": {"reason": "max_output_tokens"}
        if status == "incomplete" else None,
        "instructions": echo.instructions,
        "max_output_tokens": echo.max_output_tokens,
        "max_tool_calls": echo.max_tool_calls,
        "model": model,
        "output": list(output) if status not in UNDER_WAY else [],
        "parallel_tool_calls": echo.parallel_tool_calls,
        "previous_response_id": echo.previous_response_id,
        "reasoning": echo.reasoning,
        "service_tier": "default",
        "store": echo.store,
        "temperature": echo.temperature,
        "text": echo.text,
        "tool_choice": echo.tool_choice,
        "tools": list(echo.tools),
        "top_logprobs": echo.top_logprobs,
        "top_p": echo.top_p,
        "truncation": echo.truncation,
        "metadata": echo.metadata,
    }
    if echo.conversation is not None:
        body["conversation"] = {"id": echo.conversation}
    for key, value in (("user", echo.user), ("safety_identifier", echo.safety_identifier),
                       ("prompt_cache_key", echo.prompt_cache_key)):
        if value is not None:
            body[key] = value
    if usage is not None and status not in UNDER_WAY:
        body["usage"] = usage_object(usage)
    return body


@dataclass(slots=True)
class _Open:
    """The output item being written."""

    kind: str  # "message" | "refusal" (a message whose part is one) | "reasoning" | …
    index: int  # output_index
    id: str
    parts: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""
    namespace: str | None = None  # a namespace tool's function
    client: ClientTool | None = None  # a client-run tool's call
    commands: CommandStream | None = None  # a shell call's, as they are written
    delta_head: bytes = b""  # the pre-encoded start of this item's delta events
    #: A message's tokens (``include: ["message.output_text.logprobs"]``), as its part
    #: writes them.
    logprobs: list[Item] = field(default_factory=list)
    #: A message's text written but not yet sent: with log-probabilities asked for, a
    #: delta waits for its tokens' numbers, which come after the text in the same batch.
    held: list[str] = field(default_factory=list)


def _reasoning_item(rid: str, content: list[Item], status: str, encrypted: bool) -> Item:
    item: Item = {"id": rid, "type": "reasoning", "summary": [], "content": content,
                  "status": status}
    if encrypted:
        item["encrypted_content"] = None  # afmd's reasoning is plain text, above
    return item


def _call_item(item: _Open, arguments: str, status: str) -> Item:
    """A function call, or a custom tool's: the text of the one string the model wrote
    for it (what a call cut short wrote of it, when its JSON did not close)."""
    if item.client is not None:
        return client_tools.call_item(item.kind, item.id, item.call_id, arguments, status,
                                      item.client)
    if item.kind == "custom_tool_call":
        out: Item = {"id": item.id, "type": "custom_tool_call", "status": status,
                     "call_id": item.call_id, "name": item.name,
                     "input": custom_input(arguments)}
    else:
        out = {"id": item.id, "type": "function_call", "status": status,
               "call_id": item.call_id, "name": item.name, "arguments": arguments}
    if item.namespace is not None:
        out["namespace"] = item.namespace
    return out


def custom_input(arguments: str) -> str:
    """A custom tool's input from the arguments of the function it was offered as."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return ""
    text = value.get("input") if isinstance(value, dict) else None
    return text if isinstance(text, str) else ""


def _done_item(item: _Open, text: str, status: str, encrypted: bool) -> Item:
    """The item as it ends, whether closed in turn or cut short by a failure; a text item's
    one content part is the part its ``content_part.done`` event carries."""
    if item.kind in CALL_KINDS:
        return _call_item(item, text, status)
    if item.kind in ("message", "refusal"):
        part = _output_text(text, item.logprobs) if item.kind == "message" else \
            {"type": "refusal", "refusal": text}
        return {"id": item.id, "type": "message", "status": status, "role": "assistant",
                "content": [part]}
    return _reasoning_item(item.id, [{"type": "reasoning_text", "text": text}], status,
                           encrypted)


#: The kinds of output item a call becomes.
CALL_KINDS = frozenset({"function_call", "custom_tool_call", *client_tools.KIND_OF_CALL})


def _delta_head(event: str, item: _Open, fields: str) -> bytes:
    """The bytes every delta of the item starts with: only the delta's text and its number
    are encoded per token."""
    return (f'event: {event}\ndata: {{"type":"{event}","item_id":"{item.id}",'
            f'"output_index":{item.index}{fields},"delta":').encode()


class _EventLog:
    """The stream's events, numbered as they are written; a response that is not streamed
    writes none (its body is built from the items alone)."""

    __slots__ = ("out", "sequence", "stream")

    def __init__(self, stream: bool, opening: int) -> None:
        self.stream = stream
        self.sequence = opening  # after ResponseBuilder.start_events()'s
        self.out: list[bytes] = []

    def emit(self, payload: dict[str, Any]) -> None:
        if self.stream:
            payload["sequence_number"] = self.sequence
            self.sequence += 1
            self.out.append(sse_event(payload))

    def delta(self, item: _Open, text: str, logprobs: list[Item] | None = None) -> None:
        if self.stream:
            tail = b"" if logprobs is None else b',"logprobs":' + orjson.dumps(logprobs)
            self.out.append(item.delta_head + orjson.dumps(text) + tail
                            + b',"sequence_number":' + str(self.sequence).encode()
                            + b"}\n\n")
            self.sequence += 1

    def take(self) -> bytes:
        return b"".join(self.take_events())

    def take_events(self) -> list[bytes]:
        """The events written since the last take, one SSE event each, in sequence."""
        out, self.out = self.out, []
        return out


class ResponseBuilder:
    """One response: its output items, and (when ``stream``) the events that build them."""

    def __init__(self, echo: Echo, *, model: str, stream: bool) -> None:
        self.echo = echo
        self.model = model
        self.stream = stream
        self.id = item_id("resp")
        self.created_at = int(time.time())
        self.output: list[Item] = []
        self.usage: Usage | None = None
        self.reason: str | None = None
        self._open: _Open | None = None
        self._log = _EventLog(stream, len(self._opening()))
        self._encrypted = "reasoning.encrypted_content" in echo.include
        self._logprobs = LOGPROBS in echo.include
        #: The message whose text this batch carried: its tokens' numbers follow.
        self._written: _Open | None = None
        #: The last message closed, with its part, which late numbers still join.
        self._closed: tuple[_Open, Item] | None = None

    def fork(self) -> ResponseBuilder:
        """A builder of the same response (its id, its creation time) with nothing fed:
        a whole answer is built in it on another thread while GET reads this one."""
        twin = ResponseBuilder(self.echo, model=self.model, stream=self.stream)
        twin.id, twin.created_at = self.id, self.created_at
        return twin

    def response(self, status: str, error: APIError | None = None) -> dict[str, Any]:
        return response_object(self.echo, id=self.id, created_at=self.created_at,
                               model=self.model, status=status, output=self.output,
                               usage=self.usage, error=error)

    def status(self) -> str:
        return STATUS.get(self.reason or "stop", "completed")

    def start(self) -> bytes:
        """``response.created`` and ``response.in_progress``, numbered 0 and 1 however
        late the stream's head is written (it may go out after the first events were
        encoded: those are numbered from 2 on)."""
        return b"".join(self.start_events())

    def _opening(self) -> tuple[str, ...]:
        """The events that open the stream. A background response is ``queued`` first:
        ``response.created`` shows it so and ``response.queued`` follows, as OpenAI streams
        one; its ``response.in_progress`` is :meth:`began`'s, numbered as it comes, so
        that one cancelled while still queued goes from those to its end with no gap in
        the numbers (a client resumes after any of them)."""
        if self.echo.background:
            return ("response.created", "response.queued")
        return ("response.created", "response.in_progress")

    def start_events(self) -> list[bytes]:
        """:meth:`start`'s events apart, one SSE event each."""
        status = "queued" if self.echo.background else "in_progress"
        return [sse_event({"type": kind, "response": self.response(status),
                           "sequence_number": number})
                for number, kind in enumerate(self._opening())]

    def began(self) -> list[bytes]:
        """A background response's ``response.in_progress``: its run has begun."""
        self._log.emit({"type": "response.in_progress", "response": self.response("in_progress")})
        return self._log.take_events()

    def take(self) -> bytes:
        return self._log.take()

    def take_events(self) -> list[bytes]:
        return self._log.take_events()

    def feed(self, events: list[Event]) -> None:
        self._written = None
        for event in events:
            if isinstance(event, Logprobs):
                self._join_logprobs(event)
                continue
            if not isinstance(event, Content):
                self._release()
            if isinstance(event, Content | Reasoning | Refusal):
                kind = "message" if isinstance(event, Content) else \
                    "refusal" if isinstance(event, Refusal) else "reasoning"
                item = self._open
                if item is None or item.kind != kind:
                    item = self._open_text(kind)
                item.parts.append(event.text)
                if kind == "message" and self._logprobs:
                    item.held.append(event.text)
                    self._written = item
                else:
                    self._log.delta(item, event.text)
            elif isinstance(event, ToolCallStart):
                self._open_call(event)
            elif isinstance(event, ToolCallArguments):
                call = self._open_item()
                call.parts.append(event.fragment)
                if call.kind == "function_call":
                    self._log.delta(call, event.fragment)
                elif call.commands is not None:
                    self._commands(call, call.commands.feed(event.fragment))
            elif isinstance(event, ToolCallEnd):
                # One the output ended inside is cut short: its arguments are not whole.
                self._close(arguments=event.call.arguments,
                            status="incomplete" if event.cut else "completed")
            elif isinstance(event, Finish):
                self.reason = event.reason
                self._close(status="completed" if self.status() == "completed" else "incomplete")
            elif isinstance(event, Usage):
                self.usage = event
            elif isinstance(event, Profile):
                key = next(iter(event.payload))
                self._log.emit({"type": key, **event.payload})
        self._release()

    def _join_logprobs(self, event: Logprobs) -> None:
        """The numbers of the tokens whose text this batch's events carried, given to the
        message that text went to (a batch without message text: thinking, call markup,
        has none to give them to), and its held delta sent with them."""
        item = self._written
        if item is None:
            return
        entries = [_part_logprob(t) for t in event.tokens]
        if self._open is item:
            item.logprobs.extend(entries)
            self._release(_event_logprobs(entries))
        elif self._closed is not None and self._closed[0] is item:
            self._closed[1]["logprobs"].extend(entries)  # closed in this batch

    def _release(self, logprobs: list[Item] | None = None) -> None:
        """The open message's held text as one delta (with log-probabilities asked for,
        it carries its tokens' numbers, or none when they did not come with it)."""
        item = self._open
        if item is not None and item.held:
            text = "".join(item.held)
            item.held.clear()
            self._log.delta(item, text, [] if logprobs is None else logprobs)

    def _open_item(self) -> _Open:
        assert self._open is not None
        return self._open

    def _open_text(self, kind: str) -> _Open:
        self._close()
        prefix, part = {"message": ("msg", "output_text"), "refusal": ("msg", "refusal")}.get(
            kind, ("rs", "reasoning_text"))
        item = _Open(kind, len(self.output), item_id(prefix))
        self._open = item
        if kind in ("message", "refusal"):
            added: Item = {"id": item.id, "type": "message", "status": "in_progress",
                           "role": "assistant", "content": []}
            empty = _output_text("") if kind == "message" else {"type": "refusal",
                                                                 "refusal": ""}
        else:
            added = _reasoning_item(item.id, [], "in_progress", self._encrypted)
            empty = {"type": "reasoning_text", "text": ""}
        self._log.emit({"type": "response.output_item.added", "output_index": item.index,
                        "item": added})
        self._log.emit({"type": "response.content_part.added", "item_id": item.id,
                        "output_index": item.index, "content_index": 0, "part": empty})
        # With log-probabilities asked for, each delta writes its own.
        extra = ',"logprobs":[]' if kind == "message" and not self._logprobs else ""
        item.delta_head = _delta_head(f"response.{part}.delta", item,
                                      f',"content_index":0{extra}')
        return item

    def _open_call(self, event: ToolCallStart) -> None:
        self._close()
        client = self.echo.client_tools.get(event.name)
        custom = event.name in self.echo.custom_tools
        kind = client_tools.CALL_TYPES[client.kind] if client is not None else \
            "custom_tool_call" if custom else "function_call"
        prefix = client_tools.CALL_PREFIXES.get(kind) or ("ctc" if custom else "fc")
        item = _Open(kind, len(self.output), item_id(prefix), call_id=event.id,
                     name=event.name, namespace=self.echo.namespaces.get(event.name),
                     client=client,
                     commands=CommandStream() if kind == "shell_call" and self.stream else None)
        self._open = item
        # An apply_patch_call has no shape without its operation: it is added once whole.
        if kind != "apply_patch_call":
            self._log.emit({"type": "response.output_item.added", "output_index": item.index,
                            "item": _call_item(item, "", "in_progress")})
        # Only a function's arguments stream as written; a custom tool's input and a
        # client-run tool's action go out once whole.
        item.delta_head = b"" if kind != "function_call" else \
            _delta_head("response.function_call_arguments.delta", item, "")
        if event.arguments:
            item.parts.append(event.arguments)
            if kind == "function_call":
                self._log.delta(item, event.arguments)
            elif item.commands is not None:
                self._commands(item, item.commands.feed(event.arguments))

    def _close(self, *, status: str = "completed", arguments: str | None = None) -> None:
        """The open item's ``….done`` events, and the item into ``output``."""
        self._release()
        item, self._open = self._open, None
        if item is None:
            return
        text = "".join(item.parts)
        base = {"item_id": item.id, "output_index": item.index}
        calls = CALL_KINDS
        if item.kind in calls:
            text = text if arguments is None else arguments
            if arguments is None and status == "completed":
                status = "incomplete"  # never ended: cut short
        if item.kind == "function_call":
            self._log.emit({"type": "response.function_call_arguments.done", **base,
                            "name": item.name, "arguments": text})
        elif item.kind == "custom_tool_call":
            written = custom_input(text)
            self._log.emit({"type": "response.custom_tool_call_input.delta", **base,
                            "delta": written})
            self._log.emit({"type": "response.custom_tool_call_input.done", **base,
                            "input": written})
        done = _done_item(item, text, status, self._encrypted)
        if item.commands is not None:
            self._commands(item, item.commands.finish(done["action"]["commands"]))
        elif item.kind == "apply_patch_call":
            self._log.emit({"type": "response.output_item.added", "output_index": item.index,
                            "item": {**done, "status": "in_progress"}})
        if item.kind not in calls:
            part: Item = done["content"][0]
            if item.kind == "message":
                self._closed = (item, part)
                self._log.emit({"type": "response.output_text.done", **base,
                                "content_index": 0, "text": text,
                                "logprobs": _event_logprobs(item.logprobs)})
            elif item.kind == "refusal":
                self._log.emit({"type": "response.refusal.done", **base,
                                "content_index": 0, "refusal": text})
            else:
                self._log.emit({"type": "response.reasoning_text.done", **base,
                                "content_index": 0, "text": text})
            self._log.emit({"type": "response.content_part.done", **base, "content_index": 0,
                            "part": part})
        self.output.append(done)
        self._log.emit({"type": "response.output_item.done", "output_index": item.index,
                        "item": done})

    def _commands(self, item: _Open, events: list[CommandEvent]) -> None:
        """A shell call's commands as the API streams them: each added, written and done."""
        for kind, number, text in events:
            self._log.emit({"type": f"response.shell_call_command.{kind}",
                            "output_index": item.index, "command_index": number,
                            "delta" if kind == "delta" else "command": text})

    def finish(self) -> dict[str, Any]:
        """The final response object, and its terminal event when streamed."""
        self._close(status="incomplete")
        status = self.status()
        response = self.response(status)
        self._log.emit({"type": TERMINAL[status], "response": response})
        return response

    def abandon(self) -> dict[str, Any]:
        """The response as its client left it: ``cancelled``, its open item incomplete
        (no event: nobody reads the stream any more)."""
        self._close(status="incomplete")
        return self.response("cancelled")

    def fail(self, error: APIError, param: str | None) -> dict[str, Any]:
        """A failure after the stream began: an ``error`` event, then ``response.failed``."""
        if self._open is not None:
            item, self._open = self._open, None
            self.output.append(_done_item(item, "".join(item.parts), "incomplete",
                                          self._encrypted))
        self._log.emit({"type": "error", "code": error.code, "message": error.message,
                        "param": param})
        response = self.response("failed", error)
        self._log.emit({"type": "response.failed", "response": response})
        return response
