"""Deeply nested values: a 400 naming the too-deep value, never a 500, never a huge body.

Python's repr of a nested list, jsonschema's metaschema check and the template's JSON
encoding all recurse once (or more) per level, so a value nested a thousand levels deep
used to end in ``RecursionError`` (500) wherever afmd touched it. Bodies here are written
as JSON text, not encoded from Python values: the client's own encoder would recurse too.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afmd.dialects.fields import nesting
from afmd.dialects.fields.body import parse_json_body
from afmd.dialects.fields.nesting import MAX_NESTING, nesting_path, param_of
from afmd.errors import InvalidRequestError

pytestmark = pytest.mark.slow  # property-based fuzzing of the nesting checks

USER = '{"role":"user","content":"Say something."}'

# How each kind of nesting is written: (opening text, closing text, leaf, path segment
# that each level adds).
NESTINGS: dict[str, tuple[str, str, str, str | int]] = {
    "array": ("[", "]", '"x"', 0),
    "object": ('{"a":', "}", "1", "a"),
    "schema": ('{"type":"array","items":', "}", "true", "items"),
}

# Where the nested value sits: (body with %s for it, path to it, kind of nesting).
PLACES: dict[str, tuple[str, list[str | int], str]] = {
    "content-part-type": (
        '{"messages":[{"role":"user","content":[{"type":%s}]}]}',
        ["messages", 0, "content", 0, "type"], "array"),
    "content-part-text": (
        '{"messages":[{"role":"user","content":[{"type":"text","text":%s}]}]}',
        ["messages", 0, "content", 0, "text"], "array"),
    "content-part-extra-field": (
        '{"messages":[{"role":"user","content":[{"type":"text","text":"hi","extra":%s}]}]}',
        ["messages", 0, "content", 0, "extra"], "object"),
    "tool-type": (
        '{"messages":[' + USER + '],"tools":[{"type":%s,"function":{"name":"f"}}]}',
        ["tools", 0, "type"], "array"),
    "tool-parameters": (
        '{"messages":[' + USER + '],"tools":[{"type":"function","function":'
        '{"name":"f","parameters":%s}}]}',
        ["tools", 0, "function", "parameters"], "schema"),
    "response-format-schema": (
        '{"messages":[' + USER + '],"response_format":{"type":"json_schema",'
        '"json_schema":{"name":"x","schema":%s}}}',
        ["response_format", "json_schema", "schema"], "schema"),
    "tool-call-arguments": (
        '{"messages":[' + USER + ',{"role":"assistant","content":null,"tool_calls":[{"id":'
        '"call_1","type":"function","function":{"name":"f","arguments":%s}}]},{"role":"tool",'
        '"tool_call_id":"call_1","content":"ok"}]}',
        ["messages", 1, "tool_calls", 0, "function", "arguments"], "object"),
    "stop": ('{"messages":[' + USER + '],"stop":%s}', ["stop"], "array"),
    "metadata": ('{"messages":[' + USER + '],"metadata":{"k":%s}}', ["metadata", "k"],
                 "object"),
    "unknown-field": ('{"messages":[' + USER + '],"surprise":%s}', ["surprise"], "array"),
}

DEPTHS = [100, 500, 900, 1000, 1023, 2000]


def body_text(place: str, levels: int) -> bytes:
    """The request of ``place`` with a value nested ``levels`` containers deep."""
    template, _, kind = PLACES[place]
    opening, closing, leaf, _ = NESTINGS[kind]
    # A few tokens, for the requests that are fine and generate.
    template = template.replace('{"messages"', '{"max_tokens":4,"messages"', 1)
    return (template % (opening * levels + leaf + closing * levels)).encode()


def first_too_deep(place: str) -> tuple[int, str]:
    """How many levels of the value fit, and the param naming the first that does not.

    Each segment of the path to the value is one enclosing container (the body itself for
    the first), so the value's first level sits at depth ``len(path) + 1``.
    """
    _, path, kind = PLACES[place]
    fitting = MAX_NESTING - len(path)
    segment = NESTINGS[kind][3]
    return fitting, param_of([*path, *[segment] * fitting])


def post(http: httpx.Client, raw: bytes) -> httpx.Response:
    return http.post("/v1/chat/completions", content=raw,
                     headers={"Content-Type": "application/json"})


def check_too_deep(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text[:500]
    assert len(response.content) < 2048, len(response.content)
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "invalid_value", param, "invalid_request_error"), error
    assert f"{MAX_NESTING} levels" in error["message"], error


# --------------------------------------------------------------------------- the server


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("place", list(PLACES))
def test_deep_value_is_a_400_naming_it(http: httpx.Client, place: str, depth: int) -> None:
    _, param = first_too_deep(place)
    check_too_deep(post(http, body_text(place, depth)), param)


@pytest.mark.parametrize("place", list(PLACES))
def test_one_level_past_the_limit_is_refused(http: httpx.Client, place: str) -> None:
    fitting, param = first_too_deep(place)
    check_too_deep(post(http, body_text(place, fitting + 1)), param)


@pytest.mark.parametrize("place", list(PLACES))
def test_the_deepest_allowed_value_is_never_a_500(http: httpx.Client, place: str) -> None:
    """At the limit every later stage (schema checks, grammar compile, template) copes: the
    answer is whatever the field deserves, with a small body."""
    fitting, _ = first_too_deep(place)
    response = post(http, body_text(place, fitting))
    assert response.status_code in (200, 400), response.text[:500]
    assert response.headers["content-type"].startswith("application/json")
    if response.status_code == 400:
        assert len(response.content) < 2048, len(response.content)
        error = response.json()["error"]
        assert error["param"] is not None and error["param"].startswith(param_of(
            PLACES[place][1])), error
        assert f"{MAX_NESTING} levels" not in error["message"], error


# Schema keywords by how they nest: (opening text, closing text, levels each adds).
SCHEMA_SHAPES: dict[str, tuple[str, str, int]] = {
    "items": ('{"type":"array","items":', "}", 1),
    "not": ('{"not":', "}", 1),
    "additionalProperties": ('{"type":"object","additionalProperties":', "}", 1),
    "if": ('{"if":', ',"then":true}', 1),
    "anyOf": ('{"anyOf":[', "]}", 2),
    "properties": ('{"type":"object","properties":{"a":', "}}", 2),
    "prefixItems": ('{"type":"array","prefixItems":[', "]}", 2),
    "$defs": ('{"$defs":{"a":', "}}", 2),
    "allOf-properties": ('{"allOf":[{"properties":{"a":', "}}]}", 4),
}


@pytest.mark.parametrize("where", ["response_format", "tool_choice-required"])
@pytest.mark.parametrize("shape", list(SCHEMA_SHAPES))
def test_schemas_as_deep_as_allowed_are_served(
    http: httpx.Client, shape: str, where: str
) -> None:
    """jsonschema's checks, the grammar's copy of the schema and its compile all recurse
    per level: within the limit, every way of nesting a schema still compiles and runs."""
    opening, closing, per_level = SCHEMA_SHAPES[shape]
    above = 3 if where == "response_format" else 4  # containers around the schema
    levels = (MAX_NESTING - above) // per_level
    schema = opening * levels + "true" + closing * levels
    if where == "response_format":
        extra = f'"response_format":{{"type":"json_schema","json_schema":{{"name":"x",' \
                f'"schema":{schema}}}}}'
    else:
        extra = f'"tools":[{{"type":"function","function":{{"name":"f","parameters":' \
                f'{schema}}}}}],"tool_choice":"required"'
    raw = ('{"max_tokens":8,"messages":[' + USER + "]," + extra + "}").encode()
    response = post(http, raw)
    assert response.status_code == 200, response.text[:500]


# --------------------------------------------------------------------------- the walker


def nested_list(levels: int) -> Any:
    return orjson.loads("[" * levels + "]" * levels)


def test_nesting_path_of_shallow_values_is_none() -> None:
    assert nesting_path({"a": [1, {"b": "c"}], "d": {}}, 3) is None
    assert nesting_path("text", 0) is None
    assert nesting_path(nested_list(64), 64) is None
    assert nesting_path([0] * 10_000 + [[[]]], 3) is None


def test_nesting_path_names_the_first_too_deep_value_in_document_order() -> None:
    value = {"a": [1, [2]], "b": [[[3]]], "c": [[[[4]]]]}
    assert nesting_path(value, 3) == ["b", 0, 0]
    assert nesting_path(value, 4) == ["c", 0, 0, 0]
    assert nesting_path(value, 5) is None
    assert nesting_path(nested_list(1000), 64) == [0] * 64
    assert nesting_path([{}, {"x": {"y": []}}], 3) == [1, "x", "y"]


def test_body_nested_beyond_the_limit_is_refused_with_its_path() -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_json_body(b'{"a": [1, {"b": ' + b"[" * 70 + b"]" * 70 + b"}]}")
    err = info.value
    assert (err.status, err.code) == (400, "invalid_value")
    assert err.param == param_of(["a", 1, "b", *[0] * (MAX_NESTING - 4)])


def test_body_beyond_the_json_parsers_own_limit_gets_the_same_path() -> None:
    """orjson refuses more than 1024 levels before afmd sees a value; the path is then
    read from the text, keys with escapes included."""
    for levels in (1023, 1030, 5000):
        raw = b'{"x\\"y": [7, {"k": ' + b"[" * levels + b"]" * levels + b"}]}"
        with pytest.raises(InvalidRequestError) as info:
            parse_json_body(raw)
        assert info.value.code == "invalid_value"
        assert info.value.param == param_of(['x"y', 1, "k", *[0] * (MAX_NESTING - 4)])
    # A syntax error before the nesting is still a syntax error.
    with pytest.raises(InvalidRequestError) as info:
        parse_json_body(b'{"a": tru, "b": ' + b"[" * 2000 + b"]" * 2000 + b"}")
    assert (info.value.code, info.value.param) == ("invalid_json", None)


def test_param_of_renders_afmd_paths_and_stays_short() -> None:
    assert param_of(["messages", 0, "content", 1, "type"]) == "messages[0].content[1].type"
    assert param_of(["tools", 0, "function", "parameters", "properties", "a b"]) == (
        'tools[0].function.parameters.properties["a b"]')
    assert param_of(["", 3]) == '[""][3]'
    long = param_of(["messages", 0, "content", 0, "type", *[0] * 500])
    assert len(long) <= 160 and long.startswith("messages[0].content[0].type[0]")
    assert "…" in long and long.endswith("[0]")
    assert param_of(["k" * 100_000, 0]) == '["' + "k" * 40 + '…"][0]'


# Strings full of what could fool a scan of the text: quotes, brackets, backslash runs.
_TRICKY = st.text(alphabet='ab"\\[]{},:é', max_size=6)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | _TRICKY,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TRICKY, inner, max_size=3),
    max_leaves=25,
)


@settings(max_examples=300, deadline=None)
@given(value=_JSON, limit=st.integers(1, 6), chunk=st.sampled_from([1, 2, 3, 5, 1 << 20]),
       indent=st.sampled_from([None, 1]), ascii_only=st.booleans())
def test_text_scan_agrees_with_the_walker(
    value: Any, limit: int, chunk: int, indent: int | None, ascii_only: bool
) -> None:
    """Escapes, brackets inside strings and chunk edges (tiny chunks put every byte on
    one) never mislead the scan of the text."""
    raw = json.dumps(value, indent=indent, ensure_ascii=ascii_only).encode()
    old, nesting._CHUNK = nesting._CHUNK, chunk
    try:
        from_text = nesting.nesting_path_in_text(raw, limit)
    finally:
        nesting._CHUNK = old
    assert from_text == nesting_path(value, limit)
    assert nesting.nests_deeper_than(value, limit) == (from_text is not None)
