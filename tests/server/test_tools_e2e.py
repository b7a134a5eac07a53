"""Tool calling end to end: the official openai client against the real server.

The demo model's weights are random, so what it writes is nonsense, but under the tool
grammar every call it makes is well formed and valid against its tool's schema. String
properties carry ``maxLength`` and integers bounds so that calls stay short (random
weights otherwise write until ``max_tokens``).
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest

from afmd.dialects.openai.chat_body import parse_chat_request
from afmd.service.chat_template import template_messages

from helpers.openai_schemas import validate_chunk, validate_error, validate_response

CALL_ID = re.compile(r"^call_[A-Za-z0-9]{24}$")
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and what is 2+3?"}]
RUNS = 20

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
TOOLS = [
    {"type": "function", "function": {"name": "get_weather",
                                      "description": "Current weather in a city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                      "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


def create(client: Any, **kwargs: Any) -> Any:
    body = {"model": "demo", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 300,
            "temperature": 1.0, **kwargs}
    return client.chat.completions.create(**body)


def in_parallel(fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
    """Several requests at once (the server batches them; seeds keep runs reproducible)."""
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(fn, items))


def reasoning_of(message: Any) -> str | None:
    return getattr(message, "reasoning_content", None)


def check_call(call: Any, names: Iterable[str]) -> None:
    assert CALL_ID.match(call.id), call.id
    assert call.type == "function"
    assert call.function.name in set(names)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])


def check_forced_completion(completion: Any, names: Iterable[str]) -> bool:
    """A forced call's response; returns whether it ended with ``tool_calls``."""
    validate_response(completion.model_dump(exclude_unset=True))
    choice = completion.choices[0]
    calls = choice.message.tool_calls
    assert calls, f"no tool call: {choice}"
    assert len({c.id for c in calls}) == len(calls)
    check_reasoning_invariants(completion)
    if choice.finish_reason == "tool_calls":
        assert choice.message.content is None
        for call in calls:
            check_call(call, names)
        return True
    # Parallel calls ran into max_tokens: every finished call is valid; the cut one is
    # either kept as a truncated call or returned as text, never lost.
    assert choice.finish_reason == "length"
    for call in calls[:-1]:
        check_call(call, names)
    return False


def check_reasoning_invariants(completion: Any) -> None:
    message = completion.choices[0].message
    reasoning = reasoning_of(message) or ""
    for marker in ("<think>", "</think>"):
        assert marker not in (message.content or "")
        assert marker not in reasoning
    reasoning_tokens = completion.usage.completion_tokens_details.reasoning_tokens
    assert (reasoning_tokens > 0) == bool(reasoning)
    assert reasoning_tokens <= completion.usage.completion_tokens


# -- forced calls ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("choice", "names"),
    [
        ("required", ("get_weather", "add")),
        ({"type": "function", "function": {"name": "add"}}, ("add",)),
        ({"type": "function", "function": {"name": "get_weather"}}, ("get_weather",)),
    ],
    ids=["required", "named-add", "named-get_weather"],
)
def test_forced_calls_are_valid_every_time(client, choice: Any, names: tuple[str, ...]) -> None:
    """parallel_tool_calls false: exactly one call, and the turn ends with it."""
    runs = RUNS if choice == "required" or names == ("add",) else RUNS // 4
    completions = in_parallel(
        lambda seed: create(client, tool_choice=choice, parallel_tool_calls=False, seed=seed),
        range(runs),
    )
    for completion in completions:
        assert check_forced_completion(completion, names)
        assert len(completion.choices[0].message.tool_calls) == 1
    if choice == "required":
        assert {c.choices[0].message.tool_calls[0].function.name for c in completions} == {
            "get_weather", "add"}, "both tools are expected over 20 runs"
        assert any(reasoning_of(c.choices[0].message) for c in completions), (
            "a thinking block before the call was expected in some runs"
        )


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_parallel_forced_calls(client, choice: Any) -> None:
    names = ("add",) if isinstance(choice, dict) else tuple(SCHEMAS)
    completions = in_parallel(lambda seed: create(client, tool_choice=choice, seed=seed),
                              (1, 4, 6, 7, 9, 13))
    finished = [check_forced_completion(c, names) for c in completions]
    # Parallel calls may run into max_tokens now and then; most turns end on their own.
    assert sum(finished) > len(finished) // 2
    assert any(len(c.choices[0].message.tool_calls) > 1 for c in completions), (
        "parallel calls were expected in some runs"
    )


def test_allowed_tools_restricts_the_choice(client) -> None:
    def allowed(mode: str) -> dict[str, Any]:
        return {"type": "allowed_tools", "allowed_tools": {
            "mode": mode, "tools": [{"type": "function", "function": {"name": "add"}}]}}

    required = in_parallel(lambda seed: create(client, tool_choice=allowed("required"),
                                               parallel_tool_calls=False, seed=seed), range(6))
    for completion in required:
        assert check_forced_completion(completion, ("add",))
    auto = in_parallel(lambda seed: create(client, tool_choice=allowed("auto"), seed=seed,
                                           max_tokens=60), range(4))
    for completion in auto:
        for call in completion.choices[0].message.tool_calls or []:
            check_call(call, ("add",))
        assert "<tool_call>" not in (completion.choices[0].message.content or "")


def test_tool_choice_none_lists_the_tools_and_bans_the_call_token(client) -> None:
    auto = create(client, seed=0, max_tokens=1)
    completions = in_parallel(
        lambda seed: create(client, tool_choice="none", seed=seed, max_tokens=80), range(4)
    )
    for completion in completions:
        choice = completion.choices[0]
        assert choice.message.tool_calls is None
        assert choice.finish_reason in ("stop", "length")
        assert choice.message.content
        assert "<tool_call>" not in choice.message.content
        # The tools are in the prompt, as with auto: its prefix is cached.
        assert completion.usage.prompt_tokens == auto.usage.prompt_tokens
        assert (completion.usage.prompt_tokens_details.cached_tokens
                >= auto.usage.prompt_tokens - 1)


# -- streaming ------------------------------------------------------------------------------


def collect_stream(client: Any, **kwargs: Any) -> dict[str, Any]:
    chunks = list(create(client, stream=True, stream_options={"include_usage": True},
                         **kwargs))
    calls: dict[int, dict[str, Any]] = {}
    content, reasoning, finish = [], [], []
    for chunk in chunks:
        validate_chunk(chunk.model_dump(exclude_unset=True))
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        texts = [t for t in (delta.content, getattr(delta, "reasoning_content", None)) if t]
        assert len(texts) + bool(delta.tool_calls) <= 1, f"mixed delta: {delta}"
        if delta.content:
            content.append(delta.content)
        if getattr(delta, "reasoning_content", None):
            reasoning.append(delta.reasoning_content)
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                # The first delta of a call carries its id, type, name and arguments start.
                assert tc.index == len(calls), "indexes 0, 1, … in order"
                assert CALL_ID.match(tc.id)
                assert tc.type == "function"
                assert tc.function.name and tc.function.arguments is not None
                calls[tc.index] = {"id": tc.id, "name": tc.function.name,
                                   "arguments": tc.function.arguments, "fragments": 1}
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
                calls[tc.index]["fragments"] += 1
        if choice.finish_reason:
            finish.append(choice.finish_reason)
    return {"calls": [calls[i] for i in sorted(calls)], "content": "".join(content),
            "reasoning": "".join(reasoning), "finish": finish, "usage": chunks[-1].usage}


# (seed, whether the demo model thinks before its calls with that seed)
@pytest.mark.parametrize(("seed", "thinks"), [(3, False), (0, True), (11, True)])
def test_streamed_calls_reassemble_into_the_non_streamed_calls(
    client, seed: int, thinks: bool
) -> None:
    """Thinking goes to reasoning_content only, calls by index, nothing mixed."""
    kwargs = {"tool_choice": "required", "seed": seed}
    whole = create(client, **kwargs)
    streamed = collect_stream(client, **kwargs)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls"
    assert streamed["finish"] == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls
    ]
    for call in streamed["calls"]:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        assert call["fragments"] > 2, "the JSON arguments stream as they are produced"
    assert streamed["content"] == ""
    assert streamed["reasoning"] == (reasoning_of(message) or "")
    assert bool(streamed["reasoning"]) == thinks
    check_reasoning_invariants(whole)
    usage = streamed["usage"]
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.completion_tokens_details.reasoning_tokens == (
        whole.usage.completion_tokens_details.reasoning_tokens
    )


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_stop_sequence_never_matches_inside_a_call(client, stream: bool) -> None:
    """A call's markup and arguments are not the answer's text: stop sequences that
    appear in the forced call (the newlines around Hermes JSON, its keys, its braces)
    leave it whole, it finishes ``tool_calls``, and usage and log-probabilities count
    every token, as without the stops."""
    kwargs = {"tool_choice": "required", "tools": TOOLS[:1], "reasoning_effort": "none",
              "seed": 0, "logprobs": True}
    stops = ["\n", '"city"', "}", "<tool_call>"]
    plain = create(client, **kwargs)
    expected = [(c.function.name, c.function.arguments)
                for c in plain.choices[0].message.tool_calls]
    assert plain.choices[0].finish_reason == "tool_calls"
    assert '"city"' in expected[0][1]
    tokens = plain.usage.completion_tokens
    assert len(plain.choices[0].logprobs.content) == tokens
    if stream:
        chunks = list(create(client, stop=stops, stream=True,
                             stream_options={"include_usage": True}, **kwargs))
        calls: dict[int, list[str]] = {}
        entries, finish = [], []
        for chunk in chunks:
            for choice in chunk.choices:
                for tc in choice.delta.tool_calls or []:
                    calls.setdefault(tc.index, [tc.function.name or "", ""])[1] += \
                        tc.function.arguments or ""
                if choice.logprobs and choice.logprobs.content:
                    entries += choice.logprobs.content
                if choice.finish_reason:
                    finish.append(choice.finish_reason)
        got = [tuple(calls[i]) for i in sorted(calls)]
        usage = chunks[-1].usage
    else:
        reply = create(client, stop=stops, **kwargs)
        choice = reply.choices[0]
        got = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        entries, finish, usage = choice.logprobs.content, [choice.finish_reason], reply.usage
    assert got == expected
    assert finish == ["tool_calls"]
    assert usage.completion_tokens == tokens
    assert [e.token for e in entries] == [e.token for e in plain.choices[0].logprobs.content]


def test_reasoning_effort_values_are_accepted(client, http) -> None:
    plain = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
    assert plain.status_code == 200
    for effort in ("none", "minimal", "low", "medium", "high", "xhigh", "max"):
        response = http.post("/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 1, "reasoning_effort": effort})
        assert response.status_code == 200, response.text
        prompt = response.json()["usage"]["prompt_tokens"]
        # "none"/"minimal" switch the template's thinking off: it closes an empty block.
        if effort in ("none", "minimal"):
            assert prompt > plain.json()["usage"]["prompt_tokens"]
        else:
            assert prompt == plain.json()["usage"]["prompt_tokens"]
    bad = http.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 1, "reasoning_effort": "maximal"})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "reasoning_effort"


def test_reasoning_effort_none_with_a_forced_call(client) -> None:
    for completion in in_parallel(
        lambda seed: create(client, tool_choice="required", reasoning_effort="none",
                            parallel_tool_calls=False, seed=seed),
        range(4),
    ):
        check_forced_completion(completion, SCHEMAS)


# -- the tool loop --------------------------------------------------------------------------


def assistant_turn(message: Any) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": message.content,
        "tool_calls": [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls
        ],
    }


@pytest.mark.parametrize(
    ("choice", "names"),
    [("required", ("get_weather", "add")),
     ({"type": "function", "function": {"name": "add"}}, ("add",))],
    ids=["required", "named"],
)
def test_full_tool_loop_ends_with_a_text_answer(
    client, choice: Any, names: tuple[str, ...]
) -> None:
    first = create(client, tool_choice=choice, parallel_tool_calls=False, seed=0)
    assert first.choices[0].finish_reason == "tool_calls"
    message = first.choices[0].message
    history = [
        *MESSAGES,
        assistant_turn(message),
        *({"role": "tool", "tool_call_id": c.id, "content": "22 degrees"}
          for c in message.tool_calls),
    ]
    # required/named bind every request's first step, also after a tool result ...
    again = create(client, messages=history, tool_choice=choice, parallel_tool_calls=False,
                   seed=0)
    assert check_forced_completion(again, names)
    # ... and with auto, the model answers the tool result in text.
    second = create(client, messages=history, tool_choice="auto", seed=0, max_tokens=40)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.tool_calls is None
    assert answer.message.content
    assert "<tool_call>" not in answer.message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens

    # A follow-up may omit the tools altogether.
    follow_up = client.chat.completions.create(
        model="demo", messages=history, max_tokens=20, temperature=0)
    assert follow_up.choices[0].finish_reason in ("stop", "length")
    assert follow_up.choices[0].message.content


def test_streamed_tool_loop_answer(client) -> None:
    first = create(client, tool_choice="required", parallel_tool_calls=False, seed=1)
    message = first.choices[0].message
    history = [*MESSAGES, assistant_turn(message),
               {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "5"}]
    streamed = collect_stream(client, messages=history, tool_choice="auto", seed=1,
                              max_tokens=30)
    assert streamed["calls"] == []
    assert streamed["content"]
    assert streamed["finish"] in (["stop"], ["length"])


TWO_CALLS = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_w", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        {"id": "call_a", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
    ],
}
OUT_W = {"role": "tool", "tool_call_id": "call_w", "content": "sunny"}
OUT_A = {"role": "tool", "tool_call_id": "call_a", "content": "5"}


def test_tool_outputs_out_of_order_are_reordered(http) -> None:
    def answer(outputs: list[dict[str, Any]]) -> dict[str, Any]:
        response = http.post("/v1/chat/completions", json={
            "messages": [*MESSAGES, TWO_CALLS, *outputs], "tools": TOOLS,
            "max_tokens": 12, "temperature": 0})
        assert response.status_code == 200, response.text
        return response.json()

    in_order = answer([OUT_W, OUT_A])
    reversed_ = answer([OUT_A, OUT_W])
    # The same prompt, so the same (greedy) answer.
    assert reversed_["usage"]["prompt_tokens"] == in_order["usage"]["prompt_tokens"]
    assert (reversed_["choices"][0]["message"]["content"]
            == in_order["choices"][0]["message"]["content"])


def test_conversation_normalised_for_the_template() -> None:
    request = parse_chat_request({
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": [{"type": "text", "text": "Weather "},
                                         {"type": "text", "text": "and sum?"}]},
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": "Please."},
            TWO_CALLS,
            OUT_A,
            OUT_W,
        ],
    })
    # Reordered into the order of the calls, whatever order they came in.
    assert [m.tool_call_id for m in request.messages if m.role == "tool"] == [
        "call_w", "call_a"]
    out = template_messages(request.messages, instructions="Server rules.")
    assert out[0] == {"role": "system",
                      "content": "Server rules.\n\nBe terse.\n\nUse tools."}
    assert out[1] == {"role": "user", "content": "Weather and sum?\n\nPlease."}
    assistant = out[2]
    assert assistant["role"] == "assistant"
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_w", "call_a"]
    assert assistant["tool_calls"][1]["function"]["arguments"] == {"a": 2, "b": 3}
    assert out[3:] == [
        {"role": "tool", "content": "sunny", "tool_call_id": "call_w", "name": "get_weather"},
        {"role": "tool", "content": "5", "tool_call_id": "call_a", "name": "add"},
    ]
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool", "tool"]


# -- validation errors ----------------------------------------------------------------------

USER = {"role": "user", "content": "hi"}
CALL_A = {"id": "call_a", "type": "function",
          "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
CALL_B = {"id": "call_b", "type": "function",
          "function": {"name": "get_weather", "arguments": "{}"}}


def calls(*items: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": list(items)}


def output(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": "ok"}


def allowed_tools(*names: str) -> dict[str, Any]:
    return {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": n}}
                                      for n in names]}}


PNG = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c63f8ffff3f0005fe02fea7d6a4a40000000049454e44ae426082"
)).decode()
PNG_URL = "data:image/png;base64," + PNG


def image_message(url: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                        {"type": "image_url", "image_url": {"url": url}}]}


ERRORS = [
    ("missing-output", {"messages": [USER, calls(CALL_A, CALL_B), output("call_a")]},
     "missing_tool_output", "messages[1].tool_calls[1]"),
    ("output-not-directly-after", {"messages": [USER, calls(CALL_A), USER, output("call_a")]},
     "missing_tool_output", "messages[1].tool_calls[0]"),
    ("unknown-call-id", {"messages": [USER, calls(CALL_A), output("call_zzz")]},
     "unknown_tool_call_id", "messages[2].tool_call_id"),
    ("tool-message-without-call", {"messages": [USER, output("call_a")]},
     "unknown_tool_call_id", "messages[1].tool_call_id"),
    ("duplicate-call-id", {"messages": [USER, calls(CALL_A, CALL_A), output("call_a")]},
     "duplicate_tool_call_id", "messages[1].tool_calls[1].id"),
    ("duplicate-call-id-across-turns",
     {"messages": [USER, calls(CALL_A), output("call_a"), USER, calls(CALL_A),
                   output("call_a")]},
     "duplicate_tool_call_id", "messages[4].tool_calls[0].id"),
    ("duplicate-output",
     {"messages": [USER, calls(CALL_A), output("call_a"), output("call_a")]},
     "duplicate_tool_output", "messages[3].tool_call_id"),
    ("empty-call-id", {"messages": [USER, calls({**CALL_A, "id": ""}), output("")]},
     "invalid_value", "messages[1].tool_calls[0].id"),
    ("empty-tool-call-id", {"messages": [USER, calls(CALL_A), output("")]},
     "invalid_value", "messages[2].tool_call_id"),
    ("named-unknown-tool",
     {"messages": [USER], "tools": TOOLS,
      "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "unknown_tool", "tool_choice.function.name"),
    ("allowed-unknown-tool",
     {"messages": [USER], "tools": TOOLS, "tool_choice": allowed_tools("add", "nope")},
     "unknown_tool", "tool_choice.allowed_tools.tools[1].function.name"),
    ("tool-parameters-not-a-schema",
     {"messages": [USER], "tools": [{"type": "function", "function": {
         "name": "f", "parameters": {"type": "foo"}}}]},
     "invalid_schema", "tools[0].function.parameters"),
    ("second-tool-parameters-not-a-schema",
     {"messages": [USER], "tools": [*TOOLS, {"type": "function", "function": {
         "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 5}}}}}]},
     "invalid_schema", "tools[2].function.parameters"),
    ("legacy-functions", {"messages": [USER], "functions": [{"name": "f"}]},
     "invalid_value", "functions"),
    ("legacy-function-call", {"messages": [USER], "function_call": "auto"},
     "invalid_value", "function_call"),
    ("legacy-assistant-function-call",
     {"messages": [USER, {"role": "assistant", "content": None,
                          "function_call": {"name": "f", "arguments": "{}"}}, USER]},
     "invalid_value", "messages[1].function_call"),
    ("remote-image-url", {"messages": [image_message("https://example.com/cat.png")]},
     "unsupported_image_url", "messages[0].content[1].image_url.url"),
    ("remote-url-checked-before-capability",
     {"messages": [image_message(PNG_URL), image_message("http://example.com/a.png")]},
     "unsupported_image_url", "messages[1].content[1].image_url.url"),
    ("bad-base64", {"messages": [image_message("data:image/png;base64,@@not base64@@")]},
     "invalid_image_url", "messages[0].content[1].image_url.url"),
    ("not-an-image-data-url", {"messages": [image_message("data:text/plain,hello")]},
     "invalid_image_url", "messages[0].content[1].image_url.url"),
    ("image-without-vision", {"messages": [image_message(PNG_URL)]},
     "image_input_not_supported", "messages[0].content[1].image_url"),
]


@pytest.mark.parametrize(("body", "code", "param"), [e[1:] for e in ERRORS],
                         ids=[e[0] for e in ERRORS])
def test_rejected_before_the_model_runs(http, body: dict[str, Any], code: str,
                                        param: str) -> None:
    response = http.post("/v1/chat/completions", json={"max_tokens": 5, **body})
    assert response.status_code == 400, response.text
    payload = response.json()
    validate_error(payload)
    error = payload["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    if code == "image_input_not_supported":
        assert "image" in error["message"] and "demo" in error["message"]
    if param in ("functions", "function_call", "messages[1].function_call"):
        assert "tool" in error["message"]


def test_client_errors_surface_through_the_openai_client(client) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="demo", messages=[USER, calls(CALL_A), USER], tools=TOOLS, max_tokens=5)
    assert info.value.code == "missing_tool_output"
    assert info.value.param == "messages[1].tool_calls[0]"


def test_stream_error_events_are_never_sent_for_client_errors(http) -> None:
    """A 400 is a plain error even when streaming was asked for (nothing ran)."""
    response = http.post("/v1/chat/completions", json={
        "messages": [USER, calls(CALL_A), output("call_b")], "stream": True, "max_tokens": 5})
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["code"] == "unknown_tool_call_id"


def test_tool_schema_with_unsupported_keyword_is_downgraded(http) -> None:
    tags = {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True,
        "maxItems": 3}}, "required": ["tags"], "additionalProperties": False}
    response = http.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 300, "seed": 0, "parallel_tool_calls": False,
        "tools": [{"type": "function", "function": {"name": "tag", "parameters": tags}}],
        "tool_choice": "required"})
    assert response.status_code == 200, response.text
    assert response.headers["x-grammar-constraints"] == "downgraded"
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    arguments = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
    jsonschema.validate(arguments, {**tags, "properties": {"tags": {
        **tags["properties"]["tags"], "uniqueItems": False}}})
    plain = http.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 1, "tools": TOOLS, "tool_choice": "required"})
    assert plain.status_code == 200
    assert "x-grammar-constraints" not in plain.headers
