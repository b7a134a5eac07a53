"""Apple's own framework behind ``system``: runs on macOS 26+ with Apple Intelligence on and
apple-fm-sdk installed (``pip install -e '.[test,system]'``), and is skipped elsewhere,
saying why. Everything else about ``system`` is tested here against the stand-in
(tests/server/test_system_model.py), which cannot show what Apple's model itself does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from openai import OpenAI

from afmd.engine.apple import framework

from helpers.system_model import SystemServer

_FOUND = framework.availability()
_SDK = framework.sdk()
if _SDK is None or "fm_standin" in str(getattr(_SDK, "__file__", "")) \
        or _FOUND.reason is not None:
    pytest.skip(f"needs Apple's Foundation Models framework (macOS 26+ on Apple silicon, "
                f"Apple Intelligence on, apple-fm-sdk installed): here {_FOUND.status} "
                f"({_FOUND.detail})", allow_module_level=True)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def client() -> Iterator[OpenAI]:
    server = SystemServer()
    yield OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    server.stop()


def test_it_answers(client: OpenAI) -> None:
    completion = client.chat.completions.create(
        model="system", temperature=0, max_tokens=30,
        messages=[{"role": "user", "content": "Say hello in one word."}])
    assert completion.choices[0].message.content
    assert completion.usage.prompt_tokens > 0 and completion.usage.completion_tokens > 0


def test_a_required_tool_call_comes_back(client: OpenAI) -> None:
    completion = client.chat.completions.create(
        model="system", tools=[WEATHER], tool_choice="required",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    (call,) = completion.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments).get("city"), str)


def test_a_json_schema_answer_matches(client: OpenAI) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    completion = client.chat.completions.create(
        model="system", messages=[{"role": "user", "content": "Invent a person."}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    value = json.loads(completion.choices[0].message.content)
    assert set(value) == {"name", "age"}


def test_it_streams(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model="system", stream=True, max_tokens=60,
        messages=[{"role": "user", "content": "Count from one to ten in words."}])
    deltas = [c.choices[0].delta.content for c in stream if c.choices and
              c.choices[0].delta.content]
    assert len(deltas) > 1
