"""Apple's model's request mapping, piece by piece: JSON Schemas rewritten for the
framework's ``GenerationSchema`` (and values read back), tools' arguments schemas built
from properties, and a conversation split into instructions, transcript and prompt.

Every converted schema is checked by the stand-in's decoder, which takes only the keywords
Apple's own encoded schemas use, and a value of it (as the framework would generate it) is
read back and validated against the client's schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import jsonschema
import pytest

from afmd.core.request import ChatRequest, ImageInput, Message, ToolCall
from afmd.engine.apple import conversation, schemas, tools
from afmd.engine.apple.conversation import ToolDef

from helpers.system_model import standin


@pytest.fixture(scope="module")
def native() -> Iterator[ModuleType]:
    with standin() as module:
        yield module


@pytest.fixture(scope="module")
def fm(native: ModuleType) -> ModuleType:
    import apple_fm_sdk

    return apple_fm_sdk


CASES: list[tuple[str, dict[str, Any], bool]] = [
    ("plain object", {"type": "object", "properties": {"a": {"type": "string"},
                                                        "b": {"type": "integer"}},
                      "required": ["a"]}, False),
    ("enum and bounds", {"type": "object", "properties": {
        "c": {"type": "string", "enum": ["x", "y"]},
        "n": {"type": "number", "minimum": 0, "maximum": 1},
        "i": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
        "required": ["c", "n", "i"]}, False),
    ("nullable type arrays", {"type": "object", "properties": {
        "s": {"type": ["string", "null"]}, "m": {"type": ["integer", "string"]}},
        "required": ["s", "m"]}, False),
    ("oneOf and anyOf", {"type": "object", "properties": {
        "u": {"oneOf": [{"type": "string"}, {"type": "boolean"}]},
        "v": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}, "required": ["u", "v"]},
     False),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}},
                          "required": ["a"]},
                         {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]}, False),
    ("local refs", {"definitions": {"P": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"]}},
        "type": "object", "properties": {"p": {"$ref": "#/definitions/P"},
                                         "q": {"$ref": "#/properties/p"},
                                         "ps": {"type": "array", "items": {"$ref":
                                                                           "#/definitions/P"}}},
        "required": ["p", "q", "ps"]}, False),
    ("recursion", {"$defs": {"Node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"},
                                           "maxItems": 2}}, "required": ["v", "kids"]}},
        "$ref": "#/$defs/Node"}, False),
    ("root recursion", {"type": "object", "properties": {
        "name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"},
                                                 "maxItems": 1}},
        "required": ["name", "children"]}, False),
    ("const", {"type": "object", "properties": {"k": {"const": "fixed"}},
               "required": ["k"]}, False),
    ("pattern and lengths", {"type": "object", "properties": {
        "p": {"type": "string", "pattern": "^a+$", "minLength": 2}}, "required": ["p"]}, True),
    ("a map", {"type": "object", "properties": {"tags": {
        "type": "object", "additionalProperties": {"type": "string"}}},
        "required": ["tags"]}, True),
    ("non-string enum", {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}},
                         "required": ["n"]}, True),
]


@pytest.mark.parametrize(("name", "schema", "downgraded"), CASES, ids=[c[0] for c in CASES])
def test_schemas_become_the_frameworks_subset_and_values_come_back(
        native: ModuleType, name: str, schema: dict[str, Any], downgraded: bool) -> None:
    converted = schemas.convert(schema, title="Case Name")
    native.check_schema(converted.schema)  # Apple's keywords only
    assert converted.downgraded is downgraded, converted.described
    generated = native.synthesize(converted.schema, converted.schema)
    assert native.conforms(generated, converted.schema) is None
    restored = schemas.restore(generated, schema)
    if not downgraded:
        jsonschema.validate(restored, schema)


def test_what_cannot_be_enforced_is_described() -> None:
    converted = schemas.convert({"type": "object", "properties": {
        "p": {"type": "string", "pattern": "^a+$", "minLength": 2, "description": "Code."}}})
    described = converted.schema["properties"]["p"]["description"]
    assert described == "Code. It must match the regular expression ^a+$. At least 2 characters."
    assert converted.described == ["pattern", "minLength"]


def test_null_and_json_text_are_read_back() -> None:
    schema = {"type": "object", "properties": {
        "note": {"type": ["string", "null"]},
        "tags": {"type": "object", "additionalProperties": {"type": "integer"}},
        "n": {"enum": [1, 2]}}, "required": ["note", "tags", "n"]}
    assert schemas.restore({"tags": '{"a": 1}', "n": "2"}, schema) == {
        "tags": {"a": 1}, "n": 2, "note": None}


def test_a_remote_ref_is_no_schema_for_the_framework() -> None:
    with pytest.raises(schemas.SchemaError, match="only local"):
        schemas.convert({"$ref": "https://example.com/schema.json"})


@pytest.mark.parametrize("index", ["1", "\u00b2", "\u2460"])
def test_a_reference_into_a_list_needs_an_ascii_index_in_range(index: str) -> None:
    schema = {"type": "object", "properties": {
        "a": {"anyOf": [{"type": "integer"}]}, "b": {"$ref": f"#/properties/a/anyOf/{index}"}}}
    with pytest.raises(schemas.SchemaError, match="points at nothing"):
        schemas.convert(schema)


def test_forced_calls_are_a_schema_of_calls(native: ModuleType) -> None:
    params = {"$defs": {"City": {"type": "object", "properties": {"name": {"type": "string"}},
                                 "required": ["name"]}},
              "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
              "required": ["city"]}
    calls = schemas.calls_schema([("weather", params), ("noop", None)], parallel=True)
    native.check_schema(calls.schema)
    assert set(calls.schema["$defs"]) == {"Call_weather", "Call_noop", "T0_City"}
    one = native.synthesize(calls.schema, calls.schema)
    assert one == {"tool_calls": [{"name": "weather", "arguments": {"city": {"name": "text"}}}]}
    single = schemas.calls_schema([("weather", params)], parallel=False).schema
    assert single["properties"]["tool_calls"]["maxItems"] == 1


def _tool(parameters: Any, name: str = "lookup") -> ToolDef:
    converted = schemas.convert_parameters(parameters, title=name)
    return ToolDef(name, "", converted.schema, parameters)


def test_tool_arguments_are_a_generation_schema_of_properties(fm: ModuleType) -> None:
    parameters = {"type": "object", "properties": {
        "max-results": {"type": "integer", "minimum": 1, "maximum": 50},  # not an identifier
        "from": {"type": "string", "enum": ["a", "b"]},  # a Python keyword
        "where": {"type": "object", "properties": {"lat": {"type": "number"}},
                  "required": ["lat"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "spots": {"type": "array", "items": {"$ref": "#/$defs/Spot"}, "maxItems": 2},
        "flags": {"type": "array", "items": {"type": "boolean"}},  # no such framework array
        "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        "maybe": {"type": ["string", "null"]},
    }, "required": ["max-results", "from", "where", "tags", "spots", "flags", "either", "maybe"],
        "$defs": {"Spot": {"type": "object", "properties": {"name": {"type": "string"}},
                           "required": ["name"]}}}
    tool = _tool(parameters)
    schema, shape = tools.arguments_schema(fm, tool)
    built = schema.to_dict()  # the framework resolves every named type: no error
    props = built["properties"]
    assert list(props) == list(parameters["properties"])
    assert props["max-results"] == {"type": "integer", "minimum": 1, "maximum": 50}
    assert props["from"]["enum"] == ["a", "b"]
    assert props["where"]["$ref"].startswith("#/$defs/") and "Spot" in built["$defs"]
    assert props["tags"] == {"type": "array", "items": {"type": "string"}, "minItems": 1,
                             "maxItems": 3}
    assert props["flags"]["type"] == "string" and props["either"]["type"] == "string"
    assert "maybe" not in built["required"]
    generated = {"max-results": 3, "from": "a", "where": {"lat": 1.5}, "tags": ["x"],
                 "spots": [{"name": "s"}], "flags": "[true, false]", "either": "7"}
    assert tools.restore_arguments(generated, shape, tool) == {
        "max-results": 3, "from": "a", "where": {"lat": 1.5}, "tags": ["x"],
        "spots": [{"name": "s"}], "flags": [True, False], "either": 7, "maybe": None}
    jsonschema.validate(tools.restore_arguments(generated, shape, tool), parameters)


def test_a_tool_without_parameters_takes_an_empty_object(fm: ModuleType) -> None:
    for parameters in (None, {"type": "object"}, {"type": "object", "properties": {}}):
        schema, _ = tools.arguments_schema(fm, _tool(parameters))
        assert schema.to_dict()["properties"] == {}


def _request(*messages: Message, **fields: Any) -> ChatRequest:
    return ChatRequest(messages=messages, **fields)


def test_the_conversation_splits_into_instructions_transcript_and_prompt() -> None:
    turn = conversation.system_turn(_request(
        Message("user", "a"),
        Message("system", "S1"),
        Message("assistant", "b", tool_calls=(ToolCall("call_1", "f", '{"x":1}'),)),
        Message("tool", "out", tool_call_id="call_1"),
        Message("developer", "D1"),
        Message("user", "c"),
        Message("user", "d", images=(ImageInput(b"PNG", "messages[6].content[1]", 1),),
                has_images=True),
    ), instructions="OP", first_step=True)
    assert turn.instructions == "OP\n\nS1\n\nD1"
    assert [e["role"] for e in turn.history] == ["user", "response", "response", "tool"]
    # The text, then the calls in an entry of their own, as the framework writes them.
    assert turn.history[1]["contents"][0]["text"] == "b" and "toolCalls" not in turn.history[1]
    assert set(turn.history[2]) == {"id", "role", "toolCalls"}
    assert turn.history[2]["toolCalls"] == [{"id": "call_1", "name": "f",
                                             "arguments": '{"x":1}'}]
    assert turn.history[3]["toolName"] == "f"
    assert turn.prompt == ("c\n\nd", conversation.PromptImage(b"PNG", "messages[6].content[1]"))
    transcript = turn.transcript()
    assert transcript["transcript"]["entries"][0]["role"] == "instructions"
    json.dumps(transcript)  # plain JSON, as Transcript.from_dict takes it


def test_a_conversation_ending_in_tool_outputs_has_an_empty_prompt() -> None:
    turn = conversation.system_turn(_request(
        Message("user", "a"),
        Message("assistant", None, tool_calls=(ToolCall("call_1", "f", "{}"),)),
        Message("tool", "out", tool_call_id="call_1"),
    ), instructions="", first_step=True)
    assert turn.prompt == ("",) and turn.prompt_text == ""
    assert [e["role"] for e in turn.history] == ["user", "response", "tool"]


def test_bounds_the_framework_cannot_take_are_not_given(fm: ModuleType) -> None:
    """The SDK's Swift side turns a bound into ``Int(Double)`` and ``min...max``, which end
    the process on a 64-bit overflow or a minimum above the maximum: such bounds never
    reach it, and a fractional bound of an integer is rounded inwards."""
    parameters = {"type": "object", "properties": {
        "huge": {"type": "integer", "minimum": 0, "maximum": 9223372036854775807},
        "wide": {"type": "integer", "minimum": -1e30, "maximum": 1e20},
        "upside": {"type": "number", "minimum": 5, "maximum": 1},
        "fraction": {"type": "integer", "minimum": 0.5, "maximum": 9.5},
        "empty": {"type": "integer", "minimum": 1.2, "maximum": 1.8},
        "sizes": {"type": "array", "items": {"type": "integer", "maximum": 2 ** 64},
                  "minItems": 3, "maxItems": 1},
    }, "required": ["huge", "wide", "upside", "fraction", "empty", "sizes"]}
    converted = schemas.convert_parameters(parameters, title="bounds")
    props = converted.schema["properties"]
    assert props["huge"] == {"type": "integer", "minimum": 0}
    assert props["wide"] == {"type": "integer"}
    assert props["upside"] == {"type": "number"}
    assert props["fraction"] == {"type": "integer", "minimum": 1, "maximum": 9}
    assert props["empty"] == {"type": "integer"}
    assert props["sizes"] == {"type": "array", "items": {"type": "integer"}}
    assert converted.downgraded  # the contradictions are the client's: not enforced
    schema, _ = tools.arguments_schema(fm, _tool(parameters, "bounds"))
    schema.to_dict()  # built without a trap
    answer = schemas.convert(parameters)
    assert answer.schema["properties"]["upside"] == {"type": "number"}


def test_a_type_named_optional_is_still_required(fm: ModuleType) -> None:
    """The SDK reads a property as optional when ``"Optional"`` is in ``str`` of its type."""
    parameters = {"type": "object", "properties": {
        "OptionalSettings": {"type": "object", "properties": {"a": {"type": "string"}},
                             "required": ["a"]},
        "items": {"type": "array", "items": {"$ref": "#/$defs/OptionalItem"}},
    }, "required": ["OptionalSettings", "items"],
        "$defs": {"OptionalItem": {"type": "object", "properties": {"b": {"type": "string"}},
                                   "required": ["b"]}}}
    schema, _ = tools.arguments_schema(fm, _tool(parameters))
    built = schema.to_dict()
    assert built["required"] == ["OptionalSettings", "items"]
    assert any("Optional" in name for name in built["$defs"])  # the name itself is kept
