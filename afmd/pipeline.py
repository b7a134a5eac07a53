"""From a validated request to a stream of output events, independent of HTTP.

The pipeline owns everything between "the body is valid" and "bytes go out": resolving the
model, rendering the prompt, enforcing the context window before any prefill, starting the
generation under the turn's plan (grammar, output parsing), and turning decoded text into
client-visible pieces (content, reasoning, tool calls). The HTTP layer only frames what
this yields.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from typing import Any

from afmd import __version__
from afmd.chat import template_messages
from afmd.engine.base import Finished, Generation, GenerationRequest, SamplingParams, Text
from afmd.engine.models import LoadedModel, ModelRegistry
from afmd.errors import APIError, ConflictError, GatewayTimeoutError, InvalidRequestError
from afmd.output.pieces import Content, Piece
from afmd.output.toolcalls import ParsedCall
from afmd.profiling import SAMPLE_EVERY, ProfileInput, samples, summary
from afmd.protocol.request import ChatRequest
from afmd.protocol.response import Usage, new_completion_id
from afmd.scheduler import Cancelled, Scheduler, Ticket
from afmd.turn import TurnPlan, plan_turn, template_kwargs


@dataclass(slots=True)
class Done:
    finish_reason: str
    usage: Usage
    tool_calls: list[ParsedCall]
    # The X-AFM-Profile event payload ({"afm_profile": …} or {"afm_profile_extended": …}).
    profile: dict[str, Any] | None = None


Output = Piece | Done


@dataclass(slots=True)
class PreparedChat:
    request: ChatRequest
    request_id: str
    model: LoadedModel
    model_name: str  # what the response reports: the name the client asked for
    prompt: list[int]
    max_tokens: int
    completion_id: str
    created: int
    fingerprint: str
    deadline: float  # time.monotonic() by which the whole request must be done
    received_at: float  # time.perf_counter() when the request arrived
    plan: TurnPlan
    profile: str | None = None  # "summary" | "extended"


def _fingerprint(model: LoadedModel) -> str:
    digest = hashlib.sha256(f"{__version__}:{model.id}:{model.entry.path}".encode()).hexdigest()
    return "fp_" + digest[:10]


class ChatRun:
    """One chat completion from queue to finish: engine events in, client outputs out."""

    def __init__(self, prepared: PreparedChat) -> None:
        self.prepared = prepared
        self.ticket = Ticket()
        self.generation: Generation | None = None
        self._output = prepared.plan.output_processor()
        self._ended_by_us = False  # we stopped generation (stop sequence, call budget)
        self._answer: list[str] | None = [] if prepared.plan.json_answer else None
        self.finished = False

    def cancel(self) -> None:
        if self.generation is None:
            self.ticket.cancel()
        elif not self.generation.done:
            self.prepared.model.cancel(self.generation)

    async def next_outputs(self) -> list[Output]:
        """The next batch of outputs; the last batch ends with :class:`Done`."""
        if self.generation is None:
            self.finished = True
            usage = Usage(prompt_tokens=len(self.prepared.prompt), completion_tokens=0)
            return [Done("cancelled", usage, [])]
        remaining = self.prepared.deadline - time.monotonic()
        try:
            async with asyncio.timeout(max(remaining, 0.0)):
                events = await self.generation.next_events()
        except TimeoutError:
            self.cancel()
            raise GatewayTimeoutError(
                "The request did not complete within the server's request_timeout.",
                code="timeout",
            ) from None
        outputs: list[Output] = []
        output = self._output
        for event in events:
            if isinstance(event, Text):
                if self._ended_by_us or not event.text:
                    continue
                outputs.extend(output.feed(event.text))
                if output.should_stop:
                    self._ended_by_us = True
                    self.cancel()
            elif isinstance(event, Finished):
                outputs.extend(output.finish())
                if self._answer is not None:
                    self._answer.extend(p.text for p in outputs if isinstance(p, Content))
                outputs.append(self._done(event))
                self.finished = True
                return outputs
        if self._answer is not None:
            self._answer.extend(p.text for p in outputs if isinstance(p, Content))
        return outputs

    def _done(self, event: Finished) -> Done:
        reason = event.finish_reason
        calls = self._output.tool_calls
        if self._ended_by_us and reason == "cancelled":
            reason = "stop"  # our own early end (stop sequence, call budget), not a cancel
        if calls and reason == "stop":
            reason = "tool_calls"
        if reason == "stop" and self._answer is not None:
            self.prepared.plan.check_answer("".join(self._answer))
        usage = Usage(
            prompt_tokens=event.prompt_tokens,
            completion_tokens=event.completion_tokens,
            cached_tokens=event.cached_tokens,
            reasoning_tokens=event.reasoning_tokens,
        )
        profile = None
        mode = self.prepared.profile
        if mode is not None:
            t = event.timings
            data = summary(
                ProfileInput(
                    prompt_tokens=event.prompt_tokens,
                    cached_tokens=event.cached_tokens,
                    completion_tokens=event.completion_tokens,
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
                profile = {
                    "afm_profile_extended": {
                        "summary": data,
                        "samples": samples(event.samples, offset),
                    }
                }
            else:
                profile = {"afm_profile": data}
        return Done(reason, usage, calls, profile)


class ChatPipeline:
    def __init__(
        self, registry: ModelRegistry, scheduler: Scheduler, *, request_timeout: float
    ) -> None:
        self.registry = registry
        self.scheduler = scheduler
        self.request_timeout = request_timeout
        self._runs: dict[str, ChatRun] = {}

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
        messages = template_messages(
            request.messages, instructions=self.registry.config.server.instructions
        )
        if request.has_images and not model.supports_vision:
            index = next(i for i, m in enumerate(request.messages) if m.has_images)
            raise InvalidRequestError(
                f"The model '{entry.id}' does not accept image input; send text only or "
                "use a vision model.",
                code="image_input_not_supported",
                param=f"messages[{index}].content",
            )
        tools = [t.as_template_tool() for t in request.tools] if request.tools else None
        if request.tool_choice.mode == "none":
            tools = None
        try:
            prompt = await asyncio.to_thread(
                model.render_prompt,
                messages,
                tools=tools,
                template_kwargs=template_kwargs(request, model),
            )
        except Exception as exc:  # template errors are about the conversation's shape
            raise InvalidRequestError(
                f"The model's chat template could not render these messages: {exc}",
                code="invalid_value",
                param="messages",
            ) from None
        limit = model.context_length
        if request.max_tokens is not None:
            needed = len(prompt) + request.max_tokens
            if needed > limit:
                raise InvalidRequestError(
                    f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested {needed} tokens ({len(prompt)} in the messages, "
                    f"{request.max_tokens} in the completion). Please reduce the length of "
                    "the messages or completion.",
                    code="context_length_exceeded",
                    param="messages",
                )
            max_tokens = request.max_tokens
        else:
            max_tokens = limit - len(prompt)
            if max_tokens < 1:
                raise InvalidRequestError(
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"messages resulted in {len(prompt)} tokens. Please reduce the length of "
                    "the messages.",
                    code="context_length_exceeded",
                    param="messages",
                )
        plan = await asyncio.to_thread(plan_turn, request, model, prompt, max_tokens)
        return PreparedChat(
            request=request,
            request_id=request_id,
            model=model,
            model_name=request.model or entry.id,
            prompt=prompt,
            max_tokens=max_tokens,
            completion_id=new_completion_id(),
            created=int(time.time()),
            fingerprint=_fingerprint(model),
            deadline=started + self.request_timeout,
            received_at=received_at if received_at is not None else time.perf_counter(),
            plan=plan,
            profile=profile,
        )

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
        run = ChatRun(prepared)
        self._runs[rid] = run
        try:
            await self.scheduler.acquire(run.ticket, prepared.deadline - time.monotonic())
        except Cancelled:
            return run
        except BaseException:
            self._forget(run)
            raise
        r = prepared.request
        run.generation = prepared.model.start(
            GenerationRequest(
                request_id=rid,
                prompt=prepared.prompt,
                max_tokens=prepared.max_tokens,
                sampling=SamplingParams(
                    temperature=r.temperature,
                    top_p=r.top_p,
                    top_k=r.top_k,
                    min_p=r.min_p,
                    repetition_penalty=r.repetition_penalty,
                    seed=r.seed,
                ),
                logits_processors=prepared.plan.logits_processors(),
                sample_every=SAMPLE_EVERY if prepared.profile == "extended" else 0,
                think_ids=prepared.model.think_ids,
                starts_in_reasoning=prepared.plan.starts_in_reasoning,
            )
        )
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


__all__ = ["APIError", "ChatPipeline", "ChatRun", "Done", "Output", "PreparedChat"]
