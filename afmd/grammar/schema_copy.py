"""The grammar's copy of a client's JSON schema: re-rooted and with closed objects.

Pure functions over JSON data (no llguidance, no I/O); the input is never mutated, and
every schema node on the way is copied, so the client's schema, which the final
``jsonschema`` check uses as given, stays exactly as it was sent.

Re-rooting: a tool's ``parameters`` sit under ``properties.arguments`` of the call's
grammar schema, where a root-relative ``$ref`` (``#/$defs/X``, what pydantic emits for a
nested model) would point at nothing. Prefixing every local pointer with the place the
schema is embedded at keeps each tool's definitions its own, so tools whose ``$defs``
share names never collide.

Closing: an object schema that does not say ``additionalProperties`` allows any extra key,
and a sampled model then invents keys until ``max_tokens``. Where it is safe, the grammar
gets ``additionalProperties: false``: every closed output is valid against the schema as
given (closed is a subset of open). It is not safe — and the object stays as written —
where the schema does not list the keys on its own: no ``properties`` (``{"type":
"object"}`` would only allow ``{}``), ``patternProperties``/``unevaluatedProperties``,
composition beside ``properties`` (``allOf``, ``$ref``, ``if``/``then``/``else``, …),
``required`` names or a ``minProperties`` the properties cannot meet, a branch of an
``allOf`` that has siblings, the target of a ``$ref`` used in such a place, and anything
under ``not`` or ``if``, where a stricter schema would make the whole looser.

Dates: a string of ``format`` ``date-time``, ``date`` or ``time`` is held, where it has
no ``pattern`` of its own, to the part of RFC 3339 that date parsers read as well as
JSON Schema does (llguidance intersects the two): ``T`` and ``Z`` in capitals, seconds
up to 59, a fraction of up to six digits (microseconds), a year from 0001, February 29
in leap years only. RFC 3339 also allows ``t``, ``z``, a leap second ``:60`` and any
day 29 of February, which pydantic, Python's ``datetime`` and the openai SDK's
``parse()`` (a pydantic ``datetime`` field) refuse: a sampled model wrote them and the
SDK raised on an answer the schema accepts. The same place as closing, so again
narrower is safe: every value written is valid against the schema as given. Not under
``not`` or ``if`` (FROZEN), for the same reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

Schema = dict[str, Any]
Pointer = tuple[str, ...]

# Where subschemas live: one schema, a list of schemas, a map of name → schema.
_ONE = ("additionalProperties", "additionalItems", "items", "contains", "propertyNames",
        "not", "if", "then", "else", "unevaluatedItems", "unevaluatedProperties",
        "contentSchema")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
        "dependencies")

# Keywords that make an object accept or demand keys beyond its own ``properties``.
_SHAPING = frozenset({
    "properties", "patternProperties", "additionalProperties", "unevaluatedProperties",
    "required", "minProperties", "dependentRequired", "dependentSchemas", "dependencies",
    "allOf", "anyOf", "oneOf", "if", "then", "else", "$ref", "$dynamicRef",
})
# Besides these, an object is closed only when nothing else may add keys to it.
_BLOCKS_CLOSING = frozenset({
    "additionalProperties", "patternProperties", "unevaluatedProperties",
    "allOf", "anyOf", "oneOf", "$ref", "$dynamicRef", "if", "then", "else", "not",
    "dependentSchemas", "dependencies", "dependentRequired",
})

# Dates as parsers read them (see above). Years 0001-9999; leap years are those divisible
# by 4 but not by 100, or by 400 (year 0000 excluded).
_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
_FOURS = "(?:0[48]|[2468][048]|[13579][26])"
_LEAP = f"(?:[0-9]{{2}}{_FOURS}|{_FOURS}00)"
_DATE = (f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
         "|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
         f"|{_LEAP}-02-29)")
_TIME = ("(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,6})?"
         "(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")
DATE_PATTERNS = {
    "date-time": f"^{_DATE}T{_TIME}$",
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
}

# How safe closing is at a node: its own keys may be closed (OK), only nested objects may
# (TOP_UNSAFE: its keys are combined with a sibling's), or nothing below it (FROZEN).
OK, TOP_UNSAFE, FROZEN = 0, 1, 2


def _children(node: Schema) -> list[tuple[Pointer, Any]]:
    """Every direct subschema with its path below ``node``."""
    out: list[tuple[Pointer, Any]] = []
    for key in _ONE:
        if isinstance(node.get(key), dict):
            out.append(((key,), node[key]))
    for key in _LIST:
        if isinstance(node.get(key), list):
            out.extend(((key, str(i)), s) for i, s in enumerate(node[key]) if isinstance(s, dict))
    for key in _MAP:
        if isinstance(node.get(key), dict):
            out.extend(((key, name), s) for name, s in node[key].items() if isinstance(s, dict))
    return out


def _rebuild(node: Schema, child: Callable[[Pointer, Schema], Any]) -> Schema:
    """A shallow copy of ``node`` whose subschemas are ``child(path, subschema)``."""
    out = dict(node)
    for path, sub in _children(node):
        key, *rest = path
        if not rest:
            out[key] = child(path, sub)
        elif isinstance(node[key], list):
            if out[key] is node[key]:
                out[key] = list(node[key])
            out[key][int(rest[0])] = child(path, sub)
        else:
            if out[key] is node[key]:
                out[key] = dict(node[key])
            out[key][rest[0]] = child(path, sub)
    return out


def _escape(segment: str) -> str:
    return segment.replace("~", "~0").replace("/", "~1")


def reroot(schema: Schema, at: Pointer) -> Schema:
    """``schema`` made to work at path ``at`` inside a larger schema.

    Local pointers (``#``, ``#/…``) get the embedding path in front. A subschema with its
    own ``$id`` is a resource of its own, against which its references resolve wherever
    it sits (llguidance honours that too), so it is left as it is.
    """
    prefix = "".join("/" + _escape(s) for s in at)

    def walk(node: Schema) -> Schema:
        if "$id" in node:
            return node
        out = _rebuild(node, lambda _path, sub: walk(sub))
        for key in ("$ref", "$dynamicRef"):
            ref = node.get(key)
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                out[key] = "#" + prefix + ref[1:]
        return out

    return walk(schema)


def _pointer(ref: str) -> Pointer | None:
    """The path a local JSON-pointer reference names, or None for any other reference."""
    if ref == "#":
        return ()
    if not ref.startswith("#/"):
        return None
    return tuple(unquote(s).replace("~1", "/").replace("~0", "~") for s in ref[2:].split("/"))


def _lookup(schema: Schema, path: Pointer) -> Any:
    node: Any = schema
    for segment in path:
        if isinstance(node, dict) and segment in node:
            node = node[segment]
        elif (isinstance(node, list) and segment.isascii() and segment.isdigit()
              and int(segment) < len(node)):
            node = node[int(segment)]
        else:
            return None
    return node


def _child_levels(node: Schema, level: int) -> list[tuple[Pointer, Schema, int]]:
    """Each subschema with how safe closing is there, given the node's own level."""
    shaping = node.keys() & _SHAPING
    out = []
    for path, sub in _children(node):
        key = path[0]
        if level == FROZEN or key in ("not", "if"):
            child = FROZEN
        elif key in ("allOf", "anyOf", "oneOf"):
            # A branch holds the keys alone only if nothing beside it adds any: anyOf/oneOf
            # branches each describe the whole object, allOf branches only when alone.
            alone = shaping == {key} and (key != "allOf" or len(node[key]) == 1)
            child = OK if alone else TOP_UNSAFE
        elif key in ("then", "else", "dependentSchemas", "dependencies"):
            child = TOP_UNSAFE
        else:
            child = OK
        out.append((path, sub, child))
    return out


def _levels(schema: Schema) -> dict[Pointer, int] | None:
    """How safe closing is at every subschema, following ``$ref`` (None: unknowable)."""
    levels: dict[Pointer, int] = {}
    todo: list[tuple[Pointer, Any, int]] = [((), schema, OK)]
    while todo:
        path, node, level = todo.pop()
        if not isinstance(node, dict) or levels.get(path, -1) >= level:
            continue
        if path and "$id" in node:
            return None  # a resource of its own: its pointers are not ours to follow
        levels[path] = level
        todo.extend((path + sub_path, sub, child)
                    for sub_path, sub, child in _child_levels(node, level))
        ref = node.get("$ref")
        if isinstance(ref, str) or "$dynamicRef" in node:
            target = _pointer(ref) if isinstance(ref, str) else None
            beside = node.keys() & _SHAPING - {"$ref"}
            reach = FROZEN if level == FROZEN else TOP_UNSAFE if level or beside else OK
            if target is None:
                if reach != OK:
                    return None  # an anchor or remote target we cannot keep open
                continue
            todo.append((target, _lookup(schema, target), reach))
    return levels


def _closable(node: Schema) -> bool:
    properties = node.get("properties")
    if not isinstance(properties, dict) or not properties:
        return False
    kind = node.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        return False
    if node.keys() & _BLOCKS_CLOSING:
        return False
    required = node.get("required", [])
    if not isinstance(required, list) or not set(required) <= properties.keys():
        return False
    least = node.get("minProperties", 0)
    return isinstance(least, int) and least <= len(properties)


def _narrowable(node: Schema) -> str | None:
    """The pattern a date string is held to, or None where it is left as written."""
    fmt = node.get("format")
    if not isinstance(fmt, str) or "pattern" in node:
        return None
    kind = node.get("type", "string")
    if kind != "string" and not (isinstance(kind, list) and "string" in kind):
        return None
    return DATE_PATTERNS.get(fmt)


def closed(schema: Schema) -> Schema:
    """``schema`` with ``additionalProperties: false`` and date patterns wherever that is
    safe (see above)."""
    levels = _levels(schema)
    if levels is None:
        return schema

    def walk(path: Pointer, node: Schema) -> Schema:
        out = _rebuild(node, lambda sub_path, sub: walk(path + sub_path, sub))
        if levels.get(path) == OK and _closable(node):
            out["additionalProperties"] = False
        if levels.get(path) != FROZEN and (pattern := _narrowable(node)) is not None:
            out["pattern"] = pattern
        return out

    return walk((), schema)


__all__ = ["DATE_PATTERNS", "closed", "reroot"]
