"""A parameter's value as the model writes it in markup, and as JSON in ``arguments``.

Formats that write one tagged value per parameter (Qwen3-Coder, GLM, MiniMax, Gemma, …)
write strings raw and everything else as JSON (or Python literals). Which it is comes
from the tool's schema: a parameter whose schema only admits strings becomes a JSON
string, its text exactly as written (so a string ``"123"`` stays a string); any other
value is read as JSON, then as a Python literal (templates render ``True``), and only
failing both is kept as a string. The grammar side (``afmd.grammar.calls``) makes the same
decision from the same function, so what it forces is what is read back.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from afmd.output.markers import partial_suffix

_MAX_LITERAL = 100_000  # longer "Python literals" are not parsed (ast is recursive)
_JSON_NAMES = {"true": True, "false": False, "null": None}
_JSON_START = frozenset('{["-0123456789tfn')


def resolve(schema: Any, root: dict[str, Any] | None) -> Any:
    """A local ``$ref`` (``#/…``) followed within ``root``, once per hop (bounded)."""
    for _ in range(16):
        if not isinstance(schema, dict) or root is None:
            return schema
        ref = schema.get("$ref")
        if not isinstance(ref, str) or not ref.startswith("#"):
            return schema
        node: Any = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            else:
                return schema
        schema = node
    return schema


def is_string_schema(schema: Any, root: dict[str, Any] | None = None) -> bool:
    """True when every value ``schema`` admits is a string (null aside): then the model
    writes it raw and the call's JSON gets it as a string."""
    schema = resolve(schema, root)
    if not isinstance(schema, dict) or not schema:
        return False
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if "string" not in kinds or any(k not in ("string", "null") for k in kinds):
            return False
    if "const" in schema and not isinstance(schema["const"], str):
        return False
    enum = schema.get("enum")
    if isinstance(enum, list) and not all(isinstance(v, str) or v is None for v in enum):
        return False
    branches = [b for key in ("anyOf", "oneOf") for b in schema.get(key) or []]
    if branches and not all(
        is_string_schema(b, root) or _is_null(b) for b in branches if isinstance(b, dict)
    ):
        return False
    return kind is not None or isinstance(enum, list) or "const" in schema or bool(
        branches and any(is_string_schema(b, root) for b in branches)
    )


def _is_null(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "null"


def parameter_is_string(parameters: dict[str, Any], key: str) -> bool:
    properties = parameters.get("properties")
    if not isinstance(properties, dict) or key not in properties:
        return False
    return is_string_schema(properties[key], parameters)


def parse_value(text: str) -> Any:
    """A non-string parameter's value: JSON, else a Python literal, else the text."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    if len(text) <= _MAX_LITERAL:
        try:
            value = _literal(ast.parse(text.strip(), mode="eval").body)
        except (SyntaxError, ValueError, RecursionError, TypeError):
            pass
        else:
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                return text
            return value
    return text


def _literal(node: ast.expr) -> Any:
    """``ast.literal_eval`` where JSON's names mean what they do in JSON (templates render
    nested containers as JSON inside Python-ish markup)."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)
                if k is not None}
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError("not a number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Constant) and (
        node.value is None or isinstance(node.value, str | int | float | bool)
    ):
        return node.value
    raise ValueError("not a literal")


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def escape(text: str) -> str:
    """``text`` as the inside of a JSON string (escaping is per character, so escaped
    pieces concatenate to the escape of the whole)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class Trim:
    """How a family pads a raw value inside its tags, taken off as the value streams.

    ``newline``: one newline after the opening tag and one before the closing tag (Qwen3-
    Coder's layout); ``space``: all surrounding whitespace (GLM, MiniMax); ``cdata``: that,
    and a ``<![CDATA[…]]>`` wrapper when there is one (MiniCPM5); ``none``.
    """

    NEWLINE, SPACE, CDATA, NONE = "newline", "space", "cdata", "none"


_CDATA = ("<![CDATA[", "]]>")


def trimmed(raw: str, trim: str) -> str:
    if trim == Trim.CDATA:
        text = raw.strip()
        if text.startswith(_CDATA[0]) and text.endswith(_CDATA[1]) \
                and len(text) >= len(_CDATA[0]) + len(_CDATA[1]):
            return raw.lstrip()[len(_CDATA[0]):][: len(text) - len(_CDATA[0]) - 3]
        return text
    if trim == Trim.SPACE:
        return raw.strip()
    if trim == Trim.NEWLINE:
        if raw.startswith("\n"):
            raw = raw[1:]
        return raw[:-1] if raw.endswith("\n") else raw
    return raw


def settled(raw: str, trim: str) -> str:
    """The part of a value still being written that is sure to be in the final value."""
    if trim == Trim.CDATA:
        text = raw.lstrip()
        if _CDATA[0].startswith(text):
            return ""  # may still open a CDATA block
        if not text.startswith(_CDATA[0]):
            return text.rstrip()
        inner = text[len(_CDATA[0]):]
        # The block ends at a "]]>" followed by nothing but whitespace: hold from the
        # last one that may be it.
        keep = len(inner) - partial_suffix(inner, (_CDATA[1],))
        last = inner.rfind(_CDATA[1])
        if last != -1 and not inner[last + 3:].strip():
            keep = min(keep, last)
        return inner[:keep]
    if trim == Trim.SPACE:
        return raw.lstrip().rstrip() if raw.strip() else ""
    if trim == Trim.NEWLINE:
        if raw.startswith("\n"):
            raw = raw[1:]
        return raw[:-1] if raw.endswith("\n") else raw
    return raw


class ValueStream:
    """One parameter's value, raw text in, JSON text out as it becomes certain.

    A string streams character by character inside quotes. Another value streams as
    written when a grammar guarantees it is JSON (``verbatim``), else it is held until its
    end and converted (:func:`parse_value`).
    """

    __slots__ = ("_raw", "_sent", "_trim", "kind")

    def __init__(self, *, string: bool, verbatim: bool, trim: str) -> None:
        if string:
            self.kind = "string"
        else:
            self.kind = "verbatim" if verbatim and trim != Trim.CDATA else "held"
        self._trim = trim
        self._raw = ""
        self._sent = 0

    def start(self) -> str:
        return '"' if self.kind == "string" else ""

    def feed(self, text: str) -> str:
        self._raw += text
        if self.kind == "held":
            return ""
        sure = settled(self._raw, self._trim)
        if self.kind == "verbatim" and not self._sent and sure and sure[0] not in _JSON_START:
            # Not JSON after all (``True``, a bare word): read whole at its end.
            self.kind = "held"
            return ""
        # Leading whitespace is only settled once something else follows.
        new, self._sent = sure[self._sent:], max(self._sent, len(sure))
        return escape(new) if self.kind == "string" else new

    def end(self) -> str:
        final = trimmed(self._raw, self._trim)
        if self.kind == "held":
            return dumps(parse_value(final))
        rest = final[self._sent:]
        if self.kind == "string":
            return escape(rest) + '"'
        return rest


class ArgumentsObject:
    """A call's ``arguments`` as the JSON object its parameters build, key by key: what a
    reader writes before each key, and what ends the object however far it got (a call
    cut off mid-value still closes as valid JSON)."""

    __slots__ = ("keys", "value")

    def __init__(self) -> None:
        self.keys = 0  # -1: the arguments came whole (raw JSON): nothing to close
        self.value: ValueStream | None = None  # the value streaming now

    def key(self, name: str, value: ValueStream | None = None) -> str:
        """The text before the key's value, which ``value`` streams (when given)."""
        text = ("{" if not self.keys else ", ") + dumps(name) + ": "
        self.keys += 1
        self.value = value
        return text

    def stream(self) -> ValueStream:
        assert self.value is not None
        return self.value

    def end_value(self) -> str:
        """The open value's end ("" when none is open)."""
        value, self.value = self.value, None
        return "" if value is None else value.end()

    def close(self) -> str:
        return "{}" if self.keys == 0 else "}" if self.keys > 0 else ""
