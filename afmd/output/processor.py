"""One request's output chain: reasoning → tool calls → stop sequences → content.

Decoded text goes through the same chain whether the response is streamed or not, so a
non-streamed response is exactly the concatenation of what a stream would have sent.
Stop sequences are matched in the answer only, as OpenAI's and Anthropic's APIs match
them: never in the thinking, and never in a tool call, whose markup and arguments are
addressed to a tool and are not the answer's text (a "\n" or "}" stop would otherwise cut
every call, and a grammar-forced call must stay whole). So the reasoning is split first
and the family's call reader reads what is left (harmony's reader splits both at once);
each piece is placed in the model's text, so that ``released`` and ``stop_end`` still say
where a stop lies there. The stops see the text before, between and after the calls, and
never across a thinking block or a call: text held by the stop check is released when
one begins. The reader's pieces come lazily, so nothing after a stop is read: no call
after it opens. Whitespace in the content channel is held while it could still turn out
to be only the padding around a tool call or after a thinking block; it is released as
soon as real text follows.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from afmd.core.events import Content, Piece, Reasoning, ToolCallArguments, ToolCallStart
from afmd.core.request import ToolCall
from afmd.output.formats.base import CallContext, CallLog, MarkupReader, ToolIndex
from afmd.output.formats.registry import Family, family
from afmd.output.reasoning import ReasoningSplitter
from afmd.output.stops import StopScanner
from afmd.output.toolcalls import ToolCallParser


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How a model family writes tool calls.

    ``family``: afmd's reader for it (:mod:`afmd.output.formats.registry`, by mlx-lm's
    parser name); None reads calls between ``start`` and ``end`` with ``parse`` (or, with
    ``incremental_json``, as Hermes JSON streamed as written).
    """

    start: str
    end: str
    parse: Callable[[str, Any], Any] | None = None
    incremental_json: bool = True
    family: str | None = None

    @property
    def reader_family(self) -> Family | None:
        return family(self.family)

    @property
    def channels(self) -> bool:
        """The family's markup carries the reasoning too (harmony's channels)."""
        found = self.reader_family
        return found is not None and found.channels

    @property
    def markers(self) -> tuple[str, ...] | None:
        """Every literal the format's reader reads in the model's text; None where an
        mlx-lm parser afmd has no reader for reads the calls, as it cannot name what that
        parser reads between ``start`` and ``end``."""
        found = self.reader_family
        if found is not None:
            return found.markers
        if self.parse is not None:
            return None
        return tuple(m for m in (self.start, self.end) if m)

    @property
    def start_alone_opens(self) -> bool:
        """Only ``start`` opens a call (the generic reader reads calls between markers)."""
        found = self.reader_family
        return bool(self.start) and (found is None or found.start_alone_opens)


class OutputProcessor:
    def __init__(
        self,
        *,
        stops: tuple[str, ...] = (),
        thinking: tuple[str, str] | None = None,
        starts_in_reasoning: bool = False,
        tool_format: ToolFormat | None = None,
        tools: Any = None,
        max_calls: int | None = None,
        new_id: Callable[[], str] | None = None,
        enforced: bool = False,
        calls_on: bool = True,
        call_offset: int = 0,
    ) -> None:
        """``enforced``: a grammar makes the calls well formed; ``calls_on`` False: the
        format is read for its channels only (tools are off); ``call_offset``: calls
        earlier in the conversation, for families whose call ids count them."""
        self._stops = StopScanner(stops)
        found = tool_format.reader_family if tool_format else None
        self._channels = found is not None and found.channels
        self._reasoning = (
            ReasoningSplitter(thinking[0], thinking[1], in_reasoning=starts_in_reasoning)
            if thinking and not self._channels
            else None
        )
        make_id = new_id or (lambda: "call_0")
        family_id = found.call_id if found is not None else None
        if family_id is not None:
            def ids(name: str, index: int) -> str:
                return family_id(name, call_offset + index)
        else:
            def ids(name: str, index: int) -> str:
                return make_id()
        self._log = CallLog(ids, max_calls)
        # The family's reader: it splits the calls (and, for a channel family, the
        # reasoning) from the answer before the stop check sees it.
        self._reader: MarkupReader | None = None
        if tool_format is not None:
            ctx = CallContext(self._log, ToolIndex(tools), enforced, tool_format.parse,
                              calls_on)
            if found is not None and found.reader is not None:
                self._reader = found.reader(ctx)
            else:
                incremental = found.incremental_json if found else tool_format.incremental_json
                self._reader = ToolCallParser(tool_format.start, tool_format.end, ctx,
                                              incremental_json=incremental)
        # Where each text the reader was fed begins, in its own text and in the fed text
        # (the reasoning splitter takes the thinking out between them).
        self._places: list[tuple[int, int]] = []
        self._pending_ws = ""
        self._content_started = False
        self._fed = 0  # characters of text fed
        self._answer_end = 0  # where the answer's last piece ended, in the fed text
        self._answer_begun = False  # a character other than whitespace went to the stops
        self._stop_at = 0  # where the stop sequence that matched began, in the fed text
        self.released = 0  # characters of fed text the stop check has let through
        #: The output ended inside a call (the token limit or the model's end cut it; a stop
        #: sequence never matches in one): the call is in ``tool_calls`` as written,
        #: unfinished.
        self.cut_call = False

    @property
    def should_stop(self) -> bool:
        """Generation can end now: a stop sequence matched or the call budget is used."""
        return self._stops.stopped or self._log.saturated

    @property
    def stopped_by_sequence(self) -> bool:
        return self._stops.stopped

    @property
    def stop_sequence(self) -> str | None:
        """The stop sequence that matched (None: none did)."""
        return self._stops.matched

    @property
    def stop_end(self) -> int | None:
        """Where the matched stop sequence ends in the fed text (None: none matched): the
        chain may only know a token or more later (its tail could have opened a thinking
        block), and the answer's tokens are those through the one that wrote this."""
        matched = self._stops.matched
        return None if matched is None else self.released + len(matched)

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The complete calls so far, in order (a cut-off one joins at ``finish``)."""
        return self._log.calls

    def call(self, name: str, arguments: str) -> list[Piece]:
        """A call the model reported whole rather than wrote (Apple's framework calls a
        tool object): numbered, given an id and budgeted like a written one."""
        self._pending_ws = ""
        return self._log.whole(name, arguments)

    def feed(self, text: str) -> list[Piece]:
        self._fed += len(text)
        return self._route(text, final=False)

    def finish(self) -> list[Piece]:
        return self._route("", final=True)

    def _route(self, text: str, *, final: bool) -> list[Piece]:
        out: list[Piece] = []
        if self._reasoning is not None:
            spans = self._reasoning.feed(text) if text else []
            if final:
                spans += self._reasoning.flush()
        else:
            spans = [(self._fed - len(text), Content(text))] if text else []
        if not self._stops.stopped:
            # The reader reads no further than the stop (its pieces come lazily), so no
            # call after it opens.
            self._place(spans if self._reader is None else self._read(spans, final), out)
        if final:
            out.extend(self._content(self._stops.flush()))
        self._release()
        if final:
            if self._pending_ws and self._content_started and not self.tool_calls:
                out.append(Content(self._pending_ws))
            self._pending_ws = ""
        return _merge(out)

    def _read(self, spans: list[tuple[int, Piece]], final: bool
              ) -> Iterator[tuple[int, Piece]]:
        """The spans with the answer's text read by the family's reader: its calls apart,
        every piece placed in the fed text."""
        reader = self._reader
        assert reader is not None
        for at, piece in spans:
            if not isinstance(piece, Content):
                # A thinking block: a marker's beginning before it is text after all.
                for where, read in reader.pause():
                    yield from self._placed(where, read)
                yield at, piece
                continue
            if not self._places or self._place_of(reader.fed) != at:
                self._places.append((reader.fed, at))
            for where, read in reader.read(piece.text):
                yield from self._placed(where, read)
        if final:
            self.cut_call = self._log.streaming
            for where, read in reader.read("", final=True):
                yield from self._placed(where, read)

    def _placed(self, where: int, piece: Piece) -> Iterator[tuple[int, Piece]]:
        """A piece the reader placed at its character ``where``, placed in the fed text; a
        text it joined across a thinking block (one read whole) comes in its parts, so
        that no stop spans the block."""
        if isinstance(piece, Content):
            i = bisect_right(self._places, (where, self._fed))
            text = piece.text
            while i < len(self._places) and self._places[i][0] < where + len(text):
                cut = self._places[i][0] - where
                yield self._place_of(where), Content(text[:cut])
                where, text, i = where + cut, text[cut:], i + 1
            piece = Content(text)
        yield self._place_of(where), piece

    def _place_of(self, where: int) -> int:
        """Where the reader's character ``where`` lies in the fed text."""
        i = bisect_right(self._places, (where, self._fed)) - 1
        if i < 0:
            return where
        mine, fed = self._places[i]
        return fed + where - mine

    def _place(self, spans: Iterable[tuple[int, Piece]], out: list[Piece]) -> None:
        """The pieces, each placed in the fed text, into ``out``: the answer's through the
        stop check, which the others (thinking, a call, a channel's markup) interrupt:
        what it held is released when one begins, so no stop spans it. Called only while
        no stop matched: nothing after one is the turn's."""
        for at, piece in spans:
            if not (isinstance(piece, Content) and at == self._answer_end):
                out.extend(self._content(self._stops.flush()))
            if isinstance(piece, Content):
                out.extend(self._answer(at, piece.text))
            else:
                out.extend(self._other(piece))
            if self._stops.stopped:
                break  # taking no more pieces: the reader reads no further

    def _answer(self, at: int, text: str) -> list[Piece]:
        """The answer's ``text`` (starting at ``at`` in the fed text) through the stop
        check."""
        if not self._answer_begun:
            # Whitespace before the answer's first character (the blank lines after
            # ``</think>``) is padding the client never sees: a stop such as "\n" must
            # not end every such answer before it begins.
            lead = len(text) - len(text.lstrip())
            at, text = at + lead, text[lead:]
            self._answer_begun = bool(text)
        held = self._stops.held
        safe = self._stops.feed(text)
        if self._stops.stopped:
            self._stop_at = at - held + len(safe)
        self._answer_end = at + len(text)
        return self._content(safe)

    def _release(self) -> None:
        """How much of the fed text is through the stop check: all of it but what the
        check holds or cut, and what the reasoning splitter or the reader holds (it may
        be answer)."""
        if self._stops.stopped:
            self.released = self._stop_at
        elif self._stops.held:
            self.released = self._answer_end - self._stops.held
        else:
            unsettled = self._reader.unsettled if self._reader is not None else None
            if unsettled is not None:
                self.released = self._place_of(unsettled)
            else:
                self.released = self._fed - (self._reasoning.held if self._reasoning else 0)

    def _content(self, text: str) -> list[Piece]:
        return self._whitespace(text) if text else []

    def _other(self, piece: Piece) -> list[Piece]:
        """A piece that is not the answer's text: thinking, or a call."""
        if not isinstance(piece, Reasoning):
            self._pending_ws = ""  # padding before a call is markup, not content
        return [piece]

    def _whitespace(self, text: str) -> list[Piece]:
        """Hold trailing whitespace; drop leading whitespace of the answer."""
        text = self._pending_ws + text
        stripped = text.rstrip()
        self._pending_ws = text[len(stripped):]
        if not self._content_started:
            stripped = stripped.lstrip()
            if not stripped:
                return []
            self._content_started = True
        return [Content(stripped)] if stripped else []


def _merge(pieces: list[Piece]) -> list[Piece]:
    """Join neighbouring pieces of one channel (fewer, larger deltas); a call's first
    argument fragment rides with its header, as OpenAI's first tool-call delta does."""
    out: list[Piece] = []
    for piece in pieces:
        last = out[-1] if out else None
        if isinstance(piece, Content) and isinstance(last, Content):
            out[-1] = Content(last.text + piece.text)
        elif isinstance(piece, Reasoning) and isinstance(last, Reasoning):
            out[-1] = Reasoning(last.text + piece.text)
        elif isinstance(piece, ToolCallArguments) and isinstance(last, ToolCallStart) \
                and last.index == piece.index:
            out[-1] = ToolCallStart(last.index, last.id, last.name,
                                    last.arguments + piece.fragment)
        elif isinstance(piece, ToolCallArguments) and isinstance(last, ToolCallArguments) \
                and last.index == piece.index:
            out[-1] = ToolCallArguments(last.index, last.fragment + piece.fragment)
        else:
            out.append(piece)
    return out
