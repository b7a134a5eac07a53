"""A lark grammar read into rules of regex atoms: what afmd rewrites a custom tool's
grammar from.

A Responses ``custom`` tool's lark grammar is enforced by writing its language anew, as
one regex (:mod:`afmd.grammar.lark_regex`, where it is regular) or as rules of escaped
characters (:mod:`afmd.grammar.lark_input`, where it recurses). Both start from the same
reading: each rule and terminal a tree of sequences, alternatives, repetitions, references
and regexes (string literals, ranges and lark's ``common`` terminals become regexes too),
plus the ``%ignore`` patterns. What that reading cannot carry (special tokens, ``%json``,
templates, ``&`` and ``~`` negation, imports other than ``common``) raises
:class:`Unsupported`, and the caller generates best-effort. Whether a definition is lark
at all is llguidance's call, made before this module reads it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass


class Unsupported(Exception):
    """The grammar uses what afmd cannot rewrite."""


def parse(definition: str) -> tuple[dict[str, Node], list[Node]]:
    """The grammar's definitions by name (rules and terminals) and its ``%ignore``s."""
    parser = _Parser(definition)
    return parser.statements(), parser.ignore


def terminal(name: str) -> bool:
    """Whether a definition's name is a terminal's (upper case), not a rule's."""
    return name.lstrip("_")[:1].isupper()


# Lark's ``common`` terminals (lark/grammars/common.lark), as regexes.
_DIGIT = "[0-9]"
_INT = f"{_DIGIT}+"
_DECIMAL = rf"(?:{_INT}\.(?:{_INT})?|\.{_INT})"
_EXP = rf"(?:[eE][+-]?{_INT})"
_FLOAT = rf"(?:{_INT}{_EXP}|{_DECIMAL}{_EXP}?)"
_COMMON = {
    "DIGIT": _DIGIT, "HEXDIGIT": "[a-fA-F0-9]", "INT": _INT,
    "SIGNED_INT": rf"[+-]?{_INT}", "DECIMAL": _DECIMAL, "FLOAT": _FLOAT,
    "SIGNED_FLOAT": rf"[+-]?{_FLOAT}", "NUMBER": rf"(?:{_FLOAT}|{_INT})",
    "SIGNED_NUMBER": rf"[+-]?(?:{_FLOAT}|{_INT})",
    "ESCAPED_STRING": r'"(?:[^"\\]|\\.)*"', "LCASE_LETTER": "[a-z]",
    "UCASE_LETTER": "[A-Z]", "LETTER": "[a-zA-Z]", "WORD": "[a-zA-Z]+",
    "CNAME": "[_a-zA-Z][_a-zA-Z0-9]*", "WS_INLINE": "[ \\t]+", "WS": "[ \\t\\f\\r\\n]+",
    "CR": r"\r", "LF": r"\n", "NEWLINE": r"(?:\r?\n)+", "SH_COMMENT": "#[^\\n]*",
    "CPP_COMMENT": "//[^\\n]*", "C_COMMENT": r"/\*(?s:.)*?\*/", "SQL_COMMENT": "--[^\\n]*",
}




_TOKEN = re.compile(r"""
    (?P<skip>[ \t]+|(?:\#|//)[^\n]*|\\\r?\n)
  | (?P<newline>(?:\r?\n[ \t]*)+)
  | (?P<directive>%[a-z]+)
  | (?P<arrow>->)
  | (?P<dots>\.\.)
  | (?P<string>"(?:\\.|[^"\\\n])*"i?)
  | (?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*)
  | (?P<name>[!?]?_?[A-Za-z][A-Za-z0-9_\-]*)
  | (?P<number>[0-9]+)
  | (?P<punct>[:|()\[\]~+*?.,])
  | (?P<other>.)
""", re.VERBOSE)


@dataclass(frozen=True, slots=True)
class _Tok:
    kind: str
    text: str


@dataclass(frozen=True, slots=True)
class Seq:
    items: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Alt:
    options: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Repeat:
    item: Node
    low: int
    high: int | None


@dataclass(frozen=True, slots=True)
class Ref:
    name: str


@dataclass(frozen=True, slots=True)
class Regex:
    text: str


Node = Seq | Alt | Repeat | Ref | Regex


def _tokens(definition: str) -> list[_Tok]:
    out: list[_Tok] = []
    for match in _TOKEN.finditer(definition):
        kind = match.lastgroup or "other"
        if kind == "skip":
            continue
        if kind == "other":
            raise Unsupported(f"'{match.group()}' is not supported here")
        out.append(_Tok(kind, match.group()))
    # A line that starts with '|' continues the rule above it.
    return [t for i, t in enumerate(out)
            if not (t.kind == "newline" and i + 1 < len(out) and out[i + 1].text == "|")]


class _Parser:
    def __init__(self, definition: str) -> None:
        self.toks = _tokens(definition)
        self.i = 0
        self.defs: dict[str, Node] = {}
        self.ignore: list[Node] = []

    def peek(self) -> _Tok | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, text: str | None = None) -> _Tok:
        tok = self.peek()
        if tok is None or (text is not None and tok.text != text):
            raise Unsupported(f"expected {text or 'more'}")
        self.i += 1
        return tok

    def statements(self) -> dict[str, Node]:
        while (tok := self.peek()) is not None:
            if tok.kind == "newline":
                self.i += 1
            elif tok.kind == "directive":
                self.directive()
            else:
                self.definition()
        return self.defs

    def directive(self) -> None:
        word = self.take().text
        if word == "%ignore":
            self.ignore.append(self.alternatives())
            return
        if word != "%import":
            raise Unsupported(f"{word} is not supported here")
        path = self.take().text
        while (tok := self.peek()) is not None and tok.text == ".":
            self.take()
            path += "." + self.take().text
        module, _, name = path.rpartition(".")
        names = [(name, name)]
        if (tok := self.peek()) is not None and tok.text == "(":  # %import common (A, B)
            module, names = path, []
            self.take("(")
            while (tok := self.take()).text != ")":
                if tok.kind == "name":
                    names.append((tok.text, tok.text))
        elif tok is not None and tok.kind == "arrow":
            self.take()
            names = [(name, self.take().text)]
        if module != "common":
            raise Unsupported(f"only lark's common terminals can be imported, not {module}")
        for source, target in names:
            if source not in _COMMON:
                raise Unsupported(f"common.{source} is not known")
            self.defs[target] = Regex(_COMMON[source])

    def definition(self) -> None:
        name = self.take().text.lstrip("!?")
        if (tok := self.peek()) is not None and tok.text == ".":  # priority
            self.take()
            self.take()
        self.take(":")
        self.defs[name] = self.alternatives()
        if (tok := self.peek()) is not None and tok.kind != "newline":
            raise Unsupported(f"unexpected '{tok.text}' in {name}")

    def alternatives(self) -> Node:
        options = [self.sequence()]
        while (tok := self.peek()) is not None and tok.text == "|":
            self.take()
            options.append(self.sequence())
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def sequence(self) -> Node:
        items = []
        while (tok := self.peek()) is not None and tok.kind != "newline" \
                and tok.text not in ("|", ")", "]"):
            if tok.kind == "arrow":  # an alias names the tree, not the language
                self.take()
                self.take()
                continue
            items.append(self.postfix(self.atom()))
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def postfix(self, node: Node) -> Node:
        tok = self.peek()
        if tok is None:
            return node
        if tok.text in ("?", "*", "+"):
            self.take()
            return Repeat(node, 1 if tok.text == "+" else 0, 1 if tok.text == "?" else None)
        if tok.text == "~":
            self.take()
            low = high = self.count()
            if (nxt := self.peek()) is not None and nxt.kind == "dots":
                self.take()
                high = self.count()
            return Repeat(node, low, high)
        return node

    def count(self) -> int:
        """A repeat's bound; anything else after ``~`` is llguidance's negation."""
        tok = self.take()
        if tok.kind != "number":
            raise Unsupported("~ negation is not supported here")
        return int(tok.text)

    def atom(self) -> Node:
        tok = self.take()
        if tok.text == "(":
            node = self.alternatives()
            self.take(")")
            return node
        if tok.text == "[":
            node = self.alternatives()
            self.take("]")
            return Repeat(node, 0, 1)
        if tok.kind == "string":
            first = _literal(tok.text)
            if (nxt := self.peek()) is not None and nxt.kind == "dots":
                self.take()
                last = _literal(self.take().text)
                if len(first) != 1 or len(last) != 1:
                    raise Unsupported("a range joins single characters")
                return Regex(f"[{_escape(first)}-{_escape(last)}]")
            regex = _escape(first)
            return Regex(f"(?i:{regex})" if tok.text.endswith("i") else regex)
        if tok.kind == "regex":
            body, _, flags = tok.text[1:].rpartition("/")
            flags = "".join(f for f in flags if f in "imsx")
            return Regex(f"(?{flags}:{body})" if flags else f"(?:{body})")
        if tok.kind == "name":
            if (nxt := self.peek()) is not None and nxt.text == "{":
                raise Unsupported("templates are not supported here")
            return Ref(tok.text.lstrip("!?"))
        raise Unsupported(f"'{tok.text}' is not supported here")


def _literal(token: str) -> str:
    body = token[:-1] if token.endswith("i") else token
    try:
        value = ast.literal_eval(body)
    except (ValueError, SyntaxError):
        raise Unsupported(f"the string {body} does not decode") from None
    if not isinstance(value, str):
        raise Unsupported(f"the string {body} does not decode")
    return value


def _escape(text: str) -> str:
    out = []
    for ch in text:
        if ch.isalnum() or ch in " _" or ord(ch) > 0x7F:
            out.append(ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append("\\" + ch)
    return "".join(out)
