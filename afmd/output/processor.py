"""One request's output chain: stop sequences → reasoning → tool calls → content.

Decoded text goes through the same chain whether the response is streamed or not, so a
non-streamed response is exactly the concatenation of what a stream would have sent.
Whitespace in the content channel is held while it could still turn out to be only the
padding around a tool call or after a thinking block; it is released as soon as real text
follows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from afmd.core.request import ToolCall
from afmd.output.pieces import Content, Piece, Reasoning, ToolCallArguments, ToolCallStart
from afmd.output.reasoning import ReasoningSplitter
from afmd.output.stops import StopScanner
from afmd.output.toolcalls import ToolCallParser


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How a model family writes tool calls."""

    start: str
    end: str
    parse: Callable[[str, Any], Any] | None = None
    incremental_json: bool = True


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
    ) -> None:
        self._stops = StopScanner(stops)
        self._reasoning = (
            ReasoningSplitter(thinking[0], thinking[1], in_reasoning=starts_in_reasoning)
            if thinking
            else None
        )
        self._tools = (
            ToolCallParser(
                tool_format.start,
                tool_format.end,
                new_id=new_id or (lambda: "call_0"),
                parse=tool_format.parse,
                tools=tools,
                incremental_json=tool_format.incremental_json,
                max_calls=max_calls,
            )
            if tool_format
            else None
        )
        self._pending_ws = ""
        self._content_started = False
        self.released = 0  # characters of fed text the stop check has let through

    @property
    def should_stop(self) -> bool:
        """Generation can end now: a stop sequence matched or the call budget is used."""
        return self._stops.stopped or (self._tools is not None and self._tools.saturated)

    @property
    def stopped_by_sequence(self) -> bool:
        return self._stops.stopped

    @property
    def stop_sequence(self) -> str | None:
        """The stop sequence that matched (None: none did)."""
        return self._stops.matched

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The complete calls so far, in order (a cut-off one joins at ``finish``)."""
        return self._tools.calls if self._tools is not None else []

    def feed(self, text: str) -> list[Piece]:
        safe = self._stops.feed(text)
        self.released += len(safe)
        return self._route(safe, final=False)

    def finish(self) -> list[Piece]:
        rest = self._stops.flush()
        self.released += len(rest)
        return self._route(rest, final=True)

    def _route(self, text: str, *, final: bool) -> list[Piece]:
        if self._reasoning is not None:
            pieces = self._reasoning.feed(text) if text else []
            if final:
                pieces += self._reasoning.flush()
        else:
            pieces = [Content(text)] if text else []
        out: list[Piece] = []
        for piece in pieces:
            if isinstance(piece, Content):
                out.extend(self._content(piece.text))
            else:
                out.append(piece)
        if final:
            if self._tools is not None:
                out.extend(self._after_tools(self._tools.flush()))
            if self._pending_ws and self._content_started and not self.tool_calls:
                out.append(Content(self._pending_ws))
            self._pending_ws = ""
        return _merge(out)

    def _content(self, text: str) -> list[Piece]:
        if self._tools is None:
            return self._whitespace(text)
        return self._after_tools(self._tools.feed(text))

    def _after_tools(self, pieces: list[Piece]) -> list[Piece]:
        out: list[Piece] = []
        for piece in pieces:
            if isinstance(piece, Content):
                out.extend(self._whitespace(piece.text))
            else:
                self._pending_ws = ""  # padding before a call is markup, not content
                out.append(piece)
        return out

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
