"""``GenerationGuide`` and ``GuideType`` as apple-fm-sdk 0.2.1 has them."""

from __future__ import annotations

from enum import Enum
from typing import Any


class GuideType(Enum):
    anyOf = "enum"
    constant = "constant"
    count = "count"
    element = "element"
    maxItems = "maxItems"
    maximum = "maximum"
    minItems = "minItems"
    minimum = "minimum"
    range = "range"
    regex = "regex"


class GenerationGuide:
    def __init__(self, guide_type: GuideType, value: Any = None) -> None:
        self.guide_type = guide_type
        self.value = value

    @classmethod
    def anyOf(cls, values: list[str]) -> GenerationGuide:
        return cls(GuideType.anyOf, values)

    @classmethod
    def constant(cls, value: str) -> GenerationGuide:
        return cls(GuideType.constant, value)

    @classmethod
    def count(cls, count: int) -> GenerationGuide:
        return cls(GuideType.count, count)

    @classmethod
    def element(cls, guide: GenerationGuide) -> GenerationGuide:
        return cls(GuideType.element, guide)

    @classmethod
    def max_items(cls, value: int) -> GenerationGuide:
        return cls(GuideType.maxItems, value)

    @classmethod
    def maximum(cls, value: float) -> GenerationGuide:
        return cls(GuideType.maximum, value)

    @classmethod
    def min_items(cls, value: int) -> GenerationGuide:
        return cls(GuideType.minItems, value)

    @classmethod
    def minimum(cls, value: float) -> GenerationGuide:
        return cls(GuideType.minimum, value)

    @classmethod
    def range(cls, range_tuple: tuple[float, float]) -> GenerationGuide:
        return cls(GuideType.range, range_tuple)

    @classmethod
    def regex(cls, pattern: str) -> GenerationGuide:
        return cls(GuideType.regex, pattern)

    def keywords(self) -> dict[str, Any]:
        """The JSON Schema keywords this guide encodes to (what ``to_dict`` shows)."""
        kind, value = self.guide_type, self.value
        if kind is GuideType.anyOf:
            return {"enum": list(value)}
        if kind is GuideType.constant:
            return {"enum": [value]}
        if kind is GuideType.count:
            return {"minItems": value, "maxItems": value}
        if kind is GuideType.maxItems:
            return {"maxItems": value}
        if kind is GuideType.minItems:
            return {"minItems": value}
        if kind is GuideType.maximum:
            return {"maximum": value}
        if kind is GuideType.minimum:
            return {"minimum": value}
        if kind is GuideType.range:
            return {"minimum": value[0], "maximum": value[1]}
        if kind is GuideType.regex:
            return {"pattern": value}
        raise RuntimeError(f"Unknown or unsupported guide type: {kind}")
