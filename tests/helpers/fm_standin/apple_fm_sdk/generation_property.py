"""``Property`` as apple-fm-sdk 0.2.1 has it (``apple_fm_sdk.generation_property``), and
the SDK's Python type names (``type_conversion._python_type_to_string``)."""

from __future__ import annotations

from typing import Any, Union, get_args, get_origin

from .generation_guide import GenerationGuide


def python_type_to_string(python_type: Any) -> str:
    """As the SDK names a property's type for its Swift side."""
    if python_type is str:
        return "string"
    if python_type is int:
        return "integer"
    if python_type is float:
        return "number"
    if python_type is bool:
        return "boolean"
    if python_type is list:
        raise TypeError("Generic list types must specify an element type, for example, "
                        "List[str]")
    origin = get_origin(python_type)
    if origin is list:
        args = get_args(python_type)
        return f"array<{python_type_to_string(args[0] if args else str)}>"
    if origin is Union:
        rest = [a for a in get_args(python_type) if a is not type(None)]
        if len(rest) == 1:
            return python_type_to_string(rest[0])
    return getattr(python_type, "__name__", str(python_type))


class Property:
    def __init__(self, name: str, type_class: Any, description: str | None = None,
                 guides: list[GenerationGuide] | None = None) -> None:
        self.name = name
        self.type_class = type_class
        self.description = description
        self.guides = list(guides or [])

    @property
    def type_name(self) -> str:
        return python_type_to_string(self.type_class)

    @property
    def is_optional(self) -> bool:
        return "Optional" in str(self.type_class)  # what the SDK itself checks
