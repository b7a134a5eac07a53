"""A custom tool's recursive lark grammar as rules (afmd.grammar.lark_input), judged by
llguidance: the JSON-escaped rules take exactly the JSON strings of the texts llguidance's
own lark matcher takes under the grammar as sent, and the raw rules exactly those texts."""

from __future__ import annotations

import json
import re

import pytest

from afmd.grammar.lark_input import NotEmbeddable, json_string, lark_rules, raw_text
from afmd.grammar.lark_regex import NotRegular, lark_regex

from helpers.lark_judge import accepts, in_lark

NESTED = r'''start: item
item: "(" item ")" | "\"" item "\\" | "[" item ("\n" item)* "]" | ATOM
ATOM: /[a-c\t]+/
'''
JSONISH = r'''start: value
value: object | array | ESCAPED_STRING | SIGNED_NUMBER | "true" | "false" | "null"
array: "[" [value ("," value)*] "]"
object: "{" [pair ("," pair)*] "}"
pair: ESCAPED_STRING ":" value
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
'''
ARITH = r'''?start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")" | "-" factor | STR | NAME "(" [expr ("," expr)*] ")"
STR: /'[^'\n]*'/ | "\"" /(\\.|[^"\\\n])*/ "\""
NAME: /(?i:[a-z_]\w*)/
NUMBER: /[0-9]+(\.[0-9]+)?/
%ignore /[ \t\r\n]+/ | /#[^\n]*/
'''
CASES = {
    "nested": (NESTED, [
        "a", "(a)", '"(b)\\', '"[a\nb\n(c)]\\', "[\t]", "((a\tb))", '""a\\\\',
        "(a", '"a"', "\\a", "[a\n]", "a\n", "", "(a))", "[a\r\nb]", "d"]),
    "jsonish": (JSONISH, [
        '{"a": [1, 2, {"b\\"c": null}]}', '[\n1,\t"x\\\\y"]', '[1, "a"]', '{"k":\r\n"\\u0041"}',
        '"tab\\tnew\\nline"', '[1,\n\n  -2.5e3]', '"\u00e9\u4e2d"', "[[[[]]]]",
        '{"a" 1}', "[1,]", " [1]", "[1] ", '"a\nb"', '"unterminated', "[tru]"]),
    "arith": (ARITH, [
        "1+2*(3-4)", "1 +\n2", "'a\"b' * 2", '"q\\"x" + 1', "-(-1)\t*\t3", "f(1, g(x))",
        "1 # note\n+ 2", "Max(a_1)", "2.5/x",
        "1+", "(1", "'a\nb'", "1 2", "f(1,)", "#only", "1.", ""]),
}


@pytest.mark.parametrize("name", CASES)
def test_the_escaped_rules_take_exactly_the_escaped_texts_of_the_grammar(name: str) -> None:
    definition, samples = CASES[name]
    escaped = "start: " + json_string(definition)
    verdicts = [in_lark(definition, text) for text in samples]
    assert True in verdicts and False in verdicts
    for text, verdict in zip(samples, verdicts, strict=True):
        written = json.dumps(text, ensure_ascii=False)
        assert accepts(escaped, written) == verdict, text
        # ASCII-only JSON writes the same text too: \u escapes of non-ASCII characters
        # are not escapes JSON requires, so they are refused (one spelling per text).
        if written != json.dumps(text):
            assert not accepts(escaped, json.dumps(text)), text


@pytest.mark.parametrize("name", CASES)
def test_the_raw_rules_take_exactly_the_texts_of_the_grammar(name: str) -> None:
    definition, samples = CASES[name]
    raw = "start: " + raw_text(definition)
    for text in samples:
        assert accepts(raw, text) == in_lark(definition, text), text


def test_each_character_has_the_one_escape_json_requires() -> None:
    """Required escapes only: short ones where JSON has them, \\u00XX (hex of either
    case) for other control characters; never \\u0041 for A nor \\/ for /."""
    grammar = "start: " + json_string('start: /[A\\/\\x1b\\n\\x7f"]+/ | "(" start ")"\n')
    for written, verdict in [
        ('"A/\\u001b\\n\x7f\\""', True), ('"(\\u001B)"', True), ('"((\\n))"', True),
        ('"\\u0041"', False), ('"\\/"', False), ('"\\u000a"', False), ('"\\u007f"', False),
        ('"\x1b"', False), ('"\n"', False), ('"\\N"', False), ('"(A"', False),
    ]:
        assert accepts(grammar, written) is verdict, written


def test_an_ignored_pattern_stands_between_tokens_only() -> None:
    """As llguidance reads %ignore: between two tokens of a rule, not before the first,
    not inside a terminal."""
    definition = 'start: "(" start ")" | WORD\nWORD: /[a-z]+/\n%ignore /[ \\n]/\n'
    escaped = "start: " + json_string(definition)
    for text in ["( (ab) )", "(\n(ab))", " (ab)", "(a b)"]:
        assert accepts(escaped, json.dumps(text)) == in_lark(definition, text), text


def test_where_terminals_overlap_the_rules_read_the_grammar_as_a_cfg() -> None:
    """llguidance's greedy lexer cannot split "ab" into two NAMEs; the rules (one lexeme
    per character) read the grammar as lark's Earley parser does, and take it."""
    definition = 'start: NAME NAME | "(" start ")"\nNAME: /[a-z]+/\n'
    assert not in_lark(definition, "(ab)")
    assert accepts("start: " + json_string(definition), '"(ab)"')


@pytest.mark.parametrize("definition", [
    'start: "(" start ")" | /^x/\n',  # an anchor
    'start: "(" start ")" | /x(?=y)/\n',  # a lookaround
    'start: "(" start ")" | %json {"type": "integer"}\n',
    'start: "(" start ")" | X\nX: /a/ & /[a-z]/\n',
    'start: "(" start ")" | X\nX: /a/ ~ /b/\n',  # a negation, not a repeat
])
def test_what_the_rules_cannot_carry_is_said(definition: str) -> None:
    """Said, so the call is generated best-effort (downgraded), never a server error."""
    with pytest.raises(NotEmbeddable):
        lark_rules(definition, escaped=True)
    with pytest.raises(NotRegular):
        lark_regex(definition)


@pytest.mark.parametrize(("definition", "trimmed", "verdict"), [
    ('start: "(" start ")" | /[a-c]+/\n', True, None),
    ('start: "(" start ")" | /[a-c]+/ "\\n"\n', True, "end with '\\n'"),
    ('start: "(" start ")" | " " /[a-c]+/\n', True, "start with ' '"),
    ('start: "(" start ")" | /[a-c]+/ /[x\\u3000]/\n', True, "end with '\\u3000'"),
    ('start: "(" start ")" | /[a-c]+/ /[\\t x]/ "y"\n', True, None),
    ('start: "(" start " )" | /[a-c]+/\n%ignore " "\n', True, None),  # never at an end
    ('start: "(" start ")" | /[a-c]+/ "\\n"\n', False, None),
    ('start: "(" start ")" | /[a-c<]+/\n', False, "'<', which opens"),
    ('start: "(" start ")" | /[a-c]+/\n%ignore "<"\n', False, "'<', which opens"),
])
def test_raw_rules_are_not_used_where_the_reader_would_cut_them(
        definition: str, trimmed: bool, verdict: str | None) -> None:
    """A family that trims values strips a text's edges; a closing tag that is text ends
    the value where it is first written. Rules cannot forbid either, so where the grammar
    may derive it, they are refused (and the input is generated best-effort)."""
    if verdict is None:
        assert raw_text(definition, forbid="</p>", trimmed=trimmed).startswith("%lark {")
    else:
        with pytest.raises(NotEmbeddable, match=re.escape(verdict)):
            raw_text(definition, forbid="</p>", trimmed=trimmed)
