"""What every call format's reader shares: the turn's calls, a text buffer, the tools.

A model family writes its calls in its own markup; what a client receives is the same
whatever the family: each call's start (id and name) as soon as the name is known, then
its arguments as a JSON text in fragments whose concatenation is exactly the final
``arguments``. :class:`CallLog` keeps that promise (numbering, ids, the call budget, the
call streaming now); :class:`MarkupReader` is the buffer and the small scanning
primitives each family's state machine is written with, so that a marker split across
any number of chunks is recognised the same as a whole one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from afmd.core.events import Content, Piece, Reasoning, ToolCallArguments, ToolCallStart
from afmd.core.request import ToolCall
from afmd.output.markers import earliest, partial_suffix

_WS = " \t\r\n"
#: What a tool's name may look like in markup (OpenAI's names, plus dots and colons some
#: families put in a namespace): anything else means the text is not a call after all.
NAME = re.compile(r"[A-Za-z0-9_.:\-/]{1,128}")


def is_name(text: str) -> bool:
    return NAME.fullmatch(text) is not None


class CallLog:
    """The turn's calls: complete ones in order, and the one whose arguments stream now."""

    __slots__ = ("_arguments", "_ids", "_max", "_open", "calls")

    def __init__(self, new_id: Callable[[str, int], str], max_calls: int | None) -> None:
        self._ids = new_id
        self._max = max_calls
        self._open: tuple[str, str] | None = None
        self._arguments: list[str] = []
        self.calls: list[ToolCall] = []

    @property
    def saturated(self) -> bool:
        """As many calls as the turn may have: anything more is dropped."""
        return self._max is not None and len(self.calls) >= self._max

    @property
    def streaming(self) -> bool:
        return self._open is not None

    @property
    def written(self) -> str:
        """The open call's arguments so far."""
        return "".join(self._arguments)

    def open(self, name: str) -> list[Piece]:
        assert self._open is None, "a call opened inside another"
        index = len(self.calls)
        self._open = (self._ids(name, index), name)
        self._arguments = []
        return [ToolCallStart(index, self._open[0], name)]

    def write(self, fragment: str) -> list[Piece]:
        if not fragment or self._open is None:
            return []
        self._arguments.append(fragment)
        return [ToolCallArguments(len(self.calls), fragment)]

    def close(self) -> None:
        """The streaming call is complete (or cut off): it joins ``calls``, frozen."""
        assert self._open is not None
        call_id, name = self._open
        self.calls.append(ToolCall(call_id, name, "".join(self._arguments)))
        self._open = None
        self._arguments = []

    def whole(self, name: str, arguments: str) -> list[Piece]:
        """A call known all at once (parsed whole): its start and its one fragment."""
        if self.saturated:
            return []
        pieces = self.open(name) + self.write(arguments)
        self.close()
        return pieces


class ToolIndex:
    """The request's tools as call readers consult them: a parameter's schema by name."""

    __slots__ = ("_params", "raw")

    def __init__(self, tools: Sequence[Any] | None) -> None:
        self.raw = list(tools or [])
        self._params: dict[str, dict[str, Any]] = {}
        for tool in self.raw:
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                parameters = function.get("parameters")
                self._params[function["name"]] = parameters if isinstance(parameters, dict) \
                    else {}

    def parameters(self, tool: str) -> dict[str, Any]:
        return self._params.get(tool, {})


@dataclass(frozen=True, slots=True)
class CallContext:
    """What a reader is built with, once per turn."""

    log: CallLog
    tools: ToolIndex
    # A grammar forces well-formed calls (values that must be JSON are JSON): values may
    # then be forwarded as written instead of held until they can be checked.
    enforced: bool = False
    # mlx-lm's parser for the family: the fallback for call text the reader cannot
    # follow (it parses whole blocks).
    parse: Callable[[str, Any], Any] | None = None
    calls_on: bool = True  # False: only channels are read (calls are not expected)


class MarkupReader:
    """A buffer with scanning primitives; subclasses implement :meth:`step`.

    ``step`` consumes what it can from ``buf`` and returns True when it made progress (it
    is called again), False when it needs more text. With ``final`` it must make the
    most of what is there: generation has ended.
    """

    def __init__(self, ctx: CallContext) -> None:
        self.ctx = ctx
        self.log = ctx.log
        self.buf = ""
        self.fed = 0  # characters fed
        self.out: list[tuple[int, Piece]] = []
        # Where the block of call markup being read began (set by ``outside``): until the
        # reader is outside again, it may yet be read whole and shown as written.
        self.opened: int | None = None
        self._partial = 0  # what ``outside`` last held while it may begin a marker

    @property
    def at(self) -> int:
        """Where ``buf`` begins in the fed text: scanning only ever consumes its head."""
        return self.fed - len(self.buf)

    @property
    def unsettled(self) -> int | None:
        """Where the fed text that may still come out as content begins (None: none is
        held): the stop sequences are matched in content, so nothing from here on is
        known to be through their check yet."""
        if self.opened is not None:
            return min(self.opened, self.at)
        return self.at if self.buf else None

    # -- the reader protocol

    def read(self, text: str, *, final: bool = False) -> Iterator[tuple[int, Piece]]:
        """The pieces ``text`` completes (with ``final``: all that is left), one step at a
        time, each with where it begins in the fed text (exact for the texts of a family
        whose reader splits the answer from the rest, harmony's: the stop sequences are
        matched there). Lazy: a
        consumer that stops taking pieces (a stop sequence ended the answer) leaves the
        text after them unread, so no call after the stop is opened."""
        self.fed += len(text)
        if not self.log.saturated:
            self.buf += text
            while not self.log.saturated and self.step(final):
                yield from self._take()
            if final and not self.log.saturated:
                self.end()
        if final:
            self.buf = ""
            self.opened = None
        yield from self._take()

    def pause(self) -> list[tuple[int, Piece]]:
        """Text this reader is not fed comes next (a thinking block): what ``outside``
        held only because it may begin a marker cannot now, and is content."""
        if self.opened is None and self._partial and len(self.buf) == self._partial:
            self.content(self.buf, self.at)
            self.buf = ""
        self._partial = 0
        return self._take()

    def step(self, final: bool) -> bool:
        raise NotImplementedError

    def end(self) -> None:
        """Generation ended: settle what is left (an open call is closed as it stands)."""
        if self.log.streaming:
            self.log.close()

    def _take(self) -> list[tuple[int, Piece]]:
        out, self.out = self.out, []
        return out

    # -- emitting (``at``: where the text begins in the fed text; by default where the
    # unread text does, which is where markup-built pieces are placed)

    def _emit(self, pieces: list[Piece]) -> None:
        at = self.at
        self.out.extend((at, piece) for piece in pieces)

    def content(self, text: str, at: int | None = None) -> None:
        if text:
            self.out.append((self.at if at is None else at, Content(text)))

    def reasoning(self, text: str, at: int | None = None) -> None:
        if text:
            self.out.append((self.at if at is None else at, Reasoning(text)))

    def open_call(self, name: str) -> None:
        self._emit(self.log.open(name))

    def write(self, fragment: str) -> None:
        self._emit(self.log.write(fragment))

    def close_call(self) -> None:
        self.log.close()

    def whole(self, raw: str, markup: str) -> None:
        """Call text the reader could not follow: mlx-lm's parser reads it whole; if it
        cannot either, the text is content (markup and all: it was not a call), placed
        where its block began (``markup`` is that text, or less of it when rebuilt)."""
        calls = parse_whole(raw, self.ctx.parse, self.ctx.tools.raw)
        if not calls:
            self.content(markup, self.opened)
            return
        for name, arguments in calls:
            if self.log.saturated:
                break
            self._emit(self.log.whole(name, arguments))

    # -- scanning

    def cut(self, n: int) -> str:
        head, self.buf = self.buf[:n], self.buf[n:]
        return head

    def until(self, marker: str) -> str | None:
        """The text before ``marker``, consumed with it; None while it has not come."""
        i = self.buf.find(marker)
        if i == -1:
            return None
        head = self.buf[:i]
        self.buf = self.buf[i + len(marker):]
        return head

    def outside(self, markers: Sequence[str], final: bool) -> str | None:
        """Release content up to the first of ``markers`` (consumed, and returned); hold a
        tail that may still become one. None: no marker yet."""
        i, marker = earliest(self.buf, markers)
        at = self.at
        if i == -1:
            self.opened = None
            keep = self._partial = 0 if final else partial_suffix(self.buf, markers)
            self.content(self.cut(len(self.buf) - keep), at)
            return None
        self.content(self.cut(i), at)
        self.opened = at + i
        self.cut(len(marker))
        return marker

    def rest_of_block(self, end: str, final: bool) -> tuple[str, bool] | None:
        """The text before ``end`` (consumed with it) and whether ``end`` came: all that is
        left when generation ended without it. None while it may still come."""
        i = self.buf.find(end)
        if i == -1 and not final:
            return None
        rest = self.cut(i if i != -1 else len(self.buf))
        if i != -1:
            self.cut(len(end))
        return rest, i != -1

    def skip_ws(self) -> None:
        self.buf = self.buf.lstrip(_WS)

    def starts(self, markers: Sequence[str]) -> tuple[str | None, bool]:
        """After whitespace: which marker the buffer starts with (consumed), and whether
        it may still (the buffer is a proper prefix of one)."""
        self.skip_ws()
        for marker in markers:
            if self.buf.startswith(marker):
                self.cut(len(marker))
                return marker, False
        return None, any(m.startswith(self.buf) for m in markers)


def parse_whole(
    raw: str, parse: Callable[[str, Any], Any] | None, tools: Any
) -> list[tuple[str, str]]:
    """(name, arguments JSON) of each call in one block of call markup; [] if it fails."""
    import json

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
            try:
                arguments = json.dumps(arguments, ensure_ascii=False)
            except (TypeError, ValueError):
                return []
        calls.append((item["name"], arguments))
    return calls
