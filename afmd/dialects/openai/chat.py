"""OpenAI Chat Completions on the wire: its body in, its JSON and SSE out, its errors.

Every chunk of a stream repeats the same ``id``, ``object``, ``created``, ``model`` and
``system_fingerprint``; encoding them once per stream and splicing only the delta per chunk
keeps per-token work to one small orjson call.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
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
    TokenLogprob,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
    Usage,
    profile_payload,
)
from afmd.core.ids import alphanumerics
from afmd.core.request import ChatRequest
from afmd.dialects.fields.body import parse_json_body
from afmd.dialects.openai.chat_body import parse_chat_request
from afmd.dialects.openai.custom_tools import custom_call, custom_tool_parameters
from afmd.errors import APIError

DONE = b"data: [DONE]\n\n"


def new_completion_id() -> str:
    return "chatcmpl-" + alphanumerics(29)


def sse(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def usage_object(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": usage.reasoning_tokens,
            "audio_tokens": 0,
            "accepted_prediction_tokens": usage.accepted_prediction_tokens,
            "rejected_prediction_tokens": usage.rejected_prediction_tokens,
        },
    }


class ChunkEncoder:
    """Encodes the chunks of one stream."""

    __slots__ = (
        "_head",
        "_tail_finish",
        "_tail_open",
        "completion_id",
        "created",
        "fingerprint",
        "model",
    )

    def __init__(self, completion_id: str, created: int, model: str, fingerprint: str,
                 index: int = 0) -> None:
        self.completion_id = completion_id
        self.created = created
        self.model = model
        self.fingerprint = fingerprint
        common = orjson.dumps(
            {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "system_fingerprint": fingerprint,
            }
        )
        # `{...common...,"choices":[{"index":0,"delta":` + delta + tail
        self._head = (b"data: " + common[:-1] + b',"choices":[{"index":'
                      + str(index).encode() + b',"delta":')
        self._tail_open = b',"logprobs":null,"finish_reason":null}]}\n\n'
        self._tail_finish = b',"logprobs":null,"finish_reason":'

    def delta(self, delta: Mapping[str, Any]) -> bytes:
        return self._head + orjson.dumps(delta) + self._tail_open

    def with_logprobs(self, delta: bytes, tokens: Sequence[TokenLogprob]) -> bytes:
        """A chunk whose delta (encoded) came from ``tokens``."""
        return (self._head + delta + b',"logprobs":' + orjson.dumps(logprobs_object(tokens))
                + b',"finish_reason":null}]}\n\n')

    def content(self, text: str) -> bytes:
        return self._head + b'{"content":' + orjson.dumps(text) + b"}" + self._tail_open

    def reasoning(self, text: str) -> bytes:
        return self._head + b'{"reasoning_content":' + orjson.dumps(text) + b"}" + self._tail_open

    def role(self) -> bytes:
        return self._head + b'{"role":"assistant","content":""}' + self._tail_open

    def finish(self, reason: str) -> bytes:
        return self._head + b"{}" + self._tail_finish + orjson.dumps(reason) + b"}]}\n\n"

    def usage(self, usage: Usage) -> bytes:
        return sse(
            {
                "id": self.completion_id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "system_fingerprint": self.fingerprint,
                "choices": [],
                "usage": usage_object(usage),
            }
        )


def logprobs_object(tokens: Sequence[TokenLogprob]) -> dict[str, Any]:
    """``choices[].logprobs``: the tokens, each with its bytes and top alternatives."""
    return {
        "content": [
            {
                "token": t.token,
                "logprob": t.logprob,
                "bytes": list(t.bytes),
                "top_logprobs": [
                    {"token": a.token, "logprob": a.logprob, "bytes": list(a.bytes)}
                    for a in t.top
                ],
            }
            for t in tokens
        ],
        "refusal": None,
    }


def _call_start(event: ToolCallStart) -> dict[str, Any]:
    return {"tool_calls": [{
        "index": event.index,
        "id": event.id,
        "type": "function",
        "function": {"name": event.name, "arguments": event.arguments},
    }]}


def _call_arguments(event: ToolCallArguments) -> dict[str, Any]:
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.fragment}}]}


def assistant_message(
    content: str | None,
    *,
    reasoning: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    refusal: str | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "refusal": refusal,
        "annotations": [],
    }
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def _choice_object(index: int, events: Sequence[Event], *, logprobs: bool,
                   custom: frozenset[str]) -> dict[str, Any]:
    """One choice of a ``chat.completion`` from its events (``custom``: the names of custom
    tools, whose calls are their text)."""
    content: list[str] = []
    reasoning: list[str] = []
    refusal: list[str] = []
    calls: list[dict[str, Any]] = []
    tokens: list[TokenLogprob] = []
    reason = "stop"
    for event in events:
        if isinstance(event, Content):
            content.append(event.text)
        elif isinstance(event, Reasoning):
            reasoning.append(event.text)
        elif isinstance(event, Refusal):
            refusal.append(event.text)
        elif isinstance(event, ToolCallEnd):
            c = event.call
            calls.append(custom_call(c.id, c.name, c.arguments) if c.name in custom else
                         {"id": c.id, "type": "function",
                          "function": {"name": c.name, "arguments": c.arguments}})
        elif isinstance(event, Finish):
            reason = event.reason
        elif isinstance(event, Logprobs):
            tokens.extend(event.tokens)
    text = "".join(content)
    message = assistant_message(
        text if text or not (calls or refusal) else None,
        reasoning="".join(reasoning) or None,
        tool_calls=calls or None,
        refusal="".join(refusal) or None,
    )
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs_object(tokens) if logprobs else None,
        "finish_reason": reason,
    }


class ChatCompletionReply:
    """One chat completion (``chat.completion``) or its stream of chunks; with ``n``
    choices, the run's events come in :class:`~afmd.core.events.Choice` envelopes and each
    choice's chunks carry its ``index``."""

    __slots__ = ("_chunks", "_held", "completion_id", "created", "custom", "fingerprint",
                 "include_usage", "logprobs", "model", "n")

    def __init__(self, *, model: str, fingerprint: str, include_usage: bool,
                 logprobs: bool = False, n: int = 1,
                 custom: frozenset[str] = frozenset()) -> None:
        self.logprobs = logprobs  # the client asked for them
        self.completion_id = new_completion_id()
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint
        self.include_usage = include_usage
        self.n = n
        #: The names of custom tools: their calls are sent as their text, whole, at the end.
        self.custom = custom
        self._chunks: list[ChunkEncoder] = []
        self._held: list[set[int]] = []  # per choice: the custom calls being written

    def body(self, events: Sequence[Event]) -> bytes:
        usage = next((e for e in events if isinstance(e, Usage)), Usage(0, 0))
        if self.n == 1:
            choices = [_choice_object(0, events, logprobs=self.logprobs, custom=self.custom)]
        else:
            per: list[list[Event]] = [[] for _ in range(self.n)]
            for event in events:
                if isinstance(event, Choice):
                    per[event.index].extend(event.events)
            choices = [_choice_object(i, e, logprobs=self.logprobs, custom=self.custom)
                       for i, e in enumerate(per)]
        return orjson.dumps({
            "id": self.completion_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
            "usage": usage_object(usage),
            **profile_payload(events),
        })

    def stream_start(self) -> bytes:
        self._chunks = [ChunkEncoder(self.completion_id, self.created, self.model,
                                     self.fingerprint, i) for i in range(self.n)]
        self._held = [set() for _ in range(self.n)]
        return b"".join(chunks.role() for chunks in self._chunks)

    def stream(self, events: Sequence[Event]) -> bytes:
        assert self._chunks, "stream_start() comes first"
        out: list[bytes] = []
        run: list[Event] = []  # a single choice's events, not in an envelope
        for event in events:
            if not isinstance(event, Choice | Usage | Profile):
                run.append(event)
                continue
            if run:
                self._encode(0, run, out)
                run = []
            if isinstance(event, Choice):
                self._encode(event.index, event.events, out)
            elif isinstance(event, Usage):
                if self.include_usage:
                    out.append(self._chunks[0].usage(event))
            else:
                out.append(sse(event.payload))
        if run:
            self._encode(0, run, out)
        return b"".join(out)

    def _encode(self, choice: int, events: Sequence[Event], out: list[bytes]) -> None:
        """One choice's events as its chunks (usage and profile are the stream's)."""
        chunks, held = self._chunks[choice], self._held[choice]
        last: bytes | None = None  # the delta of the batch's last text chunk, if it is last
        for event in events:
            if isinstance(event, Logprobs):
                # With the text its tokens made: the last text chunk of this batch.
                if last is not None:
                    out[-1] = chunks.with_logprobs(last, event.tokens)
                else:
                    out.append(chunks.with_logprobs(b"{}", event.tokens))
                last = None
                continue
            last = None
            if isinstance(event, Content):
                last = b'{"content":' + orjson.dumps(event.text) + b"}"
                out.append(chunks.content(event.text))
            elif isinstance(event, Reasoning):
                last = b'{"reasoning_content":' + orjson.dumps(event.text) + b"}"
                out.append(chunks.reasoning(event.text))
            elif isinstance(event, Refusal):
                out.append(chunks.delta({"refusal": event.text}))
            elif isinstance(event, ToolCallStart):
                if event.name in self.custom:
                    held.add(event.index)  # its text is JSON until the call ends
                else:
                    out.append(chunks.delta(_call_start(event)))
            elif isinstance(event, ToolCallArguments):
                if event.index not in held:
                    out.append(chunks.delta(_call_arguments(event)))
            elif isinstance(event, ToolCallEnd):
                if event.index in held:
                    c = event.call
                    out.append(chunks.delta({"tool_calls": [
                        {"index": event.index, **custom_call(c.id, c.name, c.arguments)}]}))
            elif isinstance(event, Finish):
                out.append(chunks.finish(event.reason))
            # A function call's last delta already completed it in this dialect; usage
            # and the profile are the stream's own (see stream()).

    def stream_end(self) -> bytes:
        return DONE

    def stream_error(self, error: APIError) -> bytes:
        return sse(error.envelope()) + DONE

    def stream_abandoned(self) -> None:
        pass  # nothing outlives the request


class OpenAIChat:
    """The ``/v1/chat/completions`` adapter."""

    name = "openai_chat"

    def parse(self, raw: bytes, *, server_tools: Collection[str] = (),
              strict: bool = False) -> ChatRequest:
        return parse_chat_request(parse_json_body(raw), server_tools=server_tools,
                                  strict=strict, custom=custom_tool_parameters)

    def reply(
        self, request: ChatRequest, *, model: str, fingerprint: str
    ) -> ChatCompletionReply:
        return ChatCompletionReply(model=model, fingerprint=fingerprint,
                                   include_usage=request.include_usage,
                                   logprobs=request.logprobs is not None, n=request.n,
                                   custom=frozenset(t.name for t in request.tools if t.custom))

    def error_envelope(self, error: APIError) -> dict[str, Any]:
        return error.envelope()


OPENAI_CHAT = OpenAIChat()
