"""Counting a schema's subschemas: where a schema may be, and no further than the bound."""

from __future__ import annotations

from afmd.grammar.schema_size import subschemas


def test_every_place_a_schema_may_be_is_counted() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"items": {}, "prefixItems": [{}]}},
        "patternProperties": {"^x": {}}, "additionalProperties": {},
        "anyOf": [{}, {"not": {}}], "allOf": [{}], "oneOf": [{}],
        "if": {}, "then": {}, "else": {}, "contains": {}, "propertyNames": {},
        "$defs": {"d": {}}, "definitions": {"e": {}},
        "dependencies": {"f": ["g"], "h": {}}, "dependentSchemas": {"i": {}},
    }
    assert subschemas(schema, 1_000) == 23  # and the two types


def test_values_that_are_data_are_not_schemas() -> None:
    data = [{"type": "object"}] * 100
    schema = {"const": {"a": {}}, "enum": data, "examples": data, "default": {"b": {}},
              "properties": {"p": True}, "x-vendor": {"properties": {"q": {}}}}
    assert subschemas(schema, 1_000) == 1


def test_counting_stops_past_the_bound() -> None:
    schema = {"anyOf": [{"anyOf": [{} for _ in range(1_000)]} for _ in range(1_000)]}
    assert subschemas(schema, 50) == 51
    assert subschemas(schema, 10**7) == 1 + 1_000 + 1_000_000


def test_each_type_a_subschema_names_counts_once_more() -> None:
    assert subschemas({"anyOf": [{"type": "string"}, {"type": ["string", "null"]}]}, 100) == 6
