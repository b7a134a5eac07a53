"""The 2020-12 metaschema as one document says what jsonschema's own check says.

``afmd/service/metaschema.py`` checks a schema against the vocabularies joined into one
document, without the dynamic references that made jsonschema's check cost several times
as much; the verdict (valid or not) must be the one ``check_schema`` gives, for valid
schemas that use every vocabulary and for those same schemas broken at random places.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from afmd.service.metaschema import flat_metaschema, metaschema_problem

#: Valid schemas touching every vocabulary of 2020-12 (and the root's legacy keywords).
VALID: list[dict[str, Any]] = [
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "^x"},
                                      "b": {"type": "array", "items": {"minimum": 0}}},
     "required": ["a"], "additionalProperties": False},
    {"anyOf": [{"type": "string"}, {"type": "null"}],
     "$defs": {"n": {"type": "number", "multipleOf": 2}}},
    {"$ref": "#/$defs/x", "$defs": {"x": {"oneOf": [{"const": 1}, {"enum": [1, 2]}]}}},
    {"type": ["string", "null"], "minLength": 1, "maxLength": 3, "format": "date"},
    {"prefixItems": [{"type": "string"}], "items": False, "minItems": 1, "uniqueItems": True},
    {"if": {"type": "string"}, "then": {"minLength": 2}, "else": {"not": {"type": "null"}}},
    {"dependentRequired": {"a": ["b"]}, "dependentSchemas": {"a": {"required": ["c"]}},
     "propertyNames": {"pattern": "^[a-z]+$"}},
    {"definitions": {"a": {"type": "string"}},
     "dependencies": {"a": ["b"], "c": {"type": "object"}}},
    {"contentMediaType": "application/json", "contentSchema": {"type": "object"},
     "title": "t", "description": "d", "examples": [1], "deprecated": True},
    {"unevaluatedProperties": {"type": "string"}, "unevaluatedItems": False,
     "contains": {"type": "string"}, "minContains": 1, "$anchor": "a", "$comment": "c"},
]
#: What a broken schema gets in place of one of its values.
REPLACEMENTS: list[Any] = ["x", 1, -1, 1.5, None, True, [], ["a"], [1], {}, {"type": "strin"},
                           "[", {"$ref": 5}, [{}], "string", 0, {"$dynamicRef": 3}]


def _jsonschema_problem(schema: Any) -> str | None:
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        return str(exc.message)
    return None


def _places(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if path:
        yield path
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _places(child, (*path, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            yield from _places(child, (*path, i))


def _broken(schema: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    broken = copy.deepcopy(schema)
    for _ in range(rng.randint(1, 2)):
        *parents, last = rng.choice(list(_places(broken)))
        holder: Any = broken
        for key in parents:
            holder = holder[key]
        holder[last] = copy.deepcopy(rng.choice(REPLACEMENTS))
    return broken


@pytest.mark.parametrize("index", range(len(VALID)))
def test_verdicts_match_jsonschemas_own_check(index: int) -> None:
    schema = VALID[index]
    assert _jsonschema_problem(schema) is None
    assert metaschema_problem(schema) is None
    rng = random.Random(index)
    for _ in range(60):
        broken = _broken(schema, rng)
        assert (metaschema_problem(broken) is None) == (_jsonschema_problem(broken) is None), \
            broken


def test_a_single_fault_is_worded_as_jsonschema_words_it() -> None:
    assert metaschema_problem({"type": "strin"}) == _jsonschema_problem({"type": "strin"})
    assert metaschema_problem({"minLength": -1}) == _jsonschema_problem({"minLength": -1})


def test_the_joined_document_has_no_dynamic_reference_left() -> None:
    text = repr(flat_metaschema())
    assert "'$dynamicRef': '" not in text and "meta/" not in text


def test_another_draft_is_checked_by_its_own_metaschema() -> None:
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "strin"}
    assert metaschema_problem(draft7) is not None
    assert metaschema_problem({"$schema": "http://json-schema.org/draft-07/schema#",
                               "items": [{"type": "string"}]}) is None
