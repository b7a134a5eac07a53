"""Whether a client's JSON schema is one, checked against Draft 2020-12 at a lower cost.

The 2020-12 metaschema is seven vocabulary documents joined by ``allOf``, each reaching
back to the whole through ``$dynamicRef: "#meta"``; jsonschema resolves every one of
those references through its registry (a URL join and a lookup in another document)
for every subschema of the schema checked, seven times over, in pure Python holding the
GIL: about eight times what Draft 7's single document costs for the same schema. Since
only the standard metaschema is checked against (nothing extends it), its dynamic
references always land on its root, and one document with the vocabularies' properties
side by side and ``$ref: "#"`` in their place says the same, valid or not, at Draft 7's
cost. A schema that names another draft in ``$schema`` is checked by that draft's own
metaschema, as before.
"""

from __future__ import annotations

import functools
import re
from typing import Any

__all__ = ["metaschema_problem"]

_DRAFT = "https://json-schema.org/draft/2020-12/"
_VOCABULARIES = ("core", "applicator", "unevaluated", "validation", "meta-data",
                 "format-annotation", "content")


def metaschema_problem(schema: Any) -> str | None:
    """Why ``schema`` is not a valid JSON Schema, as jsonschema words it, or None."""
    import jsonschema

    validator_cls = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
    if validator_cls is not jsonschema.Draft202012Validator:
        validator = validator_cls(validator_cls.META_SCHEMA,
                                  format_checker=_format_checker(validator_cls))
    else:
        validator = _flat_validator()
    error = jsonschema.exceptions.best_match(validator.iter_errors(schema))
    return None if error is None else str(error.message)


@functools.cache
def _flat_validator() -> Any:
    """A validator of the 2020-12 metaschema as one document, asserting formats as
    ``check_schema`` does (a ``pattern`` must be a regular expression)."""
    import jsonschema

    cls = jsonschema.Draft202012Validator
    return cls(flat_metaschema(), format_checker=_format_checker(cls))


@functools.cache
def _format_checker(validator_cls: Any) -> Any:
    r"""The draft's own format checker, but for ``regex``: jsonschema asks Python's ``re``,
    and a schema's patterns are ECMA-262's. ``\p{L}`` and ``(?<name>...)``, which zod
    writes, are errors to ``re``: the whole schema was refused as invalid."""
    import jsonschema

    checker = jsonschema.FormatChecker(formats=())
    checker.checkers = dict(validator_cls.FORMAT_CHECKER.checkers)
    checker.checks("regex")(_ecma_regex)
    return checker


_NAMED_GROUP = re.compile(r"\(\?<([A-Za-z_][A-Za-z0-9_]*)>")
_NAMED_BACKREF = re.compile(r"\\k<([A-Za-z_][A-Za-z0-9_]*)>")
_PROPERTY = re.compile(r"\\[pP]\{[A-Za-z0-9_=]+\}")


def _ecma_regex(pattern: object) -> bool:
    """Whether ``pattern`` reads as an ECMA-262 regular expression, as near as two
    engines tell: Python's with ECMA's spellings of named groups and Unicode properties
    put in its own (it has look-around and back-references), else llguidance's (which
    reads those spellings, and is what enforces a pattern)."""
    if not isinstance(pattern, str):
        return True
    spelled = _PROPERTY.sub(r"\\w", _NAMED_BACKREF.sub(r"(?P=\1)",
                                                        _NAMED_GROUP.sub(r"(?P<\1>", pattern)))
    try:
        re.compile(spelled)
        return True
    except re.error:
        pass
    from afmd.grammar.params import pattern_readable

    return pattern_readable(pattern)


def flat_metaschema() -> dict[str, Any]:
    """The 2020-12 metaschema with its vocabularies' properties and definitions in one
    document, each ``$dynamicRef: "#meta"`` a ``$ref: "#"``."""
    from jsonschema_specifications import REGISTRY

    root = REGISTRY.contents(_DRAFT + "schema")
    properties: dict[str, Any] = {}
    defs: dict[str, Any] = {}
    for name in _VOCABULARIES:
        vocabulary = REGISTRY.contents(f"{_DRAFT}meta/{name}")
        for into, part in ((properties, vocabulary.get("properties", {})),
                           (defs, vocabulary.get("$defs", {}))):
            clash = into.keys() & part.keys()
            if clash:  # the documents' own layout changed: joining them would misread it
                raise RuntimeError(f"the 2020-12 vocabularies both define {sorted(clash)}")
            into.update(part)
    for key in root["properties"]:  # the root's own: definitions, dependencies ...
        if key in properties:
            raise RuntimeError(f"the 2020-12 metaschema defines {key!r} twice")
    properties.update(root["properties"])
    return {
        "$schema": _DRAFT + "schema",
        "type": ["object", "boolean"],
        "properties": _local(properties),
        "$defs": _local(defs),
    }


def _local(value: Any) -> Any:
    """``value`` with its references to the whole (``$dynamicRef: "#meta"``) made plain
    ``$ref: "#"``, and those to a vocabulary's definition (``meta/validation#/$defs/...``)
    into the joined ``$defs``, where its own ``#/$defs/...`` ones already point."""
    if isinstance(value, dict):
        out = {}
        for key, child in value.items():
            if key == "$dynamicRef" and isinstance(child, str):  # not the property's name
                if child != "#meta":
                    raise RuntimeError(f"an unexpected $dynamicRef {child!r}")
                out["$ref"] = "#"
            elif key == "$ref" and isinstance(child, str) and child.startswith("meta/"):
                out["$ref"] = "#" + child.partition("#")[2]  # a vocabulary's definition
            else:
                out[key] = _local(child)
        return out
    if isinstance(value, list):
        return [_local(child) for child in value]
    return value
