"""A chat turn asked for several choices (``n``): one run per choice, in one slot, read
together.

Each choice is a :class:`~afmd.service.chat_run.ChatRun` of its own (its rounds, its output
reading, its tool loop, its retries) sampling with the request's seed plus its index, so a seeded
request gives the same choices every time and choice ``i`` is what a single request with
``seed + i`` gives. All of them start in the same event-loop turn, so the engine admits
them into one batch, and the request holds one queue slot however many choices it has, as
a Completions request with several prompts does. Every batch of events carries one
:class:`~afmd.core.events.Choice` per choice that progressed (its finish reason inside);
the last ends with the usage over all of them: the prompt once, as OpenAI counts it, the
completion tokens of every choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from afmd.core.events import Choice, Event, Profile, Timings, Usage
from afmd.engine.generation import Generation
from afmd.service.chat_run import ChatRun, PreparedChat
from afmd.service.completion_run import Generations
from afmd.service.run_control import RunPolicy
from afmd.service.scheduler import Ticket
from afmd.service.servertools import ServerTools

#: What a choice's run ends with that is the request's, not the choice's.
_RUN_END = Usage | Timings | Profile


class ChoicesRun:
    """A turn's ``n`` choices; iterate it (once) for its batches of events."""

    def __init__(self, prepared: PreparedChat, policy: RunPolicy, tools: ServerTools,
                 n: int) -> None:
        self.prepared = prepared
        self.ticket = Ticket()
        self.runs = [ChatRun(prepared, policy, tools, choice=i) for i in range(n)]
        self.finished = False
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self._started = False
        self._events = self._run()

    @property
    def attempt(self) -> int:
        return max(run.attempt for run in self.runs)

    @property
    def generations(self) -> list[Generation]:
        """Each choice's current generation (what /metrics times)."""
        return [run.generation for run in self.runs if run.generation is not None]

    @property
    def generation(self) -> Generations | None:
        generations = self.generations
        return Generations(generations) if generations else None

    def __aiter__(self) -> AsyncGenerator[list[Event], None]:
        return self._events

    def start_generation(self) -> None:
        """Every choice's first generation, submitted at once: admitted together."""
        self._started = True
        for run in self.runs:
            run.start_generation()

    def cancel(self) -> None:
        if not self._started:
            self.ticket.cancel()  # still queued: it leaves the queue
        for run in self.runs:
            run.cancel()

    async def _run(self) -> AsyncGenerator[list[Event], None]:
        streams = [aiter(run) for run in self.runs]
        ends: dict[int, list[Event]] = {}  # a finished choice's usage and profile
        pending: dict[int, asyncio.Future[list[Event]]] = {}
        try:
            while len(ends) < len(streams):
                active = [i for i in range(len(streams)) if i not in ends]
                for i in active:
                    if i not in pending:
                        pending[i] = asyncio.ensure_future(anext(streams[i]))
                await asyncio.wait([pending[i] for i in active],
                                   return_when=asyncio.FIRST_COMPLETED)
                out: list[Event] = []
                for i in active:
                    if not pending[i].done():
                        continue
                    batch = pending.pop(i).result()
                    shown = [e for e in batch if not isinstance(e, _RUN_END)]
                    if shown:
                        out.append(Choice(i, tuple(shown)))
                    if self.runs[i].finished:
                        ends[i] = [e for e in batch if isinstance(e, _RUN_END)]
                if len(ends) == len(streams):
                    yield out + self._end(ends)
                    return
                if out:
                    yield out
        finally:
            for future in pending.values():
                future.cancel()
            for stream in streams:
                await _close(stream)

    def _end(self, ends: dict[int, list[Event]]) -> list[Event]:
        usages = [next((e for e in ends[i] if isinstance(e, Usage)), Usage(0, 0))
                  for i in range(len(self.runs))]
        first = usages[0]
        usage = Usage(first.prompt_tokens, sum(u.completion_tokens for u in usages),
                      first.cached_tokens, sum(u.reasoning_tokens for u in usages),
                      sum(u.accepted_prediction_tokens for u in usages),
                      sum(u.rejected_prediction_tokens for u in usages))
        reasons = [run.finish_reason or "stop" for run in self.runs]
        self.finished = True
        self.finish_reason = "cancelled" if "cancelled" in reasons else reasons[0]
        self.usage = usage
        # The timings and profile of the choice that ended last: its span covers the others'.
        last = ends[next(reversed(ends))]
        out: list[Event] = [e for e in last if isinstance(e, Timings)]
        out.append(usage)
        out += [e for e in last if isinstance(e, Profile)]
        return out


async def _close(stream: AsyncGenerator[list[Event], None]) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception:  # a choice that failed already said so through its batch
            return


__all__ = ["ChoicesRun"]
