"""A prompt far longer than its context window, refused at a cost bounded by the window.

A body may hold up to ``max_request_body_bytes`` (16 MiB) of text, and a fast tokenizer
encoding a text whole keeps, per token, its id, its string, its offsets and masks, and
per byte the alignments of the normalized text, then hands Python a list of every id
while holding the GIL: a message of many megabytes cost gigabytes and tens of seconds of
a core only to find it was many times the window, and the work went on past the
request's deadline on a thread nothing stops. A prompt so long that it could not fit however long
its tokens are is counted in pieces instead, and counting stops once it is clearly past
the window; only a prompt that may fit is encoded whole, exactly as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["PromptTooLong", "check_bound", "encode_prompt", "first_part", "may_be_past"]

#: Characters per token of the window a text may have before it is counted in pieces
#: first: prose and code are 3 to 5, so a prompt that fits is almost never counted twice.
CHARS_PER_TOKEN = 8
#: Characters of one piece counted at a time: small enough that a piece's encoding is
#: small, large enough that the tokens cut at piece ends are a rounding error.
PIECE_CHARS = 1 << 16
#: How far past the window the count goes before it stops: the pieces' count can differ
#: from the whole's by a token or two a piece (a prefix space added to each piece), so
#: a prompt counted past twice the window is past it whatever the cuts did.
OVERSHOOT = 2
#: Tokens a cut may add to the count (a SentencePiece-style tokenizer's leading space),
#: taken off again so that the count reported is one the whole text has.
_PER_CUT = 2
#: How far back from a piece's end a cut looks for whitespace (a cut between a word and
#: the space after it is a boundary of every common pre-tokenizer).
_CUT_BACK = 256


class PromptTooLong(Exception):
    """A prompt's text holds more than ``OVERSHOOT`` times the tokens asked for."""

    def __init__(self, at_least: int) -> None:
        super().__init__(f"at least {at_least} tokens")
        #: Tokens the prompt holds at least (what was counted before counting stopped).
        self.at_least = at_least


def encode_prompt(tokenizer: Any, text: str, bound: int | None) -> list[int]:
    """``text``'s token ids, as ``tokenizer.encode`` gives them without special tokens;
    :class:`PromptTooLong` when ``bound`` is given and the text clearly holds more than
    ``OVERSHOOT`` times ``bound`` tokens, found by encoding only about that many."""
    if bound is not None:
        check_bound(tokenizer, text, bound)
    return list(tokenizer.encode(text, add_special_tokens=False))


def may_be_past(text: str, bound: int) -> bool:
    """Whether ``text`` is long enough that it may be far past ``bound`` tokens: one that
    is not is encoded whole at no risk."""
    return len(text) > max(bound, PIECE_CHARS) * CHARS_PER_TOKEN


def first_part(text: str, bound: int) -> str:
    """The start of ``text`` that holds its first ``bound`` tokens, for a text cut to
    ``bound`` tokens anyway (Ollama's ``truncate``): encoding the rest only to throw it
    away cost what encoding a prompt far past the window did. Only a text whose tokens
    average more than ``OVERSHOOT * CHARS_PER_TOKEN`` characters loses some of those."""
    if not may_be_past(text, bound):
        return text
    return text[: max(bound, PIECE_CHARS) * CHARS_PER_TOKEN * OVERSHOOT]


def check_bound(tokenizer: Any, text: str, bound: int) -> None:
    """:class:`PromptTooLong` when ``text`` clearly holds more than ``OVERSHOOT`` times
    ``bound`` tokens, found by encoding only about that many; nothing otherwise."""
    if may_be_past(text, bound):
        counted = 0
        for cuts, piece in enumerate(_pieces(text)):
            counted += len(tokenizer.encode(piece, add_special_tokens=False))
            if counted > OVERSHOOT * bound:
                raise PromptTooLong(counted - _PER_CUT * cuts)


def _pieces(text: str) -> Iterator[str]:
    """``text`` in consecutive pieces of about :data:`PIECE_CHARS`, each cut before a
    whitespace character that follows a non-whitespace one where there is one near."""
    start, n = 0, len(text)
    while start < n:
        end = min(start + PIECE_CHARS, n)
        if end < n:
            for cut in range(end, max(end - _CUT_BACK, start + 1), -1):
                if text[cut].isspace() and not text[cut - 1].isspace():
                    end = cut
                    break
        yield text[start:end]
        start = end
