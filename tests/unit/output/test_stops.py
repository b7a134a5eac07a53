"""StopScanner: stop sequences over streamed text, whatever the chunking."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afmd.output.stops import StopScanner


def run(stops: Sequence[str], chunks: Iterable[str]) -> tuple[list[str], str, bool]:
    """Feed every chunk; return what each feed emitted, what flush released, and stopped."""
    scanner = StopScanner(tuple(stops))
    emitted = [scanner.feed(chunk) for chunk in chunks]
    return emitted, scanner.flush(), scanner.stopped


def expected(text: str, stops: Sequence[str]) -> str:
    """``text`` cut before the stop that completes first (ties: the one starting first).

    That is ``text[:text.find(stop)]`` for the earliest stop whenever stops do not straddle
    each other; when a long stop starts earlier but ends later than a short one ("abcd" and
    "c" over "xabcd"), generation stops at the short one, so that one is where text ends.
    """
    best: tuple[int, int] | None = None
    for stop in stops:
        i = text.find(stop) if stop else -1
        if i != -1 and (best is None or (i + len(stop), i) < best):
            best = (i + len(stop), i)
    return text if best is None else text[: best[1]]


def safe_len(seen: str, stops: Sequence[str]) -> int:
    """How much of ``seen`` may be emitted: up to the first position where a stop could
    still begin (``seen[p:]`` is a proper prefix of some stop)."""
    for p in range(len(seen)):
        tail = seen[p:]
        if any(len(tail) < len(stop) and stop.startswith(tail) for stop in stops if stop):
            return p
    return len(seen)


def test_no_stops_passes_everything_through() -> None:
    emitted, flushed, stopped = run((), ["a", "b", "</answer>"])
    assert emitted == ["a", "b", "</answer>"]
    assert flushed == ""
    assert not stopped


def test_empty_stop_string_is_ignored() -> None:
    emitted, flushed, stopped = run(("",), ["abc"])
    assert "".join(emitted) + flushed == "abc"
    assert not stopped


@pytest.mark.parametrize("stop", ["</answer>", "\n\n", "STOP", "x"])
def test_stop_split_at_every_point(stop: str) -> None:
    text = f"before {stop} after"
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            emitted, flushed, stopped = run((stop,), [text[:i], text[i:j], text[j:]])
            assert stopped, (i, j)
            assert "".join(emitted) == "before ", (i, j)
            assert flushed == ""


def test_stop_in_single_feed() -> None:
    emitted, flushed, stopped = run(("</a>",), ["hello</a>world"])
    assert emitted == ["hello"]
    assert flushed == ""
    assert stopped


def test_stop_at_very_start() -> None:
    emitted, flushed, stopped = run(("ab",), ["a", "b", "c"])
    assert emitted == ["", "", ""]
    assert flushed == ""
    assert stopped


def test_nothing_after_stop_is_emitted() -> None:
    scanner = StopScanner(("END",))
    assert scanner.feed("xEN") == "x"
    assert scanner.feed("Dyz") == ""
    assert scanner.stopped
    assert scanner.feed("more text") == ""
    assert scanner.flush() == ""


def test_multiple_stops_earliest_wins() -> None:
    stops = ("world", "o w", "ll")  # listed order does not matter, position does
    text = "hello world"
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            emitted, flushed, stopped = run(stops, [text[:i], text[i:j], text[j:]])
            assert stopped
            assert "".join(emitted) == "he", (i, j)
            assert flushed == ""


def test_stop_completing_first_wins_over_one_starting_first() -> None:
    # "abcd" starts before "c" but "c" completes first, and generation stops right there, so
    # the answer must not depend on whether "d" arrived in the same chunk as "c".
    stops = ("abcd", "c")
    text = "xabcdy"
    assert expected(text, stops) == "xab"
    for chunks in (["xabcdy"], ["xabc", "dy"], list(text), ["xa", "bcd", "y"]):
        emitted, flushed, stopped = run(stops, chunks)
        assert stopped
        assert "".join(emitted) + flushed == "xab", chunks


def test_same_end_prefers_earlier_start() -> None:
    emitted, _, stopped = run(("c", "bc"), ["xbcz"])
    assert stopped and emitted == ["x"]


def test_hold_back_never_emits_partial_stop_prefix() -> None:
    stops = ("</answer>", "<|end|>")
    text = "text </ans <|en more <|e"
    scanner = StopScanner(stops)
    emitted = ""
    for i, ch in enumerate(text, 1):
        emitted += scanner.feed(ch)
        # Exactly what can no longer become a stop has been released, nothing more.
        assert emitted == text[: safe_len(text[:i], stops)], text[:i]
    assert emitted == "text </ans <|en more "
    assert scanner.flush() == "<|e"
    assert not scanner.stopped


def test_released_when_match_becomes_impossible() -> None:
    scanner = StopScanner(("</answer>",))
    assert scanner.feed("a</ans") == "a"
    assert scanner.feed("w") == ""
    assert scanner.feed("x") == "</answx"
    assert scanner.feed("y") == "y"


def test_flush_releases_held_text_without_stop() -> None:
    scanner = StopScanner(("</answer>",))
    assert scanner.feed("the end </answ") == "the end "
    assert scanner.flush() == "</answ"
    assert not scanner.stopped
    assert scanner.flush() == ""


def test_flush_after_stop_releases_nothing() -> None:
    scanner = StopScanner(("ab",))
    scanner.feed("xa")
    scanner.feed("b and then a")
    assert scanner.flush() == ""


def test_overlapping_prefixes() -> None:
    stops = ("abab",)
    text = "ababab"
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            emitted, flushed, stopped = run(stops, [text[:i], text[i:j], text[j:]])
            assert stopped
            assert "".join(emitted) == ""
            assert flushed == ""


def test_overlapping_prefix_with_lead_in() -> None:
    # "aab" contains stop "ab" at 1; the first "a" may only be released once it cannot start it.
    stops = ("aab",)
    emitted, flushed, stopped = run(stops, ["a", "a", "a", "b"])
    assert stopped
    assert "".join(emitted) == "a"
    assert flushed == ""
    emitted, flushed, stopped = run(("abac",), ["ab", "ab", "ac"])
    assert stopped and "".join(emitted) == "ab" and flushed == ""


def test_self_overlapping_stop_not_completed() -> None:
    emitted, flushed, stopped = run(("aaa",), ["a", "a", "b", "a", "a"])
    assert not stopped
    assert "".join(emitted) + flushed == "aabaa"
    assert flushed == "aa"


def test_unicode_stops_and_text() -> None:
    stops = ("日本語", "🛑")
    text = "héllo 日本 wörld 日本語 tail"
    for i in range(len(text) + 1):
        emitted, flushed, stopped = run(stops, [text[:i], text[i:]])
        assert stopped
        assert "".join(emitted) == "héllo 日本 wörld ", i
        assert flushed == ""
    emitted, flushed, stopped = run(stops, ["a🛑", "b"])
    assert stopped and emitted == ["a", ""]
    emitted, flushed, stopped = run(stops, ["é日", "本"])
    assert not stopped
    assert emitted == ["é", ""]
    assert flushed == "日本"


# ---------------------------------------------------------------------------- property

_ALPHABET = st.sampled_from(list("ab\n<>/é日"))
_text = st.text(alphabet=_ALPHABET, max_size=40)
_stop = st.text(alphabet=_ALPHABET, min_size=1, max_size=5)


@st.composite
def _chunked(draw: st.DrawFn) -> tuple[str, list[str], tuple[str, ...]]:
    stops = tuple(draw(st.lists(_stop, min_size=0, max_size=3)))
    text = draw(_text)
    # Sometimes plant a stop so that matches are common, not just coincidences.
    if stops and draw(st.booleans()):
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(stops)) + text[at:]
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    return text, chunks, stops


@settings(max_examples=400, deadline=None)
@given(_chunked())
def test_property_output_independent_of_chunking(
    case: tuple[str, list[str], tuple[str, ...]],
) -> None:
    text, chunks, stops = case
    emitted, flushed, stopped = run(stops, chunks)
    want = expected(text, stops)
    assert "".join(emitted) + flushed == want
    assert stopped == any(stop in text for stop in stops)
    # Streaming never got ahead of what is certain: every emitted prefix is a prefix of the
    # final answer.
    so_far = ""
    for out in emitted:
        so_far += out
        assert want.startswith(so_far)
    # One chunk or one character at a time: identical result.
    single, single_flush, _ = run(stops, [text])
    chars, chars_flush, _ = run(stops, list(text))
    assert "".join(single) + single_flush == want
    assert "".join(chars) + chars_flush == want


@settings(max_examples=300, deadline=None)
@given(_chunked())
def test_property_releases_exactly_what_is_safe(
    case: tuple[str, list[str], tuple[str, ...]],
) -> None:
    _, chunks, stops = case
    scanner = StopScanner(stops)
    seen = emitted = ""
    for chunk in chunks:
        seen += chunk
        emitted += scanner.feed(chunk)
        if scanner.stopped:
            assert emitted == expected(seen, stops)
            break
        # No stop completed: no stop is in what was seen, and exactly the part that cannot
        # begin a stop any more has been released (no partial stop, no needless delay).
        assert expected(seen, stops) == seen
        assert emitted == seen[: safe_len(seen, stops)]


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda n: st.lists(st.text(alphabet=_ALPHABET, min_size=n, max_size=n), max_size=3)
    ),
    _text,
    st.data(),
)
def test_property_earliest_stop_wins(stops: list[str], text: str, data: st.DataObject) -> None:
    """Stops of one length cannot straddle: the result is text[:earliest find] exactly."""
    if stops and data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(text)))
        text = text[:at] + data.draw(st.sampled_from(stops)) + text[at:]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    bounds = [0, *cuts, len(text)]
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    found = [i for i in (text.find(stop) for stop in stops) if i != -1]
    want = text[: min(found)] if found else text
    emitted, flushed, stopped = run(stops, chunks)
    assert "".join(emitted) + flushed == want
    assert stopped == bool(found)


def test_long_stops_over_matching_output_cost_per_character() -> None:
    """Sixteen long stops whose beginning the output keeps spelling: the held text grows
    with the output, and searching it again on every token took minutes (every request
    on the server waited); following each stop's state takes a moment."""
    stops = (*(chr(0x4E00 + i) + "A" * 20_000 for i in range(15)), "A" * 20_000 + "b")
    scanner = StopScanner(stops)
    started = time.perf_counter()
    emitted = "".join(scanner.feed("A") for _ in range(3_000))
    assert time.perf_counter() - started < 2.0
    assert emitted == "" and scanner.held == 3_000 and not scanner.stopped
    assert scanner.feed("b") == "A" * 3_000 + "b"  # no stop can complete it any more
