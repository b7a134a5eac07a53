"""A custom tool's recursive lark grammar as rules of the call grammar: raw, or escaped
into a JSON string.

A Responses ``custom`` tool's input travels, in most families, as the value of a JSON
string (``{"input": "…"}``), and llguidance constrains a JSON string only by a regex; a
grammar that recurses has none (:mod:`afmd.grammar.lark_regex`). The call grammar is
itself lark, though, and takes a whole grammar where a rule may stand (``%lark { … }``).
So the input is written as ``"\\"" %lark { E(G) } "\\""``: E(G) derives, for every text
the user's grammar G derives, that text as a JSON string writes it. Families that write a
string parameter raw (Qwen3-Coder, GLM, Gemma, …) get the same rules unescaped.

Escaping is a homomorphism (each character to its escaped form), so every character or
class of G's regexes becomes one lexeme of its escaped forms and the structure around
them (sequences, alternatives, repetitions, rules) stays as it is. Lexemes are single
characters on purpose: llguidance's lexer ends a lexeme one byte ahead, and an escape is
two to six bytes, so a terminal kept whole would swallow the backslash that opens the
next token's escape (``\\n`` after a line) and fail. The language is therefore G's as a
context-free grammar over its terminals, ``%ignore`` text allowed between two tokens of a
rule (not inside a terminal, not before the first token nor after the last), as
:mod:`afmd.grammar.lark_regex` reads it for grammars that do not recurse: where G's
terminals overlap (``NAME NAME``), llguidance's greedy lexer accepts less of the raw
grammar than this does, and what this accepts still parses under lark's own Earley parser.

Each character has one escaped form, the one JSON requires: ``\\"`` and ``\\\\``,
``\\b \\f \\n \\r \\t``, any other control character as ``\\u00XX`` (hex digits of
either case), everything else (``/`` and DEL included) raw. JSON also allows ``\\u0041``
for ``A`` or ``\\/`` for ``/``; such a spelling reaches no text the plain one does not, so
it would only make the grammar ambiguous, and llguidance's own JSON strings with a
``pattern`` refuse those two as well. The reader decodes any of them.

Which characters of a regex class are ones JSON escapes is asked of llguidance itself (a
one-class matcher over a byte tokenizer), so a class means exactly what it means to
llguidance. What the rules cannot carry (anchors and lookarounds in a regex, the ``x``
flag, and what :mod:`afmd.grammar.lark_parse` cannot read) raises :class:`NotEmbeddable`,
and the caller generates that input best-effort (downgraded). So does a raw input the
family's reader would cut (:func:`raw_text`). The text written here is compiled in the
compile worker like any other grammar text; what is asked of llguidance in this process (a
class's members, a raw text's edges) is a grammar of one-character lexemes, whose lexer has
nothing to build at size.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from afmd.grammar.lark_parse import Alt, Node, Ref, Regex, Repeat, Seq, Unsupported, parse, terminal

#: The key of a custom tool's input schema that holds its lark grammar (beside a
#: ``format`` no schema compiler knows, so a path that does not embed it is downgraded).
LARK_KEY = "x-afmd-lark"
#: Past this, the rules are more than a request should make the compiler build.
MAX_TEXT = 200_000

# JSON's short escapes; other control characters are written \u00XX.
_SHORT = {0x08: "b", 0x09: "t", 0x0A: "n", 0x0C: "f", 0x0D: "r", 0x22: '"', 0x5C: "\\"}
#: The characters JSON escapes.
SPECIAL = frozenset([*range(0x20), 0x22, 0x5C])
#: Every character JSON writes raw, as a class (to intersect a user's class with).
_PLAIN = r'[^"\\\x00-\x1f]'
_META = set(r"\.+*?()|[]{}^$/#&~-")


class NotEmbeddable(Unsupported):
    """The grammar uses what the rules cannot carry: generate best-effort."""


def lark_of(schema: Any) -> str | None:
    """The lark grammar a custom tool's input schema carries, if any."""
    value = schema.get(LARK_KEY) if isinstance(schema, dict) else None
    return value if isinstance(value, str) else None


def json_string(definition: str) -> str:
    """The input as a JSON string: its quotes around the escaped rules, nested."""
    return '"\\"" %lark {\n' + lark_rules(definition, escaped=True) + '\n} "\\""'


def raw_text(definition: str, *, forbid: str = "", trimmed: bool = False) -> str:
    """The input written raw: the rules unescaped, nested.

    Rules cannot be intersected with "never ``forbid``" nor "no space at either end" as
    a terminal can, so where the family's reader would cut what they allow, they are
    not used (:class:`NotEmbeddable`): a text that may start or end with whitespace where
    the family trims values, a character that may open ``forbid`` (the closing tag, when
    it is text) anywhere."""
    text = lark_rules(definition, escaped=False)
    reason = _hazard(definition, forbid[:1], trimmed)
    if reason:
        raise NotEmbeddable(reason)
    return "%lark {\n" + text + "\n}"


# --------------------------------------------------------------------------- characters


def _escapes(specials: frozenset[int] | set[int]) -> str:
    """A regex for the escaped forms of ``specials``, case-sensitive whatever surrounds
    it (``\\N`` is no JSON escape)."""
    alts = []
    for code in sorted(c for c in specials if c in _SHORT):
        alts.append(r"\\" + ("\\" + _SHORT[code] if _SHORT[code] in '\\"' else _SHORT[code]))
    for high in (0, 1):
        lows = sorted(c & 0xF for c in specials if c >> 4 == high and c not in _SHORT)
        if lows:
            digits = "".join(f"{low:x}" + (f"{low:X}" if low > 9 else "") for low in lows)
            alts.append(rf"\\u00{high}[{digits}]")
    return "(?-i:" + "|".join(alts) + ")" if alts else ""


def _lexeme(regex: str, fold: bool) -> str:
    return f"/(?i:{regex})/" if fold else f"/{regex}/"


def _noted(chars: _Chars, lexeme: str) -> str:
    chars.seen.add(lexeme)
    return lexeme


class _ByteTokens:
    """One token per byte (and an end token): a matcher over it says which bytes may
    come first, so which ASCII characters a class holds."""

    eos_token_id = 256
    bos_token_id = None
    tokens = tuple([bytes([i]) for i in range(256)] + [b"<eos>"])
    special_token_ids = (256,)

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


@functools.cache
def _bytes_tokenizer() -> LLTokenizer:
    return LLTokenizer(TokenizerWrapper(_ByteTokens()))


@functools.lru_cache(maxsize=1024)
def _members(atom: str) -> tuple[frozenset[int], bool]:
    """The special characters a one-character regex matches, and whether it matches
    any other, as llguidance reads it."""
    try:
        grammar = LLMatcher.grammar_from_lark(f"start: /{atom}/")
    except ValueError as exc:
        raise NotEmbeddable(str(exc).strip().splitlines()[0]) from None
    matcher = LLMatcher(_bytes_tokenizer(), grammar, log_level=0)
    if matcher.is_error():
        raise NotEmbeddable(matcher.get_error())
    mask = matcher.compute_bitmask()
    allowed = {i for i in range(256) if mask[i // 8] >> (i % 8) & 1}
    return frozenset(allowed & SPECIAL), bool(allowed - SPECIAL)


class _Chars:
    """One character, class or ``.`` of a regex as a lexeme of its (escaped) forms."""

    def __init__(self, escaped: bool) -> None:
        self.escaped = escaped
        self.seen: set[str] = set()  # every lexeme written, for a hazard's search

    def char(self, code: int, fold: bool) -> str:
        if self.escaped and code in SPECIAL:
            return _noted(self, _lexeme(_escapes({code}), False))
        ch = chr(code)
        return _noted(self, _lexeme("\\" + ch if ch in _META else ch, fold))

    def klass(self, atom: str, fold: bool) -> str:
        """A class (``[…]``, ``\\d``, ``\\p{…}``)."""
        if not self.escaped:
            return _noted(self, _lexeme(atom, fold))
        specials, rest = _members(atom)
        body = atom if atom.startswith("[") else f"[{atom}]"
        return self.union(f"[{body}&&{_PLAIN}]" if rest else None, specials, fold)

    def any(self, dotall: bool) -> str:
        if not self.escaped:
            return _noted(self, "/(?s:.)/" if dotall else "/./")
        return self.union(_PLAIN, SPECIAL if dotall else SPECIAL - {0x0A}, False)

    def union(self, plain: str | None, specials: frozenset[int], fold: bool) -> str:
        alts = [a for a in (plain, _escapes(specials)) if a]
        if not alts:
            raise NotEmbeddable("a character class that matches nothing")
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return _noted(self, _lexeme(body, fold))


# --------------------------------------------------------------------------- regexes


_LITERAL_ESCAPES = {"a": 0x07, "f": 0x0C, "t": 0x09, "n": 0x0A, "r": 0x0D, "v": 0x0B}
_HEX = re.compile(r"x([0-9a-fA-F]{2})|x\{([0-9a-fA-F]+)\}|u([0-9a-fA-F]{4})|u\{([0-9a-fA-F]+)\}"
                  r"|U([0-9a-fA-F]{8})|U\{([0-9a-fA-F]+)\}")
_CLASS_ESCAPE = re.compile(r"[dDsSwW]|[pP](?:\{[^}]*\}|[A-Za-z])")
_QUANT = re.compile(r"([*+?]|\{[0-9]+(?:,[0-9]*)?\})\??")
_FLAGS = re.compile(r"\(\?([a-zA-Z]*(?:-[a-zA-Z]*)?)(:|\))")
_NAMED = re.compile(r"\(\?P?<[A-Za-z_][A-Za-z0-9_]*>")


def _either(parts: list[str | None]) -> str | None:
    """Alternatives, an empty one making the whole optional (None: only empty)."""
    some = [p for p in parts if p is not None]
    if not some:
        return None
    body = some[0] if len(some) == 1 else "(" + " | ".join(some) + ")"
    return f"({body})?" if len(some) < len(parts) else body


def _join(items: list[str | None]) -> str | None:
    some = [i for i in items if i is not None]
    return " ".join(some) if some else None


class _RegexRules:
    """One regex (Rust syntax, as llguidance reads it) as a lark expression of
    one-character lexemes: its structure as it is, each character or class a lexeme."""

    def __init__(self, text: str, chars: _Chars, reverse: bool = False) -> None:
        self.text = text
        self.chars = chars
        self.reverse = reverse  # written back to front (what the text may end with)
        self.i = 0
        self.dotall = False
        self.fold = False

    def fail(self, what: str) -> NotEmbeddable:
        return NotEmbeddable(f"{what} in /{self.text}/")

    def peek(self) -> str:
        return self.text[self.i] if self.i < len(self.text) else ""

    def whole(self) -> str | None:
        out = self.alternatives()
        if self.i != len(self.text):
            raise self.fail("an unbalanced ')'")
        return out

    def alternatives(self) -> str | None:
        state = (self.dotall, self.fold)  # a (?s) lasts to the end of its group
        parts = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            parts.append(self.sequence())
        self.dotall, self.fold = state
        return _either(parts)

    def sequence(self) -> str | None:
        out: list[str | None] = []
        while self.peek() not in ("", "|", ")"):
            atom = self.atom()
            quant = _QUANT.match(self.text, self.i)
            if quant is not None:
                self.i = quant.end()
                if atom is not None:
                    atom = f"({atom}){quant.group(1)}"
            out.append(atom)
        return _join(out[::-1] if self.reverse else out)

    def atom(self) -> str | None:
        ch = self.peek()
        if ch == "(":
            return self.group()
        if ch == "[":
            return self.chars.klass(self.bracket(), self.fold)
        if ch == ".":
            self.i += 1
            return self.chars.any(self.dotall)
        if ch in "^$":
            raise self.fail("an anchor")
        if ch == "\\":
            return self.escape()
        self.i += 1
        return self.chars.char(ord(ch), self.fold)

    def group(self) -> str | None:
        flags = _FLAGS.match(self.text, self.i)
        if flags is not None:
            letters = flags.group(1)
            if set(letters) - set("imsuU-"):
                raise self.fail(f"the flag group (?{letters})")
            on, _, off = letters.partition("-")
            self.i = flags.end()
            state = (self.dotall, self.fold)
            self.dotall = ("s" in on or self.dotall) and "s" not in off
            self.fold = ("i" in on or self.fold) and "i" not in off
            if flags.group(2) == ")":  # (?s): to the end of the enclosing group
                return None
            inner = self.alternatives()
            self.dotall, self.fold = state
            self.close()
            return inner
        named = _NAMED.match(self.text, self.i)
        if named is not None:
            self.i = named.end()
        elif self.text.startswith("(?", self.i):
            raise self.fail("a lookaround")
        else:
            self.i += 1
        inner = self.alternatives()
        self.close()
        return f"({inner})" if inner is not None else None

    def close(self) -> None:
        if self.peek() != ")":
            raise self.fail("an unclosed group")
        self.i += 1

    def bracket(self) -> str:
        """The class's own text, nested classes and escapes included."""
        start, depth = self.i, 0
        while self.i < len(self.text):
            ch = self.text[self.i]
            if ch == "\\":
                self.i += 2
                continue
            if ch == "[":
                if self.text.startswith("[:", self.i) and depth:  # [:alpha:]
                    end = self.text.find(":]", self.i + 2)
                    if end != -1:
                        self.i = end + 2
                        continue
                depth += 1
                self.i += 1
                if self.text.startswith("^", self.i):
                    self.i += 1
                if self.text.startswith("]", self.i):  # a ']' first is a literal
                    self.i += 1
                continue
            self.i += 1
            if ch == "]":
                depth -= 1
                if depth == 0:
                    return self.text[start:self.i]
        raise self.fail("an unclosed class")

    def escape(self) -> str:
        rest = self.text[self.i + 1:]
        if not rest:
            raise self.fail("a trailing backslash")
        if (cls := _CLASS_ESCAPE.match(rest)) is not None:
            self.i += 1 + cls.end()
            return self.chars.klass("\\" + cls.group(), self.fold)
        if (hexa := _HEX.match(rest)) is not None:
            self.i += 1 + hexa.end()
            code = int(next(g for g in hexa.groups() if g is not None), 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                raise self.fail("a character out of range")
            return self.chars.char(code, self.fold)
        ch = rest[0]
        self.i += 2
        if ch in _LITERAL_ESCAPES:
            return self.chars.char(_LITERAL_ESCAPES[ch], self.fold)
        if ch.isalnum():
            raise self.fail(f"the escape \\{ch}")
        return self.chars.char(ord(ch), self.fold)


# --------------------------------------------------------------------------- rules


class _Writer:
    """The grammar's rules, each written once per way it is used.

    As in :class:`afmd.grammar.lark_regex._Inliner`: a rule is written in mode ``term``
    (inside a terminal: nothing between its tokens), ``rest`` (ignored text may precede
    every token) or ``first`` (as ``rest``, except its first token); without ``%ignore``
    the three are one."""

    def __init__(self, defs: dict[str, Node], ignore: list[Node], chars: _Chars,
                 reverse: bool = False) -> None:
        self.defs = defs
        self.chars = chars
        self.reverse = reverse  # every sequence back to front (no %ignore then)
        self.lines: list[str] = []
        self.names: dict[tuple[str, str], str] = {}
        self.regexes: dict[str, str | None] = {}
        self.nullable = self._nullable()
        self.skip = ""
        if ignore:
            parts = [self.expr(n, "term") for n in ignore]
            body = _either(parts)
            if body is not None:
                self.lines.append(f"skip: ({body})*")
                self.skip = "skip"

    def _nullable(self) -> set[str]:
        """The definitions that derive the empty text (to a fixed point: they recurse)."""
        found: set[str] = set()
        changed = True
        while changed:
            changed = False
            for name, node in self.defs.items():
                if name not in found and self.empty(node, found):
                    found.add(name)
                    changed = True
        return found

    def empty(self, node: Node, found: set[str]) -> bool:
        if isinstance(node, Regex):
            return False  # a token: lark refuses a terminal that matches nothing
        if isinstance(node, Ref):
            return node.name in found
        if isinstance(node, Seq):
            return all(self.empty(item, found) for item in node.items)
        if isinstance(node, Alt):
            return any(self.empty(option, found) for option in node.options)
        return node.low == 0 or self.empty(node.item, found)

    def regex(self, text: str) -> str | None:
        if text not in self.regexes:
            self.regexes[text] = _RegexRules(text, self.chars, self.reverse).whole()
        return self.regexes[text]

    def token(self, expr: str | None, mode: str) -> str | None:
        if expr is None:
            return None
        return f"{self.skip} ({expr})" if mode == "rest" and self.skip else expr

    def rule(self, name: str, mode: str) -> str:
        key = (name, mode)
        if key not in self.names:
            if name not in self.defs:
                raise NotEmbeddable(f"{name} is not defined")
            self.names[key] = made = f"r{len(self.names) + 1}"
            at = len(self.lines)
            self.lines.append("")
            body = self.expr(self.defs[name], mode)
            self.lines[at] = f'{made}: {body if body is not None else chr(34) * 2}'
            if sum(len(line) for line in self.lines) > MAX_TEXT:
                raise NotEmbeddable("its rules are too large")
        return self.names[key]

    def expr(self, node: Node, mode: str) -> str | None:
        if not self.skip:
            mode = "term"
        if isinstance(node, Regex):
            return self.token(self.regex(node.text), mode)
        if isinstance(node, Ref):
            if mode != "term" and terminal(node.name):
                return self.token(self.rule(node.name, "term"), mode)
            return self.rule(node.name, mode)
        if isinstance(node, Seq):
            return self.sequence(node.items, mode)
        if isinstance(node, Alt):
            return _either([self.expr(option, mode) for option in node.options])
        return self.repeat(node, mode)

    def repeat(self, node: Repeat, mode: str) -> str | None:
        if mode == "first" and node.high != 1:
            # The first repetition leads; the others follow a token of this one.
            head = self.expr(node.item, "first")
            tail = self.expr(node.item, "rest")
            if head is None or tail is None:
                return None
            low = max(node.low - 1, 0)
            high = "" if node.high is None else str(node.high - 1)
            both = f"{head} ({tail}){{{low},{high}}}"
            return both if node.low > 0 else f"({both})?"
        inner = self.expr(node.item, mode)
        if inner is None:
            return None
        op = {(0, 1): "?", (0, None): "*", (1, None): "+"}.get((node.low, node.high))
        if op is None:
            op = "{" + str(node.low) + "," + ("" if node.high is None else str(node.high)) + "}"
        return f"({inner}){op}"

    def sequence(self, items: tuple[Node, ...], mode: str) -> str | None:
        if mode != "first" or not items:
            out = [self.expr(item, mode) for item in items]
            return _join(out[::-1] if self.reverse else out)
        head, tail = items[0], items[1:]
        text = _join([self.expr(head, "first"), self.sequence(tail, "rest")])
        if tail and self.empty(head, self.nullable):  # the head left out: the next leads
            return _either([text, self.sequence(tail, "first")])
        return text


@functools.lru_cache(maxsize=128)
def _rules_or_reason(definition: str, escaped: bool) -> tuple[str | None, str]:
    try:
        defs, ignore = parse(definition)
        if "start" not in defs:
            raise NotEmbeddable("there is no start rule")
        writer = _Writer(defs, ignore, _Chars(escaped))
        start = writer.expr(Ref("start"), "first")
        text = "\n".join([f'start: {start if start is not None else chr(34) * 2}',
                          *writer.lines])
    except Unsupported as exc:
        return None, str(exc)
    return text, ""


def lark_rules(definition: str, *, escaped: bool) -> str:
    """The grammar as rules of one-character lexemes, JSON-escaped when ``escaped``
    (cached: agents resend their tools every turn). Raises :class:`NotEmbeddable`."""
    text, reason = _rules_or_reason(definition, escaped)
    if text is None:
        raise NotEmbeddable(reason)
    return text


def lark_string(text: str) -> str:
    """A lark string literal for ``text`` (DEL escaped: lark strings refuse it raw)."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


#: What a family that trims values strips (Python's ``str.strip``).
_WHITESPACE = tuple(ch for ch in map(chr, range(0x3001)) if ch.isspace())


def _takes(grammar: str, texts: tuple[str, ...]) -> str | None:
    """The first of ``texts`` that ``grammar`` may begin with, if any. (A grammar of
    one-character lexemes, or of single classes: nothing here that the lexer must build
    at any size, so it is asked in this process.)"""
    matcher = LLMatcher(_bytes_tokenizer(), LLMatcher.grammar_from_lark(grammar), log_level=0)
    if matcher.is_error():
        raise NotEmbeddable(matcher.get_error())
    for text in texts:
        data = list(text.encode())
        if matcher.validate_tokens(data) == len(data):
            return text
    return None


@functools.lru_cache(maxsize=128)
def _hazard(definition: str, first: str, trimmed: bool) -> str:
    """Why the raw rules would be read back cut, or ""."""
    defs, ignore = parse(definition)
    if first:
        chars = _Chars(False)
        writer = _Writer(defs, ignore, chars)
        writer.expr(Ref("start"), "first")
        lexemes = " | ".join(sorted(chars.seen))
        if lexemes and _takes(f"start: {lexemes}", (first,)):
            return f"the text may write {first!r}, which opens the closing tag"
    if trimmed:
        for reverse, end in ((False, "start"), (True, "end")):
            writer = _Writer(defs, [], _Chars(False), reverse)
            start = writer.expr(Ref("start"), "term")
            grammar = "\n".join([f"start: {start or chr(34) * 2}", *writer.lines])
            if (space := _takes(grammar, _WHITESPACE)) is not None:
                return f"the text may {end} with {space!r}, which the family trims"
    return ""
