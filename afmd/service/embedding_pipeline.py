"""From a validated embeddings request to its vectors, independent of HTTP and wire formats.

The service resolves the model (an embedding model: a chat model is a 400
``invalid_model_kind``), tokenizes off the event loop, refuses an input longer than the
model's context before any work (naming it: ``input[3]``), then takes a slot from the
same scheduler chat requests use, so embeddings share the queue, its 429 and its 504, and
hands the sequences to the model's embedding thread, which batches them with whatever
other requests are waiting (:mod:`afmd.engine.embedding_thread`). A request is findable by its
``X-Request-ID`` while it waits or runs, so it can be cancelled like a chat request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from afmd.config.tables import ModelEntry
from afmd.core.embedding_request import EmbeddingRequest, Embeddings
from afmd.core.request import CONTEXT_WINDOW_PARAM, context_limit
from afmd.engine.generation import EmbeddingJob
from afmd.engine.models.kinds import EMBEDDING
from afmd.engine.models.loaded_model import LoadedModel
from afmd.engine.models.model_registry import ModelRegistry
from afmd.engine.models.prompt_bound import PromptTooLong, check_bound, first_part, may_be_past
from afmd.engine.models.residency import Lease
from afmd.errors import (
    APIError,
    ConflictError,
    ContextLengthError,
    GatewayTimeoutError,
    InvalidRequestError,
    NotFoundError,
)
from afmd.service.scheduler import Arrival, Cancelled, Scheduler, Ticket

#: Texts are tokenized in parts of at most this many texts and characters, the request's
#: deadline and cancel looked at between two.
TOKENIZE_TEXTS = 1024
TOKENIZE_CHARS = 1 << 20
#: The most numbers one response may carry (inputs times the vectors' width): OpenAI's
#: 2048 inputs at a width of 8192, so no request OpenAI takes is refused for it by a
#: model that wide or narrower. Ollama's ``input`` has no count limit, and millions of
#: short texts fit in a body: their vectors, then their JSON, were held whole, gigabytes
#: for one request.
MAX_VALUES = 2048 * 8192


def timeout_error() -> GatewayTimeoutError:
    return GatewayTimeoutError(
        "The embeddings were not computed within the server's request_timeout.",
        code="timeout",
    )


def cancelled_error(request_id: str) -> ConflictError:
    """The 409 a cancelled request is answered. The official SDKs retry every 409 unless
    the answer says ``x-should-retry: false``: without it, the retry ran the embeddings
    the client had just cancelled."""
    return ConflictError(
        f"The request '{request_id}' was cancelled before its embeddings were computed.",
        code="request_cancelled",
        headers={"x-should-retry": "false"},
    )


@dataclass(slots=True)
class EmbeddingRun:
    """One request from queue to vectors: what the cancel endpoint acts on."""

    request_id: str
    ticket: Ticket = field(default_factory=Ticket)
    #: Its wait for the model, which a cancel cuts short.
    arrival: Arrival = field(default_factory=Arrival)
    job: EmbeddingJob | None = None
    cancelled: bool = False
    #: What the request is answered once cancelled (the shutdown's error, or 409).
    error: APIError | None = None

    def cancel(self, error: APIError | None = None) -> None:
        """Stop the request; the first reason wins (a shutdown after a client's cancel
        still answers the cancel)."""
        if self.cancelled:
            return
        self.cancelled = True
        self.error = error or cancelled_error(self.request_id)
        self.arrival.cancel()  # waiting for its model: it stops waiting
        self.ticket.cancel()  # still queued: it leaves the queue at once
        job = self.job
        if job is not None:
            job.cancel()  # not encoded yet: skipped; encoding: its result is dropped
            if not job.future.done():
                job.future.set_exception(self.error)


@dataclass
class EmbeddingService:
    registry: ModelRegistry
    scheduler: Scheduler
    request_timeout: float
    #: Whether another kind of request (a chat) is running under this X-Request-ID.
    taken: Callable[[str], bool] = lambda request_id: False
    _runs: dict[str, EmbeddingRun] = field(default_factory=dict)

    def find(self, request_id: str) -> EmbeddingRun | None:
        return self._runs.get(request_id)

    def cancel(self, request_id: str) -> bool:
        """Cancel the request with this id, waiting for its model, queued or embedding;
        False: none is (or it was cancelled already)."""
        run = self._runs.get(request_id)
        if run is None or run.cancelled:
            return False
        run.cancel()
        return True

    def interrupt(self, error: APIError) -> None:
        """End every request waiting for a slot or being embedded with ``error``: the
        server is stopping, and what still runs when its grace period ends is answered,
        not cut with its connection."""
        for run in list(self._runs.values()):
            run.cancel(error)

    async def embed(self, request: EmbeddingRequest, request_id: str) -> Embeddings:
        deadline = time.monotonic() + self.request_timeout
        entry = self.entry_for(request.model)
        # Findable by its id from now: a cancel while its model loads ends it too.
        run = self._register(request_id)
        started = time.monotonic()
        try:
            # Held until the vectors are out: a model in use is never unloaded.
            try:
                lease = await run.arrival.unless_cancelled(self.registry.lease(
                    entry, EMBEDDING, deadline=deadline, keep_alive=request.keep_alive),
                    Lease.release)
            except Cancelled:
                raise run.error or cancelled_error(request_id) from None
            waited = time.monotonic() - started
            try:
                return dataclasses.replace(await self._embed(lease, run, request, deadline),
                                           load_seconds=waited)
            finally:
                lease.release()
        finally:
            if self._runs.get(request_id) is run:
                del self._runs[request_id]

    async def _embed(
        self, lease: Lease, run: EmbeddingRun, request: EmbeddingRequest, deadline: float
    ) -> Embeddings:
        model = lease.model
        request_id = run.request_id
        self._check_dimensions(model, request.dimensions)
        self._check_size(model, request)
        sequences = await self._sequences(model, request, run, deadline)
        lease.ticket = run.ticket  # queued until it holds a slot: /health's counts
        try:
            try:
                await self.scheduler.acquire(run.ticket, deadline - time.monotonic())
            except Cancelled:
                raise run.error or cancelled_error(request_id) from None
            if run.error is not None:
                raise run.error
            assert model.embedder is not None
            future = asyncio.get_running_loop().create_future()
            run.job = EmbeddingJob(sequences, future, request.dimensions)
            model.embedder.submit(run.job)
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                    vectors = await future
            except TimeoutError:
                raise timeout_error() from None
        finally:
            if run.job is not None:
                run.job.cancel()
            self.scheduler.release(run.ticket)
        return Embeddings(
            vectors=vectors,
            prompt_tokens=sum(len(s) for s in sequences),
            model=request.model or model.id,
        )

    def entry_for(self, name: str | None) -> ModelEntry:
        """The configured embedding model ``name`` names; with none named, the default."""
        if name is None:
            entry = self.registry.default_for(EMBEDDING)
            if entry is None:
                raise NotFoundError(
                    "No embedding model is configured; add one with kind = \"embedding\".",
                    code="model_not_found",
                    param="model",
                )
        else:
            entry = self.registry.resolve(name)
        return entry

    @staticmethod
    def _check_dimensions(model: LoadedModel, dimensions: int | None) -> None:
        if dimensions is None:
            return
        full = model.hidden_size
        if dimensions > full:
            raise InvalidRequestError(
                f"'dimensions' is {dimensions}, but the model '{model.id}' makes vectors of "
                f"{full} dimensions; ask for {full} or fewer.",
                code="invalid_value",
                param="dimensions",
            )
        if dimensions < full and not model.embedding.matryoshka:
            raise InvalidRequestError(
                f"The model '{model.id}' does not support 'dimensions': its vectors are not "
                "trained to be shortened (Matryoshka). Omit 'dimensions'.",
                code="invalid_value",
                param="dimensions",
            )

    @staticmethod
    def _check_size(model: LoadedModel, request: EmbeddingRequest) -> None:
        width = request.dimensions or model.hidden_size
        most = max(MAX_VALUES // width, 1)
        if len(request.inputs) > most:
            raise InvalidRequestError(
                f"'input' has {len(request.inputs)} entries; the model '{model.id}' makes "
                f"vectors of {width} numbers, and one request may carry at most "
                f"{MAX_VALUES} numbers: send at most {most} inputs a request.",
                code="invalid_value",
                param="input",
            )

    async def _sequences(
        self, model: LoadedModel, request: EmbeddingRequest, run: EmbeddingRun,
        deadline: float,
    ) -> list[list[int]]:
        """Token ids per input, each checked against the model's vocabulary and context."""
        texts = await _bounded(model, request, run, deadline)
        encoded = iter(await _tokenize(model, texts, run, deadline))
        vocab = model.vocab_size
        window, own = context_limit(model.context_length, request.context_window)
        sequences: list[list[int]] = []
        appended: list[int] | None = None  # asked of the tokenizer once, if a text is cut
        for item, param in zip(request.inputs, request.params, strict=True):
            if isinstance(item, str):
                ids = next(encoded)
            else:
                ids = list(item)
                for j, token in enumerate(ids):
                    if token >= vocab:
                        raise InvalidRequestError(
                            f"'{param}[{j}]' is {token}, not a token id of the model "
                            f"'{model.id}' (its vocabulary has {vocab} tokens).",
                            code="invalid_value",
                            param=f"{param}[{j}]",
                        )
            if len(ids) > window and request.truncate:
                if isinstance(item, str) and appended is None:
                    appended = model.appended_ids()
                ids = _cut(ids, window, appended if isinstance(item, str) and appended else [])
            elif len(ids) > window:
                # OpenAI's words for an embedding input over the window, which clients
                # match to split and retry (LiteLLM's ContextWindowExceededError); the
                # param names the input, or the request's own window when that is it.
                raise ContextLengthError(
                    f"This model's maximum context length is {window} tokens, "
                    f"however you requested {len(ids)} tokens ({len(ids)} in your prompt; 0 "
                    "for the completion). Please reduce your prompt; or completion length.",
                    prompt_tokens=len(ids), limit=window,
                    param=CONTEXT_WINDOW_PARAM if own else param,
                )
            sequences.append(ids)
        return sequences

    def _register(self, request_id: str) -> EmbeddingRun:
        if request_id in self._runs or self.taken(request_id):
            raise ConflictError(
                f"A request with X-Request-ID '{request_id}' is already running; "
                "use a unique id per request.",
                code="duplicate_request_id",
                param="X-Request-ID",
            )
        run = self._runs[request_id] = EmbeddingRun(request_id)
        return run


def _cut(ids: list[int], window: int, appended: list[int]) -> list[int]:
    """A text's ids cut to ``window``, still ending in what the tokenizer appends to every
    text: cutting that off pooled a last-token model's vector at whatever token the cut
    fell on (the vector of no text), where Ollama, cutting the text and encoding it
    again, keeps it."""
    tail = len(appended)
    if tail and tail < window and ids[-tail:] == appended:
        return ids[: window - tail] + appended
    return ids[:window]


async def _bounded(model: LoadedModel, request: EmbeddingRequest, run: EmbeddingRun,
                   deadline: float) -> list[str]:
    """The texts to tokenize: one that would be cut to the context anyway, only its start;
    one far past the context, refused counted in pieces only until it clearly is (a text
    of megabytes encoded whole held gigabytes and a core for tens of seconds, to be cut
    or refused afterwards: :mod:`afmd.engine.models.prompt_bound`)."""
    window, own = context_limit(model.context_length, request.context_window)
    texts: list[str] = []
    for text, param in zip(request.inputs, request.params, strict=True):
        if not isinstance(text, str):
            continue
        if may_be_past(text, window) and request.truncate:
            text = first_part(text, window)
        elif may_be_past(text, window):
            if run.error is not None:
                raise run.error
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                    await asyncio.to_thread(check_bound, model.tokenizer, text, window)
            except TimeoutError:
                raise timeout_error() from None
            except PromptTooLong as exc:
                raise ContextLengthError(
                    f"This model's maximum context length is {window} tokens, however you "
                    f"requested at least {exc.at_least} tokens (at least {exc.at_least} in "
                    "your prompt; 0 for the completion). Please reduce your prompt; or "
                    "completion length.",
                    prompt_tokens=exc.at_least, limit=window,
                    param=CONTEXT_WINDOW_PARAM if own else param,
                ) from None
        texts.append(text)
    return texts


def _parts(texts: list[str]) -> list[list[str]]:
    """``texts`` in consecutive parts of at most ``TOKENIZE_TEXTS`` texts and, unless one
    text is longer alone, ``TOKENIZE_CHARS`` characters."""
    parts: list[list[str]] = []
    part: list[str] = []
    chars = 0
    for text in texts:
        if part and (len(part) >= TOKENIZE_TEXTS or chars + len(text) > TOKENIZE_CHARS):
            parts.append(part)
            part, chars = [], 0
        part.append(text)
        chars += len(text)
    if part:
        parts.append(part)
    return parts


async def _tokenize(
    model: LoadedModel, texts: list[str], run: EmbeddingRun, deadline: float
) -> list[list[int]]:
    """The texts' ids, tokenized on a thread part by part, so that a request whose
    deadline passes or that is cancelled meanwhile is answered then and stops: a body of
    millions of short texts (Ollama's ``input`` has no count limit) took minutes to
    tokenize at once, its 504 coming that long past ``request_timeout`` and its cancel
    unheard."""
    ids: list[list[int]] = []
    for part in _parts(texts):
        if run.error is not None:
            raise run.error
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise timeout_error()
        try:
            async with asyncio.timeout(remaining):
                ids += await asyncio.to_thread(model.tokenize, part)
        except TimeoutError:
            raise timeout_error() from None
    return ids
