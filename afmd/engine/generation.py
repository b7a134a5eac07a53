"""The seam between the pipeline and the model: what a generation is and what it yields.

The pipeline never touches MLX. It hands the engine a :class:`GenerationRequest` (token ids
and sampling settings) and reads a :class:`Generation` — an asyncio-side handle fed by the
engine's thread — until a :class:`Finished` event. Keeping these types free of MLX lets the
layers above be tested with a fake engine and keeps mlx imports in one place.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from afmd.engine.reasoning_count import ReasoningMarkers
from afmd.errors import APIError

if TYPE_CHECKING:
    from afmd.core.request import ChatRequest, CompletionRequest


#: A ``temperature`` or ``top_p`` below this samples the likeliest token. Both are read in
#: float32: the inverse of such a temperature overflows, and such a nucleus rounds to no
#: mass at all, which mlx-lm's filter answers with a cut past the last token; either way
#: the draw was token 0 whatever the model said. Greedy decoding is what both tend to
#: (no single token has a probability this small to share the nucleus with).
VANISHING = 1e-30


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    repetition_context: int | None = None  # None: mlx-lm's default
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        """Only the likeliest token can be drawn. A nucleus of mass 0 (``top_p`` 0) is that
        token alone, as OpenAI and llama.cpp keep at least one; mlx-lm's filter reads 0 as
        "off", which sampled from the whole vocabulary instead."""
        return self.temperature < VANISHING or self.top_k == 1 or self.top_p < VANISHING

    @classmethod
    def of(cls, r: ChatRequest | CompletionRequest, choice: int = 0) -> SamplingParams:
        """A request's sampling settings (chat and completions name them alike); choice
        ``choice`` of several samples with the seed after the request's by as many."""
        seed = r.seed
        if seed is not None and choice:
            seed = (seed + choice) & 0xFFFF_FFFF_FFFF_FFFF
        return cls(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p,
                   repetition_penalty=r.repetition_penalty, seed=seed,
                   repetition_context=r.repetition_context,
                   presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty,
                   logit_bias=r.logit_bias)


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Extra per-sequence logits processors (grammars); opaque to this layer.
    logits_processors: Sequence[Callable[..., Any]] = ()
    # Record a memory/progress sample every this many tokens (0: none).
    sample_every: int = 0
    # The model's reasoning markers, to count reasoning tokens (None: it has none).
    reasoning: ReasoningMarkers | None = None
    starts_in_reasoning: bool = False
    # Log-probabilities of each generated token with this many alternatives (0-20; None:
    # none, and the row keeps the decode step's fast path), and of the prompt's own tokens
    # (echo), computed before generation starts.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Text exactly as ``tokenizer.decode`` of the generated ids (completions): mlx-lm's
    # streaming detokenizers trim the first token's leading space, as chat wants.
    verbatim: bool = False
    # Tokens besides the model's end-of-sequence ones that end generation, unseen (the end
    # markers of fill-in-the-middle).
    stop_ids: tuple[int, ...] = ()
    # Tokens that add no text (a chat answer's special tokens that its output chain does
    # not read: afmd.service.hidden_tokens), yet are generated like any other: counted,
    # with their log-probabilities.
    hidden_ids: frozenset[int] = frozenset()
    # The client's guess of the output (OpenAI's ``prediction``): proposed to the model
    # where the output so far agrees with it (afmd.engine.speculative.verification).
    prediction: str | None = None
    # A vision model's inputs besides the prompt ids (pixel values, image grids), opaque
    # to this layer; None: the prompt has no image.
    vision: Any = None
    # A model that reads the conversation itself instead of prompt ids (Apple's on-device
    # model: afmd.engine.apple.conversation.SystemTurn), opaque to this layer.
    conversation: Any = None
    # Runs one of the operator's server tools (name, JSON arguments) and returns what the
    # model reads as its output: for a model that calls tools itself mid-generation.
    run_tool: Callable[[str, str], Coroutine[Any, Any, str]] | None = None


@dataclass(frozen=True, slots=True)
class TokenIdLogprob:
    """One token's log-probability and the most likely tokens at its position, as ids: what
    the engine computes, before :mod:`afmd.engine.batch.tokens` describes each token as text and
    bytes (:class:`afmd.core.events.TokenLogprob`)."""

    token: int
    logprob: float | None  # None: a prompt's first token, which nothing predicts
    top: tuple[tuple[int, float], ...] = ()  # most likely first


@dataclass(frozen=True, slots=True)
class Text:
    """Decoded text of ``tokens`` new tokens (coalesced when the consumer is behind).

    ``logprobs``, when the request asked for them, has one entry per token, and each such
    event holds exactly one token: its text is what the detokenizer released on it.
    """

    text: str
    tokens: int
    logprobs: tuple[TokenIdLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """The prompt's own tokens with their log-probabilities (the first one's is None)."""

    tokens: tuple[TokenIdLogprob, ...]


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    #: Of ``cached_tokens``, those the block cache read from its disk tier (the rest were
    #: in RAM), for X-AFM-Profile.
    cached_disk_tokens: int = 0
    peak_memory_bytes: int | None = None
    # (seconds since start, tokens so far, active memory bytes) when sampling was asked.
    samples: tuple[tuple[float, int, int], ...] = ()
    # The prediction's tokens that appeared in the output, and the others (OpenAI's
    # accepted/rejected_prediction_tokens); per proposal source, the tokens verification
    # accepted and rejected and its passes.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    speculation: dict[str, dict[str, int]] = field(default_factory=dict)
    #: The ids the model wrote, as it wrote them: hidden special tokens, thinking and the
    #: end-of-sequence token that ended it included (the last is not counted in
    #: ``completion_tokens``). A prompt that starts with the prompt and these is the
    #: conversation continued exactly, and resumes from the prefix cache; a client gets
    #: them where its API returns token ids (Ollama's generate ``context``). None: the
    #: engine has no token ids to give (a vision model's, Apple's framework).
    output_ids: tuple[int, ...] | None = None

    def stopped_after(self, tokens: int) -> Finished:
        """This end as the client's stop made it, ``tokens`` in: a stop sequence is found on
        the event loop, and the engine decodes on until the stop reaches it, so the tokens
        it counted after the one that completed the match are not the answer's (OpenAI
        counts the answer through that token)."""
        if tokens >= self.completion_tokens:
            return self
        ids = self.output_ids[:tokens] if self.output_ids is not None else None
        return replace(self, completion_tokens=tokens,
                       reasoning_tokens=min(self.reasoning_tokens, tokens), output_ids=ids)


@dataclass(frozen=True, slots=True)
class ToolCalled:
    """A tool call a model made as a structure rather than as text (Apple's framework calls
    a tool object): numbered, given an id and budgeted like a written call."""

    name: str
    arguments: str  # JSON


@dataclass(frozen=True, slots=True)
class Refused:
    """The model declined to answer (Apple's framework says so instead of writing text):
    its explanation, which is not the answer's content."""

    text: str


Event = Text | PromptLogprobs | ToolCalled | Refused | Finished


@dataclass(slots=True)
class EmbeddingJob:
    """One embeddings request's sequences for the model's embedding thread.

    ``future`` receives a float32 numpy array, one row per input (the first
    ``dimensions`` of each vector when set), or the :class:`APIError` that ended it.
    """

    inputs: Sequence[Sequence[int]]
    future: asyncio.Future[Any]
    dimensions: int | None = None
    loop: asyncio.AbstractEventLoop = field(init=False)
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.loop = self.future.get_loop()

    def cancel(self) -> None:
        """Skip the job if its batch has not started; otherwise its sequences leave the
        batch's next forward pass, and what was encoded of them is dropped."""
        self.cancelled = True


class Generation:
    """The consumer's handle on one running generation.

    Events are appended from the engine thread through ``loop.call_soon_threadsafe`` and
    drained in batches, so a slow consumer gets several tokens per wake-up instead of one
    hop per token.
    """

    __slots__ = (
        "_error",
        "_events",
        "_loop",
        "_waiter",
        "cancel_requested",
        "created_at",
        "done",
        "finish",
        "first_token_seen_at",
        "request",
        "tokens",
    )

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self._loop = loop
        self._events: deque[Event] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: APIError | None = None
        self.cancel_requested = False
        self.done = False
        self.finish: Finished | None = None
        self.created_at = time.perf_counter()
        #: Tokens generated so far, as they reach the event loop: a live count that the
        #: dashboard's tokens-per-second reads while the generation runs.
        self.tokens = 0
        #: When its first token reached the event loop (a perf_counter reading): the time to
        #: first token of a generation cut off before its end (its client gone) reports,
        #: as its engine timings come with that end, after the request is logged.
        self.first_token_seen_at: float | None = None

    # -- engine side (called on the event loop via call_soon_threadsafe) --
    def push(self, events: Sequence[Event]) -> None:
        self._events.extend(events)
        for event in events:
            if isinstance(event, Text):
                self.tokens += event.tokens
                if self.first_token_seen_at is None and event.tokens:
                    self.first_token_seen_at = time.perf_counter()
            elif isinstance(event, Finished):
                self.done = True
                self.finish = event
        self._wake()

    def fail(self, error: APIError) -> None:
        self._error = error
        self.done = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- consumer side --
    def cancel(self) -> None:
        """Ask the engine to stop; it ends the stream with ``finish_reason="cancelled"``."""
        self.cancel_requested = True

    async def next_events(self) -> list[Event]:
        """Wait for at least one event and return all that are ready."""
        while not self._events:
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events = list(self._events)
        self._events.clear()
        return events
