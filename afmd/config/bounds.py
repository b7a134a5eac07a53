"""What a config value may be, and how a bad one is reported.

A setting's bounds and choices live in its dataclass field's metadata (``at_least``,
``between``, ``one_of``), next to its type and default, and :func:`check_fields` checks
any config dataclass against them: a new setting states its rules once, where it is
declared. Every problem is a :class:`ConfigError` naming the dotted key, so the CLI can
point at the exact setting to fix.

Part of afmd's lowest layer: it imports nothing else from afmd.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "ConfigError",
    "at_least",
    "between",
    "check_fields",
    "coerce",
    "describe",
    "kind_of",
    "one_of",
    "parse_text",
    "suggest",
    "toml_key",
]

_ENV_TRUE = ("true", "1", "yes")
_ENV_FALSE = ("false", "0", "no")


class ConfigError(Exception):
    """Any configuration problem; ``key`` names the setting so callers need not parse prose."""

    def __init__(self, key: str, message: str) -> None:
        # Both go to Exception so the error survives pickling (e.g. across processes).
        super().__init__(key, message)
        self.key = key
        self.message = message

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


# --------------------------------------------------------------------------- metadata


def at_least(minimum: float) -> dict[str, Any]:
    """Field metadata: a number no smaller than ``minimum`` (and finite)."""
    return {"minimum": minimum}


def between(minimum: float, maximum: float) -> dict[str, Any]:
    """Field metadata: a number within ``[minimum, maximum]`` (and finite)."""
    return {"minimum": minimum, "maximum": maximum}


def one_of(*choices: str) -> dict[str, Any]:
    """Field metadata: one of ``choices``, read case-insensitively around whitespace."""
    return {"choices": choices}


# --------------------------------------------------------------------------- value kinds

KIND_NAMES = {
    "bool": "boolean",
    "int": "integer",
    "float": "number",
    "str": "string",
    "strlist": "array of strings",
    "optint": "integer",
}


def kind_of(tp: object) -> str:
    """Reduce a field annotation to the handful of shapes config values can take."""
    simple = {bool: "bool", int: "int", float: "float", str: "str"}
    if isinstance(tp, type) and tp in simple:
        return simple[tp]
    if tp == tuple[str, ...]:
        return "strlist"
    if tp == (int | None):
        return "optint"
    raise TypeError(f"unsupported config field type {tp!r}")


def describe(value: object) -> str:
    """Render a bad value the way the user wrote it (TOML-ish), clipped for long input."""
    if isinstance(value, bool):
        text, kind = ("true" if value else "false"), "boolean"
    elif isinstance(value, int):
        text, kind = str(value), "integer"
    elif isinstance(value, float):
        text, kind = repr(value), "float"
    elif isinstance(value, str):
        text, kind = json.dumps(value, ensure_ascii=False), "string"
    elif isinstance(value, list | tuple):
        text, kind = "[...]", "array"
    elif isinstance(value, dict):
        text, kind = "{...}", "table"
    else:
        text, kind = str(value), type(value).__name__
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{kind} {text}"


def suggest(name: str, candidates: Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def toml_key(name: str) -> str:
    """Quote a table key only when TOML would need it, so error keys can be pasted back."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)


def coerce(value: object, kind: str, key: str) -> object:
    """Accept a typed value (TOML or programmatic) strictly: bool is never an int."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "int" and is_int:
        return value
    if kind == "float" and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind == "str" and isinstance(value, str):
        return _no_nul(value, key)
    if kind == "optint" and (value is None or is_int):
        return value
    if kind == "strlist" and isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise ConfigError(f"{key}[{i}]", f"expected string, got {describe(item)}")
            _no_nul(item, f"{key}[{i}]")
        return tuple(value)
    raise ConfigError(key, f"expected {KIND_NAMES[kind]}, got {describe(value)}")


def _no_nul(text: str, key: str) -> str:
    """TOML can spell a NUL (``"\\u0000"``); no path, host, id or argv the OS takes can hold
    one, and the OS refuses it only when the server starts or a request uses the value."""
    if "\0" in text:
        raise ConfigError(key, f"must not contain a NUL character (\\u0000), got {text!r}")
    return text


def parse_text(text: str, kind: str, key: str) -> object:
    """Parse an env var / CLI string by the field's type, since those only carry text."""
    stripped = text.strip()
    if kind == "str":
        return text
    if kind == "bool":
        lowered = stripped.lower()
        if lowered in _ENV_TRUE:
            return True
        if lowered in _ENV_FALSE:
            return False
        raise ConfigError(key, f"expected a boolean (true/false/1/0/yes/no), got {text!r}")
    if kind == "strlist":
        return tuple(part.strip() for part in text.split(",") if part.strip())
    if kind == "optint" and stripped == "":
        return None
    if not stripped.isascii():
        # int() and float() read any script's digits ("\u0661\u0662\u0663" is 123): a
        # value an operator cannot read back is no number of theirs.
        raise ConfigError(key, f"expected {KIND_NAMES[kind]} in ASCII digits, got {text!r}")
    try:
        return float(stripped) if kind == "float" else int(stripped)
    except ValueError:
        raise ConfigError(key, f"expected {KIND_NAMES[kind]}, got {text!r}") from None


# --------------------------------------------------------------------------- the walker

T = TypeVar("T", bound="DataclassInstance")


def _check_bounds(key: str, value: float, meta: Mapping[str, Any], origin: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value!r}{origin}")
    minimum, maximum = meta["minimum"], meta.get("maximum")
    if maximum is None:
        if value < minimum:
            raise ConfigError(key, f"must be >= {minimum:g}, got {value!r}{origin}")
    elif not minimum <= value <= maximum:
        raise ConfigError(
            key, f"must be between {minimum} and {maximum}, got {value!r}{origin}"
        )


def _check_choice(key: str, value: str, choices: tuple[str, ...], origin: str) -> str:
    normalized = value.strip().lower()
    if normalized not in choices:
        raise ConfigError(
            key,
            f"must be one of {'|'.join(choices)}, got {value!r}{suggest(normalized, choices)}"
            f"{origin}",
        )
    return normalized


def check_fields(obj: T, prefix: str, origin: Callable[[str], str] = lambda key: "") -> T:
    """``obj`` (a config dataclass) with every field checked against its metadata, in
    declaration order, and each choice normalized to its canonical spelling.

    ``prefix`` is the dotted path of ``obj`` (``server``); ``origin(key)`` says where a
    value came from (`` (from AFMD_SERVER_PORT)``), empty for the file.
    """
    normalized: dict[str, str] = {}
    for f in dataclasses.fields(obj):
        meta = f.metadata
        if not meta:
            continue
        key = f"{prefix}.{f.name}"
        value = getattr(obj, f.name)
        if "choices" in meta:
            choice = _check_choice(key, value, meta["choices"], origin(key))
            if choice != value:
                normalized[f.name] = choice
        elif "minimum" in meta and value is not None:
            _check_bounds(key, value, meta, origin(key))
    return dataclasses.replace(obj, **normalized) if normalized else obj
