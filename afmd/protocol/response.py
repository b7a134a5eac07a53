"""OpenAI response objects and their SSE encoding.

Every chunk of a stream repeats the same ``id``, ``object``, ``created``, ``model`` and
``system_fingerprint``; encoding them once per stream and splicing only the delta per chunk
keeps per-token work to one small orjson call.
"""

from __future__ import annotations

import secrets
import string
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"
_ALPHANUM = string.ascii_letters + string.digits


def _alphanumerics(n: int) -> str:
    # One getrandom() for the whole id, not one per character (secrets.choice).
    return "".join(_ALPHANUM[b % 62] for b in secrets.token_bytes(n))


def new_completion_id() -> str:
    return "chatcmpl-" + _alphanumerics(29)


def new_request_id() -> str:
    return "req_" + secrets.token_hex(16)


def new_tool_call_id() -> str:
    return "call_" + _alphanumerics(24)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": self.reasoning_tokens,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        }


def sse(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


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

    def __init__(self, completion_id: str, created: int, model: str, fingerprint: str) -> None:
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
        self._head = b"data: " + common[:-1] + b',"choices":[{"index":0,"delta":'
        self._tail_open = b',"logprobs":null,"finish_reason":null}]}\n\n'
        self._tail_finish = b',"logprobs":null,"finish_reason":'

    def delta(self, delta: Mapping[str, Any]) -> bytes:
        return self._head + orjson.dumps(delta) + self._tail_open

    def content(self, text: str) -> bytes:
        return self._head + b'{"content":' + orjson.dumps(text) + b"}" + self._tail_open

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
                "usage": usage.as_dict(),
            }
        )


def error_event(envelope: Mapping[str, Any]) -> bytes:
    return sse(envelope)


def completion_object(
    *,
    completion_id: str,
    created: int,
    model: str,
    fingerprint: str,
    message: Mapping[str, Any],
    finish_reason: str,
    usage: Usage,
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": [
            {
                "index": 0,
                "message": dict(message),
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage.as_dict(),
    }


def assistant_message(
    content: str | None,
    *,
    reasoning: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": [],
    }
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def now() -> int:
    return int(time.time())
