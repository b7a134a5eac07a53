"""One vision request's tokens as the events a text model's thread emits.

The vision thread (:mod:`afmd.engine.vision.vision_thread`) decides whose turn it is; this turns
that request's tokens into text, log-probabilities and token counts, handed to its event
loop in batches paced like :class:`afmd.engine.batch.generation_thread.BatchWorker`'s so that a fast
model
does not wake the loop once per token.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from afmd.engine.batch.detokenize import ExactDetokenizer
from afmd.engine.generation import (
    Event,
    Finished,
    Generation,
    GenerationRequest,
    Text,
    TokenIdLogprob,
)
from afmd.engine.reasoning_count import ReasoningCount
from afmd.errors import InvalidRequestError, ServerError

FLUSH_INTERVAL_S = 0.008


class VisionStream:
    """The running request's events, counts and finish reason."""

    def __init__(
        self, generation: Generation, tokenizer: Any, eos: frozenset[int], started: float,
        pending: list[Event],
    ) -> None:
        request = generation.request
        self._generation = generation
        self._request = request
        self._stop_ids = eos.union(request.stop_ids)
        self._detokenizer = (ExactDetokenizer(tokenizer) if request.verbatim
                             else tokenizer.detokenizer)
        self._pending = pending  # what comes before the first token (prompt logprobs)
        self._reasoning = (None if request.reasoning is None else
                           ReasoningCount(request.reasoning, inside=request.starts_in_reasoning))
        self._completion = 0
        self._started = started
        self._first_token_at = 0.0
        self._last_flush = started
        self.reason = "length"

    def step(self, token: int, logprobs: mx.array) -> bool:
        """Emit ``token``; False when it ends the generation instead (:attr:`reason`)."""
        now = time.perf_counter()
        self._first_token_at = self._first_token_at or now
        if self._generation.cancel_requested:
            self.reason = "cancelled"
            return False
        if token in self._stop_ids:
            self.reason = "stop"
            return False
        request = self._request
        self._completion += 1
        if token in request.hidden_ids:
            segment = ""  # never detokenized (see Row.take)
        else:
            self._detokenizer.add_token(token)
            segment = self._detokenizer.last_segment
        if self._reasoning is not None:
            self._reasoning.take(segment)
        if request.logprobs is not None:
            self._pending.append(Text(segment, 1, (_logprob(logprobs, token,
                                                            request.logprobs),)))
        else:
            _append_text(self._pending, segment)
        if self._completion == 1 or now - self._last_flush >= FLUSH_INTERVAL_S:
            push(self._generation, self._pending)
            self._pending = []
            self._last_flush = now
        return True

    def finish(self) -> None:
        self._detokenizer.finalize()
        if self._detokenizer.last_segment:
            self._pending.append(Text(self._detokenizer.last_segment, 0))
        self._pending.append(finished(
            self._generation, self.reason, len(self._request.prompt), self._completion,
            self._reasoning.tokens if self._reasoning is not None else 0, self._started,
            self._first_token_at))
        push(self._generation, self._pending)


def sampling(request: GenerationRequest) -> tuple[Any, list[Any]]:
    """The request's sampler and logits processors, as mlx-vlm's ``generate_step`` takes
    them."""
    from afmd.engine.batch.admission import make_sampler
    from afmd.engine.batch.penalties import sampling_processors

    processors = [*request.logits_processors,
                  *sampling_processors(request.sampling, request.max_tokens)]
    return make_sampler(request.sampling) or _argmax, processors


#: Prompt positions scored per forward pass: bounds the float32 logits held at once.
PROMPT_CHUNK = 64


def prompt_logprobs(model: Any, prompt: list[int], top: int,
                    cancelled: Callable[[], bool] = lambda: False,
                    ) -> tuple[TokenIdLogprob, ...] | None:
    """The prompt's own tokens' log-probabilities (echo), text prompts only; None when
    ``cancelled`` says so between two chunks. A chunk of positions at a time through a
    KV cache: the whole prompt's logits at once were its length times the vocabulary in
    float32, several times over, gigabytes for one long prompt."""
    from mlx_vlm.models.cache import make_prompt_cache

    from afmd.engine.mlx_compat import reset_rope_state

    language = model.language_model
    reset_rope_state(language)
    cache = make_prompt_cache(language)
    out = [TokenIdLogprob(prompt[0], None)]
    for start in range(0, len(prompt) - 1, PROMPT_CHUNK):
        if cancelled():
            return None
        chunk = prompt[start : min(start + PROMPT_CHUNK, len(prompt) - 1)]
        logits = language(mx.array([chunk]), cache=cache).logits[0].astype(mx.float32)
        rows = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        out += [_entry(rows[i], token, top)
                for i, token in enumerate(prompt[start + 1 : start + 1 + len(chunk)])]
    return tuple(out)


def finished(generation: Generation, reason: str, prompt: int, completion: int,
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


def push(generation: Generation, events: list[Event]) -> None:
    if events:
        with contextlib.suppress(RuntimeError):  # that loop closed (shutdown, tests)
            generation._loop.call_soon_threadsafe(generation.push, events)


def fail(generation: Generation, error: InvalidRequestError | ServerError) -> None:
    with contextlib.suppress(RuntimeError):
        generation._loop.call_soon_threadsafe(generation.fail, error)


def _argmax(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def _append_text(pending: list[Event], segment: str) -> None:
    if segment:
        pending.append(Text(segment, 1))
    elif pending and isinstance(pending[-1], Text):
        pending[-1] = Text(pending[-1].text, pending[-1].tokens + 1)
    else:
        pending.append(Text("", 1))


def _entry(row: np.ndarray, token: int, top: int) -> TokenIdLogprob:
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        index = np.argpartition(-row, top)[:top]
        index = index[np.argsort(-row[index], kind="stable")]
        best = tuple((int(i), float(row[i])) for i in index)
    return TokenIdLogprob(token, float(row[token]), best)


def _logprob(logprobs: mx.array, token: int, top: int) -> TokenIdLogprob:
    return _entry(np.array(logprobs.astype(mx.float32)).reshape(-1), token, top)


__all__ = ["FLUSH_INTERVAL_S", "VisionStream", "fail", "finished", "prompt_logprobs", "push",
           "sampling"]
