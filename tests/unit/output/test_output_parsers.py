"""The output chain (reasoning → tool calls → stops → content) as a shared parser suite.

In the spirit of vLLM's shared tool/reasoning parser tests: each case is a model's raw
output text with the reasoning, content and tool calls a client must receive. Every case
is replayed through :class:`afmd.output.processor.OutputProcessor` configured like the
demo model (``<think>``/``</think>``, Hermes ``<tool_call>`` JSON) — with incremental
argument streaming and with whole-call parsing — and through the other mlx-lm call
formats where practical. Each text is fed whole, character by character and split at
random boundaries (fixed seeds); the reassembled result must be the same whatever the
split, and equal to what the case expects.
"""

from __future__ import annotations

import itertools
import json
import random
import zlib
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from mlx_lm.tool_parsers import json_tools, mistral, pythonic, qwen3_coder

from afmd.core.events import Content, Piece, Reasoning, ToolCallArguments, ToolCallStart
from afmd.output.markers import earliest
from afmd.output.processor import OutputProcessor, ToolFormat
from afmd.output.toolcalls import match_header

THINK = ("<think>", "</think>")
RANDOM_SPLITS = 20

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                       "unit": {"enum": ["c", "f"]}},
    }}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    }}},
]


def hermes(incremental: bool) -> ToolFormat:
    return ToolFormat(
        start=json_tools.tool_call_start,
        end=json_tools.tool_call_end,
        parse=json_tools.parse_tool_call,
        incremental_json=incremental,
    )


def whole_format(module: Any) -> ToolFormat:
    """How afmd configures a non-JSON mlx-lm format: parsed whole at its end marker."""
    return ToolFormat(
        start=module.tool_call_start,
        end=module.tool_call_end,
        parse=module.parse_tool_call,
        incremental_json=False,
    )


FORMATS: dict[str, ToolFormat] = {
    "hermes-incremental": hermes(True),
    "hermes-whole": hermes(False),
    "qwen3_coder": whole_format(qwen3_coder),
    "pythonic": whole_format(pythonic),
    "mistral": whole_format(mistral),
    # afmd's own readers of those families (registry), not mlx-lm's parser on whole blocks.
    "qwen3_coder-reader": ToolFormat("<tool_call>", "</tool_call>", family="qwen3_coder"),
    "pythonic-reader": ToolFormat("<|tool_call_start|>", "<|tool_call_end|>",
                                  family="pythonic"),
}


@dataclass(frozen=True)
class Case:
    id: str
    text: str
    content: str = ""
    reasoning: str = ""
    # (name, arguments): a dict is compared as parsed JSON, a str as the exact raw text.
    calls: tuple[tuple[str, Any], ...] = ()
    stops: tuple[str, ...] = ()
    starts_in_reasoning: bool = False
    max_calls: int | None = None
    should_stop: bool = False
    markup_in_content: bool = False  # an unparseable call comes back as text, markup and all


@dataclass
class Replay:
    content: str
    reasoning: str
    calls: list[dict[str, Any]]  # per index: id, name, arguments (fragments joined), fragments
    should_stop: bool
    final_calls: list[tuple[str, str, str]]  # what the processor reports at the end
    pieces: list[Piece] = field(repr=False, default_factory=list)

    def key(self) -> tuple[Any, ...]:
        return (
            self.content,
            self.reasoning,
            [(c["id"], c["name"], c["arguments"]) for c in self.calls],
            self.should_stop,
        )


def call(name: str, arguments: Any) -> tuple[str, Any]:
    return (name, arguments)


def hermes_call(name: str, arguments: dict[str, Any], *, compact: bool = False) -> str:
    if compact:
        body = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"),
                          ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call>"
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


WEATHER = {"city": "Paris", "unit": "c"}
NESTED = {
    "query": 'a {b} [c] "d" \\ e }}',
    "filters": [{"k": "x", "v": None}, {"k": "y", "v": [1, 2.5, True, {"deep": {}}]}],
}

# The demo model's format, in both parsing modes.
HERMES_CASES = [
    Case("plain", "The weather is nice today.", content="The weather is nice today."),
    Case("surrounding-whitespace", "\n\n  Hello there\n", content="Hello there\n"),
    Case("lookalikes", "a <tool_cal b <thin c </tool_call d < e > f",
         content="a <tool_cal b <thin c </tool_call d < e > f"),
    Case("partial-marker-at-end", "ends with <tool_c", content="ends with <tool_c"),
    Case("partial-think-at-end", "ends with <thi", content="ends with <thi"),
    Case("think-then-answer", "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
         reasoning="\nLet me think.\n", content="The answer is 4."),
    Case("unterminated-think", "<think>still thinking", reasoning="still thinking"),
    Case("call-markup-inside-think", "<think>maybe <tool_call> later</think>No call.",
         reasoning="maybe <tool_call> later", content="No call."),
    Case("single-call", hermes_call("get_weather", WEATHER),
         calls=(call("get_weather", WEATHER),)),
    Case("compact-call", hermes_call("add", {"a": 1, "b": 2}, compact=True),
         calls=(call("add", {"a": 1, "b": 2}),)),
    Case("call-without-newlines",
         '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
         calls=(call("add", {"a": 1, "b": 2}),)),
    Case("think-then-call",
         "<think>I need the weather.</think>\n\n" + hermes_call("get_weather", WEATHER),
         reasoning="I need the weather.", calls=(call("get_weather", WEATHER),)),
    Case("content-then-call", "Let me check.\n\n" + hermes_call("get_weather", WEATHER),
         content="Let me check.", calls=(call("get_weather", WEATHER),)),
    Case("call-then-content", hermes_call("add", {"a": 1, "b": 2}) + "\nDone.",
         content="Done.", calls=(call("add", {"a": 1, "b": 2}),)),
    Case("content-around-call",
         "Before.\n" + hermes_call("add", {"a": 1}) + "\nAfter.",
         content="Before.\nAfter.", calls=(call("add", {"a": 1}),)),
    Case("parallel-calls",
         hermes_call("get_weather", WEATHER) + "\n" + hermes_call("add", {"a": 1, "b": 2}),
         calls=(call("get_weather", WEATHER), call("add", {"a": 1, "b": 2}))),
    Case("three-calls-after-thinking",
         "<think>three</think>\n"
         + "\n".join(hermes_call("add", {"a": i, "b": i}, compact=True) for i in range(3)),
         reasoning="three",
         calls=tuple(call("add", {"a": i, "b": i}) for i in range(3))),
    Case("nested-arguments", hermes_call("search", NESTED), calls=(call("search", NESTED),)),
    Case("empty-arguments", hermes_call("now", {}), calls=(call("now", {}),)),
    Case("unicode-arguments", hermes_call("get_weather", {"city": "Zürich 東京 🌤"}),
         calls=(call("get_weather", {"city": "Zürich 東京 🌤"}),)),
    Case("arguments-before-name",
         '<tool_call>\n{"arguments": {"a": 1}, "name": "add"}\n</tool_call>',
         calls=(call("add", {"a": 1}),)),
    Case("arguments-as-json-string",
         '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
         calls=(call("add", {"a": 1}),)),
    Case("missing-end-marker", '<tool_call>\n{"name": "add", "arguments": {"a": 1}}',
         calls=(call("add", {"a": 1}),)),
    Case("unparseable-call-is-text", "<tool_call>\nnot json\n</tool_call>",
         content="<tool_call>\nnot json\n</tool_call>", markup_in_content=True),
    # Cut off before it parses: dropped, never leaked as markup (finish_reason tells).
    Case("truncated-in-header", '<tool_call>\n{"name": "get_w'),
    Case("max-calls-drops-the-second",
         hermes_call("add", {"a": 1, "b": 2}) + "\n" + hermes_call("get_weather", WEATHER)
         + "\ntrailing text",
         calls=(call("add", {"a": 1, "b": 2}),), max_calls=1, should_stop=True),
    Case("stop-sequence", "The answer</answer> is hidden", content="The answer",
         stops=("</answer>",), should_stop=True),
    Case("stop-sequence-never-completed", "x </ans y </answe", content="x </ans y </answe",
         stops=("</answer>",)),
    Case("first-of-several-stops", "line one\n\nline two STOP", content="line one",
         stops=("STOP", "\n\n"), should_stop=True),
    # Stop sequences match the answer only, as OpenAI's and Anthropic's do.
    Case("stop-inside-thinking", "<think>abc STOP def</think>answer",
         reasoning="abc STOP def", content="answer", stops=("STOP",)),
    Case("stop-inside-thinking-and-answer", "<think>abc STOP def</think>an STOP swer",
         reasoning="abc STOP def", content="an ", stops=("STOP",), should_stop=True),
    Case("stop-before-call", "Sure END" + hermes_call("add", {"a": 1}), content="Sure ",
         stops=("END",), should_stop=True),
    Case("reasoning-opened-by-prompt", "I am thinking</think>\n\nHello",
         reasoning="I am thinking", content="Hello", starts_in_reasoning=True),
    Case("reasoning-opened-by-prompt-then-call",
         "plan\n</think>\n\n" + hermes_call("get_weather", WEATHER), reasoning="plan\n",
         calls=(call("get_weather", WEATHER),), starts_in_reasoning=True),
    Case("reasoning-opened-by-prompt-unterminated", "never closes",
         reasoning="never closes", starts_in_reasoning=True),
]

QWEN3_CODER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)

OTHER_CASES = [
    ("qwen3_coder", Case("xml-call", QWEN3_CODER_CALL,
                         calls=(call("get_weather", {"city": "San Francisco", "days": 3}),))),
    ("qwen3_coder", Case(
        "xml-think-content-two-calls",
        "<think>two</think>Checking.\n" + QWEN3_CODER_CALL + "\n"
        + "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n"
          "<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>",
        reasoning="two", content="Checking.",
        calls=(call("get_weather", {"city": "San Francisco", "days": 3}),
               call("add", {"a": 1, "b": 2})))),
    ("pythonic", Case("pythonic-call",
                      '<|tool_call_start|>[get_weather(city="Paris", days=2)]<|tool_call_end|>',
                      calls=(call("get_weather", {"city": "Paris", "days": 2}),))),
    ("pythonic", Case("pythonic-two-calls-in-one-block",
                      'See [1]. <|tool_call_start|>[get_weather(city="Paris"), '
                      "add(a=1, b=2)]<|tool_call_end|>",
                      content="See [1].",
                      calls=(call("get_weather", {"city": "Paris"}),
                             call("add", {"a": 1, "b": 2})))),
    ("pythonic", Case("pythonic-max-calls",
                      "<|tool_call_start|>[add(a=1, b=2), add(a=3, b=4)]<|tool_call_end|>",
                      calls=(call("add", {"a": 1, "b": 2}),), max_calls=1, should_stop=True)),
    ("mistral", Case("mistral-call", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
                     content="Sure.", calls=(call("get_weather", {"city": "Paris"}),))),
    ("mistral", Case("mistral-two-calls",
                     '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}add[ARGS]{"a": 1, "b": 2}',
                     calls=(call("get_weather", {"city": "Paris"}),
                            call("add", {"a": 1, "b": 2})))),
    ("mistral", Case("mistral-json-list",
                     '[1] [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, '
                     '{"name": "now", "arguments": {}}]',
                     content="[1]", calls=(call("add", {"a": 1}), call("now", {})))),
    ("hermes-incremental", Case(
        "end-marker-inside-argument-string",
        hermes_call("echo", {"text": "</tool_call> and <tool_call>"}),
        calls=(call("echo", {"text": "</tool_call> and <tool_call>"}),))),
    ("mistral", Case("mistral-plain-brackets", "a [TOOL b [x]", content="a [TOOL b [x]")),
]

# A call is not answer text: a stop sequence never matches its markup nor its arguments
# (the call comes through whole), only the text before, between and after calls, and
# never across one. Each family's call, and the stops that appear in it.
PARIS = {"city": "Paris"}
CALL_STOPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "hermes": (hermes_call("get_weather", PARIS),
               ("\n", "}", '"', "Paris", "<tool_call>", "</tool_call>", '"arguments"')),
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                    "</parameter>\n</function>\n</tool_call>",
                    ("\n", ">", "Paris", "<function=", "</parameter>", "</tool_call>")),
    "pythonic": ('<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>',
                 ("(", ")", '"', "Paris", "=", "<|tool_call_start|>", "]<|")),
    "mistral": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
                ("[", "}", '"', "Paris", "[ARGS]", "[TOOL_CALLS]")),
}
FAMILY_OF = {"hermes-incremental": "hermes", "hermes-whole": "hermes",
             **{f: f.removesuffix("-reader") for f in FORMATS if not f.startswith("hermes")}}


def call_stop_cases(fmt: str) -> list[tuple[str, Case]]:
    text, stops = CALL_STOPS[FAMILY_OF[fmt]]
    weather = (call("get_weather", PARIS),)
    cases = [
        Case(f"{fmt}-stops-inside-the-call", "Sure. " + text, content="Sure.",
             calls=weather, stops=stops[1:]),  # not "\n": it would cut nothing here
        Case(f"{fmt}-newline-stop-and-a-call", text, calls=weather, stops=stops[:1]),
        Case(f"{fmt}-stop-before-the-call", "Sure END " + text, content="Sure ",
             stops=("END", *stops), should_stop=True),
        Case(f"{fmt}-no-stop-across-the-call", "ab " + text, content="ab", calls=weather,
             stops=("b P", "b [", "b <")),
    ]
    if FAMILY_OF[fmt] != "mistral":  # no end marker: nothing comes after its calls
        cases += [
            Case(f"{fmt}-stop-after-the-call", text + " Done END more", content="Done",
                 calls=weather, stops=("END", *stops[1:]), should_stop=True),
            Case(f"{fmt}-stop-between-calls", text + " and END " + text, content="and",
                 calls=weather, stops=("END",), should_stop=True),
        ]
    return [(fmt, case) for case in cases]


CALL_STOP_CASES = [pair for fmt in FORMATS for pair in call_stop_cases(fmt)]

ALL = [(fmt, case) for fmt in ("hermes-incremental", "hermes-whole") for case in HERMES_CASES]
ALL += OTHER_CASES
ALL += CALL_STOP_CASES


def replay(case: Case, fmt: str, chunks: list[str]) -> Replay:
    ids = itertools.count()
    processor = OutputProcessor(
        stops=case.stops,
        thinking=THINK,
        starts_in_reasoning=case.starts_in_reasoning,
        tool_format=FORMATS[fmt],
        tools=TOOLS,
        max_calls=case.max_calls,
        new_id=lambda: f"call_{next(ids)}",
    )
    pieces: list[Piece] = []
    stopped = False
    for chunk in chunks:
        pieces.extend(processor.feed(chunk))
        if processor.should_stop:
            stopped = True
            break  # the pipeline ends generation here
    pieces.extend(processor.finish())
    content, reasoning = [], []
    calls: list[dict[str, Any]] = []
    for piece in pieces:
        if isinstance(piece, Content | Reasoning):
            assert piece.text, f"empty text piece {piece!r}"
            (content if isinstance(piece, Content) else reasoning).append(piece.text)
        elif isinstance(piece, ToolCallStart):
            assert piece.index == len(calls), "tool call indexes must be 0, 1, … in order"
            # The first fragment may ride with the header (OpenAI's first delta).
            calls.append({"id": piece.id, "name": piece.name, "arguments": piece.arguments,
                          "fragments": [piece.arguments] if piece.arguments else []})
        else:
            assert isinstance(piece, ToolCallArguments)
            assert calls and piece.index == len(calls) - 1, (
                "arguments must follow their own call's start"
            )
            assert piece.fragment, "empty argument fragment"
            calls[-1]["arguments"] += piece.fragment
            calls[-1]["fragments"].append(piece.fragment)
    return Replay(
        content="".join(content),
        reasoning="".join(reasoning),
        calls=calls,
        should_stop=stopped,
        final_calls=[(c.id, c.name, c.arguments) for c in processor.tool_calls],
        pieces=pieces,
    )


def random_splits(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    if len(text) < 2:
        return [text]
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(len(text) - 1, 12))))
    return [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


def splittings(case: Case) -> list[tuple[str, list[str]]]:
    seed = zlib.crc32(case.id.encode())
    out = [("whole", [case.text]), ("chars", list(case.text))]
    out += [(f"random-{k}", random_splits(case.text, seed + k)) for k in range(RANDOM_SPLITS)]
    return out


MARKUP = {
    "hermes-incremental": ("<tool_call>", "</tool_call>"),
    "hermes-whole": ("<tool_call>", "</tool_call>"),
    "qwen3_coder": ("<tool_call>", "</tool_call>", "<function=", "<parameter="),
    "pythonic": ("<|tool_call_start|>", "<|tool_call_end|>"),
    "mistral": ("[TOOL_CALLS]", "[ARGS]"),
}
MARKUP |= {f"{fmt}-reader": MARKUP[fmt] for fmt in ("qwen3_coder", "pythonic")}


def check_expected(result: Replay, case: Case, fmt: str) -> None:
    assert result.content == case.content
    assert result.reasoning == case.reasoning
    assert [c["name"] for c in result.calls] == [name for name, _ in case.calls]
    for got, (_, expected) in zip(result.calls, case.calls, strict=True):
        if isinstance(expected, str):
            assert got["arguments"] == expected
        else:
            # The fragments join to valid JSON: exactly the arguments.
            assert json.loads(got["arguments"]) == expected
    assert result.should_stop == case.should_stop
    # What a non-streamed response reports is exactly what the stream sent.
    assert result.final_calls == [(c["id"], c["name"], c["arguments"]) for c in result.calls]
    assert len({c["id"] for c in result.calls}) == len(result.calls)
    if not case.markup_in_content:
        for marker in (*THINK, *MARKUP[fmt]):
            assert marker not in result.content
    for stop in case.stops:  # the reasoning may hold one: only the answer is matched
        assert stop not in result.content


@pytest.mark.parametrize(("fmt", "case"), ALL, ids=[f"{f}:{c.id}" for f, c in ALL])
def test_case_whatever_the_split(fmt: str, case: Case) -> None:
    reference = replay(case, fmt, [case.text])
    check_expected(reference, case, fmt)
    for name, chunks in splittings(case):
        assert "".join(chunks) == case.text
        result = replay(case, fmt, chunks)
        assert result.key() == reference.key(), f"split {name}: {chunks!r}"
        check_expected(result, case, fmt)


def test_every_case_id_is_unique() -> None:
    ids = [c.id for c in HERMES_CASES] + [c.id for _, c in OTHER_CASES]
    assert len(ids) == len(set(ids))


# Calls in the {"name": …, "arguments": {…}} shape (others are parsed whole by design).
STREAMABLE = [
    c for c in HERMES_CASES
    if c.calls and not c.max_calls
    and c.id not in ("arguments-before-name", "arguments-as-json-string")
]


@pytest.mark.parametrize("case", STREAMABLE, ids=lambda c: c.id)
def test_incremental_json_streams_arguments_before_the_call_ends(case: Case) -> None:
    """Char by char, the header (id, name) is out before the arguments end, and the
    arguments of the JSON format arrive in several fragments as they are written."""
    ids = itertools.count()
    processor = OutputProcessor(thinking=THINK, starts_in_reasoning=case.starts_in_reasoning,
                                tool_format=FORMATS["hermes-incremental"],
                                new_id=lambda: f"call_{next(ids)}")
    started_at: dict[int, int] = {}
    last_fragment_at: dict[int, int] = {}
    fragments: dict[int, int] = {}
    for position, char in enumerate(case.text):
        for piece in processor.feed(char):
            if isinstance(piece, ToolCallStart):
                started_at[piece.index] = position
                if piece.arguments:
                    fragments[piece.index] = fragments.get(piece.index, 0) + 1
                    last_fragment_at[piece.index] = position
            elif isinstance(piece, ToolCallArguments):
                fragments[piece.index] = fragments.get(piece.index, 0) + 1
                last_fragment_at[piece.index] = position
    processor.finish()
    assert len(started_at) == len(case.calls)
    for index in range(len(case.calls)):
        # The header (id, name) went out while the arguments were still being written…
        assert started_at[index] < last_fragment_at[index]
        # …and the arguments followed as produced, not in one piece at the end.
        assert fragments[index] >= 2


def test_whole_parsing_sends_arguments_in_one_fragment() -> None:
    text = hermes_call("get_weather", WEATHER) + hermes_call("add", {"a": 1, "b": 2})
    processor = OutputProcessor(thinking=THINK, tool_format=FORMATS["hermes-whole"])
    pieces = [p for ch in text for p in processor.feed(ch)] + processor.finish()
    starts = [p for p in pieces if isinstance(p, ToolCallStart)]
    assert not [p for p in pieces if isinstance(p, ToolCallArguments)]
    assert [s.index for s in starts] == [0, 1]
    assert [json.loads(s.arguments) for s in starts] == [WEATHER, {"a": 1, "b": 2}]


TRUNCATED_ARGS = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "x'


@pytest.mark.parametrize("fmt", ["hermes-incremental", "hermes-whole"])
def test_unterminated_call_at_finish_never_leaks_markup(fmt: str) -> None:
    case = Case("truncated-arguments", TRUNCATED_ARGS)
    results = [replay(case, fmt, chunks) for _, chunks in splittings(case)]
    result = results[0]
    assert all(r.key() == result.key() for r in results)
    if fmt == "hermes-incremental":
        # The header was already streamed: the call stays, truncated (finish_reason tells).
        assert [(c["name"], c["arguments"]) for c in result.calls] == [
            ("add", '{"a": 1, "b": "x')
        ]
        assert result.content == ""
    else:
        # Nothing was streamed for it and it does not parse: dropped, markup never leaks
        # into content (finish_reason "length" tells the client the turn was cut).
        assert result.calls == []
        assert result.content == ""


def test_max_calls_sets_should_stop_as_soon_as_the_first_call_closes() -> None:
    first = hermes_call("add", {"a": 1, "b": 2})
    processor = OutputProcessor(thinking=THINK, tool_format=FORMATS["hermes-incremental"],
                                max_calls=1)
    for i, char in enumerate(first):
        processor.feed(char)
        assert processor.should_stop == (i == len(first) - 1)
    assert processor.feed("\n" + hermes_call("add", {"a": 3, "b": 4})) == []
    assert processor.finish() == []
    assert [(c.name, json.loads(c.arguments)) for c in processor.tool_calls] == [
        ("add", {"a": 1, "b": 2})
    ]


def test_stop_hold_back_never_leaks_while_streaming() -> None:
    """Text that could still grow into a stop sequence is not released early."""
    processor = OutputProcessor(stops=("</answer>",), thinking=THINK)
    emitted = ""
    text = "value </ans"
    for char in text:
        emitted += "".join(p.text for p in processor.feed(char) if isinstance(p, Content))
        assert "</" not in emitted
    assert emitted == "value"  # the space is held too: it may be trailing whitespace
    emitted += "".join(p.text for p in processor.feed("wer> more") if isinstance(p, Content))
    emitted += "".join(p.text for p in processor.finish() if isinstance(p, Content))
    assert emitted == "value "
    assert processor.should_stop and processor.stopped_by_sequence


def test_stop_sequences_match_the_answer_only_whatever_the_split() -> None:
    """A stop sequence in the thinking is thinking (OpenAI and Anthropic match the answer
    only); one in the answer ends it, ``released`` pointing where it began in the model's
    text; a thinking block between two parts of the answer keeps one from spanning them."""
    text = "<think>a END b</think>c END d"
    spanning = "ab<think>x</think>cd"
    for seed in range(RANDOM_SPLITS):
        processor = OutputProcessor(stops=("END",), thinking=THINK)
        pieces = [p for ch in random_splits(text, seed) for p in processor.feed(ch)]
        pieces += processor.finish()
        assert "".join(p.text for p in pieces if isinstance(p, Reasoning)) == "a END b"
        assert "".join(p.text for p in pieces if isinstance(p, Content)) == "c "
        assert processor.stop_sequence == "END"
        assert processor.released == text.index("END", text.index("</think>"))
        processor = OutputProcessor(stops=("abc",), thinking=THINK)
        pieces = [p for ch in random_splits(spanning, seed) for p in processor.feed(ch)]
        pieces += processor.finish()
        runs = [(kind, "".join(p.text for p in run))
                for kind, run in itertools.groupby(pieces, type)]
        assert runs == [(Content, "ab"), (Reasoning, "x"), (Content, "cd")]
        assert not processor.stopped_by_sequence
        assert processor.released == len(spanning)


def test_a_stop_never_matches_the_padding_before_the_answer_whatever_the_split() -> None:
    """The blank lines a thinking model writes after ``</think>`` (or any whitespace before
    the answer's first character) never reach the client, so a stop sequence such as
    "\\n" cannot match them: it would end every such answer before it began. Once the
    answer has begun its whitespace is visible, and matched."""
    cases = [
        ("<think>a\nb</think>\n\nHi\nthere", False, "Hi", "a\nb", 22),
        ("a\nb</think>\n\nHi", True, "Hi", "a\nb", 15),  # the prompt opened the thinking
        ("\n\nHi\nthere", False, "Hi", "", 4),
        ("<think>a</think>\n\n", False, "", "a", 18),  # a blank answer: nothing to stop
        ("Hi<think>a</think>\n\nthere", False, "Hi", "a", 18),  # begun: visible, matched
    ]
    for text, opened, content, reasoning, released in cases:
        for seed in range(RANDOM_SPLITS):
            processor = OutputProcessor(stops=("\n",), thinking=THINK,
                                        starts_in_reasoning=opened)
            pieces = [p for ch in random_splits(text, seed) for p in processor.feed(ch)]
            pieces += processor.finish()
            assert "".join(p.text for p in pieces if isinstance(p, Content)) == content, text
            assert "".join(p.text for p in pieces if isinstance(p, Reasoning)) == reasoning
            assert processor.released == released, text
            assert processor.stopped_by_sequence == (released < len(text)), text


def test_reasoning_and_content_never_mix_whatever_the_split() -> None:
    text = "<think>a</think>b<think>c</think>d"
    for seed in range(RANDOM_SPLITS):
        processor = OutputProcessor(thinking=THINK)
        pieces = [p for ch in random_splits(text, seed) for p in processor.feed(ch)]
        pieces += processor.finish()
        assert "".join(p.text for p in pieces if isinstance(p, Reasoning)) == "ac"
        assert "".join(p.text for p in pieces if isinstance(p, Content)) == "bd"


# ------------------------------------------------- the chain, thinking and stops, by property

_ATOMS = st.sampled_from(["<think>", "</think>", "<", "</", "<th", "a", "b", " ", "\n", "\n\n",
                          "END", "<tool_call>", "</tool_call>",
                          '{"name": "add", "arguments": {"a": 1}}'])
_STOPS = st.sampled_from(["END", "<", "<t", "b<", "a", "</", "ink>", " a", "\n", "\na", "k>a",
                          "<tool", "1}"])


def _runs(pieces: list[Piece]) -> list[tuple[str, Any]]:
    """The pieces as a client reassembles them: a channel's neighbouring texts joined, a
    call's fragments joined to its header."""
    out: list[tuple[str, Any]] = []
    for piece in pieces:
        if isinstance(piece, ToolCallArguments):
            kind, (index, name, arguments) = out[-1]
            assert kind == "call" and index == piece.index
            out[-1] = ("call", (index, name, arguments + piece.fragment))
        elif isinstance(piece, ToolCallStart):
            out.append(("call", (piece.index, piece.name, piece.arguments)))
        elif out and out[-1][0] == type(piece).__name__:
            out[-1] = (out[-1][0], out[-1][1] + piece.text)
        else:
            out.append((type(piece).__name__, piece.text))
    return out


def _fed(processor: OutputProcessor, parts: list[str]) -> list[Piece]:
    """Every piece ``parts`` make, checking after each that ``released`` never goes back
    nor past what was fed."""
    pieces: list[Piece] = []
    fed = released = 0
    for part in parts:
        pieces += processor.feed(part)
        fed += len(part)
        assert released <= processor.released <= fed
        released = processor.released
    pieces += processor.finish()
    assert released <= processor.released <= fed
    return pieces


def _hermes_blocks(answer: str, incremental: bool) -> list[tuple[int, int, str]]:
    """Each ``<tool_call>`` block of the answer's text (thinking removed): where it begins
    and ends, and what it is: a "call", "text" (an unparseable block comes back as text,
    markup and all) or "dropped" (cut off before it parses: its markup never shows)."""
    start, end = json_tools.tool_call_start, json_tools.tool_call_end
    blocks, pos = [], 0
    while (i := answer.find(start, pos)) != -1:
        j = answer.find(end, i + len(start))
        inner = answer[i + len(start): len(answer) if j == -1 else j]
        head = match_header(inner)
        if incremental and head[0] == "match" and inner[head[3]] in "{[":
            kind = "call"  # streamed: a call whatever follows its arguments
        else:
            try:
                parsed = json.loads(inner.strip())
                kind = "call" if isinstance(parsed, dict) and isinstance(
                    parsed.get("name"), str) else "text"
            except ValueError:
                kind = "text"
            if kind == "text" and j == -1:
                kind = "dropped"
        pos = len(answer) if j == -1 else j + len(end)
        blocks.append((i, pos, kind))
    return blocks


def _answer_stop(text: str, stops: tuple[str, ...], opened: bool,
                 calls: bool | None) -> tuple[tuple[int, str] | None, list[int]]:
    """Where the stop that ends the answer begins, read as the chain must: in the answer's
    own runs (thinking blocks and calls split them: a call is not answer text), after the
    whitespace before its first character; and where each call begins."""
    runs: list[tuple[int, str]] = []
    pos, thinking = 0, opened
    while pos < len(text):
        marker = THINK[1] if thinking else THINK[0]
        i = text.find(marker, pos)
        if not thinking:
            runs.append((pos, text[pos:] if i == -1 else text[pos:i]))
        if i == -1:
            break
        pos, thinking = i + len(marker), not thinking
    starts: list[int] = []
    if calls is not None:
        # The answer's characters, each where it lies in ``text``: calls are cut out.
        places = [at + k for at, run in runs for k in range(len(run))]
        answer = "".join(run for _, run in runs)
        kept, last = [], 0
        for begin, finish, kind in _hermes_blocks(answer, calls):
            if kind != "text":
                kept.append((last, begin))
                last = finish
            if kind == "call":
                starts.append(places[begin])
        kept.append((last, len(answer)))
        runs = []
        for a, b in kept:  # split again where the text was not contiguous (thinking)
            for k in range(a, b):
                if runs and places[k] == runs[-1][0] + len(runs[-1][1]):
                    runs[-1] = (runs[-1][0], runs[-1][1] + answer[k])
                else:
                    runs.append((places[k], answer[k]))
            runs.append((-1, ""))  # a call between: no stop spans it
    begun = False
    for at, run in runs:
        if not begun:
            lead = len(run) - len(run.lstrip())
            at, run, begun = at + lead, run[lead:], bool(run.strip())
        cut, which = earliest(run, stops)
        if cut != -1:
            return (at + cut, which), starts
    return None, starts


def _call_in_thinking_block(text: str) -> bool:
    """A thinking block inside a call block: the block's text is not one run of the model's
    text, so whole-parse fallbacks are shown as markup rebuilt, placed where it began."""
    i = text.find("<tool_call>")
    return i != -1 and any(m in text[i:] for m in THINK)


@settings(max_examples=300, deadline=None)
@given(st.lists(_ATOMS, min_size=1, max_size=8), st.lists(_STOPS, max_size=2), st.booleans(),
       st.sampled_from([None, True, False]), st.data())
def test_property_the_chain_is_the_same_whatever_the_split(
    atoms: list[str], stops: list[str], opened: bool, calls: bool | None, data: st.DataObject,
) -> None:
    """Streamed or whole, the same pieces; ``released`` never goes back nor past what was
    fed, and ends where the answer's stop began (never in a call: its markup and arguments
    are not answer text) or at the end; no call after the stop is opened."""
    text = "".join(atoms)
    assume(calls is None or not _call_in_thinking_block(text))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    chunks = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]

    def run(parts: list[str]) -> tuple[list[tuple[str, Any]], OutputProcessor]:
        processor = OutputProcessor(stops=tuple(stops), thinking=THINK, starts_in_reasoning=opened,
                                    tool_format=None if calls is None else hermes(calls))
        return _runs(_fed(processor, parts)), processor

    whole, one = run([text])
    split, other = run(chunks)
    assert split == whole
    assert (other.released, other.stop_sequence, other.tool_calls, other.cut_call) == (
        one.released, one.stop_sequence, one.tool_calls, one.cut_call)
    stop, starts = _answer_stop(text, tuple(stops), opened, calls)
    assert (one.released, one.stop_sequence) == (stop or (len(text), None))
    if stop is not None:
        assert one.stop_end == stop[0] + len(stop[1])
        assert text[stop[0]:one.stop_end] == stop[1]
    before = [at for at in starts if stop is None or at < stop[0]]
    assert len(one.tool_calls) == len(before)


# ------------------------------------------------------ harmony's channels and stop sequences

HARMONY = ToolFormat("", "", family="harmony")
ANALYSIS, FINAL = "<|channel|>analysis<|message|>", "<|channel|>final<|message|>"
PREAMBLE, NEXT = "<|channel|>commentary<|message|>", "<|end|><|start|>assistant"
ADD_CALL = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2}'


@dataclass(frozen=True)
class ChannelCase:
    id: str
    text: str
    stops: tuple[str, ...]
    content: str
    reasoning: str = ""
    calls: tuple[tuple[str, str], ...] = ()
    stop: str | None = None  # the stop that matched, at the last occurrence in ``text``


CHANNEL_CASES = [
    ChannelCase("in-the-analysis", f"{ANALYSIS}think END here{NEXT}{FINAL}Hi END there",
                ("END",), "Hi ", "think END here", stop="END"),
    ChannelCase("only-in-the-analysis", f"{ANALYSIS}END{NEXT}{FINAL}fine", ("END",), "fine",
                "END"),
    ChannelCase("in-the-markup", f"{ANALYSIS}x{NEXT}{FINAL}Hi",
                ("<|channel|>", "final", "<|message|>", "assistant", "<|end|>", "analysis"),
                "Hi", "x"),
    ChannelCase("padding-before-the-answer", f"{ANALYSIS}a\nb{NEXT}{FINAL}\n\nHi\nthere",
                ("\n",), "Hi", "a\nb", stop="\n"),
    ChannelCase("in-a-call", f"{ANALYSIS}add 1{NEXT}{ADD_CALL}",
                ("1", '"b"', "functions", "add", "json", "}"), "", "add 1",
                (("add", '{"a": 1, "b": 2}'),)),
    ChannelCase("in-a-preamble", f"{PREAMBLE}Let me END check{NEXT}{ADD_CALL}", ("END",),
                "Let me ", stop="END"),
    ChannelCase("across-a-channel-switch", f"{PREAMBLE}ab{NEXT}{FINAL}cd", ("bc",), "abcd"),
    ChannelCase("no-header", "Hello END world", ("END",), "Hello ", stop="END"),
    ChannelCase("like-the-end-marker", f"{ANALYSIS}<|y{NEXT}{FINAL}x<|y z", ("<|y",), "x",
                "<|y", stop="<|y"),
]


@pytest.mark.parametrize("case", CHANNEL_CASES, ids=lambda c: c.id)
def test_harmony_stops_match_the_answer_only_whatever_the_split(case: ChannelCase) -> None:
    """gpt-oss's channels as every other family's thinking: a stop sequence matches the
    answer's text only (the ``final`` channel, a ``commentary`` preamble), never the
    analysis, the channel markup, a call's message, the whitespace before the answer's
    first character nor two messages' texts together; ``released`` and ``stop_end`` say
    where it lies in the model's text."""
    for name, chunks in [("whole", [case.text]), ("chars", list(case.text))] + [
            (f"random-{seed}", random_splits(case.text, seed)) for seed in range(RANDOM_SPLITS)]:
        processor = OutputProcessor(stops=case.stops, tool_format=HARMONY, tools=TOOLS)
        pieces = _fed(processor, chunks)
        assert "".join(p.text for p in pieces if isinstance(p, Content)) == case.content, name
        assert "".join(p.text for p in pieces if isinstance(p, Reasoning)) == case.reasoning
        assert tuple((c.name, c.arguments) for c in processor.tool_calls) == case.calls, name
        assert processor.stop_sequence == case.stop, name
        at = case.text.rindex(case.stop) if case.stop else len(case.text)
        assert processor.released == at, name
        if case.stop:
            assert processor.stop_end == at + len(case.stop)


# Bodies that can never spell a harmony marker, whatever their order.
_BODY = st.lists(st.sampled_from(["<|", "<", "|", "|>", "a", "b", "ab", " ", "\n", "\n\n",
                                  "END"]), max_size=5).map("".join)
_MESSAGES = st.lists(st.tuples(st.sampled_from(["analysis", "final", "commentary"]), _BODY),
                     max_size=4)
_CHANNEL_STOPS = st.sampled_from(["END", "<", "<|", "a", "b ", "\n", "ab", "|", "b<|", "final",
                                  "<|channel|>", "analysis", "<|end|>", "1", '"b"', "}",
                                  "assistant", "<|e"])


def _harmony_turn(messages: list[tuple[str, str]], call: bool, plain: str | None,
                  closed: bool) -> tuple[str, list[tuple[int, str]]]:
    """A turn as gpt-oss writes it, and where each text the client reads as the answer
    begins in it (the final channel and commentary preambles)."""
    if plain is not None:
        plain = "x" + plain  # not a header's beginning (a cut-off header shows nothing)
        return plain, [(0, plain)]
    text, runs = "", []
    for i, (channel, body) in enumerate(messages):
        text += ("<|start|>assistant" if i else "") + f"<|channel|>{channel}<|message|>"
        if channel != "analysis":
            runs.append((len(text), body))
        text += body + ("<|end|>" if closed or i < len(messages) - 1 or call else "")
    if call:
        text += ("<|start|>assistant" if messages else "") + ADD_CALL
    return text, runs


def _first_stop(runs: list[tuple[int, str]], stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Where the stop that ends the answer begins: in one of its runs, after the whitespace
    before its first character."""
    begun = False
    for at, run in runs:
        if not begun:
            lead = len(run) - len(run.lstrip())
            at, run, begun = at + lead, run[lead:], bool(run.strip())
        cut, which = earliest(run, stops)
        if cut != -1:
            return at + cut, which
    return None


@settings(max_examples=300, deadline=None)
@given(_MESSAGES, st.booleans(), st.one_of(st.none(), _BODY), st.booleans(),
       st.lists(_CHANNEL_STOPS, max_size=2), st.data())
def test_property_harmony_stops_are_the_same_whatever_the_split(
    messages: list[tuple[str, str]], call: bool, plain: str | None, closed: bool,
    stops: list[str], data: st.DataObject,
) -> None:
    """Streamed or whole, the same pieces; ``released`` never goes back nor past what was
    fed, and ends where the answer's stop began (never one in the analysis, the markup or
    the call) or at the end; the answer is the final and preamble texts up to it."""
    text, runs = _harmony_turn(messages, call, plain, closed)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    chunks = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]

    def run(parts: list[str]) -> tuple[list[tuple[str, Any]], OutputProcessor]:
        processor = OutputProcessor(stops=tuple(stops), tool_format=HARMONY, tools=TOOLS)
        return _runs(_fed(processor, parts)), processor

    whole, one = run([text])
    split, other = run(chunks)
    assert split == whole
    assert (other.released, other.stop_sequence, other.tool_calls, other.cut_call) == (
        one.released, one.stop_sequence, one.tool_calls, one.cut_call)
    stop = _first_stop(runs, tuple(stops))
    assert (one.released, one.stop_sequence) == (stop or (len(text), None))
    end = len(text) if stop is None else stop[0]
    answer = "".join(run[:end - at] for at, run in runs if at <= end)
    content = "".join(t for kind, t in whole if kind == "Content")
    assert content.strip() == answer.strip()
    assert [t for kind, t in whole if kind == "call"] == (
        [(0, "add", '{"a": 1, "b": 2}')] if call and stop is None and plain is None else [])
