"""Custom tools whose input is a lark grammar (Codex's ``apply_patch``), on the shared
demo server: the call's input is in the grammar, judged by llguidance's own lark matcher
over the grammar as sent (not by afmd's regex or rules of it), whether the grammar is
regular or recursive; only a grammar the rules cannot carry is generated best-effort and
says so; a grammar that does not compile is a 400 naming it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from llguidance import LLMatcher

from afmd.dialects.responses.options import custom_parameters
from afmd.grammar.lark_regex import NotRegular, lark_regex
from afmd.grammar.params import string_terminal

from helpers.lark_judge import BYTES, in_lark
from helpers.paths import TESTS_DIR

APPLY_PATCH = (TESTS_DIR / "data" / "apply_patch.lark").read_text()
GREETING = 'start: greeting " " NAME "!"\ngreeting: "hi"i | "hello"\nNAME: /[A-Z][a-z]{1,6}/\n'
QUERY = """start: "select" FIELD ("," FIELD)* "from" TABLE [LIMIT]
FIELD: /[a-z]+/
TABLE: /[a-z]+/
LIMIT: "limit" " "+ INT
%import common (WS, INT)
%ignore WS
"""
NESTED = 'start: item\nitem: "(" item ")" | "x"\n'
PATCHES = [
    "*** Begin Patch\n*** Delete File: a.py\n*** End Patch",
    "*** Begin Patch\n*** Add File: b.txt\n+one\n+\n*** End Patch\n",
    "*** Begin Patch\n*** Update File: c.py\n*** Move to: d.py\n@@ def f():\n-  x\n+  y\n"
    "   z\n*** End of File\n*** Delete File: e\n*** End Patch",
    "*** Begin Patch\n*** End Patch",  # no hunk
    "*** Begin Patch\n*** Add File: b.txt\n*** End Patch",  # no line added
    "*** Begin Patch\n*** Update File: c.py\nx\n*** End Patch",  # a line without its mark
    "*** Begin Patch\n*** Delete File: \n*** End Patch",  # no name
]


def _decoded(written: str) -> str:
    """A JSON string's text cut anywhere: decoded up to its last whole escape."""
    for cut in range(7):
        try:
            return str(json.loads('"' + written[:len(written) - cut] + '"'))
        except json.JSONDecodeError:
            continue
    raise AssertionError(written)


def custom_call(http: httpx.Client, definition: str, seed: int,
                **body: Any) -> tuple[httpx.Response, dict[str, Any]]:
    tool = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
            "format": {"type": "grammar", "syntax": "lark", "definition": definition}}
    response = http.post("/v1/responses", json={
        "model": "demo", "input": "Delete a.py.", "tools": [tool],
        "tool_choice": {"type": "custom", "name": "apply_patch"}, "temperature": 1.0,
        "seed": seed, "parallel_tool_calls": False, "max_output_tokens": 300,
        "reasoning": {"effort": "none"}, **body})
    assert response.status_code == 200, response.text
    (call,) = [item for item in response.json()["output"] if item["type"] == "custom_tool_call"]
    return response, call


@pytest.mark.parametrize("definition", [APPLY_PATCH, GREETING, QUERY])
def test_the_regex_of_a_lark_grammar_has_its_language(definition: str) -> None:
    """Judged by llguidance: the grammar as lark, and afmd's regex as a lark terminal."""
    regex = LLMatcher.grammar_from_lark(f"start: /{lark_regex(definition)}/")
    samples = [*PATCHES, "hi Bob!", "HI Alexand!", "hello Bob!", "hello bob!", "hey Bob!",
               "Hi Bo!", "hi B!", "select a, b from t", "select a ,b\nfrom t limit  9",
               " select a from t", "select a from t ",
               "select a b from t", "select  a from t limit1", "select a,,b from t"]
    verdicts = [in_lark(definition, text) for text in samples]
    assert True in verdicts and False in verdicts
    for text, verdict in zip(samples, verdicts, strict=True):
        matcher = LLMatcher(BYTES, regex, log_level=0)
        accepted = bool(matcher.consume_tokens(list(text.encode()))) and matcher.is_accepting()
        # Ignored text after the last token: llguidance takes it where another token could
        # still follow; the regex never generates it (a subset, so still in the grammar).
        assert accepted == verdict or (not accepted and text != text.rstrip()), text
    with pytest.raises(NotRegular, match="recursive"):
        lark_regex(NESTED)  # such a grammar is written as rules instead (lark_input)


def test_families_that_write_strings_raw_enforce_the_same_language() -> None:
    """Qwen3-Coder, GLM, MiniMax, … write a string parameter raw, as a lark terminal."""
    parameters = custom_parameters({"type": "grammar", "syntax": "lark",
                                    "definition": APPLY_PATCH})
    raw = LLMatcher.grammar_from_lark(
        "start: " + string_terminal(parameters["properties"]["input"], parameters, False))
    for text in PATCHES:
        matcher = LLMatcher(BYTES, raw, log_level=0)
        accepted = bool(matcher.consume_tokens(list(text.encode()))) and matcher.is_accepting()
        assert accepted == in_lark(APPLY_PATCH, text), text


@pytest.mark.parametrize("seed", [1, 2])
def test_an_apply_patch_call_is_a_patch_as_far_as_it_goes(http: httpx.Client, seed: int) -> None:
    """A random model almost never writes the two characters of a JSON ``\\n`` escape, so
    its patch never ends within a test's budget: what it wrote is read from the streamed
    arguments of the function the custom tool is offered as (the same grammar), and must
    be a prefix the lark grammar can still complete, well past its fixed opening."""
    parameters = custom_parameters({"type": "grammar", "syntax": "lark",
                                    "definition": APPLY_PATCH})
    streamed = http.post("/v1/chat/completions", json={
        "model": "demo", "messages": [{"role": "user", "content": "Delete a.py."}],
        "tools": [{"type": "function", "function": {"name": "apply_patch",
                                                    "parameters": parameters}}],
        "tool_choice": "required", "max_tokens": 120, "seed": seed, "temperature": 1.0,
        "stream": True})
    arguments = "".join(
        call["function"].get("arguments") or ""
        for line in streamed.text.splitlines()
        if line.startswith("data: {")
        for choice in json.loads(line[6:])["choices"]
        for call in choice["delta"].get("tool_calls") or [])
    assert arguments.startswith('{"input":"'), arguments
    text = _decoded(arguments[len('{"input":"'):])
    assert text.startswith("*** Begin Patch\n*** ") and len(text) > 30, text
    matcher = LLMatcher(BYTES, LLMatcher.grammar_from_lark(APPLY_PATCH), log_level=0)
    assert matcher.consume_tokens(list(text.encode())) and not matcher.is_error(), text


def test_a_small_grammars_call_is_in_it_streamed_too(http: httpx.Client) -> None:
    inputs = [custom_call(http, GREETING, seed)[1]["input"] for seed in (4, 5)]
    for text in inputs:
        assert in_lark(GREETING, text), text
    streamed = http.post("/v1/responses", json={
        "model": "demo", "input": "Greet.", "stream": True, "seed": 6, "temperature": 1.0,
        "tools": [{"type": "custom", "name": "greet", "format": {
            "type": "grammar", "syntax": "lark", "definition": GREETING}}],
        "tool_choice": {"type": "custom", "name": "greet"}, "max_output_tokens": 120})
    done = [json.loads(line[6:]) for line in streamed.text.splitlines()
            if line.startswith("data: ") and "custom_tool_call_input.done" in line]
    assert len(done) == 1 and in_lark(GREETING, done[0]["input"]), done


# Recursive, with quotes, backslashes and newlines to escape in the call's JSON string.
RECURSIVE = r'''start: item
item: "(" item ")" | "\"" item "\\" | "[" item ("\n" item)* "]" | ATOM
ATOM: /[a-c]{1,3}/
'''


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_a_recursive_grammar_is_enforced(http: httpx.Client, seed: int) -> None:
    response, call = custom_call(http, RECURSIVE, seed, max_output_tokens=300)
    assert "X-Grammar-Constraints" not in response.headers
    assert in_lark(RECURSIVE, call["input"]), call["input"]


def test_a_recursive_grammar_the_rules_cannot_carry_is_generated_best_effort(
        http: httpx.Client) -> None:
    """A ``%json`` inside the grammar: neither a regex nor escaped rules can hold it."""
    definition = 'start: "(" start ")" | %json {"type": "integer"}\n'
    response, call = custom_call(http, definition, 7, max_output_tokens=40)
    assert response.headers["X-Grammar-Constraints"] == "downgraded"
    assert isinstance(call["input"], str)


@pytest.mark.parametrize("definition", ["start: (((", "start: undefined_rule", ""])
def test_a_grammar_that_does_not_compile_is_a_400(http: httpx.Client, definition: str) -> None:
    response = http.post("/v1/responses", json={
        "model": "demo", "input": "Hi.", "tools": [
            {"type": "function", "name": "f", "parameters": {"type": "object"}},
            {"type": "custom", "name": "patch", "format": {
                "type": "grammar", "syntax": "lark", "definition": definition}}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_value", "tools[1].format.definition")
    assert "lark" in error["message"]
