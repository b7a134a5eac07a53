"""A round: one generation's prompt, its token budget and its plan.

Every round of a request is made the same way: the conversation rendered through the
model's own chat template (with the operator's instructions and the request's tools),
fitted into the context window before any prefill (trimming the oldest turns when the
context policy allows it, for the request's first round only), and planned (grammar,
output parsing). All of it is CPU work that must not stall the event loop, so a round is
built in one worker-thread hop: on the image threads (:mod:`afmd.service.image_pool`)
when a vision model decodes the request's images, on the grammar threads
(:mod:`afmd.service.grammar_pool`) when it may compile a grammar, else on asyncio's
default executor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from afmd.core.request import CONTEXT_WINDOW_PARAM, ChatRequest, context_limit
from afmd.engine.apple.conversation import SystemTurn, system_turn
from afmd.engine.models.loaded_model import LoadedModel
from afmd.engine.models.prompt_bound import PromptTooLong
from afmd.errors import ContextLengthError, InvalidRequestError, request_timeout_error
from afmd.grammar.sandbox import COMPILE_DEADLINE, CompileAbandoned
from afmd.service import image_pool
from afmd.service.chat_template import template_messages, template_tools
from afmd.service.context_trim import droppable_units, without_units
from afmd.service.grammar_pool import GRAMMAR_THREADS, may_compile
from afmd.service.output_plan import (
    OutputPlan,
    check_schemas,
    plan_output,
    shows_tools,
    template_kwargs,
)
from afmd.service.prompt_prefix import continued

if TYPE_CHECKING:
    from afmd.service.images import Headers


@dataclass(slots=True)
class Round:
    """One generation: the conversation as the model sees it, and how it is generated."""

    request: ChatRequest
    prompt: list[int]
    max_tokens: int
    plan: OutputPlan
    trimmed: int = 0  # messages dropped to fit the context window
    # A vision model's image inputs for this prompt (None: no image).
    vision: dict[str, Any] | None = None
    #: What a model that reads the conversation itself is given instead of ``prompt``
    #: (Apple's on-device model).
    conversation: SystemTurn | None = None
    #: Tokens of the request's ``prompt_prefix`` left out to fit the context window.
    trimmed_prefix: int = 0


class RoundBuilder:
    """How one request's rounds are made; its tools are the same in every round."""

    __slots__ = ("_deadline", "_headers", "_inputs", "_instructions", "_pictures",
                 "_server_tools", "_tools", "_trim", "model", "offload")

    def __init__(
        self, model: LoadedModel, request: ChatRequest, *, instructions: str, trim: bool,
        server_tools: frozenset[str] = frozenset(), deadline: float | None = None,
        headers: Headers | None = None,
    ) -> None:
        self.model = model
        #: The request's deadline (``time.monotonic()``): a round still being built then
        #: is the request's 504, and trimming renders no further.
        self._deadline = deadline
        self._instructions = instructions
        self._trim = trim
        self._server_tools = server_tools  # their calls run inside a model that calls tools
        # Converted once per request, not per render (trimming renders several times).
        self._tools = template_tools(request.tools)
        # A vision model's decoded images, kept while one round is built (trimming renders
        # several times), and the image inputs of the rounds built, until release().
        self._pictures: dict[int, Any] = {}
        self._inputs: list[dict[str, Any]] = []
        # The request's pictures as opened for its pixel total, decoded from by the first
        # round built (or count) instead of opened again; let go after it.
        self._headers = headers
        #: How the builder's blocking work is run off the event loop.
        self.offload: Callable[..., Awaitable[Any]] = (
            image_pool.IMAGE_THREADS.run if request.has_images and model.vision is not None
            else GRAMMAR_THREADS.run if may_compile(request)
            else asyncio.to_thread)

    async def first(self, request: ChatRequest) -> Round:
        """The request's first round: trimmed if the policy allows, ``tool_choice`` binds."""
        return await self.bounded(self._build, request, self._trim, True)

    async def next(self, request: ChatRequest) -> Round:
        """A round afmd adds after server tools ran, free of ``tool_choice`` (which binds
        the request's first step only), and trimmed as the first was when the policy
        allows: a tool's output may be what pushes the conversation past the window, and
        the request asked for old turns to go rather than fail."""
        return await self.bounded(self._build, request, self._trim, False)

    async def bounded(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``call`` off the event loop, given up at the deadline with the request's 504.

        Trimming renders the conversation again for each step of its search, and a body of
        hundreds of thousands of short turns takes seconds a render: the request was
        answered well past its deadline, and with a slower template past the server's
        response timeout, as a 500. The thread's render in progress ends by itself, and
        trimming looks at the deadline before each render."""
        if self._deadline is None:
            return await self.offload(call, *args, **kwargs)
        # The thread runs in this context: a compile it reaches waits for the compile
        # worker no longer than the deadline.
        token = COMPILE_DEADLINE.set(self._deadline)
        try:
            async with asyncio.timeout(max(self._deadline - time.monotonic(), 0.0)):
                return await self.offload(call, *args, **kwargs)
        except (TimeoutError, CompileAbandoned):
            raise request_timeout_error() from None
        finally:
            COMPILE_DEADLINE.reset(token)

    def release(self) -> None:
        """Let go of the image inputs of the rounds built: the request is over. A finished
        run's objects refer to each other (the run and its generator, its control's
        callbacks), so they wait for the garbage collector, which may not come for several
        requests, and a vision model's processed images (hundreds of megabytes for a few
        large pictures) would wait with them."""
        for inputs in self._inputs:
            inputs.clear()
        self._inputs.clear()

    def render(self, request: ChatRequest) -> list[int]:
        """The prompt's token ids (a template error is the conversation's fault: a 400)."""
        return self._render(request)[0]

    def prompt_tokens(self, request: ChatRequest, *, must_fit: bool = False) -> int:
        """What the conversation takes of the context window (blocking): trimmed as the
        turn would trim it, when the builder trims. ``must_fit``: a prompt that leaves no
        room for one token of answer is the context error a turn would get (Anthropic's
        count_tokens refuses what its create would), and one far past the window is
        refused as a turn refuses it, counted only until it clearly is (an exact count
        is the answer only where the route answers one whatever the window)."""
        if self.model.reads_conversation:
            worker: Any = self.model.worker
            return int(worker.prompt_tokens(self._conversation(request, True)))
        limit, own = context_limit(self.model.context_length, request.context_window)
        try:
            prompt: list[int] | None
            over = 0
            if must_fit and self.model.vision is None:
                prompt, over = self._within(request, limit)
            else:
                prompt = self.render(request)
            if (prompt is None or len(prompt) >= limit) and self._trim:
                fitted, prompt, _, over = self._fit(request, limit, 1)
                if prompt is None and not must_fit:
                    prompt = self.render(fitted)
        finally:
            self._pictures.clear()
            self._headers = None
        if prompt is None:  # far past the window, trimmed as far as it goes or not at all
            raise _context_error(limit, over, None, own, at_least=True)
        if must_fit and len(prompt) >= limit:
            raise _context_error(limit, len(prompt), None, own)
        return len(prompt)

    def _conversation(self, request: ChatRequest, first_step: bool) -> SystemTurn:
        if request.continue_final:  # the framework starts every answer afresh
            raise InvalidRequestError(
                f"The model '{self.model.id}' does not continue a prefilled assistant "
                "message; end the conversation with a user message.",
                code="invalid_last_message", param="messages")
        check_schemas(request)
        return system_turn(request, instructions=self._instructions, first_step=first_step,
                           server_tools=self._server_tools)

    def _conversation_round(self, request: ChatRequest, first_step: bool) -> Round:
        """A round of a model that reads the conversation itself (Apple's): no template,
        no token ids and no grammar (the framework shapes its own output); the plan only
        reads the answer back: stop sequences, calls, the JSON answer's check."""
        if request.logprobs is not None:
            raise InvalidRequestError(
                f"The model '{self.model.id}' does not report log-probabilities.",
                code="invalid_value", param="logprobs")
        for name, given in (("logit_bias", bool(request.logit_bias)),
                            ("presence_penalty", request.presence_penalty != 0.0),
                            ("frequency_penalty", request.frequency_penalty != 0.0)):
            if given:  # the framework samples by itself: nothing to apply them to
                raise InvalidRequestError(
                    f"The model '{self.model.id}' does not take '{name}'.",
                    code="invalid_value", param=name)
        turn = self._conversation(request, first_step)
        response_format = request.response_format
        answers_json = response_format is not None and turn.forced is None
        plan = OutputPlan(
            downgraded=turn.downgraded,
            stops=request.stop,
            tools=self._tools,
            max_calls=None if request.parallel_tool_calls else 1,
            schema=response_format.schema if answers_json and response_format else None,
            json_answer=answers_json,
        )
        limit = self.model.context_length
        max_tokens = request.max_tokens if request.max_tokens is not None else limit
        return Round(request, [], max_tokens, plan, conversation=turn)

    def _within(self, request: ChatRequest, limit: int) -> tuple[list[int] | None, int]:
        """The prompt's token ids, or None and the tokens it holds at least when it is far
        past the window ``limit``: a body of megabytes is not encoded whole only to be
        refused (:mod:`afmd.engine.models.prompt_bound`)."""
        try:
            return self._render(request, bound=limit)[0], 0
        except PromptTooLong as exc:
            return None, exc.at_least

    def _render(self, request: ChatRequest, bound: int | None = None,
                ) -> tuple[list[int], dict[str, Any] | None]:
        """The prompt's token ids and, for a vision model, its image inputs; ``bound``:
        the window, past which a text prompt far longer is :class:`PromptTooLong`."""
        vision = self.model.vision
        messages = template_messages(request.messages, instructions=self._instructions,
                                     images=vision is not None)
        tools = self._tools if shows_tools(request, self.model) else None
        # The client's chat_template_kwargs win over what afmd derives (reasoning_effort).
        kwargs = {**template_kwargs(request, self.model), **request.chat_template_kwargs}
        try:
            if vision is not None:
                return vision.render(messages, tools=tools, template_kwargs=kwargs,
                                     decoded=self._pictures, headers=self._headers,
                                     continue_final=request.continue_final)
            ids = self.model.render_prompt(messages, tools=tools, template_kwargs=kwargs,
                                           continue_final=request.continue_final, bound=bound)
            return continued(request.prompt_prefix, ids, self.model.bos_id), None
        except (InvalidRequestError, PromptTooLong):  # an image's own; a prompt far too long
            raise
        except Exception as exc:  # template errors are about the conversation's shape
            raise InvalidRequestError(
                f"The model's chat template could not render these messages: {exc}",
                code="invalid_value",
                param="messages",
            ) from None

    def _build(self, request: ChatRequest, trim: bool, first_step: bool) -> Round:
        try:
            built = self._round(request, trim, first_step)
        finally:
            # Not kept past the build (a later round, after server tools, decodes them
            # again): a finished run waits for the garbage collector (see release), and
            # its pictures, three bytes a pixel, waited with it.
            self._pictures.clear()
            self._headers = None
        if built.vision is not None:
            self._inputs.append(built.vision)
        return built

    def _round(self, request: ChatRequest, trim: bool, first_step: bool) -> Round:
        if self.model.reads_conversation:
            return self._conversation_round(request, first_step)
        limit, own = context_limit(self.model.context_length, request.context_window)
        budget = request.max_tokens
        # The room the prompt must leave: all of max_tokens, unless it is only a cap.
        need = budget if budget is not None and not request.max_tokens_shrinks else 1
        if self.model.vision is not None:  # its images are decoded once, here
            found: list[int] | None
            found, vision = self._render(request)
            over = 0
        else:
            (found, over), vision = self._within(request, limit), None
        trimmed = dropped = 0
        if (found is None or len(found) + need > limit) and trim and request.prompt_prefix:
            # The earlier turns the prefix holds are the oldest, and go first, whole: their
            # ids say nothing of where a turn starts, and a turn cut in the middle would
            # read as another (Ollama's llama.cpp engine cuts tokens from the front).
            dropped = len(request.prompt_prefix)
            request = dataclasses.replace(request, prompt_prefix=())
            found, over = self._within(request, limit)
        if (found is None or len(found) + need > limit) and trim:
            request, found, trimmed, over = self._fit(request, limit, need)
            vision = self._render(request)[1] if vision is not None else None
        if found is None:  # far past the window, trimmed as far as it goes or not at all
            raise _context_error(limit, over, None, own, at_least=True)
        prompt = found
        if budget is not None and not request.max_tokens_shrinks:
            if len(prompt) + budget > limit:
                raise _context_error(limit, len(prompt), budget, own)
            max_tokens = budget
        else:
            max_tokens = limit - len(prompt)
            if max_tokens < 1:
                raise _context_error(limit, len(prompt), None, own)
            if budget is not None:
                max_tokens = min(budget, max_tokens)
        plan = plan_output(request, self.model, prompt, max_tokens, first_step=first_step,
                         template_tools=self._tools)
        plan.prepare_processors()  # the grammar matcher is built here, off the event loop
        return Round(request, prompt, max_tokens, plan, trimmed, vision, trimmed_prefix=dropped)

    def _fit(
        self, request: ChatRequest, limit: int, budget: int
    ) -> tuple[ChatRequest, list[int] | None, int, int]:
        """Drop the fewest oldest units that make the prompt fit (binary search): the
        request, its prompt (None: far past the window even so, see :meth:`_within`),
        the messages dropped, and the tokens a prompt far past the window holds at least."""
        units = droppable_units(request.messages)
        best: tuple[ChatRequest, list[int] | None, int, int] | None = None
        lo, hi = 1, len(units)
        while lo <= hi:
            if self._deadline is not None and time.monotonic() >= self._deadline:
                raise request_timeout_error()
            mid = (lo + hi) // 2
            messages, dropped = without_units(request.messages, units, mid)
            candidate = dataclasses.replace(request, messages=messages)
            prompt, _ = self._within(candidate, limit)
            if prompt is not None and len(prompt) + budget <= limit:
                best = (candidate, prompt, dropped, 0)
                hi = mid - 1
            else:
                lo = mid + 1
        if best is None:  # even the protected messages do not fit: report as usual
            messages, dropped = without_units(request.messages, units, len(units))
            candidate = dataclasses.replace(request, messages=messages)
            prompt, over = self._within(candidate, limit)
            return candidate, prompt, dropped, over
        return best


def _context_error(limit: int, prompt: int, completion: int | None,
                   own: bool, *, at_least: bool = False) -> ContextLengthError:
    """``own``: the window is the request's ``context_window``, which the error names.

    A prompt that alone fills the window is worded as OpenAI words it for its current
    models, ``Input tokens exceed the configured limit``: clients tell a context overflow
    from other 400s by that phrase (LangChain's ``ContextOverflowError``, LiteLLM's
    ``ContextWindowExceededError``), and the openai SDK no longer puts the error's code in
    the exception's text, so the message is all they read. A prompt that fits but leaves
    no room for the ``max_tokens`` asked keeps the wording that names both parts.
    ``at_least``: ``prompt`` is what was counted before counting stopped, far past the
    window (:mod:`afmd.engine.models.prompt_bound`), not the whole prompt's count."""
    param = CONTEXT_WINDOW_PARAM if own else "messages"
    if completion is not None and prompt < limit:
        return ContextLengthError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt + completion} tokens ({prompt} in the messages, {completion} in the "
            "completion). Please reduce the length of the messages or completion.",
            prompt_tokens=prompt, limit=limit, param=param)
    return ContextLengthError(
        f"Input tokens exceed the configured limit of {limit} tokens. Your messages "
        f"resulted in {'at least ' if at_least else ''}{prompt} tokens. Please reduce the "
        "length of the messages.",
        prompt_tokens=prompt, limit=limit, param=param)
