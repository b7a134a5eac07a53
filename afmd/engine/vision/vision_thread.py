"""A vision model's generation thread: one request at a time, in arrival order.

mlx-vlm's ``generate_step`` prefills the prompt with its images' features and decodes
one sequence; an image prompt's multimodal rotary positions and vision features do not
fit mlx-lm's continuous batch, so a vision model's requests take turns instead. The
thread emits the events a text model's does (:mod:`afmd.engine.generation`; the running
request's are :mod:`afmd.engine.vision.vision_stream`'s), and looks at cancellation between
tokens, of the running request and of those waiting for their turn.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any

import mlx.core as mx

from afmd.engine.generation import Event, Generation, PromptLogprobs
from afmd.engine.vision.vision_stream import (
    VisionStream,
    fail,
    finished,
    prompt_logprobs,
    push,
    sampling,
)
from afmd.engine.worker_threads import WorkerThread
from afmd.errors import ServerError

log = logging.getLogger("afmd.engine")

_WAKE = object()
_STOP = object()


class VisionWorker:
    """Generates one request at a time for a vision model, on its own thread.

    Offers the pipeline what :class:`afmd.engine.batch.generation_thread.BatchWorker` does
    (``submit``,
    ``wake``, ``stop``, the KV bytes it holds), so a vision model is driven like any.
    """

    def __init__(self, model: Any, tokenizer: Any, *, name: str) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._waiting: list[Generation] = []
        self._cache: list[Any] | None = None
        self._stopping = False
        self._thread = WorkerThread(self._run, f"afmd-vision-{name}")
        self._started = False

    # -- event-loop side --
    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def submit(self, generation: Generation) -> None:
        self._inbox.put(generation)

    def wake(self) -> None:
        self._inbox.put(_WAKE)

    def stop(self, timeout: float = 5.0) -> None:
        if self._started:
            self._inbox.put(_STOP)
            self._thread.join(timeout)

    @property
    def cache_bytes(self) -> int:
        return 0  # no prefix cache: image prompts rarely share one

    @property
    def live_cache_bytes(self) -> int:
        cache = self._cache
        try:
            return sum(c.nbytes for c in cache) if cache else 0
        except Exception:  # swapped under the read: right next time
            return 0

    # -- thread side --
    def _run(self) -> None:
        while not self._stopping:
            self._drain(block=not self._waiting)
            self._reap_waiting()
            if self._waiting and not self._stopping:
                generation = self._waiting.pop(0)
                try:
                    self._generate(generation)
                except Exception:
                    log.exception("vision generation failed")
                    fail(generation, ServerError("The model failed while generating.",
                                                 code="generation_failed"))
                finally:
                    self._cache = None
        error = ServerError("The server is shutting down.", code="shutting_down")
        self._drain(block=False)
        for generation in self._waiting:
            fail(generation, error)

    def _drain(self, *, block: bool) -> None:
        items = [self._inbox.get()] if block else []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if item is _STOP:
                self._stopping = True
            elif isinstance(item, Generation):
                self._waiting.append(item)

    def _reap_waiting(self) -> None:
        """Requests cancelled while they waited end now, not when their turn comes."""
        for generation in [g for g in self._waiting if g.cancel_requested]:
            self._waiting.remove(generation)
            push(generation, [finished(generation, "cancelled", 0, 0, 0, time.perf_counter(),
                                      0.0)])

    def _generate(self, generation: Generation) -> None:
        from mlx_vlm.generate import generate_step
        from mlx_vlm.models.cache import make_prompt_cache

        from afmd.engine.mlx_compat import reset_rope_state

        request = generation.request
        started = time.perf_counter()
        if generation.cancel_requested:  # since it was reaped: its inputs may be let go
            push(generation, [finished(generation, "cancelled", 0, 0, 0, started, 0.0)])
            return
        pending: list[Event] = []
        if request.prompt_logprobs is not None:
            scores = prompt_logprobs(self._model, request.prompt, request.prompt_logprobs,
                                     lambda: generation.cancel_requested)
            if scores is None:
                push(generation, [finished(generation, "cancelled", 0, 0, 0, started, 0.0)])
                return
            pending.append(PromptLogprobs(scores))
        if request.max_tokens <= 0:  # the prompt's numbers alone: its tokens still count
            pending.append(finished(generation, "length", len(request.prompt), 0, 0, started,
                                    started))
            push(generation, pending)
            return
        vision = dict(request.vision or {})
        pixel_values = vision.pop("pixel_values", None)
        language = self._model.language_model
        reset_rope_state(language)
        self._cache = make_prompt_cache(language)
        sampler, processors = sampling(request)
        stream = VisionStream(generation, self._tokenizer, self._eos, started, pending)
        steps = generate_step(
            mx.array([request.prompt]), self._model, pixel_values, None,
            max_tokens=request.max_tokens, sampler=sampler,
            logits_processors=processors or None, prompt_cache=self._cache, **vision,
        )
        try:
            for token, logprobs in steps:
                if not stream.step(token, logprobs):  # type: ignore[arg-type]  # mlx-vlm yields y.item(), an int, typed as an array
                    break
                self._drain(block=False)
                self._reap_waiting()
                if self._stopping:
                    raise _Stopping
        except _Stopping:
            fail(generation, ServerError("The server is shutting down.",
                                         code="shutting_down"))
            return
        finally:
            steps.close()
        stream.finish()


class _Stopping(Exception):
    """The server stops while a request is generating."""
