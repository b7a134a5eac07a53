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

from afmd.core.events import Content, Piece
from afmd.core.request import ToolCall
from afmd.output.formats.base import CallContext, parse_whole
from afmd.output.formats.jsonargs import JsonValueEnd
from afmd.output.markers import partial_suffix

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


class ToolCallParser:
    """Splits content text into plain content and tool calls."""

    def __init__(
        self,
        start: str,
        end: str,
        ctx: CallContext,
        *,
        incremental_json: bool = True,
    ) -> None:
        self._start = start
        self._end = end
        self._ctx = ctx
        self._log = ctx.log
        self._incremental = incremental_json
        self._buf = ""
        self._state = _OUTSIDE
        self._scan = JsonValueEnd()

    @property
    def calls(self) -> list[ToolCall]:
        """The complete calls, in order."""
        return self._log.calls

    @property
    def saturated(self) -> bool:
        """The turn has as many calls as allowed; anything more would be dropped."""
        return self._log.saturated

    def feed(self, text: str) -> list[Piece]:
        if self.saturated:
            return []
        self._buf += text
        out: list[Piece] = []
        while not self.saturated:
            state = self._state
            if state == _OUTSIDE:
                i = self._buf.find(self._start)
                if i == -1:
                    keep = partial_suffix(self._buf, (self._start,))
                    head = self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    if head:
                        out.append(Content(head))
                    break
                if i:
                    out.append(Content(self._buf[:i]))
                self._buf = self._buf[i + len(self._start):]
                self._state = _HEAD if self._incremental else _WHOLE
            elif state == _HEAD:
                verdict, name_start, name_end, value_start = match_header(self._buf)
                if verdict == "partial" and self._end not in self._buf:
                    break
                if verdict != "match" or self._buf[value_start] not in "{[":
                    self._state = _WHOLE
                    continue
                try:
                    name = json.loads(self._buf[name_start:name_end])
                except ValueError:
                    self._state = _WHOLE
                    continue
                if self._ctx.calls_on:
                    out.extend(self._log.open(name))
                self._buf = self._buf[value_start:]
                self._scan = JsonValueEnd()
                self._state = _ARGS
            elif state == _ARGS:
                if not self._buf:
                    break
                n = self._scan.feed(self._buf)
                fragment, self._buf = self._buf[:n], self._buf[n:]
                out.extend(self._log.write(fragment))
                if not self._scan.done:
                    break
                self._state = _AFTER_ARGS
            elif state == _AFTER_ARGS:
                i = self._buf.find(self._end)
                if i == -1:
                    break
                if self._log.streaming:
                    self._log.close()
                self._buf = self._buf[i + len(self._end):]
                self._state = _OUTSIDE
            else:  # _WHOLE
                # A format without an end marker runs to the end of generation.
                i = self._buf.find(self._end) if self._end else -1
                if i == -1:
                    break
                raw = self._buf[:i]
                self._buf = self._buf[i + len(self._end):]
                self._state = _OUTSIDE
                out.extend(self._whole_call(raw))
        return out

    def _whole_call(self, raw: str, end: str | None = None) -> list[Piece]:
        end = self._end if end is None else end
        parsed = parse_whole(raw, self._ctx.parse, self._ctx.tools.raw)
        if not parsed:
            return [Content(self._start + raw + end)]
        out: list[Piece] = []
        if not self._ctx.calls_on:
            return out
        # One block can hold several calls (pythonic ``[a(), b()]``, Mistral's list).
        for name, arguments in parsed:
            out += self._log.whole(name, arguments)
        return out

    def flush(self) -> list[Piece]:
        """End of generation: release held text; a streamed unfinished call stays as sent."""
        out: list[Piece] = []
        if self._state == _OUTSIDE:
            if self._buf and not self.saturated:
                out.append(Content(self._buf))
        elif self._log.streaming:
            self._log.close()  # truncated (finish_reason tells)
        elif not self.saturated and self._state != _AFTER_ARGS:
            # No end marker (a format without one, or generation ended just before it):
            # the call still counts when its text parses whole. A call cut off before it
            # parses is dropped: its markup must never reach content (finish_reason
            # "length" tells the client the turn was cut).
            out.extend(
                p for p in self._whole_call(self._buf, end="") if not isinstance(p, Content)
            )
        self._buf = ""
        self._state = _OUTSIDE
        return out
