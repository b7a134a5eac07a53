"""A Completions request's run: one generation per prompt, all in one slot, read together.

Every prompt's generation is submitted in the same event-loop turn, so the engine admits
them into one batch; the run holds one queue slot however many prompts there are, and
the route's machinery (cancel by id, the request deadline, the shutdown's interruption,
the profile) treats it as it treats a chat turn. Each batch of events carries one
:class:`~afmd.core.events.Choice` per prompt that progressed; the last ends with the
usage over all of them.

A choice's text is what the model wrote, exactly (no whitespace trimmed, no reasoning
split): only stop sequences cut it, and a token's log-probability goes out once the
stop-sequence check has released the token's text, never for text a stop swallowed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

from afmd.core.events import (
    Choice,
    Content,
    Event,
    Finish,
    Logprobs,
    Profile,
    Timings,
    TokenLogprob,
    Usage,
)
from afmd.engine.batch.detokenize import ExactDetokenizer
from afmd.engine.batch.tokens import LogprobQueue, TokenTable, token_table
from afmd.engine.generation import Event as EngineEvent
from afmd.engine.generation import (
    Finished,
    Generation,
    GenerationRequest,
    PromptLogprobs,
    SamplingParams,
    Text,
)
from afmd.errors import APIError, request_timeout_error
from afmd.output.stops import StopScanner
from afmd.service import profiling
from afmd.service.completion_prompts import CompletionPrompt, PreparedCompletion
from afmd.service.run_control import RunControl, RunPolicy
from afmd.service.scheduler import Ticket


class ChoiceReader:
    """One prompt's engine events read back into its choice's events."""

    __slots__ = ("_base", "_echo", "_logprobs", "_prompt", "_read", "_released", "_scanner",
                 "_stop", "_table", "_tokenizer", "ended_by_us", "finished", "reason")

    def __init__(
        self,
        prompt: CompletionPrompt,
        stops: tuple[str, ...],
        table: TokenTable | None,
        tokenizer: Any,
        stop: Callable[[], None],
        *,
        echo_logprobs: bool,
    ) -> None:
        self._prompt = prompt
        self._scanner = StopScanner(stops)
        self._table = table
        self._tokenizer = tokenizer
        self._stop = stop
        # The echoed prompt goes out first; with its log-probabilities, together with them.
        self._echo = prompt.echo if prompt.echo is not None and not echo_logprobs else None
        self._base = len(prompt.echo or "")  # generated text starts after the echo
        self._released = 0  # characters of generated text the stop check let through
        # Tokens read through the one that completed a stop sequence: an event's first
        # token released its text, any others in it released none and came after.
        self._read = 0
        self._logprobs = LogprobQueue(table) if table is not None else None
        self.ended_by_us = False  # a stop sequence matched: we stopped the generation
        self.finished: Finished | None = None
        self.reason: str | None = None

    def read(self, events: Sequence[EngineEvent], *, cancelled: bool) -> list[Event]:
        out: list[Event] = []
        if self._echo is not None:
            out.append(Content(self._echo))
            self._echo = None
        for event in events:
            if isinstance(event, PromptLogprobs):
                out += [Content(self._prompt.echo or ""), Logprobs(self._echoed(event))]
            elif isinstance(event, Text):
                if self.ended_by_us:
                    continue
                if self._logprobs is not None:
                    self._logprobs.add(event.text, event.logprobs, self._base)
                self._emit(self._scanner.feed(event.text) if event.text else "", out)
                stopped = self._scanner.stopped
                self._read += min(event.tokens, 1) if stopped else event.tokens
                if stopped:
                    self.ended_by_us = True
                    self._stop()
            elif isinstance(event, Finished):
                self._emit(self._scanner.flush(), out)
                if self._logprobs is not None:
                    self._logprobs.drop()
                self.finished = event.stopped_after(self._read) if self.ended_by_us else event
                self.reason = self._reason(event, cancelled)
                out.append(Finish(self.reason))
        return out

    def _emit(self, text: str, out: list[Event]) -> None:
        if text:
            self._released += len(text)
            out.append(Content(text))
        ready = self._logprobs.release(self._released) if self._logprobs is not None else None
        if ready is not None:
            out.append(ready)

    def _echoed(self, event: PromptLogprobs) -> tuple[TokenLogprob, ...]:
        """The prompt's tokens, each with where its text starts in the echoed prompt (the
        BOS afmd added is not in it: it takes no room)."""
        assert self._table is not None
        lead = self._prompt.lead
        detokenizer = ExactDetokenizer(self._tokenizer)
        offset = 0
        out: list[TokenLogprob] = []
        for i, entry in enumerate(event.tokens):
            out.append(self._table.describe(entry, offset))
            if i >= lead:
                detokenizer.add_token(entry.token)
                offset += len(detokenizer.last_segment)
        return tuple(out)

    def _reason(self, finished: Finished, cancelled: bool) -> str:
        if self.ended_by_us and not cancelled and (
            finished.finish_reason == "cancelled" or self._scanner.stopped
        ):
            return "stop"  # our own end at a stop sequence, not a cancel
        return finished.finish_reason


class Generations:
    """A run's generations as one, for code that stops or fails "the" generation (the
    shutdown's interruption, the model's cancel)."""

    __slots__ = ("_all",)

    def __init__(self, generations: list[Generation]) -> None:
        self._all = generations

    @property
    def done(self) -> bool:
        return all(g.done for g in self._all)

    def cancel(self) -> None:
        for generation in self._all:
            generation.cancel()

    def fail(self, error: APIError) -> None:
        for generation in self._all:
            if not generation.done:
                generation.fail(error)


class CompletionRun:
    """One Completions request's run; iterate it (once) for its batches of events."""

    def __init__(self, prepared: PreparedCompletion, policy: RunPolicy) -> None:
        self.prepared = prepared
        self.ticket = Ticket()
        self.generations: list[Generation] = []
        self.finished = False
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self._control = RunControl(policy, prepared.request_id, prepared.deadline,
                                   stop=self._stop_generations, fail=self._fail)
        self._events = self._run()

    @property
    def attempt(self) -> int:
        """Retries made."""
        return self._control.attempt

    @property
    def generation(self) -> Generations | None:
        return Generations(self.generations) if self.generations else None

    def __aiter__(self) -> AsyncGenerator[list[Event], None]:
        return self._events

    async def _run(self) -> AsyncGenerator[list[Event], None]:
        if not self.generations:  # cancelled while queued
            yield self._end([], cancelled_in_queue=True)
            return
        readers = self._readers()
        pending: dict[int, asyncio.Future[list[EngineEvent]]] = {}
        try:
            while True:
                try:
                    batches = await self._next(readers, pending)
                except APIError as exc:
                    if not await self._retry(exc, pending):
                        raise
                    if not self.generations:  # cancelled in the back-off: no new attempt
                        yield self._end([], cancelled_in_queue=True)
                        return
                    readers = self._readers()
                    continue
                out: list[Event] = []
                for index, events in batches:
                    choice = readers[index].read(events, cancelled=self._control.cancelled)
                    if choice:
                        out.append(Choice(index, tuple(choice)))
                if all(r.finished is not None for r in readers):
                    yield out + self._end(readers)
                    return
                if out:
                    self._control.emitted = True
                    yield out
        finally:
            for future in pending.values():
                future.cancel()

    async def _next(
        self, readers: list[ChoiceReader], pending: dict[int, asyncio.Future[list[EngineEvent]]]
    ) -> list[tuple[int, list[EngineEvent]]]:
        """The events of every generation that has some, waiting for at least one."""
        self._control.check()
        active = [i for i, r in enumerate(readers) if r.finished is None]
        out = await _any_events(self.generations, active, pending)
        self._control.check()
        return out

    def _readers(self) -> list[ChoiceReader]:
        prepared = self.prepared
        request = prepared.request
        table = token_table(prepared.model.tokenizer) if request.logprobs is not None else None
        return [
            ChoiceReader(prompt, prepared.stops, table, prepared.model.tokenizer,
                         self._stopper(i), echo_logprobs=request.logprobs is not None)
            for i, prompt in enumerate(prepared.prompts)
        ]

    def _stopper(self, index: int) -> Callable[[], None]:
        def stop() -> None:
            generation = self.generations[index]
            if not generation.done:
                self.prepared.model.cancel(generation)

        return stop

    async def _retry(
        self, exc: APIError, pending: dict[int, asyncio.Future[list[EngineEvent]]]
    ) -> bool:
        """Start over after a transient model failure if nothing reached the client."""
        if not self._control.may_retry(exc):
            return False
        for future in pending.values():
            future.cancel()
        pending.clear()
        self._stop_generations()
        await self._control.back_off()
        if self._control.cancelled:
            # Cancelled while it waited: nothing is submitted. A generation submitted and
            # cancelled after would be the engine's to drop, and its worker may step it
            # once first (a transient failure again becomes the 500 a cancel must not be).
            self.generations = []
        else:
            self.start_generation()
        return True

    def _end(self, readers: list[ChoiceReader], *, cancelled_in_queue: bool = False
             ) -> list[Event]:
        """Every choice's end (when it never ran), the usage over all, the profile."""
        out: list[Event] = []
        if cancelled_in_queue:
            out = [Choice(i, (Finish("cancelled"),)) for i in range(len(self.prepared.prompts))]
            reasons = ["cancelled"]
            usage = Usage(self.prepared.prompt_tokens, 0)
        else:
            reasons = [r.reason or "stop" for r in readers]
            usage = _usage([(r.finished, p.choice == 0) for r, p
                            in zip(readers, self.prepared.prompts, strict=True)
                            if r.finished is not None])
        self.finished = True
        self.finish_reason = "cancelled" if "cancelled" in reasons else reasons[0]
        self.usage = usage
        out += [_timings(self.prepared, readers), usage]
        if self.prepared.profile is not None and not cancelled_in_queue:
            out.append(Profile(_profile(self.prepared, readers, usage)))
        return out

    # -- control --
    def start_generation(self) -> None:
        """Submit every prompt's generation at once: the engine admits them together."""
        self._control.arm()
        model = self.prepared.model
        self.generations = [model.start(_request(self.prepared, p))
                            for p in self.prepared.prompts]
        if self._control.cancelled:  # cancelled meanwhile: they end at once
            self._stop_generations()

    def cancel(self) -> None:
        """Stop for good (client cancel or disconnect; also when the response is over)."""
        self._control.cancel()

    def _stop_generations(self) -> None:
        if not self.generations:
            self.ticket.cancel()
            return
        for generation in self.generations:
            if not generation.done:
                self.prepared.model.cancel(generation)

    def _fail(self) -> None:
        """The deadline passed: every consumer wakes with the 504 even mid-prefill."""
        for generation in self.generations:
            generation.fail(request_timeout_error())


async def _any_events(
    generations: list[Generation], active: list[int],
    pending: dict[int, asyncio.Future[list[EngineEvent]]],
) -> list[tuple[int, list[EngineEvent]]]:
    """The events of each active generation that has some, waiting for at least one: a lone
    generation is awaited as it is; several each get a future, kept in ``pending`` across
    calls until its events are taken."""
    if len(active) == 1 and active[0] not in pending:
        (i,) = active
        events = await generations[i].next_events()
        return [(i, events)]
    for i in active:
        if i not in pending:
            pending[i] = asyncio.ensure_future(generations[i].next_events())
    await asyncio.wait([pending[i] for i in active], return_when=asyncio.FIRST_COMPLETED)
    return [(i, pending.pop(i).result()) for i in active if pending[i].done()]


def _request(prepared: PreparedCompletion, prompt: CompletionPrompt) -> GenerationRequest:
    r = prepared.request
    return GenerationRequest(
        request_id=prepared.request_id,
        prompt=prompt.ids,
        max_tokens=prompt.max_tokens,
        sampling=SamplingParams.of(r, prompt.choice),
        sample_every=profiling.SAMPLE_EVERY if prepared.profile == "extended" else 0,
        logprobs=r.logprobs,
        prompt_logprobs=r.logprobs if r.echo and r.logprobs is not None else None,
        verbatim=True,
        stop_ids=prepared.stop_ids,
        prediction=r.prediction,
    )


def _usage(ends: list[tuple[Finished, bool]]) -> Usage:
    """Completion tokens over every choice; each prompt's tokens once (its first choice's
    count), as OpenAI counts a prompt asked for ``n`` completions."""
    firsts = [e for e, first in ends if first]
    return Usage(sum(e.prompt_tokens for e in firsts),
                 sum(e.completion_tokens for e, _ in ends),
                 sum(e.cached_tokens for e in firsts),
                 accepted_prediction_tokens=sum(e.accepted_prediction_tokens for e, _ in ends),
                 rejected_prediction_tokens=sum(e.rejected_prediction_tokens for e, _ in ends))


def _timings(prepared: PreparedCompletion, readers: list[ChoiceReader]) -> Timings:
    """The choices' phases as one: from the first start to the first token, and from
    there to the last end (they ran together)."""
    total = time.perf_counter() - prepared.received_at
    timings = [r.finished.timings for r in readers if r.finished is not None]
    if not timings:
        return Timings(total, prepared.load_seconds, 0.0, 0.0)
    first = min(t["first_token_at"] for t in timings)
    return Timings(total, prepared.load_seconds,
                   max(0.0, first - min(t["started_at"] for t in timings)),
                   max(0.0, max(t["finished_at"] for t in timings) - first))


def _profile(
    prepared: PreparedCompletion, readers: list[ChoiceReader], usage: Usage
) -> dict[str, Any]:
    """The profile over every choice: from the first start to the last end."""
    assert prepared.profile is not None
    ends = [r.finished for r in readers if r.finished is not None]
    timings = [e.timings for e in ends]
    return profiling.payload(prepared.profile, profiling.ProfileInput(
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens,
        cached_disk_tokens=min(usage.cached_tokens,
                               max((e.cached_disk_tokens for e in ends), default=0)),
        completion_tokens=usage.completion_tokens,
        received_at=prepared.received_at,
        started_at=min(t["started_at"] for t in timings),
        first_token_at=min(t["first_token_at"] for t in timings),
        finished_at=max(t["finished_at"] for t in timings),
        peak_memory_bytes=max((e.peak_memory_bytes or 0 for e in ends), default=None),
        bytes_per_token=prepared.model.weights_bytes or None,
        accepted_prediction_tokens=usage.accepted_prediction_tokens,
        rejected_prediction_tokens=usage.rejected_prediction_tokens,
        speculation=profiling.add_speculation({}, *(e.speculation for e in ends)),
    ), ends[0].samples)
