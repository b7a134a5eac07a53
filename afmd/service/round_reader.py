"""One round's engine output read back into the client's events.

The engine yields text and an end; the turn's output processor turns text into content,
reasoning and calls; the reader adds what the client sees besides: each call's end as soon
as the next starts (or the round ends), log-probabilities once the stop check released
their text, the server tools' calls hidden (:class:`~afmd.service.toolloop.ClientView`), and the
answer's text kept for a ``json_schema`` check at the end.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from afmd.core.events import Content, Event, Refusal, ToolCallEnd, ToolCallStart
from afmd.core.request import ToolCall
from afmd.engine.batch.tokens import LogprobQueue, TokenTable
from afmd.engine.generation import Event as EngineEvent
from afmd.engine.generation import Finished, Refused, Text, ToolCalled
from afmd.service.output_plan import OutputPlan
from afmd.service.toolloop import ClientView


class RoundReader:
    """One round's engine output read back into the client's events."""

    __slots__ = ("_calls", "_ended", "_ends", "_fed", "_logprobs", "_read", "_stop", "_through",
                 "_view", "answer", "ended_by_us", "output")

    def __init__(
        self, plan: OutputPlan, view: ClientView | None, stop: Callable[[], None],
        table: TokenTable | None = None,
    ) -> None:
        self.output = plan.output_processor()
        # With log-probabilities asked: each token's, once the stop check released its text.
        self._logprobs = LogprobQueue(table) if table is not None else None
        self._calls = self.output.tool_calls  # the parser's own list: it only grows
        self.answer: list[str] | None = [] if plan.json_answer else None
        self.ended_by_us = False  # we stopped generation (stop sequence, call budget)
        self._ended = 0  # calls whose end went out
        self._read = 0  # tokens of the text read so far
        # Tokens through the one whose text made us stop (an event's first token released
        # its text; any others in it released none and came after); None: not stopped so.
        self._through: int | None = None
        self._fed = 0  # characters of text fed to the output processor
        # (where a text event's text ends, tokens through its first) for the text the stop
        # check has not released yet: a stop found later ends in one of these.
        self._ends: deque[tuple[int, int]] = deque()
        self._view = view
        self._stop = stop

    def read(self, events: list[EngineEvent]) -> tuple[list[Event], Finished | None]:
        """The events for the client, and the engine's end when the round ended."""
        out: list[Event] = []
        output = self.output
        for event in events:
            if isinstance(event, Text):
                if self.ended_by_us:
                    continue
                if self._logprobs is not None:
                    self._logprobs.add(event.text, event.logprobs)
                if not event.text:
                    self._read += event.tokens
                    continue
                self._fed += len(event.text)
                self._ends.append((self._fed, self._read + min(event.tokens, 1)))
                out += output.feed(event.text)
                if output.should_stop:
                    self.ended_by_us = True
                    self._through = self._stopped_through(self._read + min(event.tokens, 1))
                    self._stop()
                else:
                    while self._ends and self._ends[0][0] <= output.released:
                        self._ends.popleft()
                self._read += event.tokens
            elif isinstance(event, ToolCalled):
                if self.ended_by_us:
                    continue
                out += output.call(event.name, event.arguments)
                if output.should_stop:
                    self.ended_by_us = True
                    self._stop()
            elif isinstance(event, Refused):
                out.append(Refusal(event.text))
            elif isinstance(event, Finished):
                out += output.finish()
                if self._through is None and output.stopped_by_sequence:
                    # Only the end told: what the chain held completed a stop.
                    self._through = self._stopped_through(self._read)
                self._add_logprobs(out)
                if self._logprobs is not None:
                    self._logprobs.drop()
                if self._through is not None:
                    event = event.stopped_after(self._through)
                return self._deliver(out, cut=output.cut_call), event
        self._add_logprobs(out)
        return self._deliver(out), None

    def _stopped_through(self, read: int) -> int:
        """Tokens through the one whose text completed the stop sequence (``read``: the
        call budget stopped us, or the stop's end is not in text still held)."""
        end = self.output.stop_end
        if end is not None:
            for fed, through in self._ends:
                if fed >= end:
                    return through
        return read

    def _add_logprobs(self, out: list[Event]) -> None:
        if self._logprobs is not None:
            ready = self._logprobs.release(self.output.released)
            if ready is not None:
                out.append(ready)

    def _deliver(self, out: list[Event], *, cut: bool = False) -> list[Event]:
        """``cut``: the round ended inside its last call."""
        if len(self._calls) > self._ended:
            out = self._with_ends(out, self._calls, cut=cut)
        if self._view is not None:
            out = self._view(out)
        if self.answer is not None:
            self.answer.extend(e.text for e in out if isinstance(e, Content))
        return out

    def _with_ends(self, events: list[Event], calls: list[ToolCall], *,
                   cut: bool = False) -> list[Event]:
        """Each newly complete call's end, before the next call starts (``cut``: the last
        one ended with the round, unfinished)."""
        out: list[Event] = []
        for event in events:
            if isinstance(event, ToolCallStart):
                while self._ended < min(event.index, len(calls)):
                    out.append(ToolCallEnd(self._ended, calls[self._ended]))
                    self._ended += 1
            out.append(event)
        while self._ended < len(calls):
            last = self._ended == len(calls) - 1
            out.append(ToolCallEnd(self._ended, calls[self._ended], cut=cut and last))
            self._ended += 1
        return out

    def reason(self, finished: Finished, *, cancelled: bool) -> str:
        if not cancelled and (self.output.stopped_by_sequence or (
            self.ended_by_us and finished.finish_reason == "cancelled"
        )):
            # Our own early end (stop sequence, call budget), not a cancel; a stop sequence
            # wins even when its last token was also the last one max_tokens allowed, and
            # even when only the end told it matched (its tail could have been markup).
            return "stop"
        return finished.finish_reason
