"""Streaming text that is exactly ``tokenizer.decode`` of the generated ids.

mlx-lm's streaming detokenizers drop a leading space of the first token, which is what a
chat answer wants and wrong for a raw completion or a fill-in-the-middle, where leading
whitespace (indentation) is the answer. This one decodes a short window of recent tokens
through the tokenizer itself and releases what the newest token added (the window starts
one emission back, so whatever a tokenizer does at a sequence's start, it does to both
sides of the subtraction), holding a token back while it ends inside a UTF-8 character.
The concatenated segments are the decode of all ids.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


class ExactDetokenizer:
    """The :class:`~mlx_lm.tokenizer_utils.StreamingDetokenizer` interface the worker uses
    (``add_token``, ``last_segment``, ``finalize``), with exact text."""

    __slots__ = ("_decode", "_prefix", "_read", "_segment", "tokens")

    def __init__(self, tokenizer: Any) -> None:
        self._decode = tokenizer.decode
        self.tokens: list[int] = []
        self._prefix = 0  # the window's start: context, already released
        self._read = 0  # tokens before this are released
        self._segment = ""

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        self._release(force=False)

    def finalize(self) -> None:
        if self._read < len(self.tokens):
            self._release(force=True)

    @property
    def last_segment(self) -> str:
        segment, self._segment = self._segment, ""
        return segment

    def _release(self, *, force: bool) -> None:
        tokens = self.tokens
        context = self._decode(tokens[self._prefix : self._read]) if self._read > self._prefix \
            else ""
        text = self._decode(tokens[self._prefix :])
        if len(text) <= len(context) and not force:
            return  # nothing visible yet (part of a character, or an empty token)
        if text.endswith(_REPLACEMENT) and not force:
            return
        self._segment += text[len(context) :]
        self._prefix, self._read = self._read, len(tokens)
