"""A custom tool's lark grammar inside the call's markup: as it is, or escaped into a JSON string.

A Responses ``custom`` tool's input travels, in most families, as the value of a JSON
string (``{"input": "…"}``), and llguidance constrains a JSON string only by a regex; a
grammar that recurses has none (:mod:`afmd.grammar.lark_regex`). Yet the call grammar is
itself lark, and llguidance takes a whole nested grammar where a rule may stand
(``%lark { … }``, with its own lexer and ``%ignore``). So the input is written as
``"\\"" %lark { E(G) } "\\""``, where E(G) is the user's grammar G with every terminal's
language mapped through JSON string escaping. Escaping is a homomorphism (each character
to its own escaped form), so it maps a regex to a regex, a concatenation, alternative or
repetition to the same of the images, and (being injective) an intersection to the
intersection; a negation becomes the negation within the escaped texts. The escaped
forms are a prefix code (an escape starts with a backslash, which no other form writes
raw), so llguidance's greedy lexer cuts E(text) exactly where it cuts the text: E(G)
accepts exactly the escapes of what G accepts, by llguidance's own reading of G.

Each character has one escaped form, the one JSON requires: ``\\"`` and ``\\\\``,
``\\b \\f \\n \\r \\t``, any other control character as ``\\u00XX`` (hex digits of
either case), everything else (``/`` and DEL included) raw. JSON also allows ``\\u0041``
for ``A`` or ``\\/`` for ``/``, but such a spelling reaches no text the plain one does not,
so it would only widen the model's choices without widening the language, and make the
grammar ambiguous; llguidance's own JSON strings refuse them too. The reader decodes any
of them, so nothing a model writes under this grammar is misread.

Families that write a string parameter raw (Qwen3-Coder, GLM, Gemma, …) take G as it is.
What the rewrite cannot carry (special tokens, ``%json``, nested grammars, grammar
references, rule attributes, anchors and lookarounds in a regex) raises
:class:`NotEmbeddable`, and the caller generates that input best-effort (downgraded).
Which characters of a regex class are ones JSON escapes is asked of llguidance itself
(a one-class matcher over a byte tokenizer), so a class means exactly what it means to
llguidance; the grammar text this module writes is compiled in the compile worker like
any other.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

#: The key of a custom tool's input schema that holds its lark grammar (with a ``format``
#: no schema compiler knows, so a path that does not embed the grammar is downgraded).
LARK_KEY = "x-afmd-lark"
#: Past this, the escaped grammar is more than the lexer should be asked to build.
MAX_TEXT = 200_000

# JSON's short escapes; other control characters are written \u00XX.
_SHORT = {0x08: "b", 0x09: "t", 0x0A: "n", 0x0C: "f", 0x0D: "r", 0x22: '"', 0x5C: "\\"}
#: The characters JSON escapes.
SPECIAL = frozenset([*range(0x20), 0x22, 0x5C])
#: Everything JSON writes raw, as a class (to intersect with a user's class).
_PLAIN = r'[^"\\\x00-\x1f]'
_META = set(r"\.+*?()|[]{}^$/#&~-")


class NotEmbeddable(Exception):
    """The grammar uses what the escaped copy cannot carry: generate best-effort."""


def lark_of(schema: Any) -> str | None:
    """The lark grammar a custom tool's input schema carries, if any."""
    value = schema.get(LARK_KEY) if isinstance(schema, dict) else None
    return value if isinstance(value, str) else None


def raw_input(definition: str) -> str:
    """The input written raw: the grammar as it is, nested."""
    return "%lark {\n" + definition + "\n}"


def json_string(definition: str) -> str:
    """The input as a JSON string: its quotes around the escaped grammar, nested."""
    return '"\\"" %lark {\n' + escaped_lark(definition) + '\n} "\\""'


# --------------------------------------------------------------------------- escapes


def _escape_regex(specials: frozenset[int] | set[int]) -> str:
    """A regex for the escaped forms of ``specials`` (case-sensitive whatever surrounds
    it: ``\\N`` is no JSON escape)."""
    alts = []
    for code in sorted(c for c in specials if c in _SHORT):
        alts.append(r"\\" + ("\\" + _SHORT[code] if _SHORT[code] in '\\"' else _SHORT[code]))
    for high in (0, 1):
        lows = [c & 0xF for c in specials if c >> 4 == high and c not in _SHORT]
        if lows:
            digits = "".join(f"{low:x}" + (f"{low:X}" if low > 9 else "") for low in sorted(lows))
            alts.append(rf"\\u00{high}[{digits}]")
    if not alts:
        return ""
    return "(?-i:" + "|".join(alts) + ")"


def _char(code: int) -> str:
    """One character's escaped form, as a regex."""
    if code in SPECIAL:
        return _escape_regex({code})
    ch = chr(code)
    return "\\" + ch if ch in _META else ch


def _set(plain: str | None, specials: frozenset[int] | set[int]) -> str:
    """The escaped forms of a set of characters: its plain part, given as a class that
    holds no special character (None: empty), and its special characters."""
    alts = [a for a in (plain, _escape_regex(specials)) if a]
    if not alts:
        raise NotEmbeddable("a character class that matches nothing")
    return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"


#: Every escaped text: E(any string).
ALL_TEXT = f"(?:{_set(_PLAIN, SPECIAL)})*"


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
    anything else, as llguidance reads it."""
    try:
        grammar = LLMatcher.grammar_from_lark(f"start: /{atom}/")
    except ValueError as exc:
        raise NotEmbeddable(str(exc)) from None
    matcher = LLMatcher(_bytes_tokenizer(), grammar, log_level=0)
    if matcher.is_error():
        raise NotEmbeddable(matcher.get_error())
    mask = matcher.compute_bitmask()
    allowed = {i for i in range(256) if mask[i // 8] >> (i % 8) & 1}
    return frozenset(allowed & SPECIAL), bool(allowed - SPECIAL)


def _class(atom: str) -> str:
    """A class (``[…]``, ``\\d``, ``\\p{…}``) of the user's regex, escaped."""
    specials, rest = _members(atom)
    body = atom if atom.startswith("[") else f"[{atom}]"
    return _set(f"[{body}&&{_PLAIN}]" if rest else None, specials)


# --------------------------------------------------------------------------- regexes


_LITERAL_ESCAPES = {"a": 0x07, "f": 0x0C, "t": 0x09, "n": 0x0A, "r": 0x0D, "v": 0x0B}
_HEX = re.compile(r"x([0-9a-fA-F]{2})|x\{([0-9a-fA-F]+)\}|u([0-9a-fA-F]{4})|u\{([0-9a-fA-F]+)\}"
                  r"|U([0-9a-fA-F]{8})|U\{([0-9a-fA-F]+)\}")
_CLASS_ESCAPE = re.compile(r"[dDsSwW]|[pP](?:\{[^}]*\}|[A-Za-z])")
_QUANT = re.compile(r"[*+?]\??|\{[0-9]+(?:,[0-9]*)?\}\??")
_FLAGS = re.compile(r"\(\?([a-zA-Z]*(?:-[a-zA-Z]*)?)(:|\))")


class _Regex:
    """The escaped copy of one regex (Rust syntax, as llguidance reads it), written as
    it is read: the structure stays, each character or class becomes its escapes."""

    def __init__(self, text: str, dotall: bool) -> None:
        self.text = text
        self.i = 0
        self.dotall = dotall

    def fail(self, what: str) -> NotEmbeddable:
        return NotEmbeddable(f"{what} in /{self.text}/")

    def peek(self) -> str:
        return self.text[self.i] if self.i < len(self.text) else ""

    def whole(self) -> str:
        out = self.alternatives()
        if self.i != len(self.text):
            raise self.fail("an unbalanced ')'")
        return out

    def alternatives(self) -> str:
        dotall = self.dotall  # a (?s) lasts to the end of its group
        parts = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            parts.append(self.sequence())
        self.dotall = dotall
        return "|".join(parts)

    def sequence(self) -> str:
        out = []
        while self.peek() not in ("", "|", ")"):
            atom = self.atom()
            quant = _QUANT.match(self.text, self.i)
            if quant is not None and atom:
                self.i = quant.end()
                atom = f"(?:{atom}){quant.group()}"
            out.append(atom)
        return "".join(out)

    def atom(self) -> str:
        ch = self.peek()
        if ch == "(":
            return self.group()
        if ch == "[":
            return _class(self.bracket())
        if ch == ".":
            self.i += 1
            specials = SPECIAL if self.dotall else SPECIAL - {0x0A}
            return _set(_PLAIN, specials)
        if ch in "^$":
            raise self.fail("an anchor")
        if ch == "\\":
            return self.escape()
        self.i += 1
        return _char(ord(ch))

    def group(self) -> str:
        flags = _FLAGS.match(self.text, self.i)
        if flags is not None:
            letters = flags.group(1)
            if set(letters) - set("imsU-"):
                raise self.fail(f"the flag group (?{letters})")
            on, _, off = letters.partition("-")
            self.i = flags.end()
            if flags.group(2) == ")":  # (?s): the rest of this group
                self.dotall = ("s" in on or self.dotall) and "s" not in off
                return f"(?{letters})" if letters.strip("-") else ""
            dotall = self.dotall
            self.dotall = ("s" in on or dotall) and "s" not in off
            inner = self.alternatives()
            self.dotall = dotall
            self.close()
            return f"(?{letters}:{inner})"
        named = re.compile(r"\(\?P?<[A-Za-z_][A-Za-z0-9_]*>").match(self.text, self.i)
        if named is not None:
            self.i = named.end()
        elif self.text.startswith("(?", self.i):
            raise self.fail("a lookaround")
        else:
            self.i += 1
        inner = self.alternatives()
        self.close()
        return f"(?:{inner})"

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
                if self.text.startswith("[:", self.i):  # [:alpha:]
                    end = self.text.find(":]", self.i + 2)
                    if end != -1:
                        self.i = end + 2
                        continue
                depth += 1
                self.i += 1
                # A ']' first in a class (after '^') is a literal.
                if self.text.startswith("^", self.i):
                    self.i += 1
                if self.text.startswith("]", self.i):
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
            return _class("\\" + cls.group())
        if (hexa := _HEX.match(rest)) is not None:
            self.i += 1 + hexa.end()
            code = int(next(g for g in hexa.groups() if g is not None), 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                raise self.fail("a character out of range")
            return _char(code)
        ch = rest[0]
        self.i += 2
        if ch in _LITERAL_ESCAPES:
            return _char(_LITERAL_ESCAPES[ch])
        if ch.isalnum():
            raise self.fail(f"the escape \\{ch}")
        return _char(ord(ch))


def _regex_token(token: str) -> str:
    """A lark ``/regex/flags`` token, escaped."""
    body, _, flags = token[1:].rpartition("/")
    if "x" in flags or "l" in flags:
        raise NotEmbeddable(f"the regex flag in {token}")
    text = _Regex(body, "s" in flags).whole()
    if "i" in flags:
        text = f"(?i:{text})"
    return "/" + text + "/"


# --------------------------------------------------------------------------- lark text


_STRING_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n",
                   "r": "\r", "t": "\t"}


def _decode(token: str) -> str:
    """A lark string literal's text."""
    body = token[1:token.rindex('"')]
    out, i = [], 0
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        code = body[i + 1:i + 2]
        if code in _STRING_ESCAPES:
            out.append(_STRING_ESCAPES[code])
            i += 2
        elif code in ("u", "x") and (size := 4 if code == "u" else 2) \
                and re.fullmatch(r"[0-9a-fA-F]+", body[i + 2:i + 2 + size] or "-"):
            out.append(chr(int(body[i + 2:i + 2 + size], 16)))
            i += 2 + size
        else:
            raise NotEmbeddable(f"the string {token}")
    return "".join(out)


def _lark_string(text: str) -> str:
    """A lark string literal for ``text`` (DEL escaped: lark strings refuse it raw)."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _string_token(token: str) -> str:
    """A lark ``"string"`` token, escaped: still a literal where it can stay one."""
    text = _decode(token)
    escaped = json.dumps(text, ensure_ascii=False)[1:-1]
    if not token.endswith("i") or escaped == text:
        return _lark_string(escaped) + ("i" if token.endswith("i") else "")
    return "/(?i:" + "".join(_char(ord(ch)) for ch in text) + ")/"


def _range(first: str, last: str) -> str:
    """``"a".."z"``, escaped."""
    low, high = _decode(first), _decode(last)
    if len(low) != 1 or len(high) != 1:
        raise NotEmbeddable("a range joins single characters")
    atom = f"[\\x{{{ord(low):x}}}-\\x{{{ord(high):x}}}]"
    return "/" + _class(atom) + "/"


# lark's common terminals llguidance knows (lark/grammars/common.lark), as regexes.
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
    "CPP_COMMENT": "//[^\\n]*", "SQL_COMMENT": "--[^\\n]*",
}

_TOKEN = re.compile(r"""
    (?P<skip>[ \t]+|\\\r?\n|(?:\#|//)[^\n]*)
  | (?P<newline>\r?\n)
  | (?P<string>"(?:\\.|[^"\\\n])*"i?)
  | (?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*)
  | (?P<directive>%[a-z]+)
  | (?P<dots>\.\.)
  | (?P<arrow>->)
  | (?P<name>[!?]?_?[A-Za-z][A-Za-z0-9_\-]*)
  | (?P<number>[0-9]+)
  | (?P<repeat>\{[0-9]*(?:,[0-9]*)?\})
  | (?P<punct>[:|()\[\]~+*?.,&])
  | (?P<other>.)
""", re.VERBOSE)


def _tokens(definition: str) -> list[tuple[str, str, bool]]:
    """The grammar's tokens: kind, text, and whether space came before (kept as it was,
    so ``NAME.2:`` stays one priority, not three tokens)."""
    out = []
    spaced = False
    for match in _TOKEN.finditer(definition):
        kind = match.lastgroup or "other"
        if kind == "other":
            raise NotEmbeddable(f"'{match.group()}' (a special token, %json, a reference, …)")
        if kind == "skip":
            spaced = True
            continue
        out.append((kind, match.group(), spaced))
        spaced = False
    return out


class _Rewriter:
    """The grammar token by token: strings and regexes become their escaped copies,
    negations are kept within escaped texts, imports become escaped definitions; the
    rest (names, operators, layout) stays as written."""

    def __init__(self, tokens: list[tuple[str, str, bool]]) -> None:
        self.toks = tokens
        self.i = 0

    def kind(self, at: int) -> str:
        return self.toks[at][0] if at < len(self.toks) else ""

    def text(self, at: int) -> str:
        return self.toks[at][1] if at < len(self.toks) else ""

    def grammar(self) -> str:
        out: list[str] = []
        line_start = True
        while self.i < len(self.toks):
            kind, text, spaced = self.toks[self.i]
            space = " " if spaced and not line_start else ""
            if kind == "newline":
                out.append("\n")
                self.i += 1
                line_start = True
                continue
            if kind == "directive":
                out.append(space + self.directive(text))
            elif line_start and kind == "name" and self.text(self.i + 1) == "[":
                raise NotEmbeddable(f"the attributes of {text}")
            else:
                out.append(space + self.item())
            line_start = False
        return "".join(out)

    def directive(self, word: str) -> str:
        if word == "%ignore":
            self.i += 1
            return "%ignore"
        if word != "%import":
            raise NotEmbeddable(f"{word}")
        end = self.i
        while self.kind(end) not in ("", "newline"):
            end += 1
        words = [text for _, text, _ in self.toks[self.i + 1:end]]
        self.i = end
        return "\n".join(f"{target}: /{_Regex(_COMMON[name], False).whole()}/"
                         for name, target in _imports(words))

    def item(self) -> str:
        kind, text, _ = self.toks[self.i]
        self.i += 1
        if kind == "string":
            if self.kind(self.i) == "dots" and self.kind(self.i + 1) == "string":
                last = self.text(self.i + 1)
                self.i += 2
                return _range(text, last)
            return _string_token(text)
        if kind == "regex":
            return _regex_token(text)
        if text == "~" and self.kind(self.i) != "number":
            return f"(~{self.operand()} & /{ALL_TEXT}/)"
        return text

    def operand(self) -> str:
        """What a negation applies to: one item, or a parenthesized group."""
        if self.text(self.i) != "(":
            return self.item()
        depth, parts = 0, []
        while self.i < len(self.toks):
            text = self.text(self.i)
            depth += (text == "(") - (text == ")")
            parts.append(self.item())
            if depth == 0:
                return " ".join(parts)
        raise NotEmbeddable("an unclosed '('")


def _imports(words: list[str]) -> list[tuple[str, str]]:
    """``%import common.X``, ``common.X -> Y``, ``common (X, Y)``: (source, target)s."""
    text = " ".join(words)
    one = re.fullmatch(r"common \. ([A-Z_]+)(?: -> ([A-Za-z_]+))?", text)
    many = re.fullmatch(r"common \( ([A-Z_ ,]+) \)", text)
    if one is not None:
        pairs = [(one.group(1), one.group(2) or one.group(1))]
    elif many is not None:
        pairs = [(n.strip(), n.strip()) for n in many.group(1).split(",") if n.strip()]
    else:
        raise NotEmbeddable(f"%import {text}")
    for name, _ in pairs:
        if name not in _COMMON:
            raise NotEmbeddable(f"common.{name}")
    return pairs


@functools.lru_cache(maxsize=64)
def _escaped_or_reason(definition: str) -> tuple[str | None, str]:
    try:
        text = _Rewriter(_tokens(definition)).grammar()
        if len(text) > MAX_TEXT:
            raise NotEmbeddable("its escaped copy is too large")
    except NotEmbeddable as exc:
        return None, str(exc)
    return text, ""


def escaped_lark(definition: str) -> str:
    """The grammar of E(text) for every text ``definition`` derives (cached: agents
    resend their tools every turn). Raises :class:`NotEmbeddable`."""
    text, reason = _escaped_or_reason(definition)
    if text is None:
        raise NotEmbeddable(reason)
    return text
