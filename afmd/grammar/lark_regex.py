"""A lark grammar as one regular expression, where its language is regular.

A Responses ``custom`` tool may constrain its free-form input with a lark grammar (Codex's
``apply_patch``). The input travels inside the family's call markup, for most families as
a JSON string, and llguidance can constrain a JSON string only by a regex (a schema
``pattern``, which it matches against the decoded text, escapes and all). A grammar whose
rules never reach themselves again describes a regular language, so inlining every rule
and terminal yields a regex for exactly the strings the grammar derives; the input is then
enforced as a ``regex`` format is. A grammar that recurses, or uses what a regex cannot
say (llguidance's ``%json``, ``&``, special tokens, …), has no such regex:
:class:`NotRegular` says why, and the caller tries the rules of
:mod:`afmd.grammar.lark_input` instead. The grammar is read by
:mod:`afmd.grammar.lark_parse`.

The language is the grammar's as a context-free grammar over its terminals. llguidance's
own lark lexer is greedy, so for a grammar whose terminals overlap it may accept less; for
line-oriented grammars such as ``apply_patch`` the two agree. Whether a definition is lark
at all is llguidance's call (:func:`check_lark`), so a definition it rejects is refused
before this module reads it.
"""

from __future__ import annotations

import functools

from llguidance import LLMatcher

from afmd.grammar.lark_parse import Alt, Node, Ref, Regex, Seq, Unsupported, parse, terminal

#: Past this, a regex is more than the lexer should be asked to build per request.
MAX_REGEX = 50_000


class NotRegular(Unsupported):
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


# ------------------------------------------------------------------ inlining


class _Inliner:
    """Each rule's regex, built once per way it is used.

    ``%ignore`` text may stand between any two tokens of a rule (not inside a terminal,
    and, as llguidance reads it, not before the first token nor after the last), so a rule
    is built in one of three modes: ``term`` (inside a terminal: nothing between),
    ``rest`` (every token may be preceded by ignored text) and ``first`` (as ``rest``,
    except its first token). (llguidance also takes ignored text after the last token
    where another token could still follow; the regex never generates it.)"""

    def __init__(self, defs: dict[str, Node], ignore: list[Node]) -> None:
        self.defs = defs
        self.done: dict[tuple[str, str], str] = {}
        self.skip = ""
        if ignore:
            self.skip = "(?:" + "|".join(self.regex(n, (), "term") for n in ignore) + ")*"

    def nullable(self, node: Node, stack: tuple[str, ...] = ()) -> bool:
        if isinstance(node, Regex):
            return False
        if isinstance(node, Ref):
            if node.name in stack or node.name not in self.defs:
                return False  # reported by regex()
            return self.nullable(self.defs[node.name], (*stack, node.name))
        if isinstance(node, Seq):
            return all(self.nullable(item, stack) for item in node.items)
        if isinstance(node, Alt):
            return any(self.nullable(option, stack) for option in node.options)
        return node.low == 0 or self.nullable(node.item, stack)

    def token(self, text: str, mode: str) -> str:
        return f"{self.skip}(?:{text})" if mode == "rest" and self.skip else text

    def regex(self, node: Node, stack: tuple[str, ...], mode: str) -> str:
        if isinstance(node, Regex):
            return self.token(node.text, mode)
        if isinstance(node, Ref):
            if mode != "term" and terminal(node.name):
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
        if isinstance(node, Seq):
            return self.sequence(node.items, stack, mode)
        if isinstance(node, Alt):
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

    def sequence(self, items: tuple[Node, ...], stack: tuple[str, ...], mode: str) -> str:
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
        defs, ignore = parse(definition)
        if "start" not in defs:
            raise NotRegular("there is no start rule")
        text = _Inliner(defs, ignore).regex(Ref("start"), (), "first")
        if len(text) > MAX_REGEX:
            raise NotRegular("its regex is too large")
    except Unsupported as exc:
        return None, str(exc)
    return text, ""
