"""The grammar's copy of a schema (afmd.grammar.schema_copy): re-rooted references, closed
objects, dates narrowed to what parsers read.

Pure unit tests on pydantic-shaped schemas. Whether a copy means the same thing is checked
with ``jsonschema`` itself: re-rooted, it accepts and rejects exactly what the original
does; closed, it rejects keys outside ``properties`` and still accepts every closed value.
"""

from __future__ import annotations

import copy
import datetime
import json
import re
from typing import Any, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field
from referencing.exceptions import Unresolvable

from afmd.grammar.schema_copy import DATE_PATTERNS, closed, reroot

ARGS = ("properties", "arguments")


class Leaf(BaseModel):
    v: int = Field(ge=0, le=9)


class Node(BaseModel):
    name: str
    kids: list[Node] = []


class Box(BaseModel):
    leaf: Leaf = Field(description="one leaf")
    leaves: list[Leaf]
    maybe: Leaf | None = None
    tree: Node
    mode: Literal["a", "b"] = "a"


def draft7(schema: dict[str, Any]) -> dict[str, Any]:
    """The same schema as older tools write it: ``definitions`` and draft-07 pointers."""
    text = json.dumps(schema).replace('"$defs"', '"definitions"')
    return json.loads(text.replace("#/$defs/", "#/definitions/"))


BOX = Box.model_json_schema()
BOX7 = draft7(BOX)
GOOD = {"leaf": {"v": 1}, "leaves": [{"v": 2}], "maybe": {"v": 3},
        "tree": {"name": "r", "kids": [{"name": "k", "kids": []}]}}
BAD = [
    {**GOOD, "leaf": {"v": 10}},  # a nested model's bound
    {**GOOD, "leaves": [{"v": "x"}]},  # a list of models
    {**GOOD, "maybe": {"w": 1}},  # Optional: the model branch
    {**GOOD, "tree": {"name": "r", "kids": [{"kids": []}]}},  # recursion
]


def wrapper(arguments: dict[str, Any], name: str = "f") -> dict[str, Any]:
    """A call schema as the tool grammar builds it."""
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def valid(schema: dict[str, Any], value: Any) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def object_nodes(schema: Any) -> list[dict[str, Any]]:
    """Every schema with ``properties`` (in pydantic's output: each model once)."""
    found = []
    if isinstance(schema, dict):
        if isinstance(schema.get("properties"), dict) and "title" in schema:
            found.append(schema)
        for value in schema.values():
            found += object_nodes(value)
    elif isinstance(schema, list):
        for value in schema:
            found += object_nodes(value)
    return found


# ------------------------------------------------------------------------------ re-rooting


@pytest.mark.parametrize("schema", [BOX, BOX7], ids=["$defs", "definitions"])
def test_embedded_references_resolve_to_the_same_definitions(schema: dict[str, Any]) -> None:
    with pytest.raises(Unresolvable):  # what used to happen
        jsonschema.validate({"name": "f", "arguments": GOOD}, wrapper(schema))
    embedded = wrapper(reroot(schema, ARGS))
    assert valid(embedded, {"name": "f", "arguments": GOOD})
    for bad in BAD:
        assert valid(schema, GOOD) and not valid(schema, bad)
        assert not valid(embedded, {"name": "f", "arguments": bad}), bad


def test_every_local_pointer_gets_the_prefix_and_nothing_else_changes() -> None:
    schema = {
        "type": "object",
        "properties": {
            "self": {"$ref": "#"},
            "sibling": {"$ref": "#/properties/leaf"},
            "leaf": {"$ref": "#/$defs/A~1B"},
            "anchored": {"$ref": "#here"},
            "remote": {"$ref": "https://example.com/s.json"},
            # Not schemas: a property named $ref and values that look like references.
            "$ref": {"const": {"$ref": "#/$defs/A~1B"}, "enum": ["#/x"]},
        },
        "$defs": {"A/B": {"type": "integer"}},
    }
    out = reroot(schema, ("anyOf", "1", "properties", "arguments"))
    props = out["properties"]
    prefix = "#/anyOf/1/properties/arguments"
    assert props["self"] == {"$ref": prefix}
    assert props["sibling"] == {"$ref": prefix + "/properties/leaf"}
    assert props["leaf"] == {"$ref": prefix + "/$defs/A~1B"}
    assert props["anchored"] == {"$ref": "#here"}
    assert props["remote"] == {"$ref": "https://example.com/s.json"}
    assert props["$ref"] == schema["properties"]["$ref"]
    assert out["$defs"] == schema["$defs"]


def test_a_schema_with_its_own_id_is_its_own_resource() -> None:
    schema = {"$id": "https://example.com/p", **BOX}
    assert reroot(schema, ARGS) == schema
    nested = {"type": "object", "properties": {"x": {"$id": "https://example.com/x",
                                                     "$ref": "#/$defs/D",
                                                     "$defs": {"D": {"type": "integer"}}}}}
    assert reroot(nested, ARGS) == nested


def test_same_named_definitions_of_several_tools_stay_apart() -> None:
    one = {"type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}},
           "required": ["item"], "$defs": {"Item": {"type": "integer"}}}
    two = {"type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}},
           "required": ["item"], "$defs": {"Item": {"type": "string"}}}
    both = {"anyOf": [wrapper(reroot(one, ("anyOf", "0", *ARGS)), "one"),
                      wrapper(reroot(two, ("anyOf", "1", *ARGS)), "two")]}
    assert valid(both, {"name": "one", "arguments": {"item": 1}})
    assert valid(both, {"name": "two", "arguments": {"item": "x"}})
    assert not valid(both, {"name": "one", "arguments": {"item": "x"}})
    assert not valid(both, {"name": "two", "arguments": {"item": 1}})


# --------------------------------------------------------------------------------- closing


@pytest.mark.parametrize("schema", [BOX, BOX7], ids=["$defs", "definitions"])
def test_pydantic_models_are_closed_everywhere(schema: dict[str, Any]) -> None:
    out = closed(schema)
    models = object_nodes(out)
    assert len(models) == 3  # Box, Leaf, Node (each once: references are not copies)
    assert all(m["additionalProperties"] is False for m in models)
    assert valid(out, GOOD)
    extra = [
        {**GOOD, "extra": 1},
        {**GOOD, "leaf": {"v": 1, "extra": 1}},
        {**GOOD, "leaves": [{"v": 1, "extra": 1}]},
        {**GOOD, "maybe": {"v": 1, "extra": 1}},
        {**GOOD, "tree": {"name": "r", "kids": [{"name": "k", "extra": 1}]}},
    ]
    for value in extra:
        assert valid(schema, value) and not valid(out, value), value
    # Closed composes with re-rooting, as the tool grammar uses them.
    embedded = wrapper(reroot(out, ARGS))
    assert valid(embedded, {"name": "f", "arguments": GOOD})
    assert not valid(embedded, {"name": "f", "arguments": extra[-1]})


def test_the_clients_schema_is_never_changed() -> None:
    for schema in (BOX, BOX7, COMPOSED):
        before = copy.deepcopy(schema)
        closed(schema)
        reroot(closed(schema), ARGS)
        assert schema == before


OPEN_OBJECT = {"type": "object"}
COMPOSED = {
    "type": "object",
    "allOf": [{"$ref": "#/$defs/Base"},
              {"properties": {"b": {"type": "integer"}}, "required": ["b"]}],
    "unevaluatedProperties": False,
    "$defs": {"Base": {"type": "object", "properties": {"a": {"type": "integer"}},
                       "required": ["a"]}},
}


@pytest.mark.parametrize(
    ("schema", "value"),
    [
        (OPEN_OBJECT, {"any": 1}),
        ({"type": "object", "properties": {}}, {"any": 1}),
        ({"type": "object", "properties": {"a": {}}, "additionalProperties": True},
         {"a": 1, "b": 2}),
        ({"type": "object", "properties": {"a": {}},
          "additionalProperties": {"type": "integer"}}, {"a": 1, "b": 2}),
        ({"type": "object", "properties": {"a": {}},
          "patternProperties": {"^x": {"type": "integer"}}}, {"a": 1, "x1": 2}),
        ({"type": "object", "properties": {"a": {}}, "unevaluatedProperties": True},
         {"a": 1, "b": 2}),
        (COMPOSED, {"a": 1, "b": 2}),
        ({"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}, {"a": 1, "b": 2}),
        ({"type": "object", "properties": {"a": {}}, "minProperties": 2}, {"a": 1, "b": 2}),
        ({"type": "object", "properties": {"a": {}},
          "$ref": "#/$defs/B", "$defs": {"B": {"properties": {"b": {}}}}}, {"a": 1, "b": 2}),
        # The same definition extended with a sibling keyword where it is used.
        ({"type": "object", "properties": {"x": {"$ref": "#/$defs/B", "required": ["c"]}},
          "required": ["x"], "$defs": {"B": {"properties": {"b": {}}}}},
         {"x": {"b": 1, "c": 2}}),
        ({"type": "object", "properties": {"a": {}},
          "if": {"properties": {"a": {"const": 1}}}, "then": {"properties": {"t": {}}}},
         {"a": 1, "t": 2}),
        ({"type": "object", "properties": {"a": {}},
          "anyOf": [{"properties": {"b": {}}, "required": ["b"]}]}, {"a": 1, "b": 2}),
    ],
    ids=["no-properties", "empty-properties", "additional-true", "additional-schema",
         "pattern", "unevaluated", "allOf", "required-elsewhere", "min-properties",
         "ref-beside-properties", "ref-extended-where-used", "if-then", "anyOf-beside"],
)
def test_objects_whose_keys_are_not_all_listed_stay_as_written(
    schema: dict[str, Any], value: Any
) -> None:
    """Closing these would make valid outputs impossible; each value proves one."""
    assert valid(schema, value)
    assert valid(closed(schema), value)


def test_closing_under_not_or_if_would_loosen_the_schema_so_it_is_left_alone() -> None:
    schema = {"type": "object", "properties": {"a": {}},
              "not": {"$ref": "#/$defs/Forbidden"},
              "$defs": {"Forbidden": {"properties": {"a": {"const": 1}}, "required": ["a"]}}}
    out = closed(schema)
    assert "additionalProperties" not in out["$defs"]["Forbidden"]
    assert not valid(out, {"a": 1, "z": 2})  # closing Forbidden would have let this through
    assert valid(out, {"a": 2})


def test_branches_of_anyof_and_single_allof_are_closed() -> None:
    schema = {
        "type": "object",
        "properties": {
            "either": {"anyOf": [{"$ref": "#/$defs/A"},
                                 {"type": "object", "properties": {"b": {}}}]},
            "wrapped": {"allOf": [{"$ref": "#/$defs/A"}], "description": "pydantic v1 style"},
            "items": {"type": "array", "items": {"type": "object", "properties": {"i": {}}}},
            "tuple": {"type": "array", "prefixItems": [{"type": "object",
                                                        "properties": {"p": {}}}]},
            "open": {"type": "object"},
        },
        "$defs": {"A": {"type": ["object", "null"], "properties": {"a": {}}}},
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["$defs"]["A"]["additionalProperties"] is False
    assert out["properties"]["either"]["anyOf"][1]["additionalProperties"] is False
    assert out["properties"]["items"]["items"]["additionalProperties"] is False
    assert out["properties"]["tuple"]["prefixItems"][0]["additionalProperties"] is False
    assert out["properties"]["open"] == {"type": "object"}
    assert not valid(out, {"wrapped": {"a": 1, "z": 1}})
    assert valid(out, {"wrapped": {"a": 1}, "open": {"z": 1}})


def test_an_anchor_reached_where_closing_is_unsafe_leaves_the_schema_as_written() -> None:
    schema = {"type": "object", "properties": {"x": {"allOf": [{"$ref": "#base"},
                                                               {"required": ["c"]}]}},
              "$defs": {"B": {"$anchor": "base", "properties": {"b": {}}}}}
    assert closed(schema) == schema


# ----------------------------------------------------------------------------------- dates


def _parses(text: str, kind: str) -> bool:
    parse = {"date": datetime.date.fromisoformat, "time": datetime.time.fromisoformat,
             "date-time": datetime.datetime.fromisoformat}[kind]
    try:
        parse(text)
    except ValueError:
        return False
    return True


def test_the_date_pattern_is_every_day_python_reads_and_no_other() -> None:
    years = [*range(0, 30), *range(96, 105), *range(396, 405), *range(1896, 1905),
             *range(1996, 2105), 2400, 9996, 9999]
    days = [f"{y:04d}-{m:02d}-{d:02d}" for y in years for m in range(1, 13)
            for d in range(1, 32)]
    date = re.compile(DATE_PATTERNS["date"])
    assert [d for d in days if bool(date.fullmatch(d)) != _parses(d, "date")] == []


@pytest.mark.parametrize(("text", "kind", "written"), [
    ("2024-02-29T23:59:59Z", "date-time", True),
    ("2000-02-29T00:00:00.123456+05:30", "date-time", True),
    ("0001-01-01T00:00:00-00:00", "date-time", True),
    ("2024-01-01t10:00:00Z", "date-time", False),  # RFC 3339 allows t and z
    ("2024-01-01T10:00:00z", "date-time", False),
    ("2024-12-31T23:59:60Z", "date-time", False),  # a leap second
    ("2023-02-29T10:00:00Z", "date-time", False),
    ("1900-02-29", "date", False),
    ("0000-01-01", "date", False),
    ("23:59:59.5Z", "time", True),
    ("23:59:60Z", "time", False),
    ("10:00:00.1234567Z", "time", False),  # beyond microseconds
])
def test_dates_are_written_as_parsers_read_them(text: str, kind: str, written: bool) -> None:
    out = closed({"type": "object", "properties": {"at": {"type": "string", "format": kind}}})
    assert valid(out, {"at": text}) is written
    if written:
        assert _parses(text.replace("Z", "+00:00"), kind)


def test_a_date_with_its_own_pattern_or_under_not_is_left_as_written() -> None:
    own = {"type": "string", "format": "date", "pattern": "^2"}
    negated = {"not": {"type": "string", "format": "date-time"}}
    out = closed({"type": "object", "properties": {"a": own, "b": negated}})
    assert out["properties"]["a"] == own and out["properties"]["b"] == negated
    nullable = closed({"type": ["string", "null"], "format": "time"})
    assert nullable["pattern"] == DATE_PATTERNS["time"]
