"""JSON Schemas as Apple's ``GenerationSchema`` takes them, and values back as asked.

The framework generates from its own schema: the JSON a ``GenerationSchema`` encodes to
(objects with ``properties``, ``required``, ``x-order`` and ``additionalProperties:
false``; strings with ``enum``; numbers with ``minimum``/``maximum``; arrays with
``items``, ``minItems``/``maxItems``; ``anyOf``; named definitions under ``$defs``,
referenced as ``#/$defs/Name``). A client's schema says more, and in more ways, so it is
rewritten into that subset:

- ``oneOf`` is ``anyOf``; ``allOf`` is merged into one schema; every local ``$ref``
  (``#/$defs/X``, ``#/definitions/X``, any JSON pointer, ``#`` itself) becomes a named
  definition, so recursion works and several schemas share one document;
- ``null`` in a type array (or an ``anyOf`` branch) makes the property optional to the
  framework, which has no null; :func:`restore` puts ``null`` back where the client's
  schema requires the key;
- ``const`` is an ``enum`` of one; several types are ``anyOf`` of each;
- what the framework cannot enforce (``pattern``, ``format``, string lengths, exclusive
  bounds, ``multipleOf``, ``uniqueItems``, non-string enums, …) is described in the
  ``description`` the model reads, not enforced, and the schema is ``downgraded``
  (``X-Grammar-Constraints: downgraded``; the answer is then not held to it);
- bounds are given only as the framework's Swift side can take them, which ends the whole
  process otherwise (apple-fm-sdk 0.2.1 converts an integer's bound with ``Int(Double)`` and
  builds ``minimum...maximum``): an integer's fractional bound is rounded inwards, one beyond
  a 64-bit integer is dropped, and bounds that admit nothing (``minimum`` above ``maximum``,
  ``minItems`` above ``maxItems``) are not given (the schema is ``downgraded``);
- a value the subset cannot shape at all (any JSON value, an object without ``properties``
  such as a map) is asked for as JSON text in a string, and :func:`restore` reads it back.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: How deep a client's schema may nest before it is refused (refs are followed once).
MAX_DEPTH = 64
_NAME_CHARS = re.compile(r"[^A-Za-z0-9_]")
_SCALARS = ("string", "integer", "number", "boolean")


class SchemaError(ValueError):
    """A schema the framework cannot be given at all (a remote ``$ref``, a broken pointer)."""


@dataclass(slots=True)
class AppleSchema:
    """A client's schema rewritten for the framework."""

    schema: dict[str, Any]
    downgraded: bool = False
    #: What was described instead of enforced (for logs and tests).
    described: list[str] = field(default_factory=list)


def type_name(text: str, fallback: str = "Value") -> str:
    """A definition's name as the framework's types are named: letters, digits and ``_``."""
    name = _NAME_CHARS.sub("_", text).strip("_") or fallback
    return name if not name[0].isdigit() else f"{fallback}_{name}"


def _pointer(root: Any, ref: str) -> Any:
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        raise SchemaError(f"only local $ref is supported (\"#/...\"), got {ref!r}")
    node = root
    for raw in ref[2:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isascii() and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise SchemaError(f"$ref {ref!r} points at nothing in the schema")
    return node


def admits_null(node: Any, root: Any = None) -> bool:
    """Whether ``null`` is a valid value of ``node`` (a type array with it, an ``anyOf`` or
    ``oneOf`` branch of type null, ``null`` among the enum values)."""
    node = _resolved(node, root)
    if not isinstance(node, Mapping):
        return node is True
    kind = node.get("type")
    if kind == "null" or (isinstance(kind, list) and "null" in kind):
        return True
    if "enum" in node and isinstance(node["enum"], list) and None in node["enum"]:
        return True
    if "const" in node and node["const"] is None:
        return True
    return any(admits_null(b, root) for key in ("anyOf", "oneOf")
               for b in node.get(key) or () if isinstance(node.get(key), list))


def as_text(node: Any, root: Any = None) -> bool:
    """Whether a value of ``node`` is asked for as JSON text (the subset cannot shape it):
    any value at all, or an object without ``properties`` (a map)."""
    node = _resolved(node, root)
    if node is True or node == {}:
        return True
    if not isinstance(node, Mapping):
        return False
    if any(k in node for k in ("anyOf", "oneOf", "enum", "const", "allOf")):
        return False
    kinds = _types(node)
    if kinds == ["object"] or (not kinds and "properties" not in node and "items" not in node
                               and not _has_scalar_keywords(node)):
        return not isinstance(node.get("properties"), Mapping) or not node["properties"]
    return False


def _has_scalar_keywords(node: Mapping[str, Any]) -> bool:
    return any(k in node for k in ("pattern", "minLength", "maxLength", "format",
                                   "minimum", "maximum", "multipleOf", "exclusiveMinimum",
                                   "exclusiveMaximum"))


def _types(node: Mapping[str, Any]) -> list[str]:
    kind = node.get("type")
    if isinstance(kind, str):
        return [kind] if kind != "null" else []
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str) and k != "null"]
    return []


def _resolved(node: Any, root: Any) -> Any:
    """``node`` with a local ``$ref`` followed (a few hops) and ``allOf`` merged."""
    for _ in range(8):
        if not isinstance(node, Mapping) or root is None:
            break
        ref = node.get("$ref")
        if not isinstance(ref, str):
            break
        try:
            target = _pointer(root, ref)
        except SchemaError:
            break
        rest = {k: v for k, v in node.items() if k != "$ref"}
        node = {**target, **rest} if isinstance(target, Mapping) and rest else target
    if isinstance(node, Mapping) and isinstance(node.get("allOf"), list):
        node = _merge_all_of(node, root)
    return node


def _merge_all_of(node: Mapping[str, Any], root: Any) -> dict[str, Any]:
    merged: dict[str, Any] = {k: v for k, v in node.items() if k != "allOf"}
    for part in node["allOf"]:
        part = _resolved(part, root)
        if not isinstance(part, Mapping):
            continue
        for key, value in part.items():
            if key == "properties" and isinstance(value, Mapping):
                merged["properties"] = {**merged.get("properties", {}), **value}
            elif key == "required" and isinstance(value, list):
                merged["required"] = [*merged.get("required", []),
                                      *(r for r in value if r not in merged.get("required", []))]
            elif key == "description" and "description" in merged:
                merged["description"] = f"{merged['description']} {value}"
            else:
                merged.setdefault(key, value)
    return merged


class _Converter:
    """One document's conversion: its definitions are shared by every schema put in it."""

    def __init__(self) -> None:
        self.defs: dict[str, Any] = {}
        self.downgraded = False
        self.described: list[str] = []
        self._named: dict[tuple[int, str], str] = {}  # (root id, ref) -> definition name

    def convert(self, node: Any, root: Any, prefix: str, depth: int = 0) -> dict[str, Any]:
        if depth > MAX_DEPTH:
            raise SchemaError(f"the schema nests deeper than {MAX_DEPTH} levels")
        if isinstance(node, Mapping) and isinstance(node.get("$ref"), str):
            return self._ref(node, root, prefix, depth)
        if isinstance(node, Mapping) and isinstance(node.get("allOf"), list):
            node = _merge_all_of(node, root)
        if as_text(node, root):
            return self._text(node, "any JSON value" if not isinstance(node, Mapping)
                              or "type" not in node else "a JSON object")
        if not isinstance(node, Mapping):
            raise SchemaError(f"a schema must be an object or a boolean, got {node!r}")
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                return self._any_of(node, node[key], root, prefix, depth)
        if "const" in node:
            return self._enum(node, [node["const"]])
        if isinstance(node.get("enum"), list):
            return self._enum(node, node["enum"])
        kinds = _types(node)
        if len(kinds) > 1:
            branches = [self.convert({**node, "type": k}, root, prefix, depth + 1) for k in kinds]
            return self._with_description({"anyOf": branches}, node)
        kind = kinds[0] if kinds else _implied_type(node)
        if kind == "object":
            return self._object(node, root, prefix, depth)
        if kind == "array":
            return self._array(node, root, prefix, depth)
        if kind in _SCALARS:
            return self._scalar(node, kind)
        return self._text(node, "a JSON value")  # type "null" alone, or nothing to go on

    # -- kinds --
    def _ref(self, node: Mapping[str, Any], root: Any, prefix: str,
             depth: int) -> dict[str, Any]:
        ref = node["$ref"]
        target = _pointer(root, ref)
        key = (id(root), ref)
        name = self._named.get(key)
        if name is None:
            base = type_name(prefix + ("Root" if ref == "#" else ref.rsplit("/", 1)[-1]))
            name = base
            n = 2
            while name in self.defs:
                name, n = f"{base}{n}", n + 1
            self._named[key] = name
            self.defs[name] = {}  # placeholder: a recursive ref finds the name already
            converted = self.convert(target, root, prefix, depth + 1)
            if "$ref" in converted or "anyOf" in converted or converted.get("type") != "object":
                # Only objects are named types in the framework: inline the rest.
                del self.defs[name]
                del self._named[key]
                return self._with_description(converted, node)
            converted["title"] = name
            self.defs[name] = converted
        out: dict[str, Any] = {"$ref": f"#/$defs/{name}"}
        if isinstance(node.get("description"), str):
            out["description"] = node["description"]
        return out

    def _any_of(self, node: Mapping[str, Any], branches: list[Any], root: Any, prefix: str,
                depth: int) -> dict[str, Any]:
        kept = [b for b in branches if not _is_null(b, root)]
        rest = {k: v for k, v in node.items() if k not in ("anyOf", "oneOf")}
        converted = [self.convert({**rest, **b} if isinstance(b, Mapping) and rest
                                  and "$ref" not in b else b, root, prefix, depth + 1)
                     for b in kept]
        if not converted:
            return self._text(node, "null")
        if len(converted) == 1:
            return self._with_description(converted[0], node)
        return self._with_description({"anyOf": converted}, node)

    def _enum(self, node: Mapping[str, Any], values: list[Any]) -> dict[str, Any]:
        strings = [v for v in values if isinstance(v, str)]
        if strings and len(strings) == len([v for v in values if v is not None]):
            return self._with_description({"type": "string", "enum": strings}, node)
        shown = ", ".join(json.dumps(v) for v in values)
        return self._text(node, f"one of these JSON values: {shown}")

    def _object(self, node: Mapping[str, Any], root: Any, prefix: str,
                depth: int) -> dict[str, Any]:
        properties = node.get("properties") or {}
        required = [r for r in node.get("required") or () if r in properties]
        out_props: dict[str, Any] = {}
        for name, sub in properties.items():
            out_props[name] = self.convert(sub, root, prefix, depth + 1)
        self._describe(node, ("patternProperties", "minProperties", "maxProperties",
                              "dependentRequired", "propertyNames"))
        if isinstance(node.get("additionalProperties"), Mapping) and \
                node["additionalProperties"]:
            self._note(node, "additionalProperties")
        out: dict[str, Any] = {
            "type": "object",
            "properties": out_props,
            # A nullable key is optional to the framework (it has no null): restore()
            # writes the null back where the client requires the key.
            "required": [r for r in required if not admits_null(properties[r], root)],
            "x-order": list(out_props),
            "additionalProperties": False,
        }
        return self._with_description(out, node)

    def _array(self, node: Mapping[str, Any], root: Any, prefix: str,
               depth: int) -> dict[str, Any]:
        items = node.get("items", True)
        if isinstance(node.get("prefixItems"), list):
            self._note(node, "prefixItems")
        out: dict[str, Any] = {"type": "array",
                               "items": self.convert(items, root, prefix, depth + 1)}
        for key in ("minItems", "maxItems"):
            if isinstance(node.get(key), int) and not isinstance(node[key], bool) \
                    and node[key] >= 0:
                out[key] = node[key]
        self._contradicted(node, out, "minItems", "maxItems")
        self._describe(node, ("uniqueItems", "contains", "minContains", "maxContains"))
        return self._with_description(out, node)

    def _scalar(self, node: Mapping[str, Any], kind: str) -> dict[str, Any]:
        out: dict[str, Any] = {"type": kind}
        if kind in ("integer", "number"):
            for key in ("minimum", "maximum"):
                value = node.get(key)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    out[key] = value
            for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
                value = node.get(key)
                if not isinstance(value, int | float) or isinstance(value, bool):
                    continue
                if kind == "integer" and float(value).is_integer():
                    # An exclusive bound of an integer is the next integer, inclusive.
                    step = 1 if bound == "minimum" else -1
                    out[bound] = int(value) + step
                else:
                    self._note(node, key)
            if kind == "integer":
                _integer_bounds(out)
            else:
                for key in ("minimum", "maximum"):
                    if key in out and not math.isfinite(out[key]):
                        del out[key]
            self._contradicted(node, out, "minimum", "maximum")
            self._describe(node, ("multipleOf",))
        elif kind == "string":
            self._describe(node, ("pattern", "format", "minLength", "maxLength",
                                  "contentEncoding", "contentMediaType"))
        out = self._with_description(out, node)
        return out

    def _text(self, node: Any, what: str) -> dict[str, Any]:
        self.downgraded = True
        self.described.append(f"JSON text ({what})")
        described = node.get("description") if isinstance(node, Mapping) else None
        text = f"{what}, written as JSON text"
        return {"type": "string", "description": f"{described} ({text})" if described
                else text[:1].upper() + text[1:]}

    def parameters(self, schema: Any, prefix: str) -> dict[str, Any]:
        """A tool's parameters: an object without ``properties`` (a tool taking no
        arguments, or any) is an object of none, not JSON text: the call's arguments
        are an object either way."""
        if schema is None or (as_text(schema, schema) and (
                not isinstance(schema, Mapping) or schema.get("type", "object") == "object")):
            return {"type": "object", "properties": {}, "required": [], "x-order": [],
                    "additionalProperties": False}
        return self.convert(schema, schema, prefix)

    def _contradicted(self, node: Mapping[str, Any], out: dict[str, Any], low: str,
                      high: str) -> None:
        """Bounds that admit nothing (``minimum`` above ``maximum``) are not given: the
        framework's Swift side builds ``low...high`` from them, which ends the process when
        ``low > high``."""
        if low in out and high in out and out[low] > out[high]:
            del out[low], out[high]
            self._note(node, low)

    # -- descriptions --
    def _describe(self, node: Mapping[str, Any], keys: tuple[str, ...]) -> None:
        for key in keys:
            if key in node:
                self._note(node, key)

    def _note(self, node: Mapping[str, Any], key: str) -> None:
        self.downgraded = True
        self.described.append(key)

    def _with_description(self, out: dict[str, Any], node: Any) -> dict[str, Any]:
        if not isinstance(node, Mapping):
            return out
        parts = [node["description"]] if isinstance(node.get("description"), str) else []
        parts += [_RULES[key](node[key]) for key in _RULES if key in node
                  and not (key in ("exclusiveMinimum", "exclusiveMaximum")
                           and out.get("type") == "integer")]
        if parts and "$ref" not in out:
            out["description"] = " ".join(p for p in parts if p)
        return out


_RULES: dict[str, Any] = {
    "pattern": lambda v: f"It must match the regular expression {v}.",
    "format": lambda v: f"Its format is {v}.",
    "minLength": lambda v: f"At least {v} characters.",
    "maxLength": lambda v: f"At most {v} characters.",
    "exclusiveMinimum": lambda v: f"Greater than {v}.",
    "exclusiveMaximum": lambda v: f"Less than {v}.",
    "multipleOf": lambda v: f"A multiple of {v}.",
    "uniqueItems": lambda v: "No item repeated." if v else "",
    "minProperties": lambda v: f"At least {v} keys.",
    "maxProperties": lambda v: f"At most {v} keys.",
}


#: The bounds an integer's guides can carry: the framework's Swift side converts each to a
#: 64-bit ``Int`` from the ``Double`` it is handed, which ends the process outside this range.
_INT_LIMIT = 2.0 ** 63


def _integer_bounds(out: dict[str, Any]) -> None:
    """An integer's bounds as whole numbers the framework can hold: a fractional bound
    rounded inwards (the framework would truncate it, admitting a value the client's schema
    does not), one beyond a 64-bit integer dropped (no generated integer reaches it)."""
    for key, rounded in (("minimum", math.ceil), ("maximum", math.floor)):
        if key not in out:
            continue
        value = out[key]
        if not math.isfinite(value) or not -_INT_LIMIT <= float(value) < _INT_LIMIT:
            del out[key]
            continue
        out[key] = value if isinstance(value, int) else int(rounded(value))


def _implied_type(node: Mapping[str, Any]) -> str | None:
    if "properties" in node:
        return "object"
    if "items" in node or "prefixItems" in node:
        return "array"
    if any(k in node for k in ("pattern", "minLength", "maxLength", "format")):
        return "string"
    if any(k in node for k in ("minimum", "maximum", "multipleOf")):
        return "number"
    return None


def _is_null(node: Any, root: Any) -> bool:
    node = _resolved(node, root)
    return isinstance(node, Mapping) and node.get("type") == "null"


def convert(schema: Any, *, title: str = "Response") -> AppleSchema:
    """One client schema as the framework's (its root named ``title``)."""
    converter = _Converter()
    out = converter.convert(schema, schema, "")
    return _document(converter, out, title)


def convert_parameters(parameters: Any, *, title: str) -> AppleSchema:
    """A tool's parameters as the framework's schema of its arguments."""
    converter = _Converter()
    return _document(converter, converter.parameters(parameters, ""), title)


def _document(converter: _Converter, out: dict[str, Any], title: str) -> AppleSchema:
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        # A root that is a reference (``{"$ref": "#/$defs/Node"}``): the type itself at
        # the root, its definition kept for the references inside it.
        out = {**copy.deepcopy(converter.defs[ref.rsplit("/", 1)[-1]]),
               **{k: v for k, v in out.items() if k != "$ref"}}
    out = dict(out)
    if out.get("type") == "object":
        out["title"] = type_name(title, "Response")
    if converter.defs:
        out["$defs"] = converter.defs
    return AppleSchema(out, converter.downgraded, converter.described)


def calls_schema(tools: list[tuple[str, Any]], *, parallel: bool) -> AppleSchema:
    """The answer of a turn that must call a tool: ``{"tool_calls": [{"name", "arguments"},
    …]}``, each call one of ``tools`` (name, client's parameters schema), at least one and,
    unless ``parallel``, exactly one."""
    converter = _Converter()
    branches: list[dict[str, Any]] = []
    for i, (name, parameters) in enumerate(tools):
        prefix = f"T{i}_"
        arguments = converter.parameters(parameters, prefix)
        call_name = type_name(f"Call_{name}", f"Call{i}")
        while call_name in converter.defs:
            call_name += "_"
        converter.defs[call_name] = {
            "title": call_name,
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]},
                           "arguments": arguments},
            "required": ["name", "arguments"],
            "x-order": ["name", "arguments"],
            "additionalProperties": False,
        }
        branches.append({"$ref": f"#/$defs/{call_name}"})
    items: dict[str, Any] = branches[0] if len(branches) == 1 else {"anyOf": branches}
    array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    root = {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
            "x-order": ["tool_calls"], "additionalProperties": False}
    return _document(converter, root, "ToolCalls")


def restore(value: Any, schema: Any, root: Any = None, depth: int = 0) -> Any:
    """A generated value as the client's ``schema`` asked for it: JSON text read back where
    it was asked for as text, ``null`` written for a required key that may be null and
    that the framework (which has no null) left out."""
    root = schema if root is None else root
    if depth > MAX_DEPTH:
        return value
    node = _resolved(schema, root)
    if as_text(node, root):
        if isinstance(value, str):
            try:
                return json.loads(value)
            except ValueError:
                return value
        return value
    if not isinstance(node, Mapping):
        return value
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            branch = _branch_for(value, node[key], root)
            return restore(value, branch, root, depth + 1) if branch is not None else value
    if isinstance(value, dict):
        properties = node.get("properties")
        if isinstance(properties, Mapping):
            value = dict(value)
            for name, sub in properties.items():
                if name in value:
                    value[name] = restore(value[name], sub, root, depth + 1)
            for name in node.get("required") or ():
                if name not in value and name in properties \
                        and admits_null(properties[name], root):
                    value[name] = None
        return value
    if isinstance(value, list) and "items" in node:
        return [restore(v, node["items"], root, depth + 1) for v in value]
    values = [node["const"]] if "const" in node else node.get("enum")
    non_strings = isinstance(values, list) and any(not isinstance(v, str) for v in values)
    if isinstance(value, str) and (non_strings or (values is None and _types(node)
                                                    and "string" not in _types(node))):
        # Asked for as JSON text: a non-string enum, a type the framework has none of.
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _branch_for(value: Any, branches: list[Any], root: Any) -> Any:
    """The ``anyOf`` branch a value was generated from (first whose kind matches)."""
    wanted = {dict: "object", list: "array", str: "string", bool: "boolean",
              int: "integer", float: "number"}.get(type(value))
    for branch in branches:
        node = _resolved(branch, root)
        if not isinstance(node, Mapping) or _is_null(node, root):
            continue
        kinds = _types(node) or ([implied] if (implied := _implied_type(node)) else [])
        if wanted in kinds or (wanted == "integer" and "number" in kinds):
            return branch
        if wanted == "string" and as_text(node, root):
            return branch
    return None


def plain(schema: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of a converted schema (callers may change theirs)."""
    return copy.deepcopy(schema)


__all__ = ["MAX_DEPTH", "AppleSchema", "SchemaError", "admits_null", "as_text",
           "calls_schema", "convert", "convert_parameters", "plain", "restore", "type_name"]
