"""Unit tests of request validation: typed values out, or an error naming the exact param."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest

from afmd.core.request import ChatRequest, Message, ToolCall, ToolSpec
from afmd.dialects.fields.body import parse_json_body
from afmd.dialects.openai.chat_body import parse_chat_request
from afmd.errors import InvalidRequestError

USER = {"role": "user", "content": "Hello"}


def parse(**fields: Any) -> ChatRequest:
    fields.setdefault("messages", [USER])
    return parse_chat_request(fields)


def error_of(body: dict[str, Any], *, strict: bool = False) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request(body, strict=strict)
    return info.value


def assert_error(
    body: dict[str, Any], code: str, param: str | None, *, strict: bool = False
) -> InvalidRequestError:
    err = error_of(body, strict=strict)
    assert (err.code, err.param, err.status) == (code, param, 400), repr(err)
    assert err.envelope()["error"]["type"] == "invalid_request_error"
    assert err.message.strip()
    return err


# --------------------------------------------------------------------------- the JSON body


def test_parse_json_body_returns_object() -> None:
    assert parse_json_body(b'{"a": [1, 2.5, null, "x"]}') == {"a": [1, 2.5, None, "x"]}


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"", "invalid_json"),
        (b"{", "invalid_json"),
        (b"{'a': 1}", "invalid_json"),
        (b'{"a": NaN}', "invalid_json"),
        (b"\xff\xfe", "invalid_json"),
        (b"[]", "invalid_type"),
        (b'"text"', "invalid_type"),
        (b"null", "invalid_type"),
        (b"42", "invalid_type"),
    ],
    ids=["empty", "truncated", "single-quotes", "nan", "bad-utf8", "array", "string",
         "null", "number"],
)
def test_parse_json_body_rejects(raw: bytes, code: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_json_body(raw)
    err = info.value
    assert err.code == code
    assert err.param is None
    assert err.status == 400
    assert "Traceback" not in err.message and err.message.strip()


# --------------------------------------------------------------------------- defaults


def test_defaults() -> None:
    req = parse()
    assert req.messages == (Message(role="user", content="Hello"),)
    assert req.model is None
    assert req.stream is False
    assert req.include_usage is False
    assert req.max_tokens is None
    assert req.temperature == 1.0
    assert req.top_p == 1.0
    assert req.top_k == 0
    assert req.min_p == 0.0
    assert req.repetition_penalty is None
    assert req.seed is None
    assert req.stop == ()
    assert req.tools == ()
    assert req.parallel_tool_calls is True
    assert req.response_format is None


def test_nulls_mean_defaults() -> None:
    nulls = ("model", "stream", "stream_options", "max_tokens", "max_completion_tokens",
             "temperature", "top_p", "seed", "n", "stop", "logprobs", "tools", "tool_choice",
             "parallel_tool_calls", "response_format")
    assert parse(**dict.fromkeys(nulls)) == parse()


def test_values_are_carried() -> None:
    req = parse(
        model="demo", stream=True, stream_options={"include_usage": True}, temperature=0,
        top_p=0.5, top_k=40, min_p=0.1, repetition_penalty=1.1, seed=-3,
        parallel_tool_calls=False,
    )
    assert req.model == "demo"
    assert req.stream is True and req.include_usage is True
    assert req.temperature == 0.0 and isinstance(req.temperature, float)
    assert req.top_p == 0.5
    assert req.top_k == 40
    assert req.min_p == 0.1
    assert req.repetition_penalty == 1.1
    assert req.seed == -3
    assert req.parallel_tool_calls is False


def test_stream_options_include_usage_false() -> None:
    assert parse(stream=True, stream_options={}).include_usage is False
    assert parse(stream=True, stream_options={"include_usage": False}).include_usage is False
    assert parse(stream=True,
                 stream_options={"include_obfuscation": False}).include_usage is False


# --------------------------------------------------------------------------- max tokens


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"max_tokens": 7}, 7),
        ({"max_completion_tokens": 9}, 9),
        ({"max_tokens": 7, "max_completion_tokens": 3}, 3),
        ({"max_tokens": 3, "max_completion_tokens": 7}, 3),
        ({"max_tokens": None, "max_completion_tokens": 4}, 4),
        ({"max_tokens": 5.0}, 5),
        ({"max_tokens": 1}, 1),
    ],
    ids=["max_tokens", "max_completion_tokens", "min-completion", "min-tokens", "null-one",
         "integral-float", "one"],
)
def test_max_tokens(fields: dict[str, Any], expected: int) -> None:
    value = parse(**fields).max_tokens
    assert value == expected
    assert type(value) is int


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize(
    ("value", "code"),
    [
        (0, "invalid_value"),
        (-1, "invalid_value"),
        (0.0, "invalid_value"),
        (1.5, "invalid_type"),
        ("5", "invalid_type"),
        (True, "invalid_type"),
        (False, "invalid_type"),
        ([5], "invalid_type"),
    ],
    ids=["zero", "negative", "zero-float", "fraction", "string", "true", "false", "array"],
)
def test_max_tokens_rejected(key: str, value: Any, code: str) -> None:
    err = assert_error({"messages": [USER], key: value}, code, key)
    if code == "invalid_type":
        assert "integer" in err.message


def test_booleans_are_not_integers_anywhere() -> None:
    for key in ("seed", "top_k", "n"):
        assert_error({"messages": [USER], key: True}, "invalid_type", key)
    for key in ("temperature", "top_p", "min_p", "repetition_penalty"):
        assert_error({"messages": [USER], key: True}, "invalid_type", key)


def test_an_integer_past_64_bits_is_out_of_range_not_a_wrong_type() -> None:
    # orjson reads 2**64 as a float and 2**63 as an int; either way the client wrote an
    # integer, and the error must say that it is too large rather than not an integer.
    for literal in (b"18446744073709551616", b"9223372036854775808", b"-9223372036854775809"):
        value = orjson.loads(literal)
        err = assert_error({"messages": [USER], "seed": value}, "invalid_value", "seed")
        assert "outside the range of a 64-bit integer" in err.message, (literal, err.message)
    assert_error({"messages": [USER], "seed": 1e300}, "invalid_value", "seed")
    assert_error({"messages": [USER], "seed": 1.5e10 + 0.5}, "invalid_type", "seed")


def test_integral_floats_accepted_as_integers() -> None:
    req = parse(seed=42.0, top_k=3.0, n=1.0)
    assert req.seed == 42 and type(req.seed) is int
    assert req.top_k == 3 and type(req.top_k) is int


# --------------------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    ("key", "value", "code"),
    [
        ("temperature", -0.1, "invalid_value"),
        ("temperature", 2.01, "invalid_value"),
        ("temperature", "hot", "invalid_type"),
        ("temperature", float("nan"), "invalid_value"),
        ("top_p", 1.5, "invalid_value"),
        ("top_p", -0.5, "invalid_value"),
        ("top_p", [1], "invalid_type"),
        ("min_p", 2, "invalid_value"),
        ("repetition_penalty", -1, "invalid_value"),
        ("top_k", -1, "invalid_value"),
        ("top_k", 0.5, "invalid_type"),
        ("seed", "7", "invalid_type"),
        ("seed", 1.5, "invalid_type"),
        ("n", 9, "invalid_value"),
        ("n", 0, "invalid_value"),
        ("n", "1", "invalid_type"),
    ],
)
def test_number_errors(key: str, value: Any, code: str) -> None:
    assert_error({"messages": [USER], key: value}, code, key)


@pytest.mark.parametrize(
    ("key", "value"),
    [("temperature", 0), ("temperature", 2), ("top_p", 0), ("top_p", 1), ("min_p", 1)],
)
def test_range_bounds_are_inclusive(key: str, value: int) -> None:
    assert getattr(parse(**{key: value}), key) == float(value)


def test_n_one_accepted() -> None:
    assert parse(n=1) == parse()


# --------------------------------------------------------------------------- stop


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("END", ("END",)),
        (["a", "b"], ("a", "b")),
        (["b", "a", "b", "a"], ("b", "a")),
        (["x", "x", "x", "x"], ("x",)),
        ([], ()),
        (["\n"], ("\n",)),
    ],
    ids=["string", "list", "dedup-keeps-order", "all-same", "empty-list", "newline"],
)
def test_stop_normalised(value: Any, expected: tuple[str, ...]) -> None:
    stop = parse(stop=value).stop
    assert stop == expected
    assert isinstance(stop, tuple)


@pytest.mark.parametrize(
    ("value", "code", "param"),
    [
        ([f"s{i}" for i in range(17)], "invalid_value", "stop"),
        (["a"] * 17, "invalid_value", "stop"),
        (["a", 1], "invalid_type", "stop[1]"),
        (["a", None], "invalid_type", "stop[1]"),
        ([""], "invalid_value", "stop[0]"),
        ("", "invalid_value", "stop[0]"),
        (5, "invalid_type", "stop"),
        ({"a": 1}, "invalid_type", "stop"),
    ],
    ids=["seventeen", "seventeen-duplicates", "int-entry", "null-entry", "empty-entry",
         "empty-string", "number", "object"],
)
def test_stop_rejected(value: Any, code: str, param: str) -> None:
    assert_error({"messages": [USER], "stop": value}, code, param)


def test_stop_limit_is_openais_only_when_strict() -> None:
    """Continue's autocomplete sends every stop of its FIM template (five for StarCoder's)
    to any host but OpenAI's; OpenAI itself takes four, and so does ``[api] strict``."""
    stops = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>", "<|endoftext|>"]
    assert parse(stop=stops).stop == tuple(stops)
    assert parse(stop=stops * 3 + ["x"]).stop == (*stops, "x")
    assert_error({"messages": [USER], "stop": stops}, "invalid_value", "stop", strict=True)


# --------------------------------------------------------------------------- messages


def test_content_parts_joined_without_separator() -> None:
    req = parse(messages=[
        {"role": "system", "content": [{"type": "text", "text": "Be "},
                                       {"type": "text", "text": "brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "one"},
                                     {"type": "text", "text": ""},
                                     {"type": "text", "text": "two"}]},
    ])
    assert [m.content for m in req.messages] == ["Be brief.", "onetwo"]
    assert [m.role for m in req.messages] == ["system", "user"]


def test_empty_parts_list_is_empty_content() -> None:
    assert parse(messages=[{"role": "user", "content": []}]).messages[0].content == ""


def test_full_conversation() -> None:
    req = parse(messages=[
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": "Weather?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "function": {"name": "get_time"}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2",
         "content": [{"type": "text", "text": "noon"}]},
    ])
    assert req.messages[1].name == "ann"
    assistant = req.messages[2]
    assert assistant.content is None
    assert assistant.tool_calls == (
        ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}'),
        ToolCall(id="call_2", name="get_time", arguments="{}"),
    )
    assert req.messages[3] == Message(role="tool", content="sunny", tool_call_id="call_1")
    assert req.messages[4].content == "noon"


def test_assistant_with_empty_string_content_is_accepted() -> None:
    req = parse(messages=[USER, {"role": "assistant", "content": ""}, USER])
    assert req.messages[1] == Message(role="assistant", content="")


def test_an_assistants_refusal_sent_back_is_what_it_said() -> None:
    """OpenAI's answers carry refusals (afmd's too: ``content: null, refusal: "…"``), and
    clients append the answer to the history as it came."""
    said = "I can't help with that."
    for turn in ({"content": [{"type": "refusal", "refusal": said}]},
                 {"content": None, "refusal": said}, {"refusal": said}):
        req = parse(messages=[USER, {"role": "assistant", **turn}, USER])
        assert req.messages[1] == Message(role="assistant", content=said), turn
    both = parse(messages=[USER, {"role": "assistant", "content": "no", "refusal": said}, USER])
    assert both.messages[1].content == "no"
    mixed = [{"type": "text", "text": "a "}, {"type": "refusal", "refusal": "b"}]
    assert parse(messages=[USER, {"role": "assistant", "content": mixed}, USER]
                 ).messages[1].content == "a b"


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def _assistant(**fields: Any) -> list[dict[str, Any]]:
    return [USER, {"role": "assistant", **fields}, {"role": "user", "content": "more"}]


@pytest.mark.parametrize(
    ("messages", "code", "param"),
    [
        (None, "missing_required_parameter", "messages"),
        ("hi", "invalid_type", "messages"),
        ({"role": "user"}, "invalid_type", "messages"),
        ([], "invalid_value", "messages"),
        ([USER, "hi"], "invalid_type", "messages[1]"),
        ([{"content": "x"}], "missing_required_parameter", "messages[0].role"),
        ([{"role": 1, "content": "x"}], "invalid_type", "messages[0].role"),
        ([{"role": "bot", "content": "x"}], "invalid_value", "messages[0].role"),
        ([{"role": "User", "content": "x"}], "invalid_value", "messages[0].role"),
        ([{"role": "user"}], "missing_required_parameter", "messages[0].content"),
        ([{"role": "user", "content": None}], "missing_required_parameter",
         "messages[0].content"),
        ([USER, {"role": "user", "content": 42}], "invalid_type", "messages[1].content"),
        ([USER, {"role": "user", "content": {"text": "x"}}], "invalid_type",
         "messages[1].content"),
        ([{"role": "user", "content": ["x"]}], "invalid_type", "messages[0].content[0]"),
        ([{"role": "user", "content": [{"text": "x"}]}], "missing_required_parameter",
         "messages[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}],
         "missing_required_parameter", "messages[0].content[1].text"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "invalid_type",
         "messages[0].content[0].text"),
        ([{"role": "user", "content": [{"type": "video"}]}], "invalid_value",
         "messages[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "input_audio"}]}], "invalid_value",
         "messages[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64,iVBORw0KGgo=", "detail": 5}}]}], "invalid_type",
         "messages[0].content[0].image_url.detail"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64,iVBORw0KGgo=", "detail": "ultra"}}]}],
         "invalid_value", "messages[0].content[0].image_url.detail"),
        ([{"role": "user", "content": "x", "name": 5}], "invalid_type", "messages[0].name"),
        ([USER, {"role": "tool", "content": "x"}], "missing_required_parameter",
         "messages[1].tool_call_id"),
        ([USER, {"role": "tool", "content": "x", "tool_call_id": 1}], "invalid_type",
         "messages[1].tool_call_id"),
        ([USER, {"role": "tool", "content": "x", "tool_call_id": ""}], "invalid_value",
         "messages[1].tool_call_id"),
        (_assistant(), "missing_required_parameter", "messages[1].content"),
        (_assistant(refusal=3), "invalid_type", "messages[1].refusal"),
        (_assistant(content=[{"type": "refusal"}]), "missing_required_parameter",
         "messages[1].content[0].refusal"),
        ([{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}],
         "invalid_value", "messages[0].content[0].type"),
        (_assistant(content=None, tool_calls=[]), "missing_required_parameter",
         "messages[1].content"),
        (_assistant(content=None, function_call={"name": "f", "arguments": "{}"}),
         "invalid_value", "messages[1].function_call"),
        (_assistant(tool_calls={}), "invalid_type", "messages[1].tool_calls"),
        (_assistant(tool_calls=["x"]), "invalid_type", "messages[1].tool_calls[0]"),
        (_assistant(tool_calls=[CALL, {"type": "function", "function": {"name": "g"}}]),
         "missing_required_parameter", "messages[1].tool_calls[1].id"),
        (_assistant(tool_calls=[{**CALL, "id": 7}]), "invalid_type",
         "messages[1].tool_calls[0].id"),
        (_assistant(tool_calls=[{**CALL, "id": ""}]), "invalid_value",
         "messages[1].tool_calls[0].id"),
        (_assistant(tool_calls=[{**CALL, "type": "bogus"}]), "invalid_value",
         "messages[1].tool_calls[0].type"),
        (_assistant(tool_calls=[{"id": "c"}]), "missing_required_parameter",
         "messages[1].tool_calls[0].function"),
        (_assistant(tool_calls=[{"id": "c", "function": "f"}]), "invalid_type",
         "messages[1].tool_calls[0].function"),
        (_assistant(tool_calls=[CALL, {"id": "c2", "function": {"arguments": "{}"}}]),
         "missing_required_parameter", "messages[1].tool_calls[1].function.name"),
        (_assistant(tool_calls=[CALL, {"id": "c2", "function": {"name": 3}}]),
         "invalid_type", "messages[1].tool_calls[1].function.name"),
        (_assistant(tool_calls=[{"id": "c", "function": {"name": "f", "arguments": {}}}]),
         "invalid_type", "messages[1].tool_calls[0].function.arguments"),
        ([{"role": "system", "content": "x"}], "missing_user_message", "messages"),
        ([{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}],
         "missing_user_message", "messages"),
        ([USER, {"role": "assistant", "content": "y"}], "invalid_last_message",
         "messages[1].role"),
        ([{"role": "system", "content": "s"}, USER, {"role": "assistant", "content": "a"},
          USER, {"role": "assistant", "content": "b"}], "invalid_last_message",
         "messages[4].role"),
    ],
    ids=[
        "missing", "string", "object", "empty", "not-object", "role-missing", "role-type",
        "role-unknown", "role-case", "content-missing", "content-null", "content-number",
        "content-object", "part-not-object", "part-type-missing", "part-text-missing",
        "part-text-type", "part-unknown", "part-audio", "image-detail-type", "image-detail-value",
        "name-type",
        "tool-no-id", "tool-id-type", "tool-id-empty", "assistant-empty",
        "assistant-refusal-type", "assistant-refusal-part-missing", "user-refusal-part",
        "assistant-empty-calls", "assistant-function-call", "tool-calls-object",
        "tool-call-string", "tool-call-id-missing", "tool-call-id-type",
        "tool-call-id-empty", "tool-call-type", "tool-call-function-missing",
        "tool-call-function-type", "tool-call-name-missing", "tool-call-name-type",
        "tool-call-arguments-object", "no-user", "no-user-assistant", "trailing-assistant",
        "trailing-assistant-later",
    ],
)
def test_message_errors(messages: Any, code: str, param: str) -> None:
    body = {} if messages is None else {"messages": messages}
    assert_error(body, code, param)


@pytest.mark.parametrize(
    "url", ["https://example.com/cat.png", "data:,", "data:image/png;base64,@@@"],
    ids=["remote", "empty-data", "bad-base64"],
)
def test_unusable_image_part_rejected(url: str) -> None:
    """A text-only parser rejects the part's type; an image-aware one rejects the URL."""
    part = {"type": "image_url", "image_url": {"url": url}}
    err = error_of({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                              part]}]})
    assert err.status == 400
    assert (err.code, err.param) in {
        ("invalid_value", "messages[0].content[1].type"),
        ("unsupported_image_url", "messages[0].content[1].image_url.url"),
        ("invalid_image_url", "messages[0].content[1].image_url.url"),
    }, repr(err)


def test_trailing_assistant_with_tool_calls_is_rejected() -> None:
    # The precise problem is the unanswered call, not the position of the message.
    assert_error({"messages": [USER, {"role": "assistant", "tool_calls": [CALL]}]},
                 "missing_tool_output", "messages[1].tool_calls[0]")


def test_first_error_wins_in_message_order() -> None:
    err = assert_error(
        {"messages": [USER, {"role": "user", "content": 1}, {"role": "nobody"}]},
        "invalid_type", "messages[1].content",
    )
    assert "messages[1].content" in err.message


# --------------------------------------------------------------------------- tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": True,
    },
}


def test_tools_parsed() -> None:
    req = parse(tools=[WEATHER, {"type": "function", "function": {"name": "now-2_X"}}],
                tool_choice="auto")
    assert req.tools == (
        ToolSpec("get_weather", "Weather for a city",
                 {"type": "object", "properties": {"city": {"type": "string"}}}, True),
        ToolSpec("now-2_X", None, None, False),
    )
    assert req.tools[1].as_template_tool() == {
        "type": "function",
        "function": {"name": "now-2_X", "parameters": {"type": "object", "properties": {}}},
    }
    assert req.tools[0].as_template_tool()["function"]["description"] == "Weather for a city"


def test_tool_choices_are_distinguished() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    choices = [parse(tools=[WEATHER], tool_choice=c).tool_choice
               for c in ("none", "auto", "required", named)]
    assert all(c is not None for c in choices)
    assert len({repr(c) for c in choices}) == 4, choices


@pytest.mark.parametrize(
    "name",
    ["", "a" * 65, "has space", "dot.name", "ünï", "semi;colon", "slash/x"],
    ids=["empty", "too-long", "space", "dot", "non-ascii", "semicolon", "slash"],
)
def test_tool_name_rejected(name: str) -> None:
    tools = [WEATHER, {"type": "function", "function": {"name": name}}]
    assert_error({"messages": [USER], "tools": tools}, "invalid_value",
                 "tools[1].function.name")


def test_tool_name_of_64_characters_accepted() -> None:
    name = "A" * 64
    assert parse(tools=[{"type": "function", "function": {"name": name}}]).tools[0].name == name


def _tool(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", **function}}


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"tools": {"type": "function"}}, "invalid_type", "tools"),
        ({"tools": ["f"]}, "invalid_type", "tools[0]"),
        ({"tools": [{"function": {"name": "f"}}]}, "missing_required_parameter",
         "tools[0].type"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "invalid_value",
         "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "missing_required_parameter", "tools[0].function"),
        ({"tools": [{"type": "function", "function": []}]}, "invalid_type",
         "tools[0].function"),
        ({"tools": [{"type": "function", "function": {}}]}, "missing_required_parameter",
         "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": 1}}]}, "invalid_type",
         "tools[0].function.name"),
        ({"tools": [_tool(), _tool()]}, "invalid_value", "tools[1].function.name"),
        ({"tools": [_tool(description=1)]}, "invalid_type", "tools[0].function.description"),
        ({"tools": [_tool(parameters="{}")]}, "invalid_type", "tools[0].function.parameters"),
        ({"tools": [_tool(strict="yes")]}, "invalid_type", "tools[0].function.strict"),
        ({"tool_choice": "any"}, "invalid_value", "tool_choice"),
        ({"tool_choice": "required"}, "invalid_value", "tool_choice"),
        ({"tool_choice": 1}, "invalid_type", "tool_choice"),
        ({"tool_choice": {"foo": 1}}, "missing_required_parameter", "tool_choice.type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "function": {"name": "f"}}},
         "invalid_value", "tool_choice.type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}},
         "missing_required_parameter", "tool_choice.function"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "f"}},
         "invalid_type", "tool_choice.function"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}},
         "missing_required_parameter", "tool_choice.function.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": 1}}},
         "invalid_type", "tool_choice.function.name"),
        ({"parallel_tool_calls": "yes"}, "invalid_type", "parallel_tool_calls"),
    ],
    ids=["tools-object", "tool-string", "type-missing", "type-unknown", "function-missing",
         "function-type", "name-missing", "name-type", "duplicate", "description-type",
         "parameters-type", "strict-type", "choice-unknown", "required-without-tools",
         "choice-type", "choice-object-no-type", "choice-object-type", "choice-no-function",
         "choice-function-type", "choice-no-name", "choice-name-type", "parallel-type"],
)
def test_tool_errors(fields: dict[str, Any], code: str, param: str) -> None:
    assert_error({"messages": [USER], **fields}, code, param)


# --------------------------------------------------------------------------- other fields


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"model": 5}, "invalid_type", "model"),
        ({"stream": "true"}, "invalid_type", "stream"),
        ({"stream": 1}, "invalid_type", "stream"),
        ({"stream_options": {"include_usage": True}}, "invalid_value", "stream_options"),
        ({"stream": False, "stream_options": {}}, "invalid_value", "stream_options"),
        ({"stream": True, "stream_options": []}, "invalid_type", "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "invalid_type",
         "stream_options.include_usage"),
        ({"stream": True, "stream_options": {"chunk": 1}}, "unknown_parameter",
         "stream_options.chunk"),
        ({"stream": True, "stream_options": {"include_obfuscation": "no"}}, "invalid_type",
         "stream_options.include_obfuscation"),
        ({"top_logprobs": 2}, "invalid_value", "top_logprobs"),
        ({"logprobs": "no"}, "invalid_type", "logprobs"),
        ({"response_format": "json"}, "invalid_type", "response_format"),
        ({"response_format": {}}, "missing_required_parameter", "response_format.type"),
        ({"response_format": {"type": "xml"}}, "invalid_value", "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "a", "description": 5, "schema": {}}}}, "invalid_type",
         "response_format.json_schema.description"),
        ({"functions": [{"name": "f"}]}, "invalid_value", "functions"),
        ({"function_call": "auto"}, "invalid_value", "function_call"),
    ],
    ids=["model-type", "stream-string", "stream-int", "stream-options-without-stream",
         "stream-options-stream-false", "stream-options-type", "include-usage-type",
         "stream-option-unknown", "include-obfuscation-type",
         "top-logprobs-without-logprobs", "logprobs-type",
         "response-format-type",
         "response-format-no-type", "response-format-unknown", "json-schema-description",
         "functions", "function-call"],
)
def test_field_errors(fields: dict[str, Any], code: str, param: str) -> None:
    assert_error({"messages": [USER], **fields}, code, param)
    assert_error({"messages": [USER], **fields}, code, param, strict=True)


def test_a_function_message_is_refused_as_deprecated() -> None:
    """The SDK still types OpenAI's legacy ``role: "function"`` message; afmd refuses it
    as it refuses ``functions`` and ``function_call``, saying what to send instead (it
    listed the roles, as for a role that does not exist)."""
    err = assert_error({"messages": [USER, {"role": "function", "name": "f", "content": "1"}]},
                       "invalid_value", "messages[1].role")
    assert "deprecated" in err.message and "'tool'" in err.message


@pytest.mark.parametrize("field", ["temprature", "prompt"], ids=["typo", "prompt"])
def test_unknown_fields_ignored_or_refused_when_strict(field: str) -> None:
    assert parse(**{field: 0.5}).ignored_fields == (field,)
    assert_error({"messages": [USER], field: 0.5}, "unknown_parameter", field, strict=True)


@pytest.mark.parametrize("tools", [[WEATHER], None], ids=["other-tool", "no-tools"])
def test_tool_choice_naming_an_absent_tool(tools: Any) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    err = error_of({"messages": [USER], "tools": tools, "tool_choice": choice})
    assert err.status == 400
    assert err.param == "tool_choice.function.name"
    assert err.code in ("invalid_value", "unknown_tool")
    assert "get_time" in err.message


def test_unknown_field_reported_before_message_errors() -> None:
    assert_error({"messages": "bad", "bogus": 1}, "unknown_parameter", "bogus", strict=True)
    assert_error({"messages": "bad", "bogus": 1}, "invalid_type", "messages")


def test_response_format() -> None:
    assert parse(response_format={"type": "text"}).response_format is None
    assert parse(response_format={"type": "json_object"}).response_format is not None


IGNORED = {
    "user": "u-1",
    "metadata": {"k": "v"},
    "store": False,
    "logprobs": False,
    "service_tier": "auto",
    "reasoning_effort": "low",
}


def _generation_inputs(req: ChatRequest) -> tuple[Any, ...]:
    """What decides the tokens generated (reasoning_effort may steer thinking models only)."""
    return (req.messages, req.model, req.stream, req.include_usage, req.max_tokens,
            req.temperature, req.top_p, req.top_k, req.min_p, req.repetition_penalty,
            req.seed, req.stop, req.tools, req.response_format)


@pytest.mark.parametrize(("key", "value"), list(IGNORED.items()), ids=list(IGNORED))
def test_ignored_fields_accepted(key: str, value: Any) -> None:
    assert _generation_inputs(parse(**{key: value})) == _generation_inputs(parse())


def test_all_ignored_fields_together() -> None:
    assert _generation_inputs(parse(**IGNORED)) == _generation_inputs(parse())
    # OpenAI's own fields are known: X-AFM-Ignored-Fields names only unknown ones.
    assert parse(**IGNORED).ignored_fields == ()


def test_prediction_is_read_not_ignored() -> None:
    """Speculative decoding proposes the prediction's tokens, so its text reaches the
    engine (it changes the speed, never the tokens: tests/unit/engine/test_speculative.py)."""
    assert parse().prediction is None
    assert parse(prediction={"type": "content", "content": "x"}).prediction == "x"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = parse(prediction={"type": "content", "content": parts})
    assert (request.prediction, request.ignored_fields) == ("ab", ())


# --------------------------------------------------------------------------- echoed values

LONG = "v" * 200_000
FN = {"type": "function", "function": {"name": "f"}}
CALLED = {"role": "assistant", "content": None,
          "tool_calls": [{"id": "c1", "type": "function",
                          "function": {"name": "f", "arguments": "{}"}}]}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": [{"role": "user", "content": [{"type": LONG}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": [LONG]}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": LONG, "content": "x"}]}, "messages[0].role"),
        ({"tools": [{"type": LONG, "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": LONG}}]},
         "tools[0].function.name"),
        ({"tools": [FN], "tool_choice": LONG}, "tool_choice"),
        ({"tools": [FN], "tool_choice": {"type": LONG}}, "tool_choice.type"),
        ({"tools": [FN], "tool_choice": {"type": "function", "function": {"name": LONG}}},
         "tool_choice.function.name"),
        ({"tools": [FN], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
            "mode": LONG, "tools": [FN]}}}, "tool_choice.allowed_tools.mode"),
        ({"response_format": {"type": LONG}}, "response_format.type"),
        ({"reasoning_effort": LONG}, "reasoning_effort"),
        ({"messages": [USER, {**CALLED, "tool_calls": [{
            "id": "c1", "type": LONG, "function": {"name": "f"}}]}, USER]},
         "messages[1].tool_calls[0].type"),
        ({"messages": [USER, {**CALLED, "tool_calls": [{
            "id": LONG, "type": "function", "function": {"name": "f"}}]}]},
         "messages[1].tool_calls[0]"),
        ({"messages": [USER, {"role": "tool", "tool_call_id": LONG, "content": "x"}]},
         "messages[1].tool_call_id"),
        ({"messages": [USER, CALLED, {"role": "tool", "tool_call_id": LONG, "content": "x"}]},
         "messages[2].tool_call_id"),
    ],
    ids=["part-type", "part-type-array", "role", "tool-type", "tool-name", "tool-choice",
         "tool-choice-type", "tool-choice-name", "allowed-tools-mode", "response-format-type",
         "reasoning-effort", "tool-call-type", "unanswered-call-id", "orphan-tool-output",
         "unknown-tool-output"],
)
def test_long_value_is_cut_short_in_the_message(fields: dict[str, Any], param: str) -> None:
    fields.setdefault("messages", [USER])
    err = error_of(fields)
    assert err.param == param
    assert len(err.message) < 400, err.message[:500]
    assert re.search(r"\(2000\d\d characters\)", err.message), err.message


def test_long_unknown_field_names_are_cut_short() -> None:
    err = error_of({"messages": [USER], LONG: 1}, strict=True)
    assert err.code == "unknown_parameter"
    assert len(err.message) < 400 and "200000 characters" in err.message
    assert err.param is not None and len(err.param) <= 200 and err.param.startswith("vvv")
    err = error_of({"messages": [USER], "stream": True, "stream_options": {LONG: 1}})
    assert len(err.message) < 400 and err.param is not None and len(err.param) <= 200


def test_short_values_are_quoted_whole() -> None:
    err = error_of({"messages": [{"role": "user", "content": [{"type": "video"}]}]})
    assert "'video'" in err.message
    err = error_of({"messages": [{"role": "user", "content": [{"type": [1, "a"]}]}]})
    assert """'[1,"a"]'""" in err.message


@pytest.mark.parametrize("key", ["user", "safety_identifier", "prompt_cache_key"])
def test_ignored_string_fields_are_still_strings(key: str) -> None:
    """Accepted and not acted on, but of OpenAI's type: a number there is a client's bug
    OpenAI reports, as afmd's completions and embeddings do for ``user``."""
    assert_error({"messages": [USER], key: 5}, "invalid_type", key)
    assert parse(**{key: "ann"}).messages == (Message(role="user", content="Hello"),)
