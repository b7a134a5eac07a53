"""From a validated request to a running turn, independent of HTTP and of wire formats.

The pipeline owns everything between "the body is valid" and "events come out": resolving
the model, adding the operator's server tools, building the first round (rendered, fitted
into the context window, planned; :mod:`afmd.service.round_builder`), waiting for a slot, and
starting the run (:mod:`afmd.service.chat_run`), which yields the turn's events until it
finishes. A dialect adapter at the edge turns those events into its wire format.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from afmd import __version__
from afmd.config.sections import Config
from afmd.config.tables import ModelEntry
from afmd.core.events import Choice, Event, Finish, Timings, Usage
from afmd.core.request import ChatRequest, CompletionRequest
from afmd.engine.apple import framework
from afmd.engine.batch.penalties import check_logit_bias
from afmd.engine.models.loaded_model import LoadedModel
from afmd.engine.models.model_registry import ModelRegistry
from afmd.engine.models.residency import Lease
from afmd.errors import ConflictError, InvalidRequestError, RateLimitError
from afmd.service import image_pool
from afmd.service.chat_run import ChatRun, PreparedChat
from afmd.service.choices import ChoicesRun
from afmd.service.completion_prompts import PreparedCompletion, prepare_completion
from afmd.service.completion_run import CompletionRun
from afmd.service.output_plan import model_formats
from afmd.service.prompt_prefix import check_prompt_prefix
from afmd.service.round_builder import RoundBuilder
from afmd.service.run_control import RunPolicy
from afmd.service.scheduler import Arrival, Cancelled, Scheduler
from afmd.service.servertools import ServerTools

if TYPE_CHECKING:
    from afmd.service.images import Headers


def _fingerprint(entry: ModelEntry) -> str:
    digest = hashlib.sha256(f"{__version__}:{entry.id}:{entry.path}".encode()).hexdigest()
    return "fp_" + digest[:10]


class NotStarted(Cancelled):
    """The request was cancelled before it had its model and prompt: it ends as cancelled
    with nothing counted (no prompt was read), in its dialect's own way."""

    def __init__(self, request: ChatRequest | CompletionRequest, entry: ModelEntry,
                 waited: float, received_at: float) -> None:
        super().__init__()
        self.request = request
        self.model_name = request.model or entry.id
        self.fingerprint = _fingerprint(entry)
        self.waited = waited
        self.received_at = received_at

    def events(self) -> list[Event]:
        """The run's events as a run cancelled in the queue ends, with no tokens."""
        request = self.request
        timings = Timings(time.perf_counter() - self.received_at, self.waited, 0.0, 0.0)
        finish = Finish("cancelled")
        if isinstance(request, ChatRequest) and request.n == 1:
            return [timings, finish, Usage(0, 0)]
        choices = request.n * (len(request.prompts)
                               if isinstance(request, CompletionRequest) else 1)
        return [*(Choice(i, (finish,)) for i in range(choices)), timings, Usage(0, 0)]


def _check_images(request: ChatRequest, model: LoadedModel, entry: ModelEntry) -> None:
    """Images for a model that cannot see them are the client's mistake, named at the first
    image part, as the client's dialect named it (``messages[0].content[1].image_url``,
    ``messages[2].content[0].content[1].source``, ``input[0].content[1].image_url``,
    ``messages[0].images[0]``), rather than dropped, which would answer another question.
    The message's index is afmd's, not the client's where a dialect maps its turns onto
    other messages (Anthropic's tool results, Responses' items): named only when a
    message says it has images without their parts."""
    if request.has_images and not model.supports_vision:
        index, message = next((i, m) for i, m in enumerate(request.messages) if m.has_images)
        raise InvalidRequestError(
            f"The model '{entry.id}' does not accept image input; send text only or "
            "use a vision model.",
            code="image_input_not_supported",
            param=message.images[0].param if message.images else f"messages[{index}].content",
        )


def _check_thinking(request: ChatRequest | CompletionRequest, model: LoadedModel,
                    entry: ModelEntry) -> None:
    """A request that demands thinking from a model that cannot think is refused, as
    Ollama refuses it, in Ollama's words (clients match them to retry without): answering
    without the reasoning asked for would pass for a model that thought nothing.
    Whether the model thinks is what its output is read with, and what ``/api/show``
    lists as ``thinking``."""
    if not request.require_thinking:
        return
    if model.reads_conversation or not model_formats(model).thinks:
        raise thinking_not_supported(request.model or entry.id)


def thinking_not_supported(name: str) -> InvalidRequestError:
    """Ollama's refusal of ``think`` for a model that cannot think, the model named as
    the request named it (Go's ``%q``)."""
    return InvalidRequestError(f"{json.dumps(name, ensure_ascii=False)} does not support "
                               "thinking", code="thinking_not_supported",
                               param="reasoning_effort")


def _with_server_tools(request: ChatRequest, tools: ServerTools) -> ChatRequest:
    """The request with the operator's server tools beside its own, which may not take
    their names (a call could not tell whose tool it is)."""
    if not tools:
        return request
    for i, tool in enumerate(request.tools):
        if tool.name in tools:
            raise InvalidRequestError(
                f"The tool name '{tool.name}' is taken by a server tool of this afmd; "
                "rename your tool.",
                code="invalid_value",
                param=tool.name_param(i),
            )
    return dataclasses.replace(request, tools=(*request.tools, *tools.specs()))


def _no_raw_prompts(entry: ModelEntry) -> InvalidRequestError:
    """A model that reads conversations (Apple's) asked for a completion of a raw prompt."""
    return InvalidRequestError(
        f"The model '{entry.id}' answers conversations, not raw prompts: use "
        "/v1/chat/completions (or Responses, or Messages) with it.",
        code="invalid_model_kind", param="model")


def _duplicate_id(rid: str) -> ConflictError:
    """Two running requests under one id: cancel by id could not tell them apart."""
    return ConflictError(
        f"A request with X-Request-ID '{rid}' is already running; "
        "use a unique id per request.",
        code="duplicate_request_id",
        param="X-Request-ID",
    )


@dataclass
class ChatPipeline:
    registry: ModelRegistry
    scheduler: Scheduler
    request_timeout: float
    tools: ServerTools | None = None  # default: the config's [[tools.server]]
    #: Whether another service runs a request with this id (embeddings): an id names one
    #: live request across every endpoint, or cancelling by it would be ambiguous.
    taken: Callable[[str], bool] = lambda request_id: False
    policy: RunPolicy = field(init=False)
    _runs: dict[str, ChatRun | ChoicesRun | CompletionRun] = field(default_factory=dict)
    #: The requests being prepared, and prepared but not started, by id.
    _arrivals: dict[str, Arrival] = field(default_factory=dict)
    #: What each prepared request holds until it ends, by the prepared object's identity:
    #: its model, and the image pixels it counts as held (their sum across requests too).
    _holds: dict[int, tuple[Lease, int]] = field(default_factory=dict)
    _pixels_held: int = 0

    def __post_init__(self) -> None:
        if self.tools is None:
            self.tools = ServerTools(self.registry.config.tools.server)
        self.policy = RunPolicy.of(self.registry.config, self.request_timeout)

    @property
    def server_tools(self) -> ServerTools:
        assert self.tools is not None
        return self.tools

    @property
    def config(self) -> Config:
        return self.registry.config

    async def prepare(
        self,
        request: ChatRequest | CompletionRequest,
        request_id: str,
        *,
        received_at: float | None = None,
        profile: str | None = None,
        timeout: float | None = None,
    ) -> PreparedChat | PreparedCompletion:
        """Lease the model and render the prompt; the request's deadline is ``timeout``
        seconds from now (None: ``request_timeout``; a background response has its own)."""
        started = time.monotonic()
        deadline = started + (self.policy.request_timeout if timeout is None else timeout)
        arrived = received_at if received_at is not None else time.perf_counter()
        entry = self.registry.resolve(request.model)
        if isinstance(request, CompletionRequest) and framework.is_system(entry):
            # Known before the lease, which is a 503 while the framework cannot answer:
            # this request could not be served even when it can.
            raise _no_raw_prompts(entry)
        if self.live(request_id) or self.taken(request_id):
            raise _duplicate_id(request_id)
        arrival = self._arrivals[request_id] = Arrival()
        try:
            # Held until the response is over (release): a model in use is never unloaded.
            lease = await arrival.unless_cancelled(self.registry.lease(
                entry, deadline=deadline, keep_alive=request.keep_alive), Lease.release)
        except Cancelled:
            self._arrivals.pop(request_id, None)
            raise NotStarted(request, entry, time.monotonic() - started, arrived) from None
        except BaseException:
            self._arrivals.pop(request_id, None)
            raise
        waited = time.monotonic() - started  # the model's load, when it was not loaded
        pixels = 0
        try:
            pixels, headers = await self._hold_pixels(request, lease.model)
            # Rendering (a grammar's compile with it) is not cut short: a cancel meanwhile
            # ends the run as soon as it starts, as one cancelled in the queue.
            prepared = await self._prepare(lease.model, entry, request, request_id, deadline,
                                           received_at, profile, headers)
        except BaseException:
            self._arrivals.pop(request_id, None)
            self._pixels_held -= pixels
            lease.release()
            raise
        prepared.load_seconds = waited
        self._holds[id(prepared)] = (lease, pixels)
        return prepared

    async def _hold_pixels(self, request: ChatRequest | CompletionRequest,
                           model: LoadedModel) -> tuple[int, Headers | None]:
        """Count a vision request's image pixels as held, or refuse it: a 400 past
        ``max_request_image_pixels`` or ``max_request_images``, a 429 past
        ``max_image_pixels_in_flight``; and the headers read for it, which its first round
        decodes from (a file is opened once).

        Its pictures are decoded as it is prepared, before it waits for a slot, and its
        processed image inputs kept until it ends (the pictures themselves are let go once
        its prompt is built), so the requests in flight are held to a budget together. A
        request is always let in when nothing else holds images, so any one can run. The
        headers are read off the event loop (Pillow walks a file's metadata in Python:
        seconds for a body's worth of it), the budget on it, with no wait in between.
        """
        if not isinstance(request, ChatRequest) or not request.has_images \
                or not model.supports_vision:
            return 0, None
        from afmd.service import images as image_decoding  # Pillow: only with images

        headers = await image_pool.IMAGE_THREADS.run(
            image_decoding.check_total,
            [image for message in request.messages for image in message.images],
            self.config.models.max_request_image_pixels,
            self.config.models.max_request_images)
        pixels = headers.pixels
        limit = self.config.models.max_image_pixels_in_flight
        if self._pixels_held and self._pixels_held + pixels > limit:
            raise RateLimitError(
                f"The server is busy with images: the vision requests in flight hold "
                f"{self._pixels_held} image pixels, and this one's {pixels} would pass "
                f"{limit} ([models] max_image_pixels_in_flight). Retry shortly.",
                code="rate_limited",
                headers={"Retry-After": str(self.scheduler.retry_after)},
            )
        self._pixels_held += pixels
        return pixels, headers

    async def _prepare(
        self,
        model: LoadedModel,
        entry: ModelEntry,
        request: ChatRequest | CompletionRequest,
        request_id: str,
        deadline: float,
        received_at: float | None,
        profile: str | None,
        headers: Headers | None = None,
    ) -> PreparedChat | PreparedCompletion:
        _check_thinking(request, model, entry)
        if isinstance(request, CompletionRequest) and model.reads_conversation:
            raise _no_raw_prompts(entry)
        if isinstance(request, CompletionRequest):  # raw prompts: no template, no tools
            return await prepare_completion(
                model, entry, request, request_id, fingerprint=_fingerprint(entry),
                deadline=deadline, received_at=received_at,
                profile=profile,
            )
        _check_images(request, model, entry)
        check_prompt_prefix(request.prompt_prefix, model, entry.id)
        if not model.reads_conversation:  # Apple's model has no token ids to bias
            check_logit_bias(request.logit_bias, model.vocab_size, entry.id)
        request = _with_server_tools(request, self.server_tools)
        rounds = RoundBuilder(model, request, instructions=self.config.server.instructions,
                              trim=self._trims(request), server_tools=self.server_tools.names,
                              deadline=deadline, headers=headers)
        return PreparedChat(
            request_id=request_id,
            rounds=rounds,
            round=await rounds.first(request),
            max_tokens=request.max_tokens,
            model_name=request.model or entry.id,
            fingerprint=_fingerprint(entry),
            deadline=deadline,
            received_at=received_at if received_at is not None else time.perf_counter(),
            profile=profile,
        )

    def _trims(self, request: ChatRequest) -> bool:
        """Whether the request's oldest turns are dropped to fit the context window."""
        if request.trim_context is not None:
            return request.trim_context
        return self.config.context.policy == "trim"

    async def count(self, request: ChatRequest, *, must_fit: bool = False) -> int:
        """The prompt tokens ``request`` would be given (its model's template with the
        server's instructions and tools), without a slot or a generation: what the
        token-counting endpoints answer; ``must_fit`` refuses a prompt the context
        window cannot hold, as a turn would."""
        entry = self.registry.resolve(request.model)
        started = time.monotonic()
        lease = await self.registry.lease(entry, keep_alive=request.keep_alive)
        pixels = 0
        try:
            _check_images(request, lease.model, entry)  # the turn would refuse them
            pixels, headers = await self._hold_pixels(request, lease.model)
            request = _with_server_tools(request, self.server_tools)
            rounds = RoundBuilder(lease.model, request,
                                  instructions=self.config.server.instructions,
                                  trim=self._trims(request),
                                  server_tools=self.server_tools.names,
                                  deadline=started + self.policy.request_timeout,
                                  headers=headers)
            return int(await rounds.bounded(rounds.prompt_tokens, request,
                                            must_fit=must_fit))
        finally:
            self._pixels_held -= pixels
            lease.release()

    async def start(
        self, prepared: PreparedChat | PreparedCompletion
    ) -> ChatRun | ChoicesRun | CompletionRun:
        """Register the run under its request id, wait for a slot, start generating.

        The run is findable by id (for the cancel endpoint) while it waits in the queue; a
        run cancelled there comes back without a generation and finishes as "cancelled".
        """
        rid = prepared.request_id
        arrival = self._arrivals.pop(rid, None)
        if rid in self._runs or self.taken(rid):
            self._release_model(prepared)
            raise _duplicate_id(rid)
        run: ChatRun | ChoicesRun | CompletionRun
        if isinstance(prepared, PreparedCompletion):
            run = CompletionRun(prepared, self.policy)
        elif prepared.round.request.n > 1:
            run = ChoicesRun(prepared, self.policy, self.server_tools, prepared.round.request.n)
        else:
            run = ChatRun(prepared, self.policy, self.server_tools)
        self._runs[rid] = run
        held = self._holds.get(id(prepared))
        if held is not None:
            held[0].ticket = run.ticket  # queued until it holds a slot: /health's counts
        if arrival is not None and arrival.cancelled:
            run.cancel()  # cancelled while it was prepared: it ends as if in the queue
        try:
            await self.scheduler.acquire(run.ticket, prepared.deadline - time.monotonic())
        except Cancelled:
            return run
        except BaseException:
            self._forget(run)
            self._release_model(prepared)
            raise
        if run.ticket.cancelled:
            return run  # cancelled just as the slot was handed over
        run.start_generation()
        return run

    def release(self, run: ChatRun | ChoicesRun | CompletionRun) -> None:
        """The response is over: stop the generation if it still runs, free its slot."""
        run.cancel()
        self.scheduler.release(run.ticket)
        run.prepared.model.touch()  # idle from now: /health's idle_since
        self._release_model(run.prepared)
        self._forget(run)

    def discard(self, prepared: PreparedChat | PreparedCompletion) -> None:
        """A prepared request that will not start: its model is free again."""
        self._arrivals.pop(prepared.request_id, None)
        self._release_model(prepared)

    def _release_model(self, prepared: PreparedChat | PreparedCompletion) -> None:
        held = self._holds.pop(id(prepared), None)
        if held is not None:
            lease, pixels = held
            self._pixels_held -= pixels
            if pixels and isinstance(prepared, PreparedChat):
                prepared.rounds.release()  # its image inputs go with its pixels' count
            lease.release()

    def _forget(self, run: ChatRun | ChoicesRun | CompletionRun) -> None:
        if self._runs.get(run.prepared.request_id) is run:
            del self._runs[run.prepared.request_id]

    def find(self, request_id: str) -> ChatRun | ChoicesRun | CompletionRun | None:
        return self._runs.get(request_id)

    def live(self, request_id: str) -> bool:
        """Whether a turn is being prepared or run under this id."""
        return request_id in self._runs or request_id in self._arrivals

    def cancel(self, request_id: str) -> bool:
        """Cancel the turn running or being prepared under this id; False: none is (or
        its run already finished)."""
        run = self._runs.get(request_id)
        if run is not None:
            if run.finished:
                return False
            run.cancel()
            return True
        arrival = self._arrivals.get(request_id)
        if arrival is None:
            return False
        arrival.cancel()
        return True

    def cancel_arriving(self) -> None:
        """Cancel every turn still waiting for its model (the server is stopping: nothing
        is loaded for them any more)."""
        for arrival in list(self._arrivals.values()):
            arrival.cancel()


__all__ = ["ChatPipeline", "NotStarted"]
