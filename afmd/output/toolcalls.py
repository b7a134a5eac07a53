"""Calls between two markers: Hermes/Qwen ``<tool_call>{json}</tool_call>``, and any
family afmd has no reader of its own for.

For the JSON format the call's header (name) is recognised as soon as it is complete and
the arguments are forwarded fragment by fragment as the model produces them, so a client
sees arguments stream; the concatenated fragments are exactly the arguments' JSON text.
Otherwise a block is parsed whole at its end marker with mlx-lm's parser for the family.
Markup never reaches ``content``; a call that cannot be parsed is returned as text rather
than dropped. (The families with their own markup are in :mod:`afmd.output.formats`.)
"""

from __future__ import annotations

import json

from afmd.core.request import ToolCall
from afmd.output.formats.base import CallContext, MarkupReader, parse_whole
from afmd.output.formats.jsonargs import JsonValueEnd

_OUTSIDE, _HEAD, _ARGS, _AFTER_ARGS, _WHOLE = range(5)
_WS = " \t\r\n"


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


_PARTIAL = ("partial", 0, 0, 0)
_FAIL = ("fail", 0, 0, 0)


def match_header(text: str, key: str = "arguments") -> tuple[str, int, int, int]:
    """Match ``{"name": "<str>", "arguments":`` (or another ``key``) at the start of ``text``.

    Returns ``("match", name_start, name_end, value_start)`` (the name is the JSON string
    ``text[name_start:name_end]``), ``"partial"`` while the text could still become a
    header, or ``"fail"``.
    """
    i = _skip_ws(text, 0)
    for literal in ("{", '"name"', ":"):
        i = _skip_ws(text, i)
        chunk = text[i: i + len(literal)]
        if chunk != literal[: len(chunk)]:
            return _FAIL
        if len(chunk) < len(literal):
            return _PARTIAL
        i += len(literal)
    i = _skip_ws(text, i)
    if i >= len(text):
        return _PARTIAL
    if text[i] != '"':
        return _FAIL
    j = i + 1
    escape = False
    while j < len(text):
        ch = text[j]
        if escape:
            escape = False
        elif ch == "\\":
            escape = True
        elif ch == '"':
            break
        j += 1
    else:
        return _PARTIAL
    name_end = j + 1
    k = name_end
    for literal in (",", f'"{key}"', ":"):
        k = _skip_ws(text, k)
        chunk = text[k: k + len(literal)]
        if chunk != literal[: len(chunk)]:
            return _FAIL
        if len(chunk) < len(literal):
            return _PARTIAL
        k += len(literal)
    k = _skip_ws(text, k)
    if k >= len(text):
        return _PARTIAL  # the value's first character decides the mode
    return "match", i, name_end, k


class ToolCallParser(MarkupReader):
    """Splits content text into plain content and tool calls."""

    def __init__(
        self,
        start: str,
        end: str,
        ctx: CallContext,
        *,
        incremental_json: bool = True,
    ) -> None:
        super().__init__(ctx)
        self._start = start
        self._end = end
        self._incremental = incremental_json
        self._state = _OUTSIDE
        self._scan = JsonValueEnd()

    @property
    def calls(self) -> list[ToolCall]:
        """The complete calls, in order."""
        return self.log.calls

    @property
    def saturated(self) -> bool:
        """The turn has as many calls as allowed; anything more would be dropped."""
        return self.log.saturated

    def step(self, final: bool) -> bool:
        state = self._state
        if state == _OUTSIDE:
            # Final or not: what is held may still be the start marker's beginning; the
            # end (``end``) releases it.
            if self.outside((self._start,), False) is None:
                return False
            self._state = _HEAD if self._incremental else _WHOLE
        elif state == _HEAD:
            verdict, name_start, name_end, value_start = match_header(self.buf)
            if verdict == "partial" and self._end not in self.buf:
                return False
            if verdict != "match" or self.buf[value_start] not in "{[":
                self._state = _WHOLE
                return True
            try:
                name = json.loads(self.buf[name_start:name_end])
            except ValueError:
                self._state = _WHOLE
                return True
            if self.ctx.calls_on:
                self.open_call(name)
            self.cut(value_start)
            self._scan = JsonValueEnd()
            self._state = _ARGS
        elif state == _ARGS:
            if not self.buf:
                return False
            self.write(self.cut(self._scan.feed(self.buf)))
            if not self._scan.done:
                return False
            self._state = _AFTER_ARGS
        elif state == _AFTER_ARGS:
            if self.until(self._end) is None:
                return False
            if self.log.streaming:
                self.log.close()
            self._state = _OUTSIDE
        else:  # _WHOLE
            # A format without an end marker runs to the end of generation.
            i = self.buf.find(self._end) if self._end else -1
            if i == -1:
                return False
            raw = self.cut(i)
            self.cut(len(self._end))
            self._state = _OUTSIDE
            self._whole_call(raw)
        return True

    def _whole_call(self, raw: str, end: str | None = None) -> None:
        end = self._end if end is None else end
        parsed = parse_whole(raw, self.ctx.parse, self.ctx.tools.raw)
        if not parsed:
            if end:  # cut off before its end: its markup must never reach content
                self.content(self._start + raw + end, self.opened)
            return
        if not self.ctx.calls_on:
            return
        # One block can hold several calls (pythonic ``[a(), b()]``, Mistral's list).
        for name, arguments in parsed:
            self._emit(self.log.whole(name, arguments))

    def end(self) -> None:
        """End of generation: release held text; a streamed unfinished call stays as sent."""
        if self._state == _OUTSIDE:
            self.content(self.buf, self.at)
        elif self.log.streaming:
            self.log.close()  # truncated (finish_reason tells)
        elif self._state != _AFTER_ARGS:
            # No end marker (a format without one, or generation ended just before it):
            # the call still counts when its text parses whole. A call cut off before it
            # parses is dropped (finish_reason "length" tells the client the turn was cut).
            self._whole_call(self.buf, end="")
        self._state = _OUTSIDE
