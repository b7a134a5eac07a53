"""OpenAI's (legacy) Completions on the wire: ``text_completion`` objects and chunks.

A streamed and a non-streamed response share one shape here (unlike chat): a stream sends
one chunk per choice that progressed in a batch, its ``text`` the new text, its
``logprobs`` the tokens of that text, ``finish_reason`` null until its last chunk; then
the usage chunk (``choices: []``) when asked, and ``data: [DONE]``.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from afmd.core.events import (
    Choice,
    Content,
    Event,
    Finish,
    Logprobs,
    Profile,
    TokenLogprob,
    Usage,
    profile_payload,
)
from afmd.core.ids import alphanumerics
from afmd.core.request import CompletionRequest
from afmd.dialects.fields.body import parse_json_body
from afmd.dialects.openai.chat import DONE, sse
from afmd.dialects.openai.completions_body import parse_completion_request
from afmd.errors import APIError


def new_completion_id() -> str:
    return "cmpl-" + alphanumerics(29)


def usage_object(usage: Usage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens, "audio_tokens": 0},
    }
    if usage.accepted_prediction_tokens or usage.rejected_prediction_tokens:
        # Only when the request sent a prediction: the details are chat's otherwise.
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": usage.accepted_prediction_tokens,
            "rejected_prediction_tokens": usage.rejected_prediction_tokens,
        }
    return out


@dataclass(slots=True)
class _ChoiceParts:
    """What one choice's events add up to (a whole choice, or one chunk of it)."""

    text: list[str] = field(default_factory=list)
    tokens: list[TokenLogprob] = field(default_factory=list)
    finish: str | None = None

    def add(self, events: Iterable[Event]) -> None:
        for event in events:
            if isinstance(event, Content):
                self.text.append(event.text)
            elif isinstance(event, Logprobs):
                self.tokens.extend(event.tokens)
            elif isinstance(event, Finish):
                self.finish = event.reason

    def choice(self, index: int, *, logprobs: bool) -> dict[str, Any]:
        return {
            "text": "".join(self.text),
            "index": index,
            "logprobs": _logprobs(self.tokens) if logprobs else None,
            "finish_reason": self.finish,
        }


def _logprobs(tokens: Sequence[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's parallel arrays; a position's alternatives include the chosen token."""
    top: list[dict[str, float] | None] = []
    for t in tokens:
        if t.logprob is None:  # an echoed prompt's first token
            top.append(None)
            continue
        alternatives = {a.token: a.logprob for a in t.top}
        alternatives.setdefault(t.token, t.logprob)
        top.append(alternatives)
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": top,
        "text_offset": [t.offset for t in tokens],
    }


class CompletionReply:
    """One ``text_completion`` response or its stream of chunks."""

    __slots__ = ("_head", "completion_id", "created", "fingerprint", "include_usage",
                 "logprobs", "model", "prompts")

    def __init__(self, *, model: str, fingerprint: str, include_usage: bool, logprobs: bool,
                 prompts: int) -> None:
        self.completion_id = new_completion_id()
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.prompts = prompts
        common = orjson.dumps(self._common())
        self._head = b"data: " + common[:-1] + b',"choices":['

    def _common(self) -> dict[str, Any]:
        return {
            "id": self.completion_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }

    def body(self, events: Sequence[Event]) -> bytes:
        parts = [_ChoiceParts() for _ in range(self.prompts)]
        usage = Usage(0, 0)
        for event in events:
            if isinstance(event, Choice):
                parts[event.index].add(event.events)
            elif isinstance(event, Usage):
                usage = event
        return orjson.dumps({
            **self._common(),
            "choices": [p.choice(i, logprobs=self.logprobs) for i, p in enumerate(parts)],
            "usage": usage_object(usage),
            **profile_payload(events),
        })

    def stream_start(self) -> bytes:
        return b""

    def stream(self, events: Sequence[Event]) -> bytes:
        out: list[bytes] = []
        for event in events:
            if isinstance(event, Choice):
                parts = _ChoiceParts()
                parts.add(event.events)
                choice = parts.choice(event.index, logprobs=self.logprobs)
                out.append(self._head + orjson.dumps(choice) + b"]}\n\n")
            elif isinstance(event, Usage):
                if self.include_usage:
                    out.append(sse({**self._common(), "choices": [],
                                    "usage": usage_object(event)}))
            elif isinstance(event, Profile):
                out.append(sse(event.payload))
        return b"".join(out)

    def stream_end(self) -> bytes:
        return DONE

    def stream_error(self, error: APIError) -> bytes:
        return sse(error.envelope()) + DONE

    def stream_abandoned(self) -> None:
        pass  # nothing outlives the request


class OpenAICompletions:
    """The ``/v1/completions`` adapter."""

    name = "openai_completions"

    def parse(self, raw: bytes, *, server_tools: Collection[str] = (),
              strict: bool = False) -> CompletionRequest:
        return parse_completion_request(parse_json_body(raw), strict=strict)

    def reply(
        self, request: CompletionRequest, *, model: str, fingerprint: str
    ) -> CompletionReply:
        return CompletionReply(model=model, fingerprint=fingerprint,
                               include_usage=request.include_usage,
                               logprobs=request.logprobs is not None,
                               prompts=len(request.prompts) * request.n)

    def error_envelope(self, error: APIError) -> dict[str, Any]:
        return error.envelope()


OPENAI_COMPLETIONS = OpenAICompletions()
