"""Ollama's native API on the wire: its chat and generate objects, streamed as NDJSON.

A stream (on by default, as in Ollama) is ``application/x-ndjson``: one JSON object per
line, each batch of the run's events one line (``message.content`` / ``thinking`` for
chat, ``response`` / ``thinking`` for generate), and a last line with ``done: true``,
``done_reason`` and Ollama's counts and durations (nanoseconds): ``total_duration``,
``load_duration``, ``prompt_eval_count``, ``prompt_eval_duration``, ``eval_count``,
``eval_duration``. A tool call goes out whole once complete, its ``arguments`` an object.
Without streaming, the same fields make one object. An error is ``{"error": "..."}``, as
a plain response with its status before the stream began and as a last line after.

Choices where afmd and Ollama differ (docs/ollama.md says the same):

* ``done_reason`` is ``stop``, ``length`` (``num_predict`` or the context window), or
  afmd's ``cancelled`` for a run cancelled by its ``X-Request-ID``; a turn that ends in
  tool calls is ``stop``, as Ollama says.
* ``prompt_eval_count`` is the whole prompt, the part the prefix cache held included.
* A templated generate's ``context`` is the ids the engine ran and wrote, not the text
  encoded again: sent back, its tokens are the next prompt's first ones exactly.
* ``X-AFM-Profile`` adds an ``afm_profile`` key to the last object.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import orjson

from afmd.core.events import (
    Choice,
    Content,
    Event,
    Finish,
    Logprobs,
    Profile,
    Reasoning,
    Refusal,
    Timings,
    TokenLogprob,
    ToolCallEnd,
    Usage,
)
from afmd.core.request import (
    CONTEXT_WINDOW_PARAM,
    PROMPT_PREFIX_PARAM,
    ChatRequest,
    CompletionRequest,
)
from afmd.dialects.ollama.ollama_body import parse_chat, parse_generate
from afmd.errors import APIError, ContextLengthError, ModelKindError

__all__ = ["MEDIA_TYPE", "OLLAMA", "OLLAMA_CHAT", "OLLAMA_GENERATE", "OllamaGenerateReply",
           "OllamaReply",
           "created_at", "error_body", "load_answer", "ndjson"]

MEDIA_TYPE = "application/x-ndjson"
_NOT_FOUND = re.compile(r"The model '(.*)' does not exist\.")
_REASONS = {"tool_calls": "stop"}


def created_at() -> str:
    """Now, as Ollama writes ``created_at`` (RFC 3339, UTC)."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


#: Characters ``str.splitlines`` ends a line at that JSON writes raw (the others it
#: escapes): the official Python client splits a stream with httpx's ``iter_lines``,
#: which splits there too, so one raw in a string cut its object in two. Escaped they
#: are the same string; Ollama's Go encoder escapes the first two itself.
_LINE_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"),
                (b"\xc2\x85", b"\\u0085"))


def ndjson(payload: Mapping[str, Any]) -> bytes:
    """One object as one line, whichever line splitter reads it."""
    line = orjson.dumps(payload)
    for raw, escaped in _LINE_BREAKS:
        if raw in line:
            line = line.replace(raw, escaped)
    return line + b"\n"


def nanoseconds(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


#: The fields the pipeline names, as Ollama's body names them: the grammar's (chat's
#: ``response_format``), the request's own context window (``options.num_ctx``), the
#: earlier answer's ids (``context``), the thinking a model lacks (``think``), and the
#: body's own paths (kept as they are).
_FIELDS = (
    (re.compile(r"response_format\.json_schema\.schema(.*)"), r"format\1"),
    (re.compile(r"response_format(\..+)?"), "format"),
    (re.compile(r"(tools\[\d+\]\.function\..+)"), r"\1"),
    (re.compile(CONTEXT_WINDOW_PARAM), "options.num_ctx"),
    (re.compile(PROMPT_PREFIX_PARAM + r"(\[\d+\])?"), r"context\1"),
    (re.compile(r"reasoning_effort"), "think"),
    (re.compile(r"((?:messages\[\d+\]\.)?images\[\d+\])"), r"\1"),
    (re.compile(r"(input\[\d+\]|options\..+)"), r"\1"),
)
#: Errors whose message is Ollama's own, which clients match: never prefixed.
_OLLAMA_WORDS = frozenset({"model_not_found", "thinking_not_supported"})


def schema_field(error: APIError) -> str | None:
    """The field an error names, as Ollama's body names it (None: no field of Ollama's
    body, such as a setting only afmd's other APIs have). An image's error names the image
    as the body did (``messages[0].images[0]``, ``/api/generate``'s ``images[0]``)."""
    param = error.param
    if param is None:
        return None
    for pattern, replacement in _FIELDS:
        if pattern.fullmatch(param):
            return pattern.sub(replacement, param)
    return None


def error_body(error: APIError, *, route: str = "generate") -> dict[str, Any]:
    """``{"error": "..."}``; an unknown model, a model that cannot think and a model of
    another kind in Ollama's own words, which clients match (the last naming the
    ``route`` asked, as Ollama does). Ollama's error is one message, so it starts with the
    field it is about where it does not name it already (as Anthropic's do): a grammar's
    message does not say which schema it read, an image's which image it is."""
    if isinstance(error, ModelKindError):
        if error.wanted == "embedding":
            return {"error": "this model does not support embeddings"}
        return {"error": f"{orjson.dumps(error.model).decode()} does not support {route}"}
    found = _NOT_FOUND.match(error.message) if error.code == "model_not_found" else None
    if found is not None:
        return {"error": f"model '{found.group(1)}' not found"}
    if isinstance(error, ContextLengthError):
        return {"error": _context_message(error)}
    field = schema_field(error)
    if field is not None and field not in error.message and error.code not in _OLLAMA_WORDS:
        return {"error": f"{field}: {error.message}"}
    return {"error": error.message}


def _context_message(error: ContextLengthError) -> str:
    """A prompt too long for its window, in the words of Ollama's MLX runner (which, as
    afmd, refuses it rather than cutting it), naming ``options.num_ctx`` when that is the
    window: the client's own setting is what to raise."""
    said = f"the input length ({error.prompt_tokens} tokens) exceeds"
    if error.param == CONTEXT_WINDOW_PARAM:
        return (f"options.num_ctx: {said} the context length options.num_ctx sets "
                f"({error.limit} tokens); shorten the input or raise options.num_ctx")
    return f"{said} the model's maximum context length ({error.limit} tokens)"


def _logprobs(tokens: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    return [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes),
             "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": list(a.bytes)}
                              for a in t.top]}
            for t in tokens]


def _arguments(text: str) -> dict[str, Any] | None:
    """A call's arguments as Ollama's object; None for a call the token limit cut short.

    Ollama has no way to say a call is unfinished (its arguments are an object, not text
    as OpenAI's), and its own parser only ever returns whole calls: a cut call sent as
    ``{}`` would have the client run the tool with no arguments. ``done_reason: "length"``
    says the turn was cut."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


class _Parts:
    """What some of a run's events add up to (one line's worth, or the whole answer)."""

    __slots__ = ("calls", "content", "finish", "profile", "thinking", "timings", "tokens",
                 "usage")

    def __init__(self) -> None:
        self.content: list[str] = []
        self.thinking: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.tokens: list[TokenLogprob] = []
        self.finish: Finish | None = None
        self.usage: Usage | None = None
        self.timings: Timings | None = None
        self.profile: dict[str, Any] | None = None

    def add(self, events: Sequence[Event]) -> None:
        for event in events:
            if isinstance(event, Choice):  # a generate's completion: its only choice
                self.add(event.events)
            elif isinstance(event, Content | Refusal):
                # Ollama's message has no refusal: the model's explanation is what it said.
                self.content.append(event.text)
            elif isinstance(event, Reasoning):
                self.thinking.append(event.text)
            elif isinstance(event, ToolCallEnd):
                call = event.call
                arguments = _arguments(call.arguments)
                if arguments is not None:
                    self.calls.append({"id": call.id, "function": {
                        "index": event.index, "name": call.name, "arguments": arguments}})
            elif isinstance(event, Logprobs):
                self.tokens.extend(event.tokens)
            elif isinstance(event, Finish):
                self.finish = event
            elif isinstance(event, Usage):
                self.usage = event
            elif isinstance(event, Timings):
                self.timings = event
            elif isinstance(event, Profile):
                self.profile = event.payload

    @property
    def shows(self) -> bool:
        return bool(self.content or self.thinking or self.calls or self.tokens)

    def end(self) -> dict[str, Any]:
        """The last object's own fields: why it ended, Ollama's counts and durations."""
        finish = self.finish or Finish("stop")
        usage = self.usage or Usage(0, 0)
        timings = self.timings or Timings(0.0, 0.0, 0.0, 0.0)
        out: dict[str, Any] = {
            "done": True,
            "done_reason": _REASONS.get(finish.reason, finish.reason),
            "total_duration": nanoseconds(timings.total),
            "load_duration": nanoseconds(timings.load),
            "prompt_eval_count": usage.prompt_tokens,
            "prompt_eval_duration": nanoseconds(timings.prompt),
            "eval_count": usage.completion_tokens,
            "eval_duration": nanoseconds(timings.generation),
        }
        if self.profile is not None:
            out.update(self.profile)
        return out


class OllamaReply:
    """One ``/api/chat`` or ``/api/generate`` answer, or its NDJSON stream."""

    media_type = MEDIA_TYPE

    __slots__ = ("chat", "logprobs", "model")

    def __init__(self, *, model: str, chat: bool, logprobs: bool) -> None:
        self.model = model
        self.chat = chat  # /api/chat's ``message`` (else /api/generate's ``response``)
        self.logprobs = logprobs

    def _object(self, parts: _Parts, *, done: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": created_at()}
        content, thinking = "".join(parts.content), "".join(parts.thinking)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if parts.calls:
                message["tool_calls"] = parts.calls
            out["message"] = message
        else:
            out["response"] = content
            if thinking:
                out["thinking"] = thinking
            if parts.calls:
                out["tool_calls"] = parts.calls
        if self.logprobs and parts.tokens:
            out["logprobs"] = _logprobs(parts.tokens)
        if done:
            out.update(parts.end())
            self._ended(out)
        else:
            out["done"] = False
        return out

    def _ended(self, out: dict[str, Any]) -> None:
        """What the last object adds besides the counts (see OllamaGenerateReply)."""

    def body(self, events: Sequence[Event]) -> bytes:
        parts = _Parts()
        parts.add(events)
        return orjson.dumps(self._object(parts, done=True))

    def stream_start(self) -> bytes:
        return b""

    def stream(self, events: Sequence[Event]) -> bytes:
        parts = _Parts()
        parts.add(events)
        if parts.usage is None:  # not the last batch
            return ndjson(self._object(parts, done=False)) if parts.shows else b""
        out = b""
        if parts.shows:  # the last text, then the end on a line of its own (as Ollama)
            last = _Parts()
            last.content, last.thinking, last.calls, last.tokens = (
                parts.content, parts.thinking, parts.calls, parts.tokens)
            out = ndjson(self._object(last, done=False))
            parts.content, parts.thinking, parts.calls, parts.tokens = [], [], [], []
        return out + ndjson(self._object(parts, done=True))

    def stream_end(self) -> bytes:
        return b""

    def stream_error(self, error: APIError) -> bytes:
        return ndjson(error_body(error, route="chat" if self.chat else "generate"))

    def stream_abandoned(self) -> None:
        pass  # nothing outlives the request


class OllamaGenerateReply(OllamaReply):
    """A templated ``/api/generate`` answer: its last object carries ``context``, the ids
    the model ran and wrote (:class:`~afmd.dialects.dialect.ReturnsTokens`), which the
    client sends back to go on with the conversation. A raw or fill-in-the-middle one
    has none, as in Ollama (a raw prompt is the client's own text to continue)."""

    __slots__ = ("_context",)

    def __init__(self, *, model: str, logprobs: bool) -> None:
        super().__init__(model=model, chat=False, logprobs=logprobs)
        self._context: list[int] | None = None

    def tokens_ran(self, tokens: list[int]) -> None:
        self._context = tokens

    def _ended(self, out: dict[str, Any]) -> None:
        if self._context is not None:
            out["context"] = self._context


class OllamaErrors:
    """Ollama's error envelope, for every ``/api/...`` route (and the gate's refusals of
    them): ``{"error": "..."}`` with afmd's status, but for a chat model asked for
    embeddings: Ollama's runner answers that 501, and its clients read the status."""

    name = "ollama"
    route = "generate"  # what Ollama's refusal of a model of another kind says was asked
    any_body_media_type = True  # see AnyBodyMediaType

    def error_status(self, error: APIError) -> tuple[int, Mapping[str, str]]:
        if isinstance(error, ModelKindError) and error.wanted == "embedding":
            return 501, error.headers
        return error.status, error.headers

    def error_envelope(self, error: APIError) -> dict[str, Any]:
        return error_body(error, route=self.route)

    def error_param(self, error: APIError) -> str | None:
        return schema_field(error) or error.param


class OllamaChat(OllamaErrors):
    """The ``/api/chat`` adapter."""

    name = "ollama_chat"
    route = "chat"

    def parse(self, raw: bytes, *, server_tools: Collection[str] = (),
              strict: bool = False) -> ChatRequest:
        return parse_chat(raw, server_tools=server_tools, strict=strict)

    def reply(self, request: ChatRequest, *, model: str, fingerprint: str) -> OllamaReply:
        return OllamaReply(model=model, chat=True, logprobs=request.logprobs is not None)


class OllamaGenerate(OllamaErrors):
    """The ``/api/generate`` adapter: a chat turn through the template, or a completion
    (``raw``, or fill-in-the-middle with ``suffix``)."""

    name = "ollama_generate"

    def parse(self, raw: bytes, *, server_tools: Collection[str] = (),
              strict: bool = False) -> ChatRequest | CompletionRequest:
        return parse_generate(raw, strict=strict)

    def reply(self, request: ChatRequest | CompletionRequest, *, model: str,
              fingerprint: str) -> OllamaReply:
        logprobs = request.logprobs is not None
        if isinstance(request, ChatRequest):  # through the template: it has a context
            return OllamaGenerateReply(model=model, logprobs=logprobs)
        return OllamaReply(model=model, chat=False, logprobs=logprobs)


OLLAMA = OllamaErrors()
OLLAMA_CHAT = OllamaChat()
OLLAMA_GENERATE = OllamaGenerate()


def load_answer(model: str, *, chat: bool, reason: str) -> bytes:
    """What a request that only loads or unloads its model is answered."""
    out: dict[str, Any] = {"model": model, "created_at": created_at()}
    if chat:
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    out.update({"done": True, "done_reason": reason})
    return orjson.dumps(out)

