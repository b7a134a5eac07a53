"""``GenerationSchema`` (built from properties) and ``GeneratedContent``, as apple-fm-sdk
0.2.1 has them, with what the framework's Swift side does with a built schema: the type
of each property, the guides each type allows, named types resolved from the root's list
(``buildSchema``: an unknown type name, such as ``array<boolean>``'s, fails), and the
bounds its Swift side cannot take (:class:`SwiftTrap`)."""

from __future__ import annotations

import json
import re
from typing import Any

from .errors import InvalidGenerationSchemaError, UnsupportedGuideError, make
from .generation_guide import GenerationGuide, GuideType
from .generation_property import Property

_ALLOWED = {
    "string": {GuideType.anyOf, GuideType.constant, GuideType.regex},
    "integer": {GuideType.range, GuideType.maximum, GuideType.minimum},
    "number": {GuideType.range, GuideType.maximum, GuideType.minimum},
    "boolean": set(),
    "array<string>": {GuideType.count, GuideType.maxItems, GuideType.minItems,
                      GuideType.anyOf, GuideType.element},
    "array<integer>": {GuideType.count, GuideType.maxItems, GuideType.minItems,
                       GuideType.element},
    "array<number>": {GuideType.count, GuideType.maxItems, GuideType.minItems,
                      GuideType.element},
}
_REFERENCE_ARRAY = {GuideType.count, GuideType.maxItems, GuideType.minItems}
_BOUNDS = {GuideType.range, GuideType.maximum, GuideType.minimum}


class SwiftTrap(BaseException):
    """A Swift runtime trap in the SDK's bindings, which ends the whole process on a Mac
    (``FoundationModelsCBindings.swift``, apple-fm-sdk 0.2.1 at e868e60): ``resolveIntGuides``
    converts a bound with ``Int(Double)``, which traps outside ``Int``'s range, and
    ``resolveIntGuides``/``resolveDoubleGuides`` build ``min...max``, which traps when
    ``min > max``."""


def _check_bounds(guide: GenerationGuide, integer: bool) -> None:
    """What ``buildSchema`` does with a bound guide before it can fail gracefully."""
    values = guide.value if guide.guide_type is GuideType.range else (guide.value,)
    if integer:
        for value in values:
            if not -(2.0 ** 63) <= float(value) < 2.0 ** 63:
                raise SwiftTrap(f"Fatal error: Double value cannot be converted to Int: {value}")
        values = tuple(int(float(v)) for v in values)  # Int(Double) truncates toward zero
    if guide.guide_type is GuideType.range and values[0] > values[1]:
        raise SwiftTrap("Fatal error: Range requires lowerBound <= upperBound")


class GenerationSchema:
    def __init__(self, type_class: type, description: str | None = None,
                 properties: list[Property] | None = None,
                 dynamic_nested_types: list[GenerationSchema] | None = None,
                 _ptr: Any = None) -> None:
        self.type_class = type_class
        self.description = description
        self.properties = list(properties or [])
        self.dynamic_nested_types = list(dynamic_nested_types or [])
        for prop in self.properties:  # the SDK converts each property as it is added
            _property_json(prop)

    @property
    def name(self) -> str:
        return self.type_class.__name__

    def _object(self) -> dict[str, Any]:
        props = {p.name: _property_json(p) for p in self.properties}
        out: dict[str, Any] = {
            "title": self.name, "type": "object", "properties": props,
            "required": [p.name for p in self.properties if not p.is_optional],
            "x-order": [p.name for p in self.properties], "additionalProperties": False,
        }
        if self.description:
            out["description"] = self.description
        return out

    def to_dict(self) -> dict[str, Any]:
        out = self._object()
        defs = {n.name: n._object() for n in self.dynamic_nested_types}
        if defs:
            out["$defs"] = defs
        known = {self.name, *defs}
        for ref in _references(out):
            if ref not in known:
                raise make(InvalidGenerationSchemaError,
                           f"Failed to resolve the type {ref!r} of the schema")
        return out


def _references(node: Any) -> list[str]:
    found: list[str] = []
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            found.append(ref.rsplit("/", 1)[-1])
        for value in node.values():
            found += _references(value)
    elif isinstance(node, list):
        for value in node:
            found += _references(value)
    return found


def _property_json(prop: Property) -> dict[str, Any]:
    kind = prop.type_name
    guides = list(prop.guides)
    if kind in _ALLOWED:
        allowed = _ALLOWED[kind]
        out: dict[str, Any]
        if kind.startswith("array<"):
            out = {"type": "array", "items": {"type": kind[6:-1]}}
        else:
            out = {"type": kind}
    elif kind.startswith("array<"):
        allowed = _REFERENCE_ARRAY
        out = {"type": "array", "items": {"$ref": f"#/$defs/{kind[6:-1]}"}}
    else:
        allowed = set()
        out = {"$ref": f"#/$defs/{kind}"}
    for guide in guides:
        target = out
        if guide.guide_type is GuideType.element:
            if not kind.startswith("array<"):
                raise make(UnsupportedGuideError, f"element guide on {kind}")
            guide = guide.value
            target = out["items"]
        elif guide.guide_type not in allowed:
            raise make(UnsupportedGuideError,
                       f"{guide.guide_type.name} guide on a property of type {kind}")
        if guide.guide_type in _BOUNDS:
            _check_bounds(guide, integer="integer" in kind)
        if guide.guide_type is GuideType.regex:
            try:
                re.compile(guide.value)
            except re.error as exc:
                raise make(UnsupportedGuideError, f"bad regex: {exc}") from None
        target.update(guide.keywords())
    if prop.description:
        out["description"] = prop.description
    return out


class GenerationID:
    pass


class GeneratedContent:
    def __init__(self, content_dict: Any = None, id: GenerationID | None = None,
                 _ptr: Any = None) -> None:
        self.id = id or GenerationID()
        self._content_dict = {} if content_dict is None else content_dict

    @classmethod
    def from_json(cls, json_str: str) -> GeneratedContent:
        return cls(json.loads(json_str))

    def to_json(self) -> str:
        return json.dumps(self._content_dict)

    def value(self, type_class: Any = None, for_property: str | None = None) -> Any:
        if for_property:
            return self._content_dict.get(for_property)
        return self._content_dict


__all__ = ["GeneratedContent", "GenerationGuide", "GenerationSchema"]
