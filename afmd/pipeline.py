"""From a validated request to a stream of output events, independent of HTTP.

The pipeline owns everything between "the body is valid" and "bytes go out": resolving the
model, rendering the prompt (trimming old turns when the context policy says so), enforcing
the context window before any prefill, and running the generation under the turn's plan
(grammar, output parsing). A request may take several rounds: when the model calls only
server tools, afmd runs them and generates again within the same request and slot; the
client sees the text of every round but never a server tool's call or result. Transient
model failures before anything reached the client are retried. The HTTP layer only frames
what this yields.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from afmd import __version__
from afmd.chat import template_messages
from afmd.config import Config
from afmd.context import droppable_units, without_units
from afmd.core.events import (
    Content,
    Event,
    Finish,
    Piece,
    Profile,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from afmd.core.request import ChatRequest, Message, ToolCall, ToolChoice
from afmd.engine.base import Finished, Generation, GenerationRequest, SamplingParams, Text
from afmd.engine.models import LoadedModel, ModelRegistry
from afmd.errors import (
    APIError,
    ConflictError,
    GatewayTimeoutError,
    InvalidRequestError,
)
from afmd.logs import get_logger
from afmd.profiling import SAMPLE_EVERY, ProfileInput, samples, summary
from afmd.scheduler import Cancelled, Scheduler, Ticket
from afmd.servertools import ServerTools
from afmd.turn import TurnPlan, plan_turn, template_kwargs

log = get_logger("afmd.pipeline")

_ANSWER_WITHOUT_TOOLS = (
    "The tool budget for this request is used up. Answer the user now with what you have, "
    "without calling any tool."
)


@dataclass(slots=True)
class Round:
    """One generation: the prompt it starts from and the plan that shapes it."""

    request: ChatRequest  # the conversation as the model sees it in this round
    prompt: list[int]
    max_tokens: int
    plan: TurnPlan
    trimmed: int = 0


@dataclass(slots=True)
class PreparedChat:
    request: ChatRequest  # as the client sent it (plus server tools)
    request_id: str
    model: LoadedModel
    model_name: str  # what the response reports: the name the client asked for
    round: Round
    fingerprint: str
    deadline: float  # time.monotonic() by which the whole request must be done
    received_at: float  # time.perf_counter() when the request arrived
    profile: str | None = None  # "summary" | "extended"

    # The first round's view, which is what the response headers describe.
    @property
    def plan(self) -> TurnPlan:
        return self.round.plan

    @property
    def prompt(self) -> list[int]:
        return self.round.prompt

    @property
    def trimmed(self) -> int:
        return self.round.trimmed


def _fingerprint(model: LoadedModel) -> str:
    digest = hashlib.sha256(f"{__version__}:{model.id}:{model.entry.path}".encode()).hexdigest()
    return "fp_" + digest[:10]


@dataclass(slots=True)
class _Totals:
    prompt: int = 0
    completion: int = 0
    cached: int = 0
    reasoning: int = 0

    def add(self, event: Finished) -> None:
        self.prompt += event.prompt_tokens
        self.completion += event.completion_tokens
        self.cached += event.cached_tokens
        self.reasoning += event.reasoning_tokens

    def usage(self) -> Usage:
        return Usage(self.prompt, self.completion, self.cached, self.reasoning)


class ChatRun:
    """One chat completion from queue to finish: engine events in, client outputs out."""

    def __init__(self, pipeline: ChatPipeline, prepared: PreparedChat) -> None:
        self._pipeline = pipeline
        self.prepared = prepared
        self.ticket = Ticket()
        self.generation: Generation | None = None
        self.finished = False
        self.finish_reason: str | None = None  # once finished
        self.usage: Usage | None = None  # once finished
        self._round = prepared.round
        self._rounds_with_tools = 0
        self._server_calls = 0
        self._tools_ran = False
        self._emitted = False  # something reached the client: no more retries
        self._attempt = 0
        self._totals = _Totals()
        self._cancel_requested = False
        self._timed_out = False
        # One timer per request for request_timeout, not one per awaited batch of tokens.
        self._deadline: asyncio.TimerHandle | None = None
        self._reset_round_state()

    def _reset_round_state(self) -> None:
        self._output = self._round.plan.output_processor()
        self._ended_by_us = False  # we stopped generation (stop sequence, call budget)
        self._answer: list[str] | None = [] if self._round.plan.json_answer else None
        self._hidden: set[int] = set()  # processor indexes of server tool calls
        self._visible: dict[int, int] = {}  # processor index -> client index

    # -- control --
    def start_generation(self) -> None:
        if self._deadline is None:
            loop = asyncio.get_running_loop()  # its clock is time.monotonic(), as deadline's
            self._deadline = loop.call_at(self.prepared.deadline, self._on_deadline)
        rnd = self._round
        r = rnd.request
        self.generation = self.prepared.model.start(
            GenerationRequest(
                request_id=self.prepared.request_id,
                prompt=rnd.prompt,
                max_tokens=rnd.max_tokens,
                sampling=SamplingParams(
                    temperature=r.temperature,
                    top_p=r.top_p,
                    top_k=r.top_k,
                    min_p=r.min_p,
                    repetition_penalty=r.repetition_penalty,
                    seed=r.seed,
                ),
                logits_processors=rnd.plan.logits_processors(),
                sample_every=SAMPLE_EVERY if self.prepared.profile == "extended" else 0,
                think_ids=self.prepared.model.think_ids,
                starts_in_reasoning=rnd.plan.starts_in_reasoning,
            )
        )

    def cancel(self) -> None:
        """Stop for good (client cancel or disconnect; also when the response is over)."""
        self._cancel_requested = True
        if self._deadline is not None:
            self._deadline.cancel()
        self._stop_generation()

    def _stop_generation(self) -> None:
        if self.generation is None:
            self.ticket.cancel()
        elif not self.generation.done:
            self.prepared.model.cancel(self.generation)

    # -- output --
    def __aiter__(self) -> AsyncIterator[list[Event]]:
        return self._batches()

    async def _batches(self) -> AsyncIterator[list[Event]]:
        while not self.finished:
            yield await self.next_outputs()

    def _done(
        self, reason: str, usage: Usage, calls: list[ToolCall], profile: dict[str, Any] | None
    ) -> list[Event]:
        self.finished = True
        self.finish_reason = reason
        self.usage = usage
        out: list[Event] = [ToolCallEnd(i, call) for i, call in enumerate(calls)]
        out += [Finish(reason), usage]
        if profile is not None:
            out.append(Profile(profile))
        return out

    async def next_outputs(self) -> list[Event]:
        """The next batch of outputs; the last batch ends with :class:`Finish`, usage."""
        if self.generation is None:
            usage = Usage(prompt_tokens=len(self.prepared.prompt), completion_tokens=0)
            return self._done("cancelled", usage, [], None)
        while True:
            try:
                events = await self._next_events()
            except APIError as exc:
                if not await self._retry(exc):
                    raise
                continue
            outputs = self._consume(events)
            if outputs and isinstance(outputs[-1], _RoundOver):
                finished = outputs.pop().event
                done = await self._end_round(finished)
                if done is None:  # another round follows
                    if outputs:
                        self._emitted = True
                        return outputs
                    continue
                outputs.extend(done)
            if outputs:
                self._emitted = True
                return outputs

    async def _next_events(self) -> list[Any]:
        assert self.generation is not None
        if not self._timed_out:
            events = await self.generation.next_events()
            if not self._timed_out:
                return events
        raise _timeout_error()

    def _on_deadline(self) -> None:
        """request_timeout passed: stop the engine and wake the consumer with a 504."""
        self._timed_out = True
        self._stop_generation()
        if self.generation is not None:
            self.generation.fail(_timeout_error())

    async def _retry(self, exc: APIError) -> bool:
        """Retry a transient model failure if nothing reached the client and no tool ran."""
        retries = self._pipeline.config.engine.retries
        if (
            exc.code != "generation_failed"
            or self._emitted
            or self._tools_ran
            or self._cancel_requested
            or self._attempt >= retries
        ):
            return False
        delay = self._pipeline.config.engine.retry_backoff * (2 ** self._attempt)
        self._attempt += 1
        log.warning("retrying generation", request_id=self.prepared.request_id,
                    attempt=self._attempt, delay_s=delay)
        await asyncio.sleep(delay)
        self._reset_round_state()
        self.start_generation()
        return True

    def _consume(self, events: list[Any]) -> list[Any]:
        outputs: list[Any] = []
        output = self._output
        for event in events:
            if isinstance(event, Text):
                if self._ended_by_us or not event.text:
                    continue
                outputs.extend(self._visible_pieces(output.feed(event.text)))
                if output.should_stop:
                    self._ended_by_us = True
                    self._stop_generation()
            elif isinstance(event, Finished):
                outputs.extend(self._visible_pieces(output.finish()))
                if self._answer is not None:
                    self._answer.extend(p.text for p in outputs if isinstance(p, Content))
                outputs.append(_RoundOver(event))
                return outputs
        if self._answer is not None:
            self._answer.extend(p.text for p in outputs if isinstance(p, Content))
        return outputs

    def _visible_pieces(self, pieces: list[Piece]) -> list[Piece]:
        """Drop server tool calls; number the client's calls 0, 1, … in order."""
        server = self._pipeline.server_tools
        if not server:
            return pieces
        out: list[Piece] = []
        for piece in pieces:
            if isinstance(piece, ToolCallStart):
                if piece.name in server:
                    self._hidden.add(piece.index)
                    continue
                self._visible[piece.index] = len(self._visible)
                out.append(dataclasses.replace(piece, index=self._visible[piece.index]))
            elif isinstance(piece, ToolCallArguments):
                if piece.index in self._hidden:
                    continue
                out.append(dataclasses.replace(piece, index=self._visible[piece.index]))
            else:
                out.append(piece)
        return out

    async def _end_round(self, event: Finished) -> list[Event] | None:
        """The round is over: finish the request, or run server tools and go on."""
        self._totals.add(event)
        server = self._pipeline.server_tools
        calls = self._output.tool_calls
        client_calls = [c for c in calls if c.name not in server]
        server_calls = [c for c in calls if c.name in server]
        reason = event.finish_reason
        if self._ended_by_us and not self._cancel_requested and (
            reason == "cancelled" or self._output.stopped_by_sequence
        ):
            # Our own early end (stop sequence, call budget), not a cancel; a stop sequence
            # wins even when its last token was also the last one max_tokens allowed.
            reason = "stop"
        if server_calls and not client_calls and reason == "stop":
            left = self._tokens_left()
            if left is not None and left < 1:  # max_tokens bounds all rounds together
                return self._done("length", self._totals.usage(), [], self._profile(event))
            await self._run_server_tools(server_calls)
            if self._cancel_requested:
                return self._done("cancelled", self._totals.usage(), [], self._profile(event))
            self.start_generation()
            return None
        if client_calls and reason == "stop":
            reason = "tool_calls"
        if reason == "stop" and self._answer is not None:
            self._round.plan.check_answer("".join(self._answer))
        return self._done(reason, self._totals.usage(), client_calls, self._profile(event))

    async def _run_server_tools(self, calls: list[ToolCall]) -> None:
        pipeline = self._pipeline
        budget = pipeline.config.tools
        self._rounds_with_tools += 1
        self._tools_ran = True
        history = list(self._round.request.messages)
        history.append(
            Message(
                role="assistant",
                content=None,
                tool_calls=tuple(calls),
            )
        )
        for call in calls:
            if self._server_calls >= budget.max_calls:
                content = '{"error": "tool call budget exhausted"}'
            else:
                self._server_calls += 1
                content = (await pipeline.server_tools.run(call.name, call.arguments)).content
            history.append(Message(role="tool", content=content, tool_call_id=call.id))
        exhausted = (
            self._rounds_with_tools >= budget.max_rounds
            or self._server_calls >= budget.max_calls
        )
        request = dataclasses.replace(
            self._round.request, messages=tuple(history), max_tokens=self._tokens_left()
        )
        if exhausted:
            request = dataclasses.replace(
                request,
                tool_choice=ToolChoice("none"),
                messages=(*request.messages, Message(role="system",
                                                     content=_ANSWER_WITHOUT_TOOLS)),
            )
        # A round after server tools ran is free: tool_choice bound the request's first.
        self._round = await pipeline.build_round(
            request, self.prepared.model, trim=False, first_step=False
        )
        self._reset_round_state()

    def _tokens_left(self) -> int | None:
        """What the client's max_tokens leaves for further rounds (None: no limit)."""
        limit = self.prepared.request.max_tokens
        return None if limit is None else limit - self._totals.completion

    def _profile(self, event: Finished) -> dict[str, Any] | None:
        mode = self.prepared.profile
        if mode is None:
            return None
        t = event.timings
        data = summary(
            ProfileInput(
                prompt_tokens=self._totals.prompt,
                cached_tokens=self._totals.cached,
                completion_tokens=self._totals.completion,
                received_at=self.prepared.received_at,
                started_at=t["started_at"],
                first_token_at=t["first_token_at"],
                finished_at=t["finished_at"],
                peak_memory_bytes=event.peak_memory_bytes,
                bytes_per_token=self.prepared.model.weights_bytes or None,
            )
        )
        if mode == "extended":
            offset = t["started_at"] - self.prepared.received_at
            return {
                "afm_profile_extended": {
                    "summary": data,
                    "samples": samples(event.samples, offset),
                }
            }
        return {"afm_profile": data}


@dataclass(slots=True)
class _RoundOver:
    event: Finished


def _timeout_error() -> GatewayTimeoutError:
    return GatewayTimeoutError(
        "The request did not complete within the server's request_timeout.", code="timeout"
    )


def _context_error(limit: int, prompt: int, completion: int | None) -> InvalidRequestError:
    if completion is not None:
        return InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt + completion} tokens ({prompt} in the messages, {completion} in the "
            "completion). Please reduce the length of the messages or completion.",
            code="context_length_exceeded",
            param="messages",
        )
    return InvalidRequestError(
        f"This model's maximum context length is {limit} tokens. However, your messages "
        f"resulted in {prompt} tokens. Please reduce the length of the messages.",
        code="context_length_exceeded",
        param="messages",
    )


@dataclass
class ChatPipeline:
    registry: ModelRegistry
    scheduler: Scheduler
    request_timeout: float
    tools: ServerTools | None = None  # default: the config's [[tools.server]]
    _runs: dict[str, ChatRun] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tools is None:
            self.tools = ServerTools(self.registry.config.tools.server)

    @property
    def server_tools(self) -> ServerTools:
        assert self.tools is not None
        return self.tools

    @property
    def config(self) -> Config:
        return self.registry.config

    async def prepare(
        self,
        request: ChatRequest,
        request_id: str,
        *,
        received_at: float | None = None,
        profile: str | None = None,
    ) -> PreparedChat:
        started = time.monotonic()
        entry = self.registry.resolve(request.model)
        model = await self.registry.get(entry)
        if request.has_images and not model.supports_vision:
            index = next(i for i, m in enumerate(request.messages) if m.has_images)
            raise InvalidRequestError(
                f"The model '{entry.id}' does not accept image input; send text only or "
                "use a vision model.",
                code="image_input_not_supported",
                param=f"messages[{index}].content",
            )
        request = self._with_server_tools(request)
        first = await self.build_round(
            request, model, trim=self.config.context.policy == "trim"
        )
        return PreparedChat(
            request=request,
            request_id=request_id,
            model=model,
            model_name=request.model or entry.id,
            round=first,
            fingerprint=_fingerprint(model),
            deadline=started + self.request_timeout,
            received_at=received_at if received_at is not None else time.perf_counter(),
            profile=profile,
        )

    def _with_server_tools(self, request: ChatRequest) -> ChatRequest:
        if not self.server_tools:
            return request
        for i, tool in enumerate(request.tools):
            if tool.name in self.server_tools:
                raise InvalidRequestError(
                    f"The tool name '{tool.name}' is taken by a server tool of this afmd; "
                    "rename your tool.",
                    code="invalid_value",
                    param=f"tools[{i}].function.name",
                )
        return dataclasses.replace(request, tools=(*request.tools, *self.server_tools.specs()))

    def _render_sync(self, request: ChatRequest, model: LoadedModel) -> list[int]:
        messages = template_messages(request.messages, instructions=self.config.server.instructions)
        tools = [t.as_template_tool() for t in request.tools] if request.tools else None
        if request.tool_choice.mode == "none":
            tools = None
        try:
            return model.render_prompt(
                messages, tools=tools, template_kwargs=template_kwargs(request, model)
            )
        except Exception as exc:  # template errors are about the conversation's shape
            raise InvalidRequestError(
                f"The model's chat template could not render these messages: {exc}",
                code="invalid_value",
                param="messages",
            ) from None

    async def _render(self, request: ChatRequest, model: LoadedModel) -> list[int]:
        return await asyncio.to_thread(self._render_sync, request, model)

    async def build_round(
        self, request: ChatRequest, model: LoadedModel, *, trim: bool, first_step: bool = True
    ) -> Round:
        """Render, fit into the context window (trimming if allowed), and plan.

        All of it runs in one worker-thread hop: templates, tokenization and grammar
        compilation are milliseconds of CPU that must not stall the event loop, and each
        extra hop adds to the time to first token.
        """
        return await asyncio.to_thread(
            self._build_round_sync, request, model, trim, first_step
        )

    def _build_round_sync(
        self, request: ChatRequest, model: LoadedModel, trim: bool, first_step: bool = True
    ) -> Round:
        limit = model.context_length
        budget = request.max_tokens
        prompt = self._render_sync(request, model)
        trimmed = 0
        if len(prompt) + (budget or 1) > limit and trim:
            request, prompt, trimmed = self._trim(request, model, limit, budget or 1)
        if budget is not None:
            if len(prompt) + budget > limit:
                raise _context_error(limit, len(prompt), budget)
            max_tokens = budget
        else:
            max_tokens = limit - len(prompt)
            if max_tokens < 1:
                raise _context_error(limit, len(prompt), None)
        plan = plan_turn(request, model, prompt, max_tokens, first_step=first_step)
        plan.prepare_processors()  # the grammar matcher is built here, off the event loop
        return Round(request, prompt, max_tokens, plan, trimmed)

    def _trim(
        self, request: ChatRequest, model: LoadedModel, limit: int, budget: int
    ) -> tuple[ChatRequest, list[int], int]:
        """Drop the fewest oldest units that make the prompt fit (binary search)."""
        units = droppable_units(request.messages)
        best: tuple[ChatRequest, list[int], int] | None = None
        lo, hi = 1, len(units)
        while lo <= hi:
            mid = (lo + hi) // 2
            messages, dropped = without_units(request.messages, units, mid)
            candidate = dataclasses.replace(request, messages=messages)
            prompt = self._render_sync(candidate, model)
            if len(prompt) + budget <= limit:
                best = (candidate, prompt, dropped)
                hi = mid - 1
            else:
                lo = mid + 1
        if best is None:  # even the protected messages do not fit: report as usual
            messages, dropped = without_units(request.messages, units, len(units))
            candidate = dataclasses.replace(request, messages=messages)
            return candidate, self._render_sync(candidate, model), dropped
        return best

    async def start(self, prepared: PreparedChat) -> ChatRun:
        """Register the run under its request id, wait for a slot, start generating.

        The run is findable by id (for the cancel endpoint) while it waits in the queue; a
        run cancelled there comes back without a generation and finishes as "cancelled".
        """
        rid = prepared.request_id
        if rid in self._runs:
            raise ConflictError(
                f"A request with X-Request-ID '{rid}' is already running; "
                "use a unique id per request.",
                code="duplicate_request_id",
                param="X-Request-ID",
            )
        run = ChatRun(self, prepared)
        self._runs[rid] = run
        try:
            await self.scheduler.acquire(run.ticket, prepared.deadline - time.monotonic())
        except Cancelled:
            return run
        except BaseException:
            self._forget(run)
            raise
        if run.ticket.cancelled:
            return run  # cancelled just as the slot was handed over
        run.start_generation()
        return run

    def release(self, run: ChatRun) -> None:
        """The response is over: stop the generation if it still runs, free its slot."""
        run.cancel()
        self.scheduler.release(run.ticket)
        self._forget(run)

    def _forget(self, run: ChatRun) -> None:
        if self._runs.get(run.prepared.request_id) is run:
            del self._runs[run.prepared.request_id]

    def find(self, request_id: str) -> ChatRun | None:
        return self._runs.get(request_id)


__all__ = ["APIError", "ChatPipeline", "ChatRun", "PreparedChat"]
