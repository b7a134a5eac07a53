"""The reasoning count: tokens from the one that starts the opening marker to the one that
completes the closing marker, however the markers are split into tokens.

Each case is the text of each generated token in order (what the detokenizer added), as
real families write them; the end-to-end count per family is in
tests/server/test_tool_formats_e2e.py.
"""

from __future__ import annotations

import pytest

from afmd.engine.reasoning_count import ReasoningCount, ReasoningMarkers
from afmd.output.formats.harmony import ANALYSIS

THINK = ReasoningMarkers("<think>", "</think>")
GEMMA = ReasoningMarkers("<|channel>thought", "<channel|>")
HARMONY = ReasoningMarkers(*ANALYSIS)


def count(markers: ReasoningMarkers, texts: list[str], *, inside: bool = False) -> int:
    counter = ReasoningCount(markers, inside=inside)
    for text in texts:
        counter.take(text)
    return counter.tokens


@pytest.mark.parametrize(("texts", "want"), [
    # one token each marker, as Qwen writes them
    (["<think>", "Let", " me", " see", "</think>", "\n\n", "Hi", "."], 5),
    # no thought at all
    (["Hello", " there", "."], 0),
    # the close spelled over two tokens, the answer starting in the second
    (["<think>", "hmm", "</th", "ink>Hi", " there"], 4),
    # text before the open in the token that starts it: that token reaches into the block
    (["Hi", "<th", "ink>", "a", "</think>"], 4),
    # opened and closed in one token
    (["A", "<think>x</think>", "B"], 1),
    # never closed: every token from the open on
    (["<think>", "a", "b", "c"], 4),
    # two blocks
    (["<think>", "a", "</think>", "b", "<think>", "c", "</think>", "d"], 6),
    # the token that closes one block opens the next: counted once
    (["<think>", "a", "</think><th", "ink>", "b", "</think>", "c"], 6),
    (["<think>", "a", "</think><think>", "b", "</think>"], 5),
    (["A", "<think>x</think><think>", "y", "</think>", "B"], 3),
])
def test_think_blocks(texts: list[str], want: int) -> None:
    assert count(THINK, texts) == want


def test_a_marker_spelled_in_other_tokens_and_ending_inside_one() -> None:
    """Under a grammar a model may write ``thought`` as any tokens it allows, and go on
    with the thought in the token that ends it."""
    texts = ["<|channel>", "th", "ou", "g", "h", "ton", " al", "<channel|>", "Paris", "!"]
    assert count(GEMMA, texts) == 8


def test_the_prompt_opened_the_block() -> None:
    assert count(THINK, ["still", " thinking", "</think>", "Answer"], inside=True) == 3
    assert count(THINK, ["Answer"], inside=True) == 1  # cut before it closed


def test_harmony_analysis_then_final() -> None:
    texts = ["<|channel|>", "analysis", "<|message|>", "Need", " weather", "<|end|>",
             "<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "Sunny", "."]
    assert count(HARMONY, texts) == 6
    # A commentary call after the analysis is not reasoning either.
    call = ["<|channel|>", "analysis", "<|message|>", "x", "<|end|>", "<|start|>",
            "assistant", "<|channel|>", "commentary", " to=functions.f", "<|message|>", "{}"]
    assert count(HARMONY, call) == 5


def test_a_long_answer_keeps_only_a_markers_length() -> None:
    counter = ReasoningCount(THINK)
    for _ in range(10_000):
        counter.take("word <thin")
    assert counter.tokens == 0
    assert len(counter._text) < len(THINK.start) and len(counter._lengths) <= 2


def test_what_counts_as_marker_text() -> None:
    assert THINK.within("<think>") and THINK.within("</") and not THINK.within("Hello")
    with pytest.raises(ValueError):
        ReasoningMarkers("", "</think>")
