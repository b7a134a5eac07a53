"""The checks every dialect's body parser is built from, each naming the exact ``param``.

OpenAI answers a malformed field with a 400 whose ``param`` points at it (for example
``messages[2].content``), and clients fix their requests from it. Every wire format afmd
speaks checks its fields with these same primitives, so a wrong type, a missing field, a
value out of bounds or an unknown field reads alike in each, and a client's value is
quoted the same bounded way.

Scalar fields are data: a :class:`Scalar` row gives a field's JSON type, bounds and default,
and :func:`read_scalars` walks a table of them. Structured fields (messages, tools) are
parsed by code built from the same primitives.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from afmd.errors import InvalidRequestError


def type_name(value: Any) -> str:
    """A value's JSON type, as error messages name it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


#: Characters of a client's value an error message repeats: enough to recognise it, while
#: a megabyte-long value still gets a small error.
MAX_ECHO_CHARS = 100


def clip(text: str) -> str:
    """A client's text cut short for an error message, its full length noted."""
    if len(text) <= MAX_ECHO_CHARS:
        return text
    return f"{text[:MAX_ECHO_CHARS]}… ({len(text)} characters)"


def quoted(value: Any) -> str:
    """A client's value as an error message quotes it: a string as is, anything else as
    JSON, cut short with its full length noted."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = orjson.dumps(value).decode()
        except orjson.JSONEncodeError:
            text = type_name(value)
    if len(text) <= MAX_ECHO_CHARS:
        return f"'{text}'"
    return f"'{text[:MAX_ECHO_CHARS]}…' ({len(text)} characters)"


# ---------------------------------------------------------------------------- errors


def wrong_type(param: str, expected: str, value: Any) -> InvalidRequestError:
    return InvalidRequestError(
        f"Invalid type for '{param}': expected {expected}, but got {type_name(value)}.",
        code="invalid_type",
        param=param,
    )


def missing(param: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"Missing required parameter: '{param}'.",
        code="missing_required_parameter",
        param=param,
    )


def invalid(param: str | None, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, code="invalid_value", param=param)


def not_one_of(param: str, value: Any, choices: Sequence[str]) -> InvalidRequestError:
    """A string outside its enumeration, the supported values listed."""
    return invalid(
        param,
        f"Invalid value for '{param}': {quoted(value)}. Supported values are: "
        + ", ".join(f"'{c}'" for c in choices)
        + ".",
    )


def reject_unknown(
    obj: Mapping[str, Any],
    known: frozenset[str],
    *,
    what: str = "Unrecognized request argument supplied",
    prefix: str = "",
    deprecated: Mapping[str, str] | None = None,
    message: str | None = None,
) -> None:
    """Refuse the first key of ``obj`` outside ``known``: a silently ignored misspelling
    would change the answer without telling the client. ``deprecated`` keys (never among
    ``known``) get their own message, an ``invalid_value`` naming what replaced them.
    ``prefix`` is where ``obj`` sits (``messages[0].``): the message names the whole path,
    as the param does, since a key alone (``type``) says nothing of which object held it.
    ``message`` replaces that message where the envelope names the param itself
    (Anthropic's ``<param>: Extra inputs are not permitted``)."""
    if known.issuperset(obj):  # deprecated keys are never known ones
        return
    for key in obj:
        if deprecated and key in deprecated:
            raise invalid(prefix + key, deprecated[key])
        if key not in known:
            raise InvalidRequestError(
                message or f"{what}: {clip(prefix + key)}", code="unknown_parameter",
                param=prefix + key,
            )


def unknown_keys(
    obj: Mapping[str, Any],
    known: frozenset[str],
    *,
    strict: bool,
    what: str = "Unrecognized request argument supplied",
    deprecated: Mapping[str, str] | None = None,
) -> tuple[str, ...]:
    """The top-level keys of a body outside ``known``, in the body's order, which a
    tolerant parser ignores: clients send fields meant for other servers (``options``,
    ``num_ctx``), and refusing them breaks the client where ignoring them changes nothing
    it could get elsewhere. ``strict`` refuses the first one instead, as
    :func:`reject_unknown`. ``deprecated`` keys are refused either way: ignoring
    ``functions`` would silently drop the client's tools."""
    if known.issuperset(obj):  # most bodies
        return ()
    if strict:
        reject_unknown(obj, known, what=what, deprecated=deprecated)
    unknown: list[str] = []
    for key in obj:
        if deprecated and key in deprecated:
            raise invalid(key, deprecated[key])
        if key not in known:
            unknown.append(key)
    return tuple(unknown)


# ---------------------------------------------------------------------------- typed values


def required(obj: Mapping[str, Any], key: str, param: str, kind: type, expected: str) -> Any:
    """A field that must be present and of one JSON type (``param`` is its full path)."""
    value = obj.get(key)
    if value is None:
        raise missing(param)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise wrong_type(param, expected, value)
    return value


def optional(obj: Mapping[str, Any], key: str, param: str, kind: type, expected: str) -> Any:
    """A field that may be absent or null (then None), else of one JSON type."""
    value = obj.get(key)
    if value is not None and (
        not isinstance(value, kind) or (kind is int and isinstance(value, bool))
    ):
        raise wrong_type(param, expected, value)
    return value


#: Integers a request may carry: what every API's integer fields (int64) hold.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_EXACT_FLOAT = float(2**53)


def _outside_int64(param: str) -> InvalidRequestError:
    return invalid(param, f"Invalid '{param}': the value is outside the range of a 64-bit "
                          "integer.")


def as_int(
    value: Any, param: str, *, minimum: float | None = None, maximum: float | None = None
) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        # 5.0 is what some JSON encoders produce for 5; accept exact integral floats, as
        # far as a double holds integers exactly (1e20 is no one's integer).
        if isinstance(value, float) and value.is_integer() and abs(value) <= _EXACT_FLOAT:
            value = int(value)
        elif isinstance(value, float) and math.isfinite(value) and abs(value) >= 2.0**63:
            # An integer literal past 64 bits reaches us as a float (the JSON parser's
            # fallback, -2**63 - 1 rounding to -2**63): the client wrote an integer, so say
            # what is wrong with it.
            raise _outside_int64(param)
        else:
            raise wrong_type(param, "an integer", value)
    if not INT64_MIN <= value <= INT64_MAX:
        raise _outside_int64(param)
    if minimum is not None and value < minimum:
        raise invalid(param, f"Invalid '{param}': {value} is less than the minimum of {minimum}.")
    if maximum is not None and value > maximum:
        raise invalid(
            param, f"Invalid '{param}': {value} is greater than the maximum of {maximum}."
        )
    return value


def as_number(value: Any, param: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise wrong_type(param, "a number", value)
    value = float(value)
    if math.isnan(value) or value < lo or value > hi:
        raise invalid(
            param, f"Invalid '{param}': {value:g} is outside the allowed range [{lo:g}, {hi:g}]."
        )
    return value


#: The longest stop sequence: ending text is what one is for, and each is followed
#: character by character over the whole output (an automaton as long as it is, built per
#: request).
MAX_STOP_CHARS = 4096


def string_list(value: Any, param: str, limit: int) -> tuple[str, ...]:
    """A string or an array of at most ``limit`` non-empty strings (stop sequences) of at
    most :data:`MAX_STOP_CHARS` characters, each kept once, in order."""
    if value is None:
        return ()
    if isinstance(value, str):
        values = [value]
    elif isinstance(value, list):
        values = value
    else:
        raise wrong_type(param, "a string or an array of strings", value)
    if len(values) > limit:
        raise invalid(param, f"'{param}' accepts at most {limit} sequences, got {len(values)}.")
    for i, s in enumerate(values):
        if not isinstance(s, str):
            raise wrong_type(f"{param}[{i}]", "a string", s)
        if not s:
            raise invalid(f"{param}[{i}]", "A stop sequence must not be empty.")
        if len(s) > MAX_STOP_CHARS:
            raise invalid(f"{param}[{i}]", f"A stop sequence may be at most {MAX_STOP_CHARS} "
                                           f"characters long, got {len(s)}.")
    return tuple(dict.fromkeys(values))


# ---------------------------------------------------------------------------- the table

Kind = Literal["boolean", "integer", "number", "string"]
Reader = Callable[[Any, str], Any]


@dataclass(frozen=True, slots=True)
class Scalar:
    """One scalar field of a body: its JSON type, bounds and default.

    ``minimum``/``maximum`` bound an integer (either may be absent) or a number (both
    given); ``choices`` enumerate a string's values; ``rule`` is a check beyond type and
    bounds (a value afmd cannot honour), called with the typed value and its param.
    ``read`` checks a present value against all of it (see :func:`_reader`).
    """

    name: str
    kind: Kind
    default: Any = None
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | None = None
    required: bool = False
    rule: Callable[[Any, str], None] | None = None
    read: Reader = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind == "number" and (self.minimum is None or self.maximum is None):
            raise ValueError(f"number field {self.name!r} needs both bounds")
        object.__setattr__(self, "read", _reader(self))


def _reader(row: Scalar) -> Reader:
    """``row``'s checks as one call taking a present value and its param.

    A well-formed value passes one inline test; anything else goes to the primitive that
    names the problem. Every request's scalars pass through here on the event loop.
    """
    kind, choices = row.kind, row.choices
    minimum, maximum = row.minimum, row.maximum
    lo = -math.inf if minimum is None else minimum
    hi = math.inf if maximum is None else maximum
    check: Reader
    if kind == "boolean":

        def check(value: Any, param: str) -> Any:
            if value is True or value is False:
                return value
            raise wrong_type(param, "a boolean", value)

    elif kind == "number":

        def check(value: Any, param: str) -> Any:
            if type(value) is float and lo <= value <= hi:
                return value
            return as_number(value, param, lo, hi)

    elif kind == "integer":

        int_lo, int_hi = max(lo, INT64_MIN), min(hi, INT64_MAX)

        def check(value: Any, param: str) -> Any:
            if type(value) is int and int_lo <= value <= int_hi:
                return value
            return as_int(value, param, minimum=minimum, maximum=maximum)

    else:

        def check(value: Any, param: str) -> Any:
            if not isinstance(value, str):
                raise wrong_type(param, "a string", value)
            if choices is not None and value not in choices:
                raise not_one_of(param, value, choices)
            return value

    rule = row.rule
    if rule is None:
        return check

    def checked(value: Any, param: str) -> Any:
        value = check(value, param)
        rule(value, param)
        return value

    return checked


def read_scalar(obj: Mapping[str, Any], row: Scalar, prefix: str = "") -> Any:
    """One field read from ``obj``: its default if absent or null."""
    value = obj.get(row.name)
    if value is not None:
        return row.read(value, prefix + row.name)
    if row.required:
        raise missing(prefix + row.name)
    return row.default


def read_scalars(
    obj: Mapping[str, Any], table: Sequence[Scalar], prefix: str = ""
) -> dict[str, Any]:
    """Every field of ``table`` read from ``obj`` in table order (so the first problem in
    that order is the one reported); an absent or null field takes its default."""
    values: dict[str, Any] = {}
    for row in table:
        value = obj.get(row.name)
        if value is not None:
            values[row.name] = row.read(value, prefix + row.name)
        elif row.required:
            raise missing(prefix + row.name)
        else:
            values[row.name] = row.default
    return values


def names(table: Sequence[Scalar]) -> frozenset[str]:
    return frozenset(row.name for row in table)
