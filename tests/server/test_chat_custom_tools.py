"""Chat Completions' ``custom`` tools (free-form text, a grammar enforced) through the
official ``openai`` client, on the real server and the demo model: offered, forced by every
kind of ``tool_choice``, answered as ``custom`` calls (whole and streamed), and sent back
in the history. They were a 400 ``tools[0].type``."""

from __future__ import annotations

import re
from typing import Any

import openai
import pytest

from conftest import parse_sse

MESSAGES = [{"role": "user", "content": "Name a word."}]
PATTERN = "[a-z]{1,5}"
TOOL = {"type": "custom", "custom": {"name": "word", "description": "A short word.",
                                     "format": {"type": "grammar", "grammar": {
                                         "syntax": "regex", "definition": PATTERN}}}}
FUNCTION = {"type": "function", "function": {"name": "other", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


def _ask(client: Any, tool_choice: Any, **extra: Any) -> Any:
    return client.chat.completions.create(
        model="demo", messages=MESSAGES, tools=[TOOL, FUNCTION], tool_choice=tool_choice,
        max_tokens=200, reasoning_effort="none", seed=3, parallel_tool_calls=False, **extra)


@pytest.mark.parametrize("tool_choice", [
    "required",
    {"type": "custom", "custom": {"name": "word"}},
    {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "custom", "custom": {"name": "word"}}]}},
], ids=["required", "named", "allowed_tools"])
def test_a_custom_call_is_its_text(client: Any, tool_choice: Any) -> None:
    reply = _ask(client, tool_choice)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    if not isinstance(tool_choice, str):
        assert [call.type for call in calls] == ["custom"]
    call = calls[0]
    if call.type == "custom":
        assert call.custom.name == "word"
        assert re.fullmatch(PATTERN, call.custom.input)
        assert call.id.startswith("call_")


def test_a_streamed_custom_call_comes_whole(client: Any, http: Any) -> None:
    response = http.post("/v1/chat/completions", json={
        "model": "demo", "messages": MESSAGES, "tools": [TOOL], "stream": True,
        "tool_choice": {"type": "custom", "custom": {"name": "word"}}, "max_tokens": 200,
        "reasoning_effort": "none", "seed": 3, "parallel_tool_calls": False})
    assert response.status_code == 200
    deltas = [call for chunk in parse_sse(response.text) if chunk != "[DONE]"
              for choice in chunk["choices"] for call in choice["delta"].get("tool_calls", [])]
    assert len(deltas) == 1
    (delta,) = deltas
    assert delta["index"] == 0 and delta["type"] == "custom"
    assert delta["custom"]["name"] == "word"
    assert re.fullmatch(PATTERN, delta["custom"]["input"])
    whole = _ask(client, {"type": "custom", "custom": {"name": "word"}})
    assert whole.choices[0].message.tool_calls[0].custom.input == delta["custom"]["input"]


def test_a_custom_call_goes_back_in_the_history(client: Any) -> None:
    call = _ask(client, {"type": "custom", "custom": {"name": "word"}}).choices[0] \
        .message.tool_calls[0]
    history = [*MESSAGES, {"role": "assistant", "content": None,
                           "tool_calls": [call.model_dump(exclude_none=True)]},
               {"role": "tool", "tool_call_id": call.id, "content": "ok"}]
    reply = client.chat.completions.create(model="demo", messages=history, tools=[TOOL],
                                           max_tokens=8, reasoning_effort="none")
    assert reply.choices[0].finish_reason in ("length", "stop", "tool_calls")


@pytest.mark.parametrize(("tool", "param"), [
    ({"type": "custom"}, "tools[0].custom"),
    ({"type": "custom", "custom": {"name": "w", "format": {"type": "grammar", "grammar": {
        "syntax": "regex", "definition": "("}}}}, "tools[0].custom.format.grammar.definition"),
    ({"type": "custom", "custom": {"name": "w", "format": {"type": "grammar", "grammar": {
        "syntax": "ebnf", "definition": "a"}}}}, "tools[0].custom.format.grammar.syntax"),
    ({"type": "custom", "custom": {"name": "w", "format": {"type": "json"}}},
     "tools[0].custom.format.type"),
], ids=["no-custom", "bad-regex", "bad-syntax", "bad-format"])
def test_a_bad_custom_tool_is_named(client: Any, tool: Any, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", messages=MESSAGES, tools=[tool],
                                       max_tokens=8)
    assert caught.value.body["param"] == param


@pytest.mark.parametrize("tools", [[TOOL, FUNCTION], [FUNCTION]], ids=["both", "functions"])
def test_a_custom_choice_names_a_custom_tool(client: Any, tools: list[Any]) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="demo", messages=MESSAGES, tools=tools, max_tokens=8,
            tool_choice={"type": "custom", "custom": {"name": "other"}})
    assert caught.value.body["param"] == "tool_choice.custom.name"
    assert caught.value.body["code"] == "unknown_tool"
