"""Apple's on-device model (``system``) end to end, against the SDK stand-in.

A real afmd server (in this process, on its own loop) serves ``system`` through the stand-in
``apple_fm_sdk`` (tests/helpers/fm_standin: the SDK's API and threading, a scripted model:
``!say``, ``!call``, ``!echo``, … in the prompt). Each test is one row of the mapping the
issue lists, or one of the framework's errors, seen through the official clients or the
wire; ``!echo`` answers with what the framework was given, so the mapping is checked where
it lands. The real framework's tests are tests/server/test_system_framework.py (macOS only).
"""

from __future__ import annotations

import base64
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from openai import OpenAI

from conftest import parse_sse
from helpers.openai_schemas import validate_chunk, validate_error, validate_response
from helpers.system_model import SystemServer, set_availability, standin

CHAT = "/v1/chat/completions"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["utc", "local"]}}, "required": ["zone"]}}}
CALL_ID = re.compile(r"call_[A-Za-z0-9]{24}")
TOOLS_PY = '''
def add(a, b):
    return {"sum": a + b}
'''


@pytest.fixture(scope="module")
def native() -> Iterator[ModuleType]:
    with standin() as module:
        yield module


@pytest.fixture(scope="module")
def server(native: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemServer]:
    tmp = tmp_path_factory.mktemp("system")
    (tmp / "tools.py").write_text(TOOLS_PY)
    config = f'''
[server]
instructions = "Operator rules."
[queue]
max_concurrent_requests = 2
[models.aliases]
"gpt-4o-mini" = "system"
[system]
# Parallel calls reach afmd from threads a loaded test machine may start late: a window
# wider than the default 40 ms, so that the three of a test are collected every time.
tool_call_debounce = 0.3
[tools]
max_calls = 3
[[tools.server]]
name = "add"
description = "Adds two integers."
parameters.type = "object"
parameters.properties.a.type = "integer"
parameters.properties.b.type = "integer"
parameters.required = ["a", "b"]
python = "{tmp / 'tools.py'}:add"
'''
    running = SystemServer(config, tmp)
    yield running
    running.stop()


@pytest.fixture(autouse=True)
def fresh(native: ModuleType) -> Iterator[None]:
    native.STATE.log.clear()
    native.STATE.images_supported = True
    native.STATE.context_size = 4096
    set_availability(native, None)
    yield


@pytest.fixture(scope="module")
def client(server: SystemServer) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server: SystemServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def echo(http: httpx.Client, **body: Any) -> dict[str, Any]:
    """What the framework was given, as the stand-in's ``!echo`` answers it."""
    response = http.post(CHAT, json={"messages": user("!echo"), **body})
    assert response.status_code == 200, response.text
    return json.loads(response.json()["choices"][0]["message"]["content"])


def chat(http: httpx.Client, **body: Any) -> httpx.Response:
    return http.post(CHAT, json=body)


# -- what the request maps onto ------------------------------------------------------


def test_system_and_developer_messages_are_the_instructions_wherever_they_stand(
        http: httpx.Client) -> None:
    seen = echo(http, messages=[
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "!echo"},
    ])
    assert seen["instructions"] == "Operator rules.\n\nBe terse.\n\nAnswer in French."
    assert [e["role"] for e in seen["entries"]] == ["user", "response"]
    assert seen["prompt"] == "!echo"


def test_user_turns_are_the_prompt_and_earlier_turns_the_transcript(http: httpx.Client) -> None:
    seen = echo(http, messages=[
        {"role": "user", "content": "one"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "three"},
        {"role": "user", "content": "four"},
        {"role": "user", "content": "!echo"},
    ])
    entries = seen["entries"]
    assert [(e["role"], e["contents"][0]["text"]) for e in entries] == [
        ("user", "one\n\ntwo"), ("response", "three")]
    assert all(e["id"] and e["contents"][0]["id"] for e in entries)
    assert seen["prompt"] == "four\n\n!echo"


def test_data_images_are_attachments_of_the_prompt(http: httpx.Client, native: ModuleType) -> None:
    png = base64.b64decode(
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5ErkJggg==")
    content = [{"type": "text", "text": "!echo"},
               {"type": "image_url", "image_url": {
                   "url": "data:image/png;base64," + base64.b64encode(png).decode()}}]
    seen = echo(http, messages=[{"role": "user", "content": content}])
    assert seen["images"] == [len(png)] and seen["prompt"] == "!echo"

    native.STATE.images_supported = False  # macOS 26 takes no images (macOS 27 does)
    refused = chat(http, messages=[{"role": "user", "content": content}])
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "image_input_not_supported"
    assert error["param"] == "messages[0].content[1].image_url"


def test_an_image_the_os_cannot_take_is_refused_when_streamed_too(
        server: SystemServer, native: ModuleType) -> None:
    """The SDK's stream composes its prompt on a thread of its own, where the image's
    error is lost and the stream waits for ever: afmd composes the prompt first."""
    png = base64.b64decode(
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5ErkJggg==")
    native.STATE.images_supported = False
    content = [{"type": "text", "text": "Describe it."},
               {"type": "image_url", "image_url": {
                   "url": "data:image/png;base64," + base64.b64encode(png).decode()}}]
    with httpx.Client(base_url=server.url, timeout=10) as quick:
        refused = quick.post(CHAT, json={"messages": [{"role": "user", "content": content}],
                                         "stream": True})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "image_input_not_supported"


def test_tool_history_is_the_transcript_and_a_last_tool_message_continues(
        http: httpx.Client, native: ModuleType) -> None:
    messages = [
        {"role": "user", "content": "weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_AAA", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_BBB", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        # Sent out of order: afmd puts outputs in the calls' order.
        {"role": "tool", "tool_call_id": "call_BBB", "content": "rainy"},
        {"role": "tool", "tool_call_id": "call_AAA", "content": "sunny"},
    ]
    response = chat(http, messages=messages, tools=[WEATHER])
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == \
        "get_weather said sunny; get_weather said rainy"
    entries = native.STATE.log[-1]["entries"]
    assert [e["role"] for e in entries] == ["user", "response", "tool", "tool"]
    calls = entries[1]["toolCalls"]
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("call_AAA", "get_weather", {"city": "Paris"}), ("call_BBB", "get_weather",
                                                          {"city": "Rome"})]
    assert [(e["toolCallID"], e["toolName"], e["contents"][0]["text"]) for e in entries[2:]] \
        == [("call_AAA", "get_weather", "sunny"), ("call_BBB", "get_weather", "rainy")]
    assert native.STATE.log[-1]["prompt"] == ""


def test_tools_are_framework_tools_and_a_call_comes_back_as_tool_calls(
        client: OpenAI, native: ModuleType) -> None:
    completion = client.chat.completions.create(
        model="system", messages=user('!call get_weather {"city": "Oslo"}'),
        tools=[WEATHER, TIME])
    validate_response(completion.model_dump(exclude_unset=True))
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert CALL_ID.fullmatch(call.id)
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    offered = native.STATE.log[-1]["tools"]
    assert offered["get_weather"]["description"] == "The weather in a city."
    assert offered["get_time"]["arguments"]["properties"]["zone"]["enum"] == ["utc", "local"]


def test_parallel_calls_are_collected_then_the_turn_ends(client: OpenAI) -> None:
    script = "\n".join(f'!call get_weather {{"city": "{c}"}}' for c in ("A", "B", "C"))
    completion = client.chat.completions.create(model="system", messages=user(script),
                                                tools=[WEATHER])
    calls = completion.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["A", "B", "C"]
    assert len({c.id for c in calls}) == 3


def test_parallel_tool_calls_false_returns_one_call(client: OpenAI) -> None:
    script = '!call get_weather {"city": "A"}\n!call get_weather {"city": "B"}'
    completion = client.chat.completions.create(model="system", messages=user(script),
                                                tools=[WEATHER], parallel_tool_calls=False)
    calls = completion.choices[0].message.tool_calls
    assert len(calls) == 1 and json.loads(calls[0].function.arguments) == {"city": "A"}


def test_a_streamed_call_arrives_as_tool_call_deltas(http: httpx.Client) -> None:
    response = chat(http, messages=user('!call get_weather {"city": "Oslo"}'), tools=[WEATHER],
                    stream=True)
    chunks = [c for c in parse_sse(response.text) if c != "[DONE]"]
    for chunk in chunks:
        validate_chunk(chunk)
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert CALL_ID.fullmatch(deltas[0]["id"])
    assert "".join(d["function"].get("arguments", "") for d in deltas) == '{"city":"Oslo"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_server_tools_run_inside_and_the_model_goes_on(client: OpenAI) -> None:
    completion = client.chat.completions.create(
        model="system", messages=user('!call add {"a": 2, "b": 3}'), tools=[WEATHER])
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == 'add said {"sum":5}'


def test_server_tool_calls_are_budgeted(client: OpenAI) -> None:
    script = "\n".join(f'!call add {{"a": {i}, "b": 1}}' for i in range(4))  # max_calls 3
    content = client.chat.completions.create(
        model="system", messages=user(script)).choices[0].message.content
    assert content.count('{"sum":') == 3
    assert content.count("tool call budget exhausted") == 1


def test_tool_choice_none_offers_no_tool(http: httpx.Client) -> None:
    assert echo(http, tools=[WEATHER], tool_choice="none")["tools"] == {}


def test_allowed_tools_restrict_what_is_offered(http: httpx.Client) -> None:
    choice = {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "get_time"}}]}}
    tools = echo(http, tools=[WEATHER, TIME], tool_choice=choice)["tools"]
    assert set(tools) == {"get_time"}  # the operator's server tools are not allowed either


def test_required_and_named_choices_force_a_call(client: OpenAI, native: ModuleType) -> None:
    forced = client.chat.completions.create(
        model="system", messages=user("!say I would rather not."), tools=[WEATHER, TIME],
        tool_choice="required")
    (call,) = forced.choices[0].message.tool_calls
    assert forced.choices[0].finish_reason == "tool_calls"
    assert call.function.name in ("get_weather", "get_time")
    schema = native.STATE.log[-1]["schema"]
    calls = schema["properties"]["tool_calls"]
    assert calls["minItems"] == 1 and "maxItems" not in calls
    assert native.STATE.log[-1]["tools"] == {}  # a forced step offers no tool to call itself

    named = client.chat.completions.create(
        model="system", messages=user('!json {"tool_calls": [{"name": "get_time", '
                                      '"arguments": {"zone": "utc"}}]}'),
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False)
    (call,) = named.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time",
                                                                        {"zone": "utc"})
    schema = native.STATE.log[-1]["schema"]
    assert schema["properties"]["tool_calls"]["maxItems"] == 1
    assert list(schema["$defs"]) == ["Call_get_time"]


def test_required_binds_a_request_whose_history_ends_in_tool_results(client: OpenAI) -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_AAA", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_AAA", "content": "sunny"},
    ]
    completion = client.chat.completions.create(model="system", messages=messages,
                                                tools=[WEATHER], tool_choice="required")
    assert completion.choices[0].finish_reason == "tool_calls"


def test_a_forced_server_call_runs_and_the_next_step_is_free(client: OpenAI,
                                                              native: ModuleType) -> None:
    completion = client.chat.completions.create(
        model="system", messages=user('!json {"tool_calls": [{"name": "add", '
                                      '"arguments": {"a": 20, "b": 22}}]}'),
        tool_choice={"type": "function", "function": {"name": "add"}})
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == 'add said {"sum":42}'
    first, second = native.STATE.log[-2:]
    assert first["schema"] is not None and second["schema"] is None
    assert set(second["tools"]) == {"add"} and second["prompt"] == ""


def test_temperature_zero_is_greedy_else_sampled_with_top_p_and_seed(
        http: httpx.Client, client: OpenAI) -> None:
    greedy = echo(http, temperature=0)["options"]
    assert greedy["sampling"] == {"mode": "greedy"} and greedy["temperature"] is None
    sampled = echo(http, temperature=0.7, top_p=0.9, seed=42)["options"]
    assert sampled["sampling"] == {"mode": "random", "top_p": 0.9, "seed": 42}
    assert sampled["temperature"] == 0.7
    top_k = echo(http, temperature=0.7, top_k=5)["options"]["sampling"]
    assert top_k == {"mode": "random", "top_k": 5, "seed": None}

    def answer(**kwargs: Any) -> str:
        return client.chat.completions.create(model="system", messages=user("!sample"),
                                              **kwargs).choices[0].message.content

    assert answer(seed=7, temperature=1) == answer(seed=7, temperature=1)
    assert answer(temperature=0) == answer(temperature=0)
    assert len({answer(seed=s, temperature=1) for s in range(4)}) > 1


def test_max_tokens_is_the_response_limit_and_ends_by_length(client: OpenAI,
                                                              http: httpx.Client) -> None:
    assert echo(http, max_completion_tokens=77)["options"]["maximum_response_tokens"] == 77
    assert echo(http, max_tokens=300, max_completion_tokens=777)["options"][
        "maximum_response_tokens"] == 300  # the smaller holds
    cut = client.chat.completions.create(model="system", messages=user("!words 40"),
                                         max_tokens=6)
    assert cut.choices[0].message.content == "w0 w1 w2 w3 w4 w5"
    assert cut.choices[0].finish_reason == "length"
    assert cut.usage.completion_tokens == 6
    whole = client.chat.completions.create(model="system", messages=user("!words 4"),
                                           max_tokens=6)
    assert whole.choices[0].finish_reason == "stop"


def test_stop_sequences_end_the_answer_by_afmds_scanner(client: OpenAI,
                                                         http: httpx.Client) -> None:
    completion = client.chat.completions.create(
        model="system", messages=user("!say alpha beta END gamma delta"), stop=["END"])
    # What precedes the stop sequence, exactly (as with every model).
    assert completion.choices[0].message.content == "alpha beta "
    assert completion.choices[0].finish_reason == "stop"
    response = chat(http, messages=user("!say alpha bEN Dbeta END gamma"), stop=["END"],
                    stream=True)
    chunks = [c for c in parse_sse(response.text) if c != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "alpha bEN Dbeta "  # a stop sequence split across snapshots


def test_json_schema_goes_through_generation_schema(http: httpx.Client,
                                                    native: ModuleType) -> None:
    schema = {
        "$defs": {"Point": {"type": "object", "properties": {
            "x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}},
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "note": {"type": ["string", "null"]},
            "at": {"$ref": "#/$defs/Point"},
            "shape": {"oneOf": [{"type": "string", "enum": ["dot", "line"]},
                                {"type": "integer"}]},
            "both": {"allOf": [{"type": "object", "properties": {"a": {"type": "boolean"}},
                                "required": ["a"]},
                               {"properties": {"b": {"type": "number"}}, "required": ["b"]}]},
        },
        "required": ["name", "note", "at", "shape", "both"],
        "additionalProperties": False,
    }
    response = chat(http, messages=user("make one"), response_format={
        "type": "json_schema", "json_schema": {"name": "thing", "schema": schema}})
    assert response.status_code == 200, response.text
    assert "x-grammar-constraints" not in response.headers
    value = json.loads(response.json()["choices"][0]["message"]["content"])
    jsonschema.validate(value, schema)
    assert value["note"] is None  # nullable and required: written back by afmd
    given = native.STATE.log[-1]["schema"]
    assert given["title"] == "thing" and given["x-order"] == list(schema["properties"])
    assert "anyOf" in given["properties"]["shape"]
    assert given["properties"]["at"] == {"$ref": "#/$defs/Point"}
    assert set(given["properties"]["both"]["required"]) == {"a", "b"}
    assert "note" not in given["required"]


def test_a_pattern_is_described_not_enforced_and_said_so(http: httpx.Client,
                                                         native: ModuleType) -> None:
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
              "required": ["code"]}
    response = chat(http, messages=user('!json {"code": "abc"}'), response_format={
        "type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    assert response.status_code == 200, response.text
    assert response.headers["x-grammar-constraints"] == "downgraded"
    assert json.loads(response.json()["choices"][0]["message"]["content"]) == {"code": "abc"}
    described = native.STATE.log[-1]["schema"]["properties"]["code"]
    assert "pattern" not in described and "^[A-Z]{3}$" in described["description"]


def test_json_object_is_best_effort_and_validated(http: httpx.Client, native: ModuleType) -> None:
    wrapped = chat(http, messages=user('!say Sure: ```json {"a": 1} ```'),
                   response_format={"type": "json_object"})
    assert wrapped.status_code == 200, wrapped.text
    assert json.loads(wrapped.json()["choices"][0]["message"]["content"]) == {"a": 1}
    assert "JSON object" in native.STATE.log[-1]["instructions"]
    broken = chat(http, messages=user("!say no json here"),
                  response_format={"type": "json_object"})
    assert broken.status_code == 500 and broken.json()["error"]["code"] == "invalid_json_output"


def test_streaming_turns_snapshots_into_deltas(http: httpx.Client) -> None:
    response = chat(http, messages=user("!words 12"), stream=True,
                    stream_options={"include_usage": True})
    chunks = [c for c in parse_sse(response.text) if c != "[DONE]"]
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    deltas = [d for d in deltas if d]
    assert len(deltas) >= 6  # one snapshot a token: many deltas, not one
    assert "".join(deltas) == " ".join(f"w{i}" for i in range(12))
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_usage_is_the_frameworks_count(client: OpenAI) -> None:
    completion = client.chat.completions.create(
        model="system", messages=[{"role": "system", "content": "one two three"},
                                  {"role": "user", "content": "!say four five six seven"}],
        tools=[WEATHER], tool_choice="none")  # no tool offered, the server's neither
    # Stand-in tokens are whitespace-led words: instructions (operator's too) and prompt.
    assert completion.usage.prompt_tokens == 2 + 3 + 5
    assert completion.usage.completion_tokens == 4


# -- the framework's errors ----------------------------------------------------------


@pytest.mark.parametrize(("error", "status", "code"), [
    ("GuardrailViolationError", 400, "content_filter"),
    ("UnsupportedLanguageOrLocaleError", 400, "unsupported_language"),
    ("ExceededContextWindowSizeError", 400, "context_length_exceeded"),
    ("RateLimitedError", 429, "rate_limited"),
    ("ConcurrentRequestsError", 503, "busy"),
    ("AssetsUnavailableError", 503, "model_unavailable"),
])
def test_framework_errors_are_afmds(http: httpx.Client, error: str, status: int,
                                    code: str) -> None:
    response = chat(http, messages=user(f"!raise {error} detail"))
    assert response.status_code == status, response.text
    validate_error(response.json())
    assert response.json()["error"]["code"] == code
    if status in (429, 503):
        assert response.headers["retry-after"] == "2"
    else:
        assert "retry-after" not in response.headers


def test_a_transient_decoding_failure_is_retried_then_reported(http: httpx.Client,
                                                               native: ModuleType) -> None:
    response = chat(http, messages=user("!raise DecodingFailureError broken"))
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "generation_failed"
    assert len(native.STATE.log) == 3  # [engine] retries = 2


def test_a_prompt_that_cannot_fit_is_refused_before_generating(http: httpx.Client,
                                                               native: ModuleType) -> None:
    long = "word " * 3800
    response = chat(http, messages=user(long), max_tokens=500)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "maximum context length is 4096 tokens" in error["message"]
    assert native.STATE.log == []


def test_the_window_is_the_one_the_framework_states(http: httpx.Client,
                                                   native: ModuleType) -> None:
    """``SystemLanguageModel.context_size`` (apple-fm-sdk 0.2.1) is the OS's model's
    window: a conversation is held to it, not to a window afmd assumes."""
    native.STATE.context_size = 16384
    fits = chat(http, messages=user("!say ok\n" + "word " * 9000), max_tokens=500)
    assert fits.status_code == 200, fits.text
    native.STATE.context_size = 4096
    response = chat(http, messages=user("word " * 5000), max_tokens=64)
    assert response.status_code == 400, response.text
    assert "limit of 4096 tokens" in response.json()["error"]["message"]


def test_a_prompt_over_the_window_is_worded_as_openai_words_it(http: httpx.Client,
                                                               native: ModuleType) -> None:
    """A prompt that alone fills the window says OpenAI's ``Input tokens exceed the
    configured limit``, the phrase clients read to tell an overflow from other 400s, as
    the MLX models' refusal says it."""
    response = chat(http, messages=user("word " * 9000))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith("Input tokens exceed the configured limit of 4096 tokens.")
    # Anthropic's words on /v1/messages, the phrase Claude Code compacts a conversation on
    # (the system model's refusal carried no numbers for the dialect to word it with).
    messages = http.post("/v1/messages", json={"model": "system", "max_tokens": 64,
                                               "messages": user("word " * 9000)})
    assert messages.status_code == 400, messages.text
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 4096 maximum",
                        messages.json()["error"]["message"]), messages.text
    assert native.STATE.log == []


def test_a_refusal_is_a_200_with_refusal(client: OpenAI, http: httpx.Client) -> None:
    completion = client.chat.completions.create(
        model="system", messages=user("!raise RefusalError I cannot help with that."))
    validate_response(completion.model_dump(exclude_unset=True))
    message = completion.choices[0].message
    assert message.refusal == "I cannot help with that." and message.content is None
    assert completion.choices[0].finish_reason == "stop"
    streamed = chat(http, messages=user("!raise RefusalError No."), stream=True)
    chunks = [c for c in parse_sse(streamed.text) if c != "[DONE]"]
    assert [c["choices"][0]["delta"].get("refusal") for c in chunks
            if c["choices"][0]["delta"].get("refusal")] == ["No."]


def test_requests_beyond_max_concurrent_requests_wait_for_a_session(
        http: httpx.Client, native: ModuleType) -> None:
    peak = {"value": 0}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak["value"] = max(peak["value"], native.STATE.active)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    statuses: list[int] = []
    workers = [threading.Thread(target=lambda: statuses.append(
        chat(http, messages=user("!delay 30\n!words 5")).status_code)) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    stop.set()
    watcher.join()
    assert statuses == [200] * 4
    assert peak["value"] == 2  # [queue] max_concurrent_requests


def test_logprobs_bias_penalties_and_raw_completions_are_refused(http: httpx.Client) -> None:
    logprobs = chat(http, messages=user("hi"), logprobs=True)
    assert logprobs.status_code == 400 and logprobs.json()["error"]["param"] == "logprobs"
    # The Responses API asks for them in include, which its 400 names.
    included = http.post("/v1/responses", json={
        "model": "system", "input": "hi", "include": ["message.output_text.logprobs"]})
    assert included.status_code == 400 and included.json()["error"]["param"] == "include"
    for field, value in (("logit_bias", {"5": 10}), ("presence_penalty", 0.5),
                         ("frequency_penalty", -1.0)):  # sampling the framework has no hook for
        refused = chat(http, messages=user("hi"), **{field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field
    completions = http.post("/v1/completions", json={"model": "system", "prompt": "hi"})
    assert completions.status_code == 400
    assert completions.json()["error"]["code"] == "invalid_model_kind"


def test_a_stream_ended_early_stops_the_framework_with_it(http: httpx.Client,
                                                         native: ModuleType) -> None:
    """The SDK's stream is a detached native iteration that releasing the stream cancels:
    a stop sequence ends the framework's work with the answer (the next request finds it
    idle), not once the stream's thread is joined."""
    response = chat(http, messages=user("!delay 50\n!words 200"), stream=True, stop=["w3"])
    assert response.status_code == 200, response.text
    ended = time.monotonic()
    while native.STATE.active and time.monotonic() - ended < 5:
        time.sleep(0.01)
    assert time.monotonic() - ended < 1.0


def test_cancel_by_request_id_stops_the_framework(http: httpx.Client, native: ModuleType) -> None:
    result: dict[str, Any] = {}

    def run() -> None:
        result["response"] = http.post(CHAT, json={"messages": user("!delay 50\n!words 200"),
                                                   "stream": True},
                                       headers={"X-Request-ID": "cancel-me"})

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 10
    while native.STATE.active == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert http.post("/v1/chat/completions/cancel-me/cancel").json()["cancelled"] is True
    thread.join(10)
    chunks = [c for c in parse_sse(result["response"].text) if c != "[DONE]"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "cancelled"
    deadline = time.monotonic() + 5
    while native.STATE.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert native.STATE.active == 0


def test_an_alias_can_name_system(client: OpenAI) -> None:
    completion = client.chat.completions.create(model="gpt-4o-mini", messages=user("!say hi"))
    assert completion.model == "gpt-4o-mini" and completion.choices[0].message.content == "hi"


# -- every dialect, one boundary --------------------------------------------------------


def test_responses_reach_the_system_model(client: OpenAI) -> None:
    text = client.responses.create(model="system", input="!say hello there",
                                   instructions="Be kind.")
    assert text.output_text == "hello there"
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"][
        "parameters"]}
    called = client.responses.create(model="system", input='!call get_weather {"city": "Oslo"}',
                                     tools=[tool])
    (item,) = called.output
    assert item.type == "function_call" and json.loads(item.arguments) == {"city": "Oslo"}
    refused = client.responses.create(model="system", input="!raise RefusalError Not that.")
    part = refused.output[0].content[0]
    assert (part.type, part.refusal) == ("refusal", "Not that.")


def test_messages_reach_the_system_model(server: SystemServer, native: ModuleType) -> None:
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    message = claude.messages.create(model="system", max_tokens=64, system="Be kind.",
                                     messages=user("!echo"))
    seen = json.loads(message.content[0].text)
    assert seen["instructions"] == "Operator rules.\n\nBe kind."
    called = claude.messages.create(
        model="system", max_tokens=64, messages=user('!call get_weather {"city": "Oslo"}'),
        tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}])
    assert called.stop_reason == "tool_use"
    (block,) = called.content
    assert block.name == "get_weather" and block.input == {"city": "Oslo"}
    refused = claude.messages.create(model="system", max_tokens=64,
                                     messages=user("!raise RefusalError Not that."))
    assert refused.stop_reason == "refusal" and refused.content[0].text == "Not that."
    # Claude Code's max_tokens is a cap the context window lowers, not a demand.
    capped = httpx.post(server.url + "/v1/messages", timeout=30, json={
        "model": "system", "max_tokens": 32000, "messages": user("!say ok")})
    assert capped.json()["content"][0]["text"] == "ok"
    assert native.STATE.log[-1]["options"]["maximum_response_tokens"] < 4096


def test_ollama_reaches_the_system_model(server: SystemServer) -> None:
    """Ollama's message has no refusal field: the explanation is its content, streamed
    or not (it was dropped: an empty answer)."""
    for stream in (False, True):
        answer = httpx.post(server.url + "/api/chat", timeout=30, json={
            "model": "system", "stream": stream,
            "messages": user("!raise RefusalError Not that.")})
        assert answer.status_code == 200, answer.text
        lines = [json.loads(line) for line in answer.text.splitlines()]
        assert "".join(line["message"]["content"] for line in lines) == "Not that."
        assert lines[-1]["done"] is True


def test_the_model_becomes_available_while_afmd_runs(http: httpx.Client,
                                                    native: ModuleType) -> None:
    set_availability(native, "model_not_ready")
    health = http.get("/health")
    assert health.status_code == 503
    assert health.json()["status"] == "unavailable"
    assert health.json()["reason"] == "model_not_ready"
    assert health.json()["models"]["system"] == "unavailable: model_not_ready"
    refused = chat(http, messages=user("!say hi"))
    assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
    assert "model_not_ready" in refused.json()["error"]["message"]
    set_availability(native, None)
    assert http.get("/health").json()["models"]["system"] == "available"
    assert chat(http, messages=user("!say hi")).json()["choices"][0]["message"]["content"] \
        == "hi"


def test_show_describes_the_model(tmp_path: Path, native: ModuleType) -> None:
    import subprocess
    import sys

    from helpers.system_model import STANDIN

    run = subprocess.run([sys.executable, "-m", "afmd", "show", "system", "--json"],
                         capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(STANDIN),
                              "HOME": str(tmp_path), "AFM_STANDIN_UNAVAILABLE":
                              "apple_intelligence_not_enabled"})
    assert run.returncode == 0, run.stderr
    info = json.loads(run.stdout)
    assert info["availability"] == "unavailable: apple_intelligence_not_enabled"
    assert info["context_length"] == 4096 and info["kind"] == "chat"
    assert info["served_through"] == "apple-fm-sdk 0.2.1"
