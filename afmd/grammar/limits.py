"""What a client's JSON schema may hold before it reaches the grammar compiler.

llguidance 1.9.1 recurses without end (a stack overflow: the process dies with SIGSEGV,
every request in flight with it) when a number in a schema is, as a double, -2^63 or
rounds to it: ``{"enum": [-9223372036854775808]}``, the same in ``const``, an integer
range pinned there (``minimum`` = ``maximum``), or ``-1e300`` where an integer is wanted.
A larger thread stack does not help; the recursion has no end. Numbers outside int64 make
its schema reader fail, and bounds of that size are refused by it anyway, so the screen
below costs a legitimate schema nothing: every number in the schema (wherever it sits,
since ``const`` and ``enum`` values nest) must be finite and, compared as a double,
above -2^63; an integer must fit int64, a float stay below 2^63. An enum and an
object's properties are bounded as well, so one schema cannot make the compile that
follows arbitrarily long, and so is an integral ``multipleOf``: llguidance builds an
automaton with about as many states as its value (a power of ten excepted), which for a
value in the millions takes seconds and hundreds of megabytes when the matcher is built.
``multipleOf`` must be greater than 0, as JSON Schema says.

What gets past this screen is still compiled in a separate process
(:mod:`afmd.grammar.sandbox`), so an input this screen does not know about costs a
request, never the server.

Pure functions over JSON data; the walk is iterative (the body was depth-checked on
arrival, but a walk that cannot recurse needs no such promise).
"""

from __future__ import annotations

import math
from typing import Any

from afmd.dialects.fields.nesting import Segment, param_of

#: Magnitude (as a double) a schema's number must stay below: int64's range, open at
#: both ends, where llguidance's integer-range code has its fault.
NUMBER_LIMIT = float(2**63)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

#: Values one ``enum`` may list.
MAX_ENUM = 10_000
#: Properties one object schema may list: the compile grows faster than their number
#: (optional ones above all), and the compile worker's time bound is the backstop.
MAX_PROPERTIES = 1_000
#: Largest integral ``multipleOf`` other than a power of ten.
MAX_MULTIPLE_OF = 10_000


def schema_limit_problem(schema: Any) -> tuple[str, list[Segment]] | None:
    """Why the compiler must not see ``schema``, and where in it, or None."""
    stack: list[tuple[list[Segment], Any]] = [([], schema)]
    while stack:
        path, value = stack.pop()
        kind = type(value)
        if kind is dict:
            enum = value.get("enum")
            if type(enum) is list and len(enum) > MAX_ENUM:
                return (f"an enum lists {len(enum)} values; at most {MAX_ENUM} are "
                        "supported", [*path, "enum"])
            multiple = value.get("multipleOf")
            if type(multiple) is int or type(multiple) is float:
                problem = _multiple_problem(multiple)
                if problem is not None:
                    return problem, [*path, "multipleOf"]
            properties = value.get("properties")
            if type(properties) is dict and len(properties) > MAX_PROPERTIES:
                return (f"an object lists {len(properties)} properties; at most "
                        f"{MAX_PROPERTIES} are supported", [*path, "properties"])
            # Reversed, so that the first offending value in document order is named.
            stack.extend(([*path, key], child)
                         for key, child in reversed(list(value.items())))
        elif kind is list:
            stack.extend(([*path, i], child) for i, child in reversed(list(enumerate(value))))
        elif kind is int or kind is float:
            problem = _number_problem(value)
            if problem is not None:
                return problem, path
    return None


def _multiple_problem(value: int | float) -> str | None:
    if not value > 0:  # NaN too
        return f"multipleOf must be greater than 0, not {value!r}"
    if value <= MAX_MULTIPLE_OF or not float(value).is_integer():
        return None
    if math.isfinite(value) and str(int(value)).rstrip("0") == "1":  # 10^k: cheap
        return None
    return (f"a multipleOf of {value!r} is more than grammars support (at most "
            f"{MAX_MULTIPLE_OF}, or a power of ten)")


def _number_problem(value: int | float) -> str | None:
    if type(value) is int:
        # Compared as a double too: integers that round to -2^63 crash like -2^63 does.
        if _INT64_MIN < value <= _INT64_MAX and float(value) > -NUMBER_LIMIT:
            return None
        shown = str(value) if abs(value) < 10**30 else "an integer this large"
    else:
        if math.isfinite(value) and -NUMBER_LIMIT < value < NUMBER_LIMIT:
            return None
        shown = repr(value)
    return (f"{shown} is outside the range of numbers grammars support "
            "(greater than -2^63, less than 2^63)")


def schema_limit_param(schema: Any, param: str) -> tuple[str, str] | None:
    """:func:`schema_limit_problem` as a message (naming the place in the schema, for
    dialects whose errors carry no param) and the offending value's param below
    ``param``."""
    found = schema_limit_problem(schema)
    if found is None:
        return None
    problem, path = found
    if not path:
        return problem, param
    below = param_of(path)
    where = f"at {below}: " if not below.startswith("[") else f"at schema{below}: "
    return where + problem, param + ("" if below.startswith("[") else ".") + below


__all__ = ["MAX_ENUM", "MAX_MULTIPLE_OF", "MAX_PROPERTIES", "NUMBER_LIMIT", "schema_limit_param",
           "schema_limit_problem"]
