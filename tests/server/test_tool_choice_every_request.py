"""``tool_choice`` binds the first step of every request, also after tool results.

OpenAI enforces ``required`` and a named function on every request; a request whose
history ends in tool results starts with a first step like any other. End to end with the
official client against the real server and the demo model, sampled (temperature 1.0)
over several seeds: every response is a valid call. (afmd's own rounds after server tools
ran are free; see tests/server/test_server_tools.py.)
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest

from helpers.openai_schemas import validate_response

LOOKUP = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                   "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": LOOKUP, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}}
         for name, schema in SCHEMAS.items()]

# A conversation whose last step was a tool's result (and, for parallel calls, two).
ONE_RESULT = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_w", "type": "function",
         "function": {"name": "get_weather",
                      "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_w", "content": "22 degrees, sunny"},
]
TWO_RESULTS = [
    {"role": "user", "content": "Weather in Paris, and 2+3?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_w", "type": "function",
         "function": {"name": "get_weather",
                      "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        {"id": "call_a", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_w", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_a", "content": "5"},
]
SEEDS = range(8)
NAMED_ADD = {"type": "function", "function": {"name": "add"}}


def check_all_calls(completions: list[Any], names: tuple[str, ...]) -> None:
    for completion in completions:
        validate_response(completion.model_dump(exclude_unset=True))
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        calls = choice.message.tool_calls
        assert calls and len(calls) == 1
        assert calls[0].function.name in names
        jsonschema.validate(json.loads(calls[0].function.arguments),
                            SCHEMAS[calls[0].function.name])


@pytest.mark.parametrize("history", [ONE_RESULT, TWO_RESULTS], ids=["one", "parallel"])
@pytest.mark.parametrize(
    ("choice", "names"),
    [("required", ("get_weather", "add")), (NAMED_ADD, ("add",))],
    ids=["required", "named"],
)
def test_a_request_after_tool_results_still_obeys_tool_choice(
    client, history: list[dict[str, Any]], choice: Any, names: tuple[str, ...]
) -> None:
    def one(seed: int) -> Any:
        return client.chat.completions.create(
            model="demo", messages=history, tools=TOOLS, tool_choice=choice,
            parallel_tool_calls=False, reasoning_effort="none", temperature=1.0,
            max_tokens=200, seed=seed,
        )

    with ThreadPoolExecutor(4) as pool:
        check_all_calls(list(pool.map(one, SEEDS)), names)


def test_a_streamed_request_after_a_tool_result_still_obeys_tool_choice(client) -> None:
    for seed in SEEDS[:3]:
        stream = client.chat.completions.create(
            model="demo", messages=ONE_RESULT, tools=TOOLS, tool_choice=NAMED_ADD,
            parallel_tool_calls=False, reasoning_effort="none", temperature=1.0,
            max_tokens=200, seed=seed, stream=True,
        )
        content, arguments, names, finish = "", "", [], []
        for chunk in stream:
            for choice in chunk.choices:
                delta = choice.delta
                content += delta.content or ""
                for call in delta.tool_calls or []:
                    if call.function and call.function.name:
                        names.append(call.function.name)
                    arguments += (call.function.arguments or "") if call.function else ""
                if choice.finish_reason:
                    finish.append(choice.finish_reason)
        assert (content, names, finish) == ("", ["add"], ["tool_calls"])
        jsonschema.validate(json.loads(arguments), ADD)


def test_auto_after_a_tool_result_may_answer_in_text(client) -> None:
    completion = client.chat.completions.create(
        model="demo", messages=ONE_RESULT, tools=TOOLS, tool_choice="auto",
        reasoning_effort="none", temperature=0, max_tokens=20, seed=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.tool_calls is None and choice.message.content
