"""A lark grammar as one regular expression, where its language is regular.

A Responses ``custom`` tool may constrain its free-form input with a lark grammar (Codex's
``apply_patch``). The input travels inside the family's call markup, for most families as
a JSON string, and llguidance can constrain a JSON string only by a regex (a schema
``pattern``, which it matches against the decoded text, escapes and all). A grammar whose
rules never reach themselves again describes a regular language, so inlining every rule
and terminal yields a regex for exactly the strings the grammar derives; the input is then
enforced as a ``regex`` format is. A grammar that recurses, or uses what a regex cannot
say (llguidance's ``%json``, ``&``, special tokens, …), has no such regex:
:class:`NotRegular` says why, and the caller generates best-effort (downgraded).

The language is the grammar's as a context-free grammar over its terminals. llguidance's
own lark lexer is greedy, so for a grammar whose terminals overlap it may accept less; for
line-oriented grammars such as ``apply_patch`` the two agree. Whether a definition is lark
at all is llguidance's call (:func:`check_lark`), so a definition it rejects is refused
before this module reads it.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass

from llguidance import LLMatcher

#: Past this, a regex is more than the lexer should be asked to build per request.
MAX_REGEX = 50_000

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


class NotRegular(Exception):
    """The grammar has no regex: it recurses, or uses what a regex cannot express."""


@functools.lru_cache(maxsize=64)
def check_lark(definition: str) -> str | None:
    """llguidance's complaint about a lark grammar, or None when it compiles (cached:
    Codex resends its ``apply_patch`` grammar with every request)."""
    try:
        grammar = LLMatcher.grammar_from_lark(definition)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    except (ValueError, TypeError) as exc:
        return str(exc).strip().splitlines()[0]
    if is_error:
        return (messages or ["invalid grammar"])[0].strip().splitlines()[0]
    return None


# ------------------------------------------------------------------ reading the grammar

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
class _Seq:
    items: tuple[_Node, ...]


@dataclass(frozen=True, slots=True)
class _Alt:
    options: tuple[_Node, ...]


@dataclass(frozen=True, slots=True)
class _Repeat:
    item: _Node
    low: int
    high: int | None


@dataclass(frozen=True, slots=True)
class _Ref:
    name: str


@dataclass(frozen=True, slots=True)
class _Regex:
    text: str


_Node = _Seq | _Alt | _Repeat | _Ref | _Regex


def _tokens(definition: str) -> list[_Tok]:
    out: list[_Tok] = []
    for match in _TOKEN.finditer(definition):
        kind = match.lastgroup or "other"
        if kind == "skip":
            continue
        if kind == "other":
            raise NotRegular(f"'{match.group()}' has no regex form")
        out.append(_Tok(kind, match.group()))
    # A line that starts with '|' continues the rule above it.
    return [t for i, t in enumerate(out)
            if not (t.kind == "newline" and i + 1 < len(out) and out[i + 1].text == "|")]


class _Parser:
    def __init__(self, definition: str) -> None:
        self.toks = _tokens(definition)
        self.i = 0
        self.defs: dict[str, _Node] = {}
        self.ignore: list[_Node] = []

    def peek(self) -> _Tok | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, text: str | None = None) -> _Tok:
        tok = self.peek()
        if tok is None or (text is not None and tok.text != text):
            raise NotRegular(f"expected {text or 'more'}")
        self.i += 1
        return tok

    def statements(self) -> dict[str, _Node]:
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
            raise NotRegular(f"{word} has no regex form")
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
            raise NotRegular(f"only lark's common terminals can be imported, not {module}")
        for source, target in names:
            if source not in _COMMON:
                raise NotRegular(f"common.{source} is not known")
            self.defs[target] = _Regex(_COMMON[source])

    def definition(self) -> None:
        name = self.take().text.lstrip("!?")
        if (tok := self.peek()) is not None and tok.text == ".":  # priority
            self.take()
            self.take()
        self.take(":")
        self.defs[name] = self.alternatives()
        if (tok := self.peek()) is not None and tok.kind != "newline":
            raise NotRegular(f"unexpected '{tok.text}' in {name}")

    def alternatives(self) -> _Node:
        options = [self.sequence()]
        while (tok := self.peek()) is not None and tok.text == "|":
            self.take()
            options.append(self.sequence())
        return options[0] if len(options) == 1 else _Alt(tuple(options))

    def sequence(self) -> _Node:
        items = []
        while (tok := self.peek()) is not None and tok.kind != "newline" \
                and tok.text not in ("|", ")", "]"):
            if tok.kind == "arrow":  # an alias names the tree, not the language
                self.take()
                self.take()
                continue
            items.append(self.postfix(self.atom()))
        return items[0] if len(items) == 1 else _Seq(tuple(items))

    def postfix(self, node: _Node) -> _Node:
        tok = self.peek()
        if tok is None:
            return node
        if tok.text in ("?", "*", "+"):
            self.take()
            return _Repeat(node, 1 if tok.text == "+" else 0, 1 if tok.text == "?" else None)
        if tok.text == "~":
            self.take()
            low = int(self.take().text)
            high = low
            if (nxt := self.peek()) is not None and nxt.kind == "dots":
                self.take()
                high = int(self.take().text)
            return _Repeat(node, low, high)
        return node

    def atom(self) -> _Node:
        tok = self.take()
        if tok.text == "(":
            node = self.alternatives()
            self.take(")")
            return node
        if tok.text == "[":
            node = self.alternatives()
            self.take("]")
            return _Repeat(node, 0, 1)
        if tok.kind == "string":
            first = _literal(tok.text)
            if (nxt := self.peek()) is not None and nxt.kind == "dots":
                self.take()
                last = _literal(self.take().text)
                if len(first) != 1 or len(last) != 1:
                    raise NotRegular("a range joins single characters")
                return _Regex(f"[{_escape(first)}-{_escape(last)}]")
            regex = _escape(first)
            return _Regex(f"(?i:{regex})" if tok.text.endswith("i") else regex)
        if tok.kind == "regex":
            body, _, flags = tok.text[1:].rpartition("/")
            flags = "".join(f for f in flags if f in "imsx")
            return _Regex(f"(?{flags}:{body})" if flags else f"(?:{body})")
        if tok.kind == "name":
            if (nxt := self.peek()) is not None and nxt.text == "{":
                raise NotRegular("templates have no regex form")
            return _Ref(tok.text.lstrip("!?"))
        raise NotRegular(f"'{tok.text}' has no regex form")


def _literal(token: str) -> str:
    body = token[:-1] if token.endswith("i") else token
    try:
        value = ast.literal_eval(body)
    except (ValueError, SyntaxError):
        raise NotRegular(f"the string {body} does not decode") from None
    if not isinstance(value, str):
        raise NotRegular(f"the string {body} does not decode")
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


# ------------------------------------------------------------------ inlining


def _terminal(name: str) -> bool:
    return name.lstrip("_")[:1].isupper()


class _Inliner:
    """Each rule's regex, built once per way it is used.

    ``%ignore`` text may stand between any two tokens of a rule (not inside a terminal,
    and, as llguidance reads it, not before the first token nor after the last), so a rule
    is built in one of three modes: ``term`` (inside a terminal: nothing between),
    ``rest`` (every token may be preceded by ignored text) and ``first`` (as ``rest``,
    except its first token). (llguidance also takes ignored text after the last token
    where another token could still follow; the regex never generates it.)"""

    def __init__(self, defs: dict[str, _Node], ignore: list[_Node]) -> None:
        self.defs = defs
        self.done: dict[tuple[str, str], str] = {}
        self.skip = ""
        if ignore:
            self.skip = "(?:" + "|".join(self.regex(n, (), "term") for n in ignore) + ")*"

    def nullable(self, node: _Node, stack: tuple[str, ...] = ()) -> bool:
        if isinstance(node, _Regex):
            return False
        if isinstance(node, _Ref):
            if node.name in stack or node.name not in self.defs:
                return False  # reported by regex()
            return self.nullable(self.defs[node.name], (*stack, node.name))
        if isinstance(node, _Seq):
            return all(self.nullable(item, stack) for item in node.items)
        if isinstance(node, _Alt):
            return any(self.nullable(option, stack) for option in node.options)
        return node.low == 0 or self.nullable(node.item, stack)

    def token(self, text: str, mode: str) -> str:
        return f"{self.skip}(?:{text})" if mode == "rest" and self.skip else text

    def regex(self, node: _Node, stack: tuple[str, ...], mode: str) -> str:
        if isinstance(node, _Regex):
            return self.token(node.text, mode)
        if isinstance(node, _Ref):
            if mode != "term" and _terminal(node.name):
                return self.token(self.regex(node, stack, "term"), mode)
            key = (node.name, mode)
            if node.name in stack:
                raise NotRegular(f"{node.name} is recursive")
            if key not in self.done:
                if node.name not in self.defs:
                    raise NotRegular(f"{node.name} is not defined")
                self.done[key] = self.regex(self.defs[node.name], (*stack, node.name), mode)
                if len(self.done[key]) > MAX_REGEX:
                    raise NotRegular("its regex is too large")
            return f"(?:{self.done[key]})"
        if isinstance(node, _Seq):
            return self.sequence(node.items, stack, mode)
        if isinstance(node, _Alt):
            return "(?:" + "|".join(self.regex(o, stack, mode) for o in node.options) + ")"
        if mode == "first" and self.skip and node.high != 1:
            # The first repetition leads; the others follow a token of this one.
            head = self.regex(node.item, stack, "first")
            tail = self.regex(node.item, stack, "rest")
            more = "*" if node.high is None else f"{{0,{node.high - 1}}}"
            if node.low > 1:
                more = f"{{{node.low - 1},}}" if node.high is None \
                    else f"{{{node.low - 1},{node.high - 1}}}"
            both = f"(?:{head}(?:{tail}){more})"
            return both if node.low > 0 else f"(?:{both})?"
        inner = self.regex(node.item, stack, mode)
        if (node.low, node.high) == (0, 1):
            op = "?"
        elif node.high is None:
            op = "*" if node.low == 0 else "+" if node.low == 1 else f"{{{node.low},}}"
        else:
            op = f"{{{node.low},{node.high}}}"
        return f"(?:{inner}){op}"

    def sequence(self, items: tuple[_Node, ...], stack: tuple[str, ...], mode: str) -> str:
        if mode != "first" or not self.skip or not items:
            return "".join(self.regex(item, stack, mode) for item in items)
        head, tail = items[0], items[1:]
        text = self.regex(head, stack, "first") + self.sequence(tail, stack, "rest")
        if tail and self.nullable(head, stack):  # the head left out: the next one leads
            text = f"(?:{text}|{self.sequence(tail, stack, 'first')})"
        return text


def lark_regex(definition: str) -> str:
    """The regex (Rust/llguidance syntax, unanchored) for the strings ``start`` derives.

    Raises :class:`NotRegular` when there is none (or it would be too large).
    """
    regex, reason = _regex_or_reason(definition)
    if regex is None:
        raise NotRegular(reason)
    return regex


@functools.lru_cache(maxsize=64)
def _regex_or_reason(definition: str) -> tuple[str | None, str]:
    try:
        parser = _Parser(definition)
        defs = parser.statements()
        if "start" not in defs:
            raise NotRegular("there is no start rule")
        text = _Inliner(defs, parser.ignore).regex(_Ref("start"), (), "first")
        if len(text) > MAX_REGEX:
            raise NotRegular("its regex is too large")
    except NotRegular as exc:
        return None, str(exc)
    return text, ""
