"""What the Anthropic Messages tests share: tools, a prompt, and the SSE reader."""

from __future__ import annotations

import json
from typing import Any

from anthropic.types import Message, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from pydantic import TypeAdapter

MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and what is 2+3?"}]

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 999},
        "b": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
# String properties carry maxLength and integers bounds so that the demo model's calls
# stay short (its random weights otherwise write until max_tokens).
TOOLS = [
    {"name": "get_weather", "description": "Current weather in a city.",
     "input_schema": WEATHER},
    {"name": "add", "description": "Add two integers.", "input_schema": ADD},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
#: A prompt the demo model answers at length when greedy (for runs that must last).
STORY = {"system": "You are terse.",
         "messages": [{"role": "user", "content": "Tell me a long story."}],
         "temperature": 0}
STORY_CHAT = {"messages": [{"role": "system", "content": "You are terse."},
                           {"role": "user", "content": "Tell me a long story."}],
              "temperature": 0}
#: Seeds with which the demo model thinks before its forced calls (and one it does not).
THINKS = (0, 11)
NO_THINKING = 3


_EVENTS: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
#: afmd's own events (the SDK skips them) and the one it ends a cancelled run with.
AFMD_EVENTS = ("afm_profile", "afm_profile_extended")
AFMD_STOP_REASONS = ("cancelled",)


def validate_message(obj: dict[str, Any]) -> None:
    """Valid as the SDK's own types say (which it does not check itself)."""
    if obj.get("stop_reason") in AFMD_STOP_REASONS:
        obj = {**obj, "stop_reason": "end_turn"}
    Message.model_validate(obj)


def validate_event(name: str, data: dict[str, Any]) -> None:
    if name == "error":
        if data["error"]["type"] != "request_too_large":  # Anthropic's; the SDK lacks it
            ErrorResponse.model_validate(data)
    elif name == "message_start":
        validate_message(data["message"])
    elif name == "message_delta" and data["delta"]["stop_reason"] in AFMD_STOP_REASONS:
        _EVENTS.validate_python({**data, "delta": {**data["delta"], "stop_reason": "end_turn"}})
    elif name != "ping" and name not in AFMD_EVENTS:
        _EVENTS.validate_python(data)


def parse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """An Anthropic SSE body as (event name, data) pairs, each valid as the SDK's types
    say; the name must be the data's ``type``, as Anthropic's are."""
    out: list[tuple[str, dict[str, Any]]] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        lines = block.split("\n")
        assert len(lines) == 2, block
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        name, data = lines[0][len("event: "):], json.loads(lines[1][len("data: "):])
        assert data["type"] == name, block
        validate_event(name, data)
        out.append((name, data))
    return out


def error_of(response: Any) -> tuple[str, str]:
    """The type and message of an Anthropic error response, checked for its shape."""
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    # ``details`` only where Anthropic's machine-readable error_code is afmd's too.
    assert set(body["error"]) - {"details"} == {"type", "message"}, body
    assert set(body["error"].get("details", {"error_code": ""})) == {"error_code"}, body
    validate_event("error", body)
    return body["error"]["type"], body["error"]["message"]
