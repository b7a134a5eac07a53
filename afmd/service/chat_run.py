"""One chat turn from its slot to its last event, as a loop that reads as it runs.

Each round generates and reads the model's output back into events; a transient model
failure before anything reached the client (and before any tool ran) is retried; when the
round's only calls are to server tools, the tool loop runs them and the next round
generates with their results; otherwise the turn finishes. The run is an async iterator of
event batches (one per engine wake-up, so a stream sends one write per batch, not per
token); the last batch ends with :class:`~afmd.core.events.Finish` and
:class:`~afmd.core.events.Usage`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from afmd.core.events import Event, Finish, Profile, Timings, Usage
from afmd.core.request import ChatRequest, ToolCall
from afmd.engine.batch.tokens import token_table
from afmd.engine.generation import Finished, Generation, GenerationRequest, SamplingParams
from afmd.engine.models.loaded_model import LoadedModel
from afmd.errors import APIError, request_timeout_error
from afmd.service import profiling
from afmd.service.output_plan import OutputPlan
from afmd.service.round_builder import Round, RoundBuilder
from afmd.service.round_reader import RoundReader
from afmd.service.run_control import RunControl, RunPolicy
from afmd.service.scheduler import Ticket
from afmd.service.servertools import ServerTools
from afmd.service.toolloop import ToolLoop

if TYPE_CHECKING:
    from afmd.engine.batch.penalties import LogitsProcessor

__all__ = ["ChatRun", "PreparedChat"]


@dataclass(slots=True)
class PreparedChat:
    """A request ready to run: its model, its first round, what its response reports."""

    request_id: str
    rounds: RoundBuilder
    round: Round  # the first round, which the response headers describe
    max_tokens: int | None  # the client's, for all rounds together
    model_name: str  # what the response reports: the name the client asked for
    fingerprint: str
    deadline: float  # time.monotonic() by which the whole request must be done
    received_at: float  # time.perf_counter() when the request arrived
    profile: str | None = None  # "summary" | "extended"
    load_seconds: float = 0.0  # spent waiting for the model before the turn was prepared

    @property
    def model(self) -> LoadedModel:
        return self.rounds.model

    @property
    def plan(self) -> OutputPlan:
        return self.round.plan

    @property
    def prompt(self) -> list[int]:
        return self.round.prompt

    @property
    def trimmed(self) -> int:
        return self.round.trimmed

    @property
    def trimmed_prefix(self) -> int:
        return self.round.trimmed_prefix


@dataclass(slots=True)
class _Totals:
    """Token counts over every round of the run."""

    prompt: int = 0
    completion: int = 0
    cached: int = 0
    cached_disk: int = 0
    reasoning: int = 0
    accepted: int = 0  # prediction tokens (the first round's: the only one with it)
    rejected: int = 0
    speculation: dict[str, dict[str, int]] = field(default_factory=dict)
    prefill_s: float = 0.0  # each round's start to its first token
    decode_s: float = 0.0  # each round's first token to its end

    def add(self, event: Finished) -> None:
        t = event.timings
        self.prefill_s += max(0.0, t["first_token_at"] - t["started_at"])
        self.decode_s += max(0.0, t["finished_at"] - t["first_token_at"])
        self.prompt += event.prompt_tokens
        self.completion += event.completion_tokens
        self.cached += event.cached_tokens
        self.cached_disk += event.cached_disk_tokens
        self.reasoning += event.reasoning_tokens
        self.accepted += event.accepted_prediction_tokens
        self.rejected += event.rejected_prediction_tokens
        profiling.add_speculation(self.speculation, event.speculation)

    def usage(self) -> Usage:
        return Usage(self.prompt, self.completion, self.cached, self.reasoning,
                     self.accepted, self.rejected)


class ChatRun:
    """One turn's run; iterate it (once) for its batches of events."""

    def __init__(self, prepared: PreparedChat, policy: RunPolicy, tools: ServerTools, *,
                 choice: int = 0) -> None:
        self.prepared = prepared
        self.choice = choice  # which of the request's ``n`` choices (its seed's offset)
        self.round = prepared.round
        self.ticket = Ticket()
        self.generation: Generation | None = None
        self.finished = False
        self.finish_reason: str | None = None  # once finished
        self.usage: Usage | None = None  # once finished
        limit = prepared.round.request.max_server_tool_calls
        self._tools = ToolLoop(tools, max_rounds=policy.max_tool_rounds,
                               max_calls=policy.max_tool_calls if limit is None
                               else min(limit, policy.max_tool_calls))
        self._totals = _Totals()
        # The last round's prompt and the ids its generation wrote (see token_ids).
        self._ran: list[int] | None = None
        # The current round's processors: its grammar's matcher says afterwards whether
        # it was followed to the end.
        self._processors: list[LogitsProcessor] = []
        # The server tools of a round being run (None: none are): a cancel or the deadline
        # stops them, a tool's process with them.
        self._running_tools: asyncio.Task[ChatRequest] | None = None
        self._control = RunControl(policy, prepared.request_id, prepared.deadline,
                                   stop=self._stop, fail=self._fail)
        self._events = self._run()

    @property
    def attempt(self) -> int:
        """Retries made."""
        return self._control.attempt

    @property
    def token_ids(self) -> list[int] | None:
        """The ids the model last ran and wrote: the last round's prompt, then what its
        generation wrote through the answer's end (its end-of-sequence token included,
        a stop sequence's overrun not). A client that sends them back as the start of
        its next prompt continues this conversation, and the prefix cache resumes it.
        None: nothing was generated, or the engine gives no ids (vision, Apple's)."""
        return self._ran

    def __aiter__(self) -> AsyncGenerator[list[Event], None]:
        return self._events

    async def _run(self) -> AsyncGenerator[list[Event], None]:
        if self.generation is None:  # cancelled while queued
            yield self._end("cancelled", None)
            return
        while True:
            # Generate, reading events as they come; retry a transient failure.
            reading = self._reading()
            finished: Finished | None = None
            while finished is None:
                assert self.generation is not None
                try:
                    self._control.check()
                    events = await self.generation.next_events()
                    self._control.check()
                except APIError as exc:
                    if not await self._retry(exc):
                        raise
                    if self._control.cancelled:  # in the back-off: no new attempt
                        yield self._end("cancelled", None)
                        return
                    reading = self._reading()
                    continue
                out, finished = reading.read(events)
                if finished is None and out:
                    self._control.emitted = True
                    yield out
            # The round is over: run the server tools it called and go again, or finish.
            self._totals.add(finished)
            written = finished.output_ids
            self._ran = None if written is None else [*self.round.prompt, *written]
            reason, server_calls = await self._settle(reading, finished)
            if not server_calls:
                stop = reading.output.stop_sequence if reason == "stop" else None
                yield out + self._end(reason, finished, stop)
                return
            if out:
                self._control.emitted = True
                yield out
            request = await self._run_tools(server_calls)
            going_on = request is not None and not self._control.cancelled
            if request is not None and going_on:
                self.round = await self.prepared.rounds.next(request)
                going_on = not self._control.cancelled  # none starts after a cancel
            if not going_on:
                yield self._end("cancelled", finished)
                return
            self.start_generation()

    async def _settle(self, reading: RoundReader,
                      finished: Finished) -> tuple[str, list[ToolCall]]:
        """The round's finish reason; the server calls to run before the next (none: done).

        A structured answer is checked against its schema off the event loop: jsonschema
        is pure Python, and a long answer against a large ``enum`` (each value compared in
        turn) held every other request for seconds."""
        reason = reading.reason(finished, cancelled=self._control.cancelled)
        if reason != "cancelled":
            self.round.plan.check_grammar(self._processors)
        client, server = self._tools.split(reading.output.tool_calls)
        if server and not client and reason == "stop":
            left = self._tokens_left()
            if left is None or left >= 1:
                return reason, server
            return "length", []  # max_tokens bounds all rounds together
        if client and reason == "stop" and not reading.output.cut_call:
            # A call the turn ended inside is not one to run: "stop" says so, as
            # "length" does for the token limit (a stop sequence never cuts a call).
            reason = "tool_calls"
        # An answer a client's stop sequence cut is the text the client asked for: only
        # one the model ended itself must be whole.
        if (reason == "stop" and reading.answer is not None
                and reading.output.stop_sequence is None):
            await asyncio.to_thread(self.round.plan.check_answer, "".join(reading.answer))
        return reason, []

    async def _run_tools(self, calls: list[ToolCall]) -> ChatRequest | None:
        """The next round's request, the server calls' results in it; None: the run was
        cancelled while they ran, and what still ran was stopped (a tool's process killed),
        not waited for up to its timeout. The deadline stops them too: its 504, at once."""
        task = asyncio.ensure_future(
            self._tools.run(self.round.request, calls, self._tokens_left()))
        self._running_tools = task
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not task.cancelled() or (current is not None and current.cancelling()):
                raise  # the request itself is being cancelled (its client left)
            self._control.check()
            return None
        finally:
            self._running_tools = None

    def _reading(self) -> RoundReader:
        table = None
        if self.round.request.logprobs is not None:
            table = token_table(self.prepared.model.tokenizer)
        return RoundReader(self.round.plan, self._tools.view(), self._stop_generation, table)

    async def _retry(self, exc: APIError) -> bool:
        """Retry a transient model failure if nothing reached the client and no tool ran."""
        if not self._control.may_retry(exc, tools_ran=self._tools.ran):
            return False
        await self._control.back_off()
        if not self._control.cancelled:
            # Cancelled while it waited, nothing is submitted: a generation submitted and
            # cancelled after would be the engine's to drop, and its worker may step it
            # once first (a transient failure again becomes the 500 a cancel must not be).
            self.start_generation()
        return True

    def _tokens_left(self) -> int | None:
        """What the client's max_tokens leaves for further rounds (None: no limit)."""
        limit = self.prepared.max_tokens
        return None if limit is None else limit - self._totals.completion

    def _end(
        self, reason: str, finished: Finished | None, stop_sequence: str | None = None
    ) -> list[Event]:
        """The last events: finish reason (with the stop sequence that matched, if one
        did), usage over all rounds, the profile if asked."""
        if finished is None:  # never generated
            usage = Usage(prompt_tokens=len(self.prepared.prompt), completion_tokens=0)
        else:
            usage = self._totals.usage()
        self.finished = True
        self.finish_reason = reason
        self.usage = usage
        timings = Timings(time.perf_counter() - self.prepared.received_at,
                          self.prepared.load_seconds, self._totals.prefill_s,
                          self._totals.decode_s)
        out: list[Event] = [timings, Finish(reason, stop_sequence), usage]
        if self.prepared.profile is not None and finished is not None:
            out.append(Profile(_profile(self.prepared, self._totals, finished)))
        return out

    # -- control --
    def start_generation(self) -> None:
        self._control.arm()
        self._processors = self.round.plan.logits_processors()
        self.generation = self.prepared.model.start(
            _generation(self.prepared, self.round, self.choice, self._tools.run_one,
                        self._processors))
        if self._control.cancelled:
            # Cancelled since the last generation ended (a retry's back-off, the next
            # round's preparation): this one ends at once, and the run as "cancelled".
            self.prepared.model.cancel(self.generation)

    def cancel(self) -> None:
        """Stop for good (client cancel or disconnect; also when the response is over)."""
        self._control.cancel()

    def _stop(self) -> None:
        """Stop what runs: the generation, or the round's server tools."""
        self._stop_generation()
        if self._running_tools is not None:
            self._running_tools.cancel()

    def _stop_generation(self) -> None:
        if self.generation is None:
            self.ticket.cancel()
        elif not self.generation.done:
            self.prepared.model.cancel(self.generation)

    def _fail(self) -> None:
        """The deadline passed: the consumer wakes with the 504 even mid-prefill."""
        if self.generation is not None:
            self.generation.fail(request_timeout_error())


def _generation(prepared: PreparedChat, rnd: Round, choice: int,
                run_tool: Callable[[str, str], Coroutine[Any, Any, str]],
                processors: list[LogitsProcessor]) -> GenerationRequest:
    r = rnd.request
    return GenerationRequest(
        request_id=prepared.request_id,
        prompt=rnd.prompt,
        max_tokens=rnd.max_tokens,
        sampling=SamplingParams.of(r, choice),
        logits_processors=processors,
        sample_every=profiling.SAMPLE_EVERY if prepared.profile == "extended" else 0,
        reasoning=rnd.plan.reasoning,
        starts_in_reasoning=rnd.plan.starts_in_reasoning,
        logprobs=r.logprobs,
        hidden_ids=rnd.plan.hidden_ids,
        vision=rnd.vision,
        # What the client predicted is this turn's answer: later rounds (after server
        # tools) write something else.
        prediction=r.prediction if rnd is prepared.round else None,
        conversation=rnd.conversation,
        run_tool=run_tool if rnd.conversation is not None else None,
    )


def _profile(prepared: PreparedChat, totals: _Totals, finished: Finished) -> dict[str, Any]:
    """The profile over all rounds' tokens, timed by the last round's engine timings."""
    assert prepared.profile is not None
    t = finished.timings
    return profiling.payload(prepared.profile, profiling.ProfileInput(
        prompt_tokens=totals.prompt,
        cached_tokens=totals.cached,
        cached_disk_tokens=totals.cached_disk,
        completion_tokens=totals.completion,
        received_at=prepared.received_at,
        started_at=t["started_at"],
        first_token_at=t["first_token_at"],
        finished_at=t["finished_at"],
        peak_memory_bytes=finished.peak_memory_bytes,
        bytes_per_token=prepared.model.weights_bytes or None,
        accepted_prediction_tokens=totals.accepted,
        rejected_prediction_tokens=totals.rejected,
        speculation=totals.speculation,
    ), finished.samples)

