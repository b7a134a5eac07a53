"""Every call format on the same cases, read back by afmd (the vLLM pattern).

Each case is an assistant turn in afmd's terms (reasoning, content, calls); each family's
spec writes it the way that family's model does (:mod:`helpers.formats`), and the text is
fed to the output chain whole, character by character and split at random points (fixed
seeds). Whatever the split, the client must get the same reasoning, content and calls, the
call's argument fragments must concatenate to its final ``arguments`` (valid JSON equal to
what was written), no markup may reach content, and, where mlx-lm has a parser for the
family, afmd must read the call as mlx-lm does. The end-to-end half (grammars, real
models per family) is in ``test_tool_formats_e2e.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import itertools
import json
import pkgutil
import random
import re
import zlib
from dataclasses import dataclass
from typing import Any

import pytest

from afmd.core.events import Content, Piece, Reasoning, ToolCallArguments, ToolCallStart
from afmd.output.formats import gemma, harmony, kimi, llama, mistral, pythonic, tagged
from afmd.output.formats.base import parse_whole
from afmd.output.formats.registry import FAMILIES
from afmd.output.processor import OutputProcessor, ToolFormat
from afmd.service.hidden_tokens import is_read

from helpers.formats import SPECS, Calls, Spec

SPLITS = 12


def tool(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties}}}


TOOLS = [
    tool("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}),
    tool("add", {"a": {"type": "integer"}, "b": {"type": "integer"}}),
    tool("search", {"query": {"type": "string"}, "filters": {"type": "array"}}),
    tool("now", {}),
    tool("note", {"text": {"type": "string"}}),
    tool("flags", {"on": {"type": "boolean"}, "off": {"type": "boolean"},
                   "none": {"type": "null"}}),
]


@dataclass(frozen=True)
class Case:
    id: str
    content: str = ""
    reasoning: str = ""
    calls: Calls = ()  # type: ignore[assignment]
    max_calls: int | None = None
    expected_calls: int | None = None  # calls the client gets (default: all)

    @property
    def parallel(self) -> bool:
        return len(self.calls) > 1


WEATHER = ("get_weather", {"city": "Paris", "days": 3})
ADD = ("add", {"a": 1, "b": 2})
CASES = [
    Case("plain", content="The weather is nice today."),
    Case("single-call", calls=[WEATHER]),
    Case("content-then-call", content="Let me check.", calls=[WEATHER]),
    Case("think-then-call", reasoning="I need the weather.", calls=[WEATHER]),
    Case("think-then-answer", reasoning="Two and two.", content="It is 4."),
    Case("two-calls", calls=[WEATHER, ADD]),
    Case("nested-values", calls=[("search", {
        "query": 'a "q" \\ {b} [c] </x>',
        "filters": [{"k": "x", "v": None}, {"k": "y", "v": [1, 2.5, True, {"deep": {}}]}],
    })]),
    Case("no-arguments", calls=[("now", {})]),
    Case("digits-in-a-string", calls=[("note", {"text": "123"})]),
    Case("booleans-and-null", calls=[("flags", {"on": True, "off": False, "none": None})]),
    Case("unicode", calls=[("get_weather", {"city": "Zürich 東京 🌤", "days": 1})]),
    Case("multiline-string", calls=[("note", {"text": "line one\n  line two"})]),
    Case("call-budget", calls=[WEATHER, ADD], max_calls=1, expected_calls=1),
]


def applies(spec: Spec, case: Case) -> bool:
    if case.reasoning and spec.think is None and spec.id != "harmony":
        return False
    if case.content and case.calls and not spec.text_then_calls:
        return False  # Llama's calls are the whole turn
    return spec.parallel or not case.parallel


ALL = [(s, c) for s in SPECS.values() for c in CASES if applies(s, c)]


def model_text(spec: Spec, case: Case) -> str:
    parts = []
    if case.reasoning:
        parts.append(spec.reasoning(case.reasoning))
    if case.content:
        if spec.id == "harmony":
            channel = "commentary" if case.calls else "final"
            tail = "<|end|><|start|>assistant" if case.calls else ""
            parts.append(f"<|channel|>{channel}<|message|>{case.content}{tail}")
        else:
            parts.append(case.content + ("\n" if case.calls else ""))
    if case.calls:
        parts.append(spec.calls(list(case.calls)))
    return "".join(parts)


def tool_format(spec: Spec) -> ToolFormat:
    family = FAMILIES[spec.reader]
    parse = None
    if spec.parser is not None:
        parse = importlib.import_module(f"mlx_lm.tool_parsers.{spec.parser}").parse_tool_call
    return ToolFormat(family.start, family.end, parse, incremental_json=False,
                      family=spec.reader)


@dataclass
class Replay:
    content: str
    reasoning: str
    calls: list[dict[str, Any]]
    final: list[tuple[str, str, str]]
    stopped: bool

    def key(self) -> tuple[Any, ...]:
        return (self.content, self.reasoning,
                [(c["name"], c["arguments"]) for c in self.calls], self.stopped)


def replay(spec: Spec, chunks: list[str], *, max_calls: int | None = None,
           enforced: bool = False) -> Replay:
    ids = itertools.count()
    processor = OutputProcessor(
        thinking=spec.think, tool_format=tool_format(spec), tools=TOOLS, max_calls=max_calls,
        new_id=lambda: f"call_{next(ids)}", enforced=enforced)
    pieces: list[Piece] = []
    stopped = False
    for chunk in chunks:
        pieces += processor.feed(chunk)
        if processor.should_stop:
            stopped = True
            break
    pieces += processor.finish()
    content, reasoning, calls = [], [], []
    for piece in pieces:
        if isinstance(piece, Content | Reasoning):
            assert piece.text
            (content if isinstance(piece, Content) else reasoning).append(piece.text)
        elif isinstance(piece, ToolCallStart):
            assert piece.index == len(calls)
            calls.append({"id": piece.id, "name": piece.name, "arguments": piece.arguments,
                          "fragments": [piece.arguments] if piece.arguments else []})
        else:
            assert isinstance(piece, ToolCallArguments)
            assert calls and piece.index == len(calls) - 1 and piece.fragment
            calls[-1]["arguments"] += piece.fragment
            calls[-1]["fragments"].append(piece.fragment)
    final = [(c.id, c.name, c.arguments) for c in processor.tool_calls]
    return Replay("".join(content), "".join(reasoning), calls, final, stopped)


def splittings(text: str, seed: int) -> list[list[str]]:
    out = [[text], list(text)]
    for k in range(SPLITS):
        rng = random.Random(seed + k)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 16))))
        out.append([text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])])
    return out


def check(spec: Spec, case: Case, result: Replay) -> None:
    assert result.content == case.content
    assert result.reasoning == case.reasoning
    expected = list(case.calls)[: case.expected_calls or len(case.calls)]
    assert [c["name"] for c in result.calls] == [name for name, _ in expected]
    for got, (_, arguments) in zip(result.calls, expected, strict=True):
        assert json.loads(got["arguments"]) == arguments
    # What a non-streamed answer reports is exactly what streamed.
    assert result.final == [(c["id"], c["name"], c["arguments"]) for c in result.calls]
    assert result.stopped == (case.expected_calls is not None)
    for token in spec.tokens:
        assert token not in result.content and token not in result.reasoning


@pytest.mark.parametrize(("spec", "case"), ALL, ids=[f"{s.id}:{c.id}" for s, c in ALL])
def test_case_whatever_the_split(spec: Spec, case: Case) -> None:
    text = model_text(spec, case)
    reference = replay(spec, [text], max_calls=case.max_calls)
    check(spec, case, reference)
    for chunks in splittings(text, zlib.crc32(f"{spec.id}:{case.id}".encode())):
        for enforced in (False, True):
            result = replay(spec, chunks, max_calls=case.max_calls, enforced=enforced)
            assert result.key() == reference.key() or json_equal(result, reference), chunks
            check(spec, case, result)


def json_equal(a: Replay, b: Replay) -> bool:
    """Held values are re-encoded, verbatim ones are not: equal as JSON is enough."""
    return (a.content, a.reasoning, a.stopped) == (b.content, b.reasoning, b.stopped) and [
        (c["name"], json.loads(c["arguments"])) for c in a.calls] == [
        (c["name"], json.loads(c["arguments"])) for c in b.calls]


# A pythonic value is a Python literal, known to be one only once whole, unless a grammar
# made it JSON (which afmd's always does when tools are on).
STREAMED = [(s, enforced) for s in SPECS.values() for enforced in (False, True)
            if enforced or s.id != "pythonic"]


@pytest.mark.parametrize(("spec", "enforced"), STREAMED,
                         ids=[f"{s.id}-{'enforced' if e else 'free'}" for s, e in STREAMED])
def test_arguments_stream_while_the_call_is_written(spec: Spec, enforced: bool) -> None:
    """Fed character by character, the call starts (id, name) long before its arguments
    end, and a long string argument arrives in many fragments, as it is written."""
    text = "x" * 40
    call_text = spec.calls([("note", {"text": text})])
    ids = itertools.count()
    processor = OutputProcessor(thinking=spec.think, tool_format=tool_format(spec),
                                tools=TOOLS, new_id=lambda: f"call_{next(ids)}",
                                enforced=enforced)
    started_at = None
    fragments: list[tuple[int, str]] = []
    for position, char in enumerate(call_text):
        for piece in processor.feed(char):
            if isinstance(piece, ToolCallStart):
                started_at = position
                if piece.arguments:
                    fragments.append((position, piece.arguments))
            elif isinstance(piece, ToolCallArguments):
                fragments.append((position, piece.fragment))
    processor.finish()
    (call,) = processor.tool_calls
    assert "".join(f for _, f in fragments) == call.arguments
    assert json.loads(call.arguments) == {"text": text}
    assert started_at is not None and started_at < call_text.index(text)
    during = [f for position, f in fragments if position < call_text.index(text) + len(text)]
    assert len(during) >= 20, "the string value streams as it is written"


@pytest.mark.parametrize("spec", [s for s in SPECS.values() if s.parser], ids=lambda s: s.id)
def test_calls_read_as_mlx_lm_reads_them(spec: Spec) -> None:
    """The call block parsed whole by mlx-lm's own parser for the family gives the same
    calls (its server hands the parser the text between the markers)."""
    fmt = tool_format(spec)
    family = FAMILIES[spec.reader]
    for case in CASES:
        if not case.calls or not applies(spec, case) or case.max_calls:
            continue
        if (spec.id, case.id) in MLX_LM_DIFFERS:
            continue
        text = spec.calls(list(case.calls))
        inner = text[len(family.start):] if family.start else text
        if family.end and inner.endswith(family.end) and not case.parallel:
            inner = inner[: -len(family.end)]
        if case.parallel and family.end and text.count(family.start) > 1:
            continue  # one block per call: mlx-lm is handed one at a time
        got = parse_whole(inner, fmt.parse, TOOLS)
        ours = replay(spec, [text])
        assert [(n, json.loads(a)) for n, a in got] == [
            (c["name"], json.loads(c["arguments"])) for c in ours.calls], case.id


# Where mlx-lm's parser reads a call differently, afmd follows the schema: Muse Spark's
# parser decodes every value as JSON (a string "123" becomes 123); Qwen3-Coder's and
# MiniMax's read booleans and null by the declared type only; FunctionGemma's splits
# nested values at commas; Gemma 4's regex rewrites bare keys inside strings too; LongCat's
# cannot read a call without arguments.
MLX_LM_DIFFERS = {
    ("longcat", "no-arguments"),  # mlx-lm's longcat parser needs an argument
    ("muse_spark", "digits-in-a-string"),
    ("qwen3_coder", "booleans-and-null"),
    ("minimax_m2", "booleans-and-null"),
    ("function_gemma", "nested-values"),
    ("gemma4", "nested-values"),
}


def test_every_format_of_mlx_lm_has_a_reader() -> None:
    """mlx-lm's tool parsers, each read by afmd's own reader (and forced by a grammar:
    see afmd.grammar.calls.GRAMMARS)."""
    import pkgutil

    import mlx_lm.tool_parsers

    from afmd.grammar.calls import GRAMMARS

    names = {m.name for m in pkgutil.iter_modules(mlx_lm.tool_parsers.__path__)}
    assert names <= set(FAMILIES), names - set(FAMILIES)
    assert set(FAMILIES) == set(GRAMMARS)


@pytest.mark.parametrize("family", ["gemma4", "function_gemma"])
def test_gemma_json_values_keep_commas_and_brackets_in_their_strings(family: str) -> None:
    """afmd's grammar writes a Gemma call's non-string values as JSON: a ``,`` or ``}``
    inside one of their strings (a patch's diff) is text, not where the value ends."""
    spec = SPECS[family]
    start, end, quote = {"gemma4": ("<|tool_call>", "<tool_call|>", '<|"|>'),
                         "function_gemma": ("<start_function_call>", "<end_function_call>",
                                            "<escape>")}[family]
    filters = [{"k": 'a, "b"} c] \\', "v": None}, {"k": "{", "v": [1]}]
    text = (f"{start}call:search{{filters:{json.dumps(filters)},query:{quote}q{quote}}}"
            f"{end}")
    for chunks in ([text], list(text)):
        (call,) = replay(spec, chunks).calls
        assert json.loads(call["arguments"]) == {"filters": filters, "query": "q"}


def hidden_by_afmd(spec: Spec) -> set[str]:
    """The spec's special tokens a chat answer would leave out: neither an end id nor
    part of a marker its call format's reader or its reasoning reads."""
    markers = FAMILIES[spec.reader].markers + (spec.think or ())
    return {t for t in spec.tokens if t not in spec.eos and not is_read(t, markers)}


@pytest.mark.parametrize(("spec", "case"), ALL, ids=[f"{s.id}:{c.id}" for s, c in ALL])
def test_each_reader_needs_only_its_declared_markers(spec: Spec, case: Case) -> None:
    """The turn as the client's text would carry it, every special token the family does
    not declare taken out (afmd.service.hidden_tokens), reads back the same: a marker the
    reader needs but its family does not declare would break the calls or the thinking."""
    text = model_text(spec, case)
    for token in hidden_by_afmd(spec):
        text = text.replace(token, "")
    for chunks in ([text], list(text)):
        check(spec, case, replay(spec, chunks, max_calls=case.max_calls))


# Reader modules, each with the families whose markers name its literals.
READERS = {gemma: ("gemma4", "function_gemma"), harmony: ("harmony",), kimi: ("kimi_k2",),
           llama: ("llama3_json",), mistral: ("mistral",), pythonic: ("pythonic",),
           tagged: tuple(n for n, f in FAMILIES.items() if f.reader is not None
                         and getattr(f.reader, "__module__", "") == tagged.__name__)}
# What a special token's text looks like in markup: ``<…>`` (``<|x|>``, ``<x>``, ``</x>``,
# ``<|x>``) or Mistral's ``[UPPER]``; a regex's named group (``(?P<name>``) is no markup.
SPECIAL_LOOKING = re.compile(r"<[^\s<>()\[\]]+>|\[[A-Z_/]+\]")
_GROUP_NAME = re.compile(r"\(\?P<\w+>")


def code_strings(module: Any) -> list[str]:
    """The string literals of a module's code (not its docstrings), regex escapes undone
    and named groups left out."""
    tree = ast.parse(inspect.getsource(module))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [_GROUP_NAME.sub("", node.value).replace("\\", "") for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings]


@pytest.mark.parametrize("module", list(READERS), ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_families_declare_every_marker_their_reader_module_names(module: Any) -> None:
    """Every markup literal in a reader's code lies inside a marker its families declare,
    so a marker added to a reader without declaring it fails here, not in a chat answer
    that lost its token."""
    names = READERS[module]
    assert names, module.__name__
    declared = tuple(m for name in names for m in FAMILIES[name].markers)
    for literal in code_strings(module):
        for found in SPECIAL_LOOKING.findall(literal):
            assert is_read(found, declared), (module.__name__, found)


@pytest.mark.parametrize("name", sorted(
    m.name for m in pkgutil.iter_modules(importlib.import_module("mlx_lm.tool_parsers").__path__)))
def test_mlx_lm_parsers_read_no_marker_their_family_leaves_out(name: str) -> None:
    """A family's reader hands what it cannot follow to mlx-lm's parser for the family:
    that parser must find every token it reads in the text too (an mlx-lm upgrade whose
    parser reads a new marker fails here)."""
    module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    for literal in code_strings(module):
        for found in SPECIAL_LOOKING.findall(literal):
            assert is_read(found, FAMILIES[name].markers), (name, found)


def test_every_family_declares_its_start_and_end() -> None:
    for family in FAMILIES.values():
        assert {family.start, family.end} - {""} <= set(family.markers), family.name


def test_tag_syntax_markers_name_every_tag_field() -> None:
    """A tag added to TagSyntax is read by the tagged reader: its markers must list it."""
    tags = {f.name for f in dataclasses.fields(tagged.TagSyntax)
            if f.name not in ("trim", "name", "key_name", "strings_by_type")}
    for syntax in (tagged.QWEN3_CODER, tagged.GLM47, tagged.LONGCAT, tagged.MINIMAX_M2,
                   tagged.MUSE_SPARK, tagged.MINICPM5, tagged.KIMI_K3):
        for name in tags:
            value = getattr(syntax, name)
            values = value if isinstance(value, tuple) else (value,)
            assert {v for v in values if v} <= set(syntax.markers), name
