"""Tool calls out of the model's text, streamed as they are written.

The model writes calls in its family's markup (Hermes/Qwen ``<tool_call>{json}</tool_call>``,
Qwen3-coder XML, Mistral, pythonic, …). For the JSON format the call's header (name) is
recognised as soon as it is complete and the arguments are forwarded fragment by fragment
as the model produces them, so a client sees arguments stream; the concatenated fragments
are exactly the arguments' JSON text. Other formats are parsed whole at their end marker
with mlx-lm's parser for that family. Markup never reaches ``content``; a call that cannot
be parsed is returned as text rather than dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from afmd.core.request import ToolCall
from afmd.output.markers import partial_suffix
from afmd.output.pieces import Content, Piece, ToolCallArguments, ToolCallStart

_OUTSIDE, _HEAD, _ARGS, _AFTER_ARGS, _WHOLE = range(5)
_WS = " \t\r\n"


class _JsonValueEnd:
    """Finds where a JSON object/array ends, fed incrementally."""

    __slots__ = ("depth", "done", "escape", "in_string")

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.done = False

    def feed(self, text: str) -> int:
        """How many characters of ``text`` belong to the value (all, until it closes)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


_PARTIAL = ("partial", 0, 0, 0)
_FAIL = ("fail", 0, 0, 0)


def _match_header(text: str) -> tuple[str, int, int, int]:
    """Match ``{"name": "<str>", "arguments":`` at the start of ``text``.

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
    for literal in (",", '"arguments"', ":"):
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
        *,
        new_id: Callable[[], str],
        parse: Callable[[str, Any], Any] | None = None,
        tools: Any = None,
        incremental_json: bool = True,
        max_calls: int | None = None,
    ) -> None:
        self._start = start
        self._end = end
        self._new_id = new_id
        self._parse = parse
        self._tools = tools
        self._incremental = incremental_json
        self._max_calls = max_calls
        self._buf = ""
        self._state = _OUTSIDE
        self._scan = _JsonValueEnd()
        # The call whose arguments are streaming: (id, name) and its arguments so far.
        self._open: tuple[str, str] | None = None
        self._arguments = ""
        self.calls: list[ToolCall] = []  # complete calls, in order

    @property
    def saturated(self) -> bool:
        """The turn has as many calls as allowed; anything more would be dropped."""
        return self._max_calls is not None and len(self.calls) >= self._max_calls

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
                verdict, name_start, name_end, value_start = _match_header(self._buf)
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
                self._open = (self._new_id(), name)
                self._arguments = ""
                out.append(ToolCallStart(len(self.calls), self._open[0], name))
                self._buf = self._buf[value_start:]
                self._scan = _JsonValueEnd()
                self._state = _ARGS
            elif state == _ARGS:
                if not self._buf:
                    break
                n = self._scan.feed(self._buf)
                fragment, self._buf = self._buf[:n], self._buf[n:]
                self._arguments += fragment
                out.append(ToolCallArguments(len(self.calls), fragment))
                if not self._scan.done:
                    break
                self._state = _AFTER_ARGS
            elif state == _AFTER_ARGS:
                i = self._buf.find(self._end)
                if i == -1:
                    break
                self._close()
                self._buf = self._buf[i + len(self._end):]
                self._state = _OUTSIDE
            else:  # _WHOLE
                # A format without an end marker (Mistral) runs to the end of generation.
                i = self._buf.find(self._end) if self._end else -1
                if i == -1:
                    break
                raw = self._buf[:i]
                self._buf = self._buf[i + len(self._end):]
                self._state = _OUTSIDE
                out.extend(self._whole_call(raw))
        return out

    def _close(self) -> None:
        """The streaming call is complete (or cut off): it joins ``calls``, frozen."""
        assert self._open is not None
        call_id, name = self._open
        self.calls.append(ToolCall(call_id, name, self._arguments))
        self._open = None
        self._arguments = ""

    def _whole_call(self, raw: str, end: str | None = None) -> list[Piece]:
        end = self._end if end is None else end
        parsed = _parse_whole(raw, self._parse, self._tools)
        if not parsed:
            return [Content(self._start + raw + end)]
        out: list[Piece] = []
        # One block can hold several calls (pythonic ``[a(), b()]``, Mistral's list).
        for name, arguments in parsed:
            if self.saturated:
                break
            call = ToolCall(self._new_id(), name, arguments)
            index = len(self.calls)
            self.calls.append(call)
            out += [ToolCallStart(index, call.id, name), ToolCallArguments(index, arguments)]
        return out

    def flush(self) -> list[Piece]:
        """End of generation: release held text; a streamed unfinished call stays as sent."""
        out: list[Piece] = []
        if self._state == _OUTSIDE:
            if self._buf and not self.saturated:
                out.append(Content(self._buf))
        elif self._open is not None:
            self._close()  # truncated (finish_reason tells)
        elif not self.saturated:
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


def _parse_whole(
    raw: str, parse: Callable[[str, Any], Any] | None, tools: Any
) -> list[tuple[str, str]]:
    """(name, arguments JSON) of each call in one block of call markup; [] if it fails."""
    try:
        parsed = parse(raw, tools) if parse is not None else json.loads(raw.strip())
    except Exception:  # a model's malformed call is data, not a server error
        return []
    items = parsed if isinstance(parsed, list) else [parsed]
    calls: list[tuple[str, str]] = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        arguments = item.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append((item["name"], arguments))
    return calls
