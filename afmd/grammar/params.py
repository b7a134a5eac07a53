"""A tool's parameters as grammar pieces, for formats that write one value per key.

JSON-argument formats embed the whole ``parameters`` schema as one ``%json``; formats
that tag each parameter (Qwen3-Coder, GLM, MiniMax, pythonic, Gemma, …) need it key by
key: which keys, in which order, which are required, and per key either a ``%json`` value
or — for a parameter that only admits strings, which these formats write raw — a lark
terminal for the raw text. The string test is the readers' own
(:func:`afmd.output.formats.values.is_string_schema`), so what is forced is what is read.

Whatever a per-key grammar cannot enforce (a top-level ``anyOf``, ``minProperties``, a
string ``format``, …) raises :class:`Inexact` in strict mode; the lenient build drops it
and the turn is marked ``X-Grammar-Constraints: downgraded``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher, regex_to_lark

from afmd.grammar.schema_copy import reroot
from afmd.output.formats.values import is_string_schema, resolve

_ROOT_DEF = "__afmd_parameters"
# Top-level keywords a sequence of keys cannot express.
_INEXACT = frozenset({
    "patternProperties", "allOf", "anyOf", "oneOf", "if", "then", "else", "not",
    "dependentRequired", "dependentSchemas", "dependencies", "minProperties",
    "maxProperties", "propertyNames", "unevaluatedProperties", "$dynamicRef",
})
ANY_KEY = r"/[A-Za-z_][A-Za-z0-9_]{0,63}/"


class Inexact(Exception):
    """The strict grammar cannot express the schema: build it lenient (downgraded)."""


@dataclass(frozen=True, slots=True)
class Param:
    key: str
    schema: Any  # as embedded in a %json (re-rooted when it references definitions)
    required: bool
    string: bool
    raw: Any  # the property's own schema, for string constraints


@dataclass(frozen=True, slots=True)
class Params:
    params: tuple[Param, ...]
    any_keys: bool  # no properties listed: any key, any JSON value


def plan(parameters: dict[str, Any], lenient: bool) -> Params:
    """The keys of a (closed) parameters schema in the order the grammar writes them."""
    root = parameters
    schema = resolve(parameters, root)
    if not isinstance(schema, dict):
        schema = {}
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        _inexact(lenient, "parameters that are not an object")
    if not lenient and schema.keys() & _INEXACT:
        raise Inexact(sorted(schema.keys() & _INEXACT)[0])
    properties = schema.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = [r for r in schema.get("required") or [] if isinstance(r, str)]
    extra = schema.get("additionalProperties", True)
    params = []
    for key, sub in properties.items():
        params.append(_param(root, key, sub, key in required))
    for key in required:
        if key not in properties:
            params.append(_param(root, key, extra if isinstance(extra, dict) else {}, True))
    return Params(tuple(params), any_keys=not properties and extra is not False)


def _param(root: dict[str, Any], key: str, schema: Any, required: bool) -> Param:
    embedded = _embedded(root, key, schema)
    return Param(key, embedded, required, is_string_schema(schema, root), schema)


def _embedded(root: dict[str, Any], key: str, schema: Any) -> Any:
    """A property's schema that stands alone: with the root's definitions when it refers
    to them (local pointers re-rooted under one definition holding the whole root)."""
    if not isinstance(schema, dict) or '"$ref"' not in json.dumps(schema):
        return schema if isinstance(schema, dict) else {}
    pointer = "/".join(s.replace("~", "~0").replace("/", "~1")
                       for s in ("$defs", _ROOT_DEF, "properties", key))
    if resolve(root, root) is not root:  # the root itself is a reference
        return {**schema, "$defs": {_ROOT_DEF: reroot(root, ("$defs", _ROOT_DEF))}}
    return {"$ref": "#/" + pointer,
            "$defs": {_ROOT_DEF: reroot(root, ("$defs", _ROOT_DEF))}}


def _inexact(lenient: bool, what: str) -> None:
    if not lenient:
        raise Inexact(what)


# --------------------------------------------------------------------- raw string values


def _escape_regex(text: str) -> str:
    out = []
    for ch in text:
        out.append("\\" + ch if ch in r"\.+*?()|[]{}^$/" else ch)
    return "".join(out).replace("\n", r"\n").replace("\r", r"\r").replace("\t", r"\t")


def _pattern(pattern: str) -> str:
    """A JSON Schema pattern (a search, ECMA-flavoured) as a whole-match lark regex."""
    starts = pattern.startswith("^")
    ends = pattern.endswith("$") and not pattern.endswith("\\$")
    core = pattern[1 if starts else 0: -1 if ends else None]
    regex = ("" if starts else "(?s:.*)") + "(?:" + core + ")" + ("" if ends else "(?s:.*)")
    return "/" + regex_to_lark(regex, "dw") + "/"


def string_terminal(schema: Any, root: dict[str, Any], lenient: bool) -> str:
    """A lark terminal expression for the raw text of a string that ``schema`` admits."""
    schema = resolve(schema, root)
    if not isinstance(schema, dict):
        return "/(?s:.*)/"
    if isinstance(schema.get("const"), str):
        return "/" + _escape_regex(schema["const"]) + "/"
    enum = schema.get("enum")
    if isinstance(enum, list):
        words = [v for v in enum if isinstance(v, str)]
        return "(" + " | ".join("/" + _escape_regex(w) + "/" for w in words) + ")" if words \
            else "/(?s:.*)/"
    branches = [b for key in ("anyOf", "oneOf") for b in schema.get(key) or []
                if isinstance(b, dict) and is_string_schema(b, root)]
    terms = []
    if branches:
        terms.append("(" + " | ".join(string_terminal(b, root, lenient) for b in branches) + ")")
    low, high = schema.get("minLength"), schema.get("maxLength")
    if isinstance(low, int) or isinstance(high, int):
        least = low if isinstance(low, int) else 0
        most = high if isinstance(high, int) else ""
        terms.append(f"/(?s:.{{{least},{most}}})/")
    if isinstance(schema.get("pattern"), str) and not lenient:
        terms.append(_pattern(schema["pattern"]))
    if "format" in schema:
        _inexact(lenient, f"format {schema['format']!r} of a raw string")
    if "allOf" in schema or "not" in schema:
        _inexact(lenient, "allOf/not on a raw string")
    return " & ".join(terms) if terms else "/(?s:.*)/"


def raw_value(
    expression: str, *, forbid: Sequence[str] = (), close: str = "", trimmed: bool
) -> str:
    """A terminal for a raw value: ``expression`` that never contains any of ``forbid``
    (the value's closing tag, when it is text) nor, for a family that trims values,
    starts or ends with whitespace; followed by the text ``close``, when it is text (then
    the terminal ends right after it: one lexeme, nothing for the lexer to split)."""
    parts = [f"({expression})"]
    if trimmed:
        parts += [r"~/(?s:\s.*)/", r"~/(?s:.*\s)/"]
    parts += ["~/(?s:.*)" + _escape_regex(tag) + "(?s:.*)/" for tag in forbid]
    body = " & ".join(parts)
    return f"({body}) {json.dumps(close)}" if close else body


# --------------------------------------------------------------------- sequences


class Rules:
    """Lark rules under construction, with fresh names."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.lines: list[str] = []
        self._n = 0

    def add(self, body: str, kind: str = "r") -> str:
        self._n += 1
        name = f"{self.prefix}{kind}{self._n}"
        self.lines.append(f"{name}: {body}")
        return name

    def terminal(self, body: str) -> str:
        self._n += 1
        name = f"{self.prefix.upper()}T{self._n}"
        self.lines.append(f"{name}: {body}")
        return name


def sequence(rules: Rules, items: Sequence[tuple[str, bool]], sep: str) -> tuple[str, bool]:
    """The items in order, optional ones omissible, ``sep`` between those present.

    Returns an expression and whether it may be empty (the caller adds ``?``).
    """
    n = len(items)
    if not n:
        return "", True
    if not sep:  # self-delimited items: each present or not
        return " ".join(item if required else f"{item}?" for item, required in items), \
            not any(required for _, required in items)
    tails: list[str | None] = [None] * (n + 1)
    for i in reversed(range(n)):
        item, required = items[i]
        rest = f" {tails[i + 1]}" if tails[i + 1] else ""
        if required:
            tails[i] = rules.add(f"{sep} {item}{rest}")
        else:
            tails[i] = rules.add(f"({sep} {item})?{rest}")
    heads: list[str | None] = [None] * (n + 1)
    empty = True
    for i in reversed(range(n)):
        item, required = items[i]
        rest = f" {tails[i + 1]}" if tails[i + 1] else ""
        if required:
            heads[i] = rules.add(f"{item}{rest}")
            empty = False
        else:
            alternative = f" | {heads[i + 1]}" if heads[i + 1] else ""
            heads[i] = rules.add(f"{item}{rest}{alternative}")
    return heads[0] or "", empty


def with_options(schema: Any, lenient: bool) -> dict[str, Any]:
    schema = schema if isinstance(schema, dict) else {}
    if lenient:
        schema = _readable_patterns(schema)
    guidance = dict(schema.get("x-guidance") or {})
    guidance.update({"whitespace_flexible": False, "lenient": lenient})
    return {**schema, "x-guidance": guidance}


#: Marks a schema whose ``pattern`` is kept in the lenient build (enforced or refused).
KEPT_PATTERN = "x-afmd-kept-pattern"
#: Keywords whose values are data, not subschemas: a ``pattern`` key there is data.
_DATA = frozenset({"enum", "const", "default", "examples"})


#: Patterns up to this long have their verdicts cached (agents resend their schemas); a
#: longer one is asked again, so the cache holds little whatever clients send.
_CACHED_PATTERN = 4096


def pattern_readable(pattern: str) -> bool:
    """Whether llguidance's regular expressions (Rust's syntax) can enforce ``pattern``.
    A JSON Schema pattern is ECMA-262's: look-around and back-references are valid there
    (zod's ``email()`` pattern opens with look-aheads) and not here."""
    if len(pattern) <= _CACHED_PATTERN:
        return _cached_readable(pattern)
    return _readable(pattern)


@functools.lru_cache(maxsize=256)
def _cached_readable(pattern: str) -> bool:
    return _readable(pattern)


def _readable(pattern: str) -> bool:
    grammar = LLMatcher.grammar_from_json_schema({"type": "string", "pattern": pattern})
    is_error, _ = LLMatcher.validate_grammar_with_warnings(grammar, None)
    return not is_error


def _readable_patterns(schema: Any) -> Any:
    """``schema`` without the patterns llguidance cannot read, for the lenient build: the
    value is then held to the rest of its schema (the turn marked downgraded), where the
    whole schema was refused as the client's error although it is a valid one."""
    if isinstance(schema, list):
        return [_readable_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            if schema.get(KEPT_PATTERN) or pattern_readable(value):
                out[key] = value
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {k: _readable_patterns(v) for k, v in value.items()
                        if not isinstance(k, str) or pattern_readable(k)}
        elif key in _DATA:
            out[key] = value
        elif key == "properties" and isinstance(value, dict):  # names, not keywords
            out[key] = {k: _readable_patterns(v) for k, v in value.items()}
        else:
            out[key] = _readable_patterns(value)
    return out


def kept_patterns(parameters: Any) -> dict[str, Any]:
    """A custom tool's parameters (one string, ``input``) with its pattern kept in the
    lenient build: the pattern is the tool's grammar, not one keyword of a schema."""
    schema = parameters if isinstance(parameters, dict) else {"type": "object"}
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        return schema
    text = properties.get("input")
    if not isinstance(text, dict) or "pattern" not in text:
        return schema
    return {**schema, "properties": {**properties, "input": {**text, KEPT_PATTERN: True}}}


def json_value(schema: Any, lenient: bool) -> str:
    return "%json " + json.dumps(with_options(schema, lenient))


Builder = Callable[[Rules, Param, bool], str]
