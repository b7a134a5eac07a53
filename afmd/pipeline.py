"""From a validated request to a stream of output events, independent of HTTP.

The pipeline owns everything between "the body is valid" and "bytes go out": resolving the
model, rendering the prompt, enforcing the context window before any prefill, starting the
generation, and turning raw decoded text into client-visible deltas (stop sequences now;
reasoning and tool calls plug in here too). The HTTP layer only frames what this yields.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from afmd import __version__
from afmd.chat import template_messages
from afmd.engine.base import Finished, Generation, GenerationRequest, SamplingParams, Text
from afmd.engine.models import LoadedModel, ModelRegistry
from afmd.errors import APIError, ConflictError, GatewayTimeoutError, InvalidRequestError
from afmd.output.stops import StopScanner
from afmd.protocol.request import ChatRequest
from afmd.protocol.response import Usage, new_completion_id


@dataclass(slots=True)
class Delta:
    content: str = ""


@dataclass(slots=True)
class Done:
    finish_reason: str
    usage: Usage
    timings: dict[str, float] = field(default_factory=dict)


Output = Delta | Done


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
    deadline: float


def _fingerprint(model: LoadedModel) -> str:
    digest = hashlib.sha256(f"{__version__}:{model.id}:{model.entry.path}".encode()).hexdigest()
    return "fp_" + digest[:10]


class ChatRun:
    """One running chat completion: engine events in, client-visible outputs out."""

    def __init__(self, prepared: PreparedChat, generation: Generation) -> None:
        self.prepared = prepared
        self.generation = generation
        self._scanner = StopScanner(prepared.request.stop)
        self._stopped = False
        self.finished = False

    def cancel(self) -> None:
        if not self.generation.done:
            self.prepared.model.cancel(self.generation)

    async def next_outputs(self) -> list[Output]:
        """The next batch of outputs; the last batch ends with :class:`Done`."""
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
        text_parts: list[str] = []
        outputs: list[Output] = []
        for event in events:
            if isinstance(event, Text):
                if self._stopped or not event.text:
                    continue
                safe = self._scanner.feed(event.text)
                if safe:
                    text_parts.append(safe)
                if self._scanner.stopped:
                    self._stopped = True
                    self.cancel()
            elif isinstance(event, Finished):
                tail = self._scanner.flush()
                if tail:
                    text_parts.append(tail)
                if text_parts:
                    outputs.append(Delta("".join(text_parts)))
                    text_parts = []
                reason = "stop" if self._stopped else event.finish_reason
                usage = Usage(
                    prompt_tokens=event.prompt_tokens,
                    completion_tokens=event.completion_tokens,
                    cached_tokens=event.cached_tokens,
                )
                outputs.append(Done(reason, usage, dict(event.timings)))
                self.finished = True
        if text_parts:
            outputs.insert(0, Delta("".join(text_parts)))
        return outputs

    async def outputs(self) -> AsyncIterator[list[Output]]:
        while not self.finished:
            batch = await self.next_outputs()
            if batch:
                yield batch


class ChatPipeline:
    def __init__(self, registry: ModelRegistry, *, request_timeout: float) -> None:
        self.registry = registry
        self.request_timeout = request_timeout
        self._running: dict[str, ChatRun] = {}

    async def prepare(self, request: ChatRequest, request_id: str) -> PreparedChat:
        started = time.monotonic()
        entry = self.registry.resolve(request.model)
        model = await self.registry.get(entry)
        messages = template_messages(
            request.messages, instructions=self.registry.config.server.instructions
        )
        tools = [t.as_template_tool() for t in request.tools] if request.tools else None
        if request.tool_choice == "none":
            tools = None
        try:
            prompt = await asyncio.to_thread(model.render_prompt, messages, tools=tools)
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
        )

    def start(self, prepared: PreparedChat) -> ChatRun:
        if prepared.request_id in self._running:
            raise ConflictError(
                f"A request with X-Request-ID '{prepared.request_id}' is already running; "
                "use a unique id per request.",
                code="duplicate_request_id",
            )
        r = prepared.request
        generation = prepared.model.start(
            GenerationRequest(
                request_id=prepared.request_id,
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
            )
        )
        run = ChatRun(prepared, generation)
        self._running[prepared.request_id] = run
        return run

    def release(self, run: ChatRun) -> None:
        """Forget a run once its response is over; cancel it if it is still going."""
        run.cancel()
        if self._running.get(run.prepared.request_id) is run:
            del self._running[run.prepared.request_id]

    def find(self, request_id: str) -> ChatRun | None:
        return self._running.get(request_id)

    @property
    def active_requests(self) -> int:
        return len(self._running)


__all__ = ["APIError", "ChatPipeline", "ChatRun", "Delta", "Done", "Output", "PreparedChat"]
