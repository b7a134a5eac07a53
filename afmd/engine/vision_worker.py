"""A vision model's generation thread: one request at a time, in arrival order.

mlx-vlm's ``generate_step`` prefills the prompt with its images' features and decodes
one sequence; an image prompt's multimodal rotary positions and vision features do not
fit mlx-lm's continuous batch, so a vision model's requests take turns instead. The
thread emits the events a text model's does (:mod:`afmd.engine.base`), in hand-offs
paced like :class:`afmd.engine.worker.BatchWorker`'s, and looks at cancellation between
tokens, of the running request and of those waiting for their turn.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Any

import mlx.core as mx
import numpy as np

from afmd.engine.base import Event, Finished, Generation, PromptLogprobs, Text, TokenLogprob
from afmd.engine.detokenize import ExactDetokenizer
from afmd.errors import InvalidRequestError, ServerError

log = logging.getLogger("afmd.engine")

_WAKE = object()
_STOP = object()
_FLUSH_INTERVAL_S = 0.008


class VisionWorker:
    """Generates one request at a time for a vision model, on its own thread.

    Offers the pipeline what :class:`afmd.engine.worker.BatchWorker` does (``submit``,
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
        self._thread = threading.Thread(target=self._run, name=f"afmd-vision-{name}",
                                        daemon=True)
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
                    _fail(generation, ServerError("The model failed while generating.",
                                                  code="generation_failed"))
                finally:
                    self._cache = None
        error = ServerError("The server is shutting down.", code="shutting_down")
        self._drain(block=False)
        for generation in self._waiting:
            _fail(generation, error)

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
            _push(generation, [_finished(generation, "cancelled", 0, 0, 0, time.perf_counter(),
                                         0.0)])

    def _generate(self, generation: Generation) -> None:
        from mlx_vlm.generate.ar import generate_step
        from mlx_vlm.models.cache import make_prompt_cache

        from afmd.engine.worker import make_sampler

        request = generation.request
        started = time.perf_counter()
        pending: list[Event] = []
        if request.prompt_logprobs is not None:
            pending.append(PromptLogprobs(self._prompt_logprobs(request.prompt,
                                                                request.prompt_logprobs)))
        if request.max_tokens <= 0:
            pending.append(_finished(generation, "length", 0, 0, 0, started, started))
            _push(generation, pending)
            return
        vision = dict(request.vision or {})
        pixel_values = vision.pop("pixel_values", None)
        language = self._model.language_model
        for attr in ("_position_ids", "_rope_deltas"):  # multimodal rotary state
            if hasattr(language, attr):
                setattr(language, attr, None)
        self._cache = make_prompt_cache(language)
        processors = list(request.logits_processors)
        if request.sampling.repetition_penalty:
            from mlx_lm.sample_utils import make_logits_processors

            processors.extend(make_logits_processors(
                repetition_penalty=request.sampling.repetition_penalty))
        sampler = make_sampler(request.sampling) or _argmax
        stop_ids = self._eos.union(request.stop_ids)
        detokenizer = (ExactDetokenizer(self._tokenizer) if request.verbatim
                       else self._tokenizer.detokenizer)
        think = request.think_ids
        in_reasoning = request.starts_in_reasoning
        completion = reasoning = 0
        first_token_at = 0.0
        last_flush = started
        reason = "length"
        steps = generate_step(
            mx.array([request.prompt]), self._model, pixel_values, None,
            max_tokens=request.max_tokens, sampler=sampler,
            logits_processors=processors or None, prompt_cache=self._cache, **vision,
        )
        try:
            for token, logprobs in steps:
                now = time.perf_counter()
                first_token_at = first_token_at or now
                if generation.cancel_requested:
                    reason = "cancelled"
                    break
                if token in stop_ids:
                    reason = "stop"
                    break
                completion += 1
                if think is not None:
                    in_reasoning = in_reasoning or token == think[0]
                    reasoning += in_reasoning
                    in_reasoning = in_reasoning and token != think[1]
                detokenizer.add_token(token)
                segment = detokenizer.last_segment
                if request.logprobs is not None:
                    pending.append(Text(segment, 1, (_logprob(logprobs, token,
                                                              request.logprobs),)))
                else:
                    _append_text(pending, segment)
                if completion == 1 or now - last_flush >= _FLUSH_INTERVAL_S:
                    _push(generation, pending)
                    pending = []
                    last_flush = now
                self._drain(block=False)
                self._reap_waiting()
                if self._stopping:
                    raise _Stopping
        except _Stopping:
            _fail(generation, ServerError("The server is shutting down.",
                                          code="shutting_down"))
            return
        finally:
            steps.close()
        detokenizer.finalize()
        if detokenizer.last_segment:
            pending.append(Text(detokenizer.last_segment, 0))
        pending.append(_finished(generation, reason, len(request.prompt), completion,
                                 reasoning, started, first_token_at))
        _push(generation, pending)

    def _prompt_logprobs(self, prompt: list[int], top: int) -> tuple[TokenLogprob, ...]:
        """The prompt's own tokens' log-probabilities (echo), text prompts only."""
        logits = self._model.language_model(mx.array([prompt])).logits[0].astype(mx.float32)
        rows = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        out = [TokenLogprob(prompt[0], None)]
        for i in range(1, len(prompt)):
            out.append(_entry(rows[i - 1], prompt[i], top))
        return tuple(out)


class _Stopping(Exception):
    """The server stops while a request is generating."""


def _argmax(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def _append_text(pending: list[Event], segment: str) -> None:
    if segment:
        pending.append(Text(segment, 1))
    elif pending and isinstance(pending[-1], Text):
        pending[-1] = Text(pending[-1].text, pending[-1].tokens + 1)
    else:
        pending.append(Text("", 1))


def _entry(row: np.ndarray, token: int, top: int) -> TokenLogprob:
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        index = np.argpartition(-row, top)[:top]
        index = index[np.argsort(-row[index], kind="stable")]
        best = tuple((int(i), float(row[i])) for i in index)
    return TokenLogprob(token, float(row[token]), best)


def _logprob(logprobs: mx.array, token: int, top: int) -> TokenLogprob:
    return _entry(np.array(logprobs.astype(mx.float32)).reshape(-1), token, top)


def _finished(generation: Generation, reason: str, prompt: int, completion: int,
              reasoning: int, started: float, first_token_at: float) -> Finished:
    now = time.perf_counter()
    return Finished(
        finish_reason=reason,
        prompt_tokens=prompt,
        completion_tokens=completion,
        reasoning_tokens=reasoning,
        timings={
            "queued_at": generation.created_at,
            "started_at": started,
            "first_token_at": first_token_at or now,
            "finished_at": now,
        },
        peak_memory_bytes=mx.get_peak_memory(),
    )


def _push(generation: Generation, events: list[Event]) -> None:
    if events:
        with contextlib.suppress(RuntimeError):  # that loop closed (shutdown, tests)
            generation._loop.call_soon_threadsafe(generation.push, events)


def _fail(generation: Generation, error: InvalidRequestError | ServerError) -> None:
    with contextlib.suppress(RuntimeError):
        generation._loop.call_soon_threadsafe(generation.fail, error)
