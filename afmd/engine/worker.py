"""The generation thread: one per loaded model, decoding every running request together.

MLX work must stay off the event loop (a decode step holds the GIL for milliseconds, and a
long prefill for seconds), so each model owns a thread that drives mlx-lm's
``BatchGenerator``. Requests join the running batch between steps and leave when done;
cancellation is a flag checked once per step, so a cancelled or disconnected request frees
its slot within one decode step. Results of a step go to the event loop in one
``call_soon_threadsafe`` hop for all requests, not one per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

from afmd.engine.base import Event, Finished, Generation, PromptLogprobs, SamplingParams, Text
from afmd.engine.decode import DecodeBatch
from afmd.engine.detokenize import ExactDetokenizer
from afmd.engine.logprobs import prompt_logprobs, resolve
from afmd.engine.sampling import RowSampler
from afmd.engine.speculative import RowSpec, Standing
from afmd.errors import ServerError

log = logging.getLogger("afmd.engine")

_WAKE = object()
_FLUSH_INTERVAL_S = 0.008
# At most this long the thread waits for the loop to take a first token (see _step).
_FIRST_TOKEN_HANDOFF_S = 0.003
_STOP = object()


def make_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array] | None:
    """A per-request sampler with its own PRNG key (:class:`RowSampler`); ``None``
    means greedy: the batch then samples all greedy rows with one shared argmax."""
    return RowSampler.of(params)


@dataclass(slots=True)
class _Sequence:
    generation: Generation
    uid: int
    detokenizer: Any
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    started_at: float = 0.0
    first_token_at: float = 0.0
    pending: list[Event] = field(default_factory=list)
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    in_reasoning: bool = False
    reasoning_tokens: int = 0
    # Some text a client would see has been produced (see ``BatchWorker._step``).
    shown: bool = False
    # Alternatives per token when the request reports log-probabilities (else None).
    logprobs: int | None = None
    # Tokens that end this sequence unseen: the model's end-of-sequence ones and the
    # request's own (fill-in-the-middle end markers).
    stop_ids: frozenset[int] = frozenset()
    # Speculation's numbers, read when the sequence leaves (see DecodeBatch.spec_rows).
    spec: RowSpec | None = None


class BatchWorker:
    """Owns a model's ``BatchGenerator`` and the thread that steps it."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str,
        max_batch: int = 8,
        prefill_step_size: int = 2048,
        prompt_cache_bytes: int = 1 << 30,
        prompt_cache_entries: int = 16,
        prompt_lookup: bool = True,
        draft_model: Any = None,
    ) -> None:
        self._model = model
        self._prompt_lookup = prompt_lookup
        self._draft_model = draft_model
        # Owned by the thread: how each kind of proposal source fared lately.
        self._standing: dict[str, Standing] = {}
        self._tokenizer = tokenizer
        self._max_batch = max(1, max_batch)
        self._prefill_step_size = prefill_step_size
        self._eos = sorted(tokenizer.eos_token_ids)
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._active: dict[int, _Sequence] = {}
        self._thread = threading.Thread(target=self._run, name=f"afmd-engine-{name}", daemon=True)
        self._generator: BatchGenerator | None = None
        self._batch: DecodeBatch | None = None  # the generator's running batch
        self._started = False
        # Sequences with events not yet handed to the event loop, and when we last did.
        self._unflushed: dict[int, _Sequence] = {}
        self._last_flush = 0.0
        # Owned by the thread: KV states of finished requests, reused for shared prefixes.
        self._prompt_cache: LRUPromptCache | None = None
        if prompt_cache_bytes > 0 and prompt_cache_entries > 0:
            self._prompt_cache = LRUPromptCache(
                max_size=prompt_cache_entries, max_bytes=prompt_cache_bytes
            )
        self._cache_key = name
        # Fault injection for tests of the retry path: the first N decode steps fail as
        # a transient MLX error would (AFMD_INJECT_FAILURES=N, documented in the README).
        self._inject_failures = int(os.environ.get("AFMD_INJECT_FAILURES", "0") or 0)

    # -- event-loop side --
    def start(self) -> None:
        if not self._started:
            self._started = True
            # The decode thread needs the GIL back the moment MLX returns; with the default
            # 5 ms switch interval it can wait a whole interval behind the event loop.
            sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
            self._thread.start()

    def submit(self, generation: Generation) -> None:
        self._inbox.put(generation)

    @property
    def cache_bytes(self) -> int:
        """Bytes of KV state the prefix cache holds (a plain counter: safe to read from
        the event loop while the thread updates it)."""
        return self._prompt_cache.nbytes if self._prompt_cache is not None else 0

    @property
    def live_cache_bytes(self) -> int:
        """Bytes of KV state the running batch holds, read from the event loop: a cache
        the thread swaps meanwhile is counted at the next read."""
        batch = self._batch
        try:
            return sum(c.nbytes for c in batch.prompt_cache) if batch is not None else 0
        except Exception:  # a list resized under the read: 0 now, right next time
            return 0

    def wake(self) -> None:
        """Make the thread look at cancellation flags even if it is idle."""
        self._inbox.put(_WAKE)

    def stop(self, timeout: float = 5.0) -> None:
        if self._started:
            self._inbox.put(_STOP)
            self._thread.join(timeout)

    # -- thread side --
    def _new_generator(self) -> BatchGenerator:
        generator = BatchGenerator(
            self._model,
            max_tokens=256,
            stop_tokens=[[t] for t in self._eos],
            completion_batch_size=self._max_batch,
            prefill_batch_size=self._max_batch,
            prefill_step_size=self._prefill_step_size,
        )
        self._batch = DecodeBatch.install(generator)
        return generator

    def _run(self) -> None:
        self._generator = self._new_generator()
        while True:
            try:
                if not self._take_inbox(block=not self._active):
                    break
                self._reap_cancelled()
                if self._active:
                    self._step()
            except Exception as exc:  # a model failure must not kill the thread
                log.exception("generation step failed")
                self._fail_all(exc)
        self._fail_all(None)

    def _take_inbox(self, *, block: bool) -> bool:
        items: list[Any] = []
        if block:
            items.append(self._inbox.get())
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if item is _STOP:
                return False
            if isinstance(item, Generation):
                self._admit(item)
        return True

    def _admit(self, generation: Generation) -> None:
        request = generation.request
        seq = _Sequence(
            generation=generation,
            uid=-1,
            detokenizer=(
                ExactDetokenizer(self._tokenizer) if request.verbatim
                else self._tokenizer.detokenizer
            ),
            prompt_tokens=len(request.prompt),
            started_at=time.perf_counter(),
            in_reasoning=request.starts_in_reasoning,
            logprobs=request.logprobs,
            stop_ids=frozenset(self._eos).union(request.stop_ids),
        )
        if generation.cancel_requested:
            self._finish(seq, "cancelled")
            self._flush([seq])
            return
        if request.prompt_logprobs is not None:
            seq.pending.append(PromptLogprobs(
                prompt_logprobs(self._model, request.prompt, request.prompt_logprobs)
            ))
        if request.max_tokens <= 0:  # the prompt's numbers were all that was asked
            seq.first_token_at = time.perf_counter()
            self._finish(seq, "length")
            self._flush([seq])
            return
        processors = list(request.logits_processors)
        if request.sampling.repetition_penalty:
            processors.extend(make_logits_processors(
                repetition_penalty=request.sampling.repetition_penalty
            ))
        assert self._generator is not None
        cache, rest = self._cached_prefix(request.prompt)
        seq.cached_tokens = len(request.prompt) - len(rest)
        sampler = make_sampler(request.sampling)
        seq.spec = RowSpec.for_request(
            request, processors, sampler, seq.stop_ids, tokenizer=self._tokenizer,
            prompt_lookup=self._prompt_lookup, draft=self._draft_model,
            standing=self._standing,
        )
        (uid,) = self._generator.insert(
            [rest],
            max_tokens=[request.max_tokens],
            caches=[cache],
            all_tokens=[request.prompt[: seq.cached_tokens]],
            samplers=[sampler],
            logits_processors=[processors],
            stop_sequences=(
                [StopSequences([[t] for t in sorted(seq.stop_ids)])] if request.stop_ids
                else None
            ),
        )
        seq.uid = uid
        self._active[uid] = seq
        if seq.logprobs is not None and self._batch is not None:
            self._batch.logprob_rows[uid] = seq.logprobs
        if seq.spec is not None and self._batch is not None:
            self._batch.spec_rows[uid] = seq.spec

    def _cached_prefix(self, prompt: list[int]) -> tuple[Any, list[int]]:
        """The longest cached KV state for a prefix of ``prompt``, and the tokens left."""
        if self._prompt_cache is None:
            return None, prompt
        cache, rest = self._prompt_cache.fetch_nearest_cache(self._cache_key, prompt)
        if cache is None:
            return None, prompt
        if not rest:
            # An exact hit still needs one token to compute the next logits from.
            if not can_trim_prompt_cache(cache):
                return None, prompt
            trim_prompt_cache(cache, 1)
            rest = prompt[-1:]
        return cache, list(rest)

    def _remember(self, tokens: list[int] | None, cache: Any) -> None:
        if self._prompt_cache is not None and tokens and cache is not None:
            # mlx-lm hands a finished row's KV state out as a lazy slice of the whole
            # batch's buffers: unevaluated, each entry kept every row's keys and values
            # alive while the cache counted only its own bytes, so prompt_cache_bytes
            # bounded a fraction of what it held. Evaluating copies the row out now.
            mx.eval([c.state for c in cache])
            self._prompt_cache.insert_cache(self._cache_key, list(tokens), cache)

    def _reap_cancelled(self) -> None:
        cancelled = [s for s in self._active.values() if s.generation.cancel_requested]
        if not cancelled:
            return
        assert self._generator is not None
        self._generator.remove([s.uid for s in cancelled])
        for seq in cancelled:
            del self._active[seq.uid]
            self._forget_logprobs(seq)
            self._finish(seq, "cancelled")
        self._flush(cancelled)

    def _step(self) -> None:
        assert self._generator is not None
        if self._inject_failures > 0:
            self._inject_failures -= 1
            raise RuntimeError("[metal::malloc] injected failure (AFMD_INJECT_FAILURES)")
        _, responses = self._generator.next()
        if not responses:
            return
        now = time.perf_counter()
        urgent = False  # a first token or a finish goes out at once
        first = False
        for response in responses:
            seq = self._active.get(response.uid)
            if seq is None:
                continue
            self._unflushed[id(seq)] = seq
            if not seq.first_token_at:
                seq.first_token_at = now
            if not seq.shown:
                # The client's first token is this one or still to come (after a reasoning
                # model's opening think marker, or leading whitespace): it goes out at
                # once, not a flush interval later.
                urgent = first = True
            reason = response.finish_reason
            every = seq.generation.request.sample_every
            sample = every and (seq.completion_tokens % every == 0 or reason is not None)
            if reason == "stop" and response.token in seq.stop_ids:
                # The end-of-sequence token is a signal, not text.
                pass
            else:
                seq.completion_tokens += 1
                think = seq.generation.request.think_ids
                if think is not None:
                    if response.token == think[0]:
                        seq.in_reasoning = True
                    if seq.in_reasoning:
                        seq.reasoning_tokens += 1
                    if response.token == think[1]:
                        seq.in_reasoning = False
                seq.detokenizer.add_token(response.token)
                segment = seq.detokenizer.last_segment
                if (
                    not seq.shown
                    and segment.strip()
                    and (think is None or response.token not in think)
                ):
                    seq.shown = True
                if seq.logprobs is not None:
                    # One event per token, so its numbers stay with the text it released.
                    entry = resolve(response.logprobs, response.token, seq.logprobs)
                    seq.pending.append(Text(segment, 1, (entry,)))
                elif segment:
                    seq.pending.append(Text(segment, 1))
                elif seq.pending and isinstance(seq.pending[-1], Text):
                    last = seq.pending[-1]
                    seq.pending[-1] = Text(last.text, last.tokens + 1)
                else:
                    seq.pending.append(Text("", 1))
            if sample:  # counted after this step's token, so it is included
                seq.samples.append(
                    (now - seq.started_at, seq.completion_tokens, mx.get_active_memory())
                )
            if reason is not None:
                del self._active[response.uid]
                self._forget_logprobs(seq)
                self._remember(response.all_tokens, response.prompt_cache)
                self._finish(seq, reason)
                urgent = True
        # Each hand-off wakes the event loop through a pipe and makes the two threads trade
        # the GIL; between first token and finish, pace hand-offs so a hop carries the
        # tokens of a few steps (a few ms of latency, invisible in a stream).
        if urgent or now - self._last_flush >= _FLUSH_INTERVAL_S or not self._active:
            # A first token is waited for: let the event loop send it before this thread
            # goes back to building the next step, which would hold the GIL the loop needs
            # (measured: the hand-off otherwise waits ~0.7 ms, a switch interval or more).
            ack = threading.Event() if first else None
            self._flush(list(self._unflushed.values()), ack)
            self._unflushed.clear()
            self._last_flush = now
            if ack is not None:
                ack.wait(_FIRST_TOKEN_HANDOFF_S)

    def _forget_logprobs(self, seq: _Sequence) -> None:
        if seq.logprobs is not None and self._batch is not None:
            self._batch.logprob_rows.pop(seq.uid, None)
        if seq.spec is not None and self._batch is not None:
            self._batch.spec_rows.pop(seq.uid, None)

    def _finish(self, seq: _Sequence, reason: str) -> None:
        seq.detokenizer.finalize()
        tail = seq.detokenizer.last_segment
        if tail:
            seq.pending.append(Text(tail, 0))
        now = time.perf_counter()
        seq.pending.append(
            Finished(
                finish_reason=reason,
                prompt_tokens=seq.prompt_tokens,
                completion_tokens=seq.completion_tokens,
                cached_tokens=seq.cached_tokens,
                reasoning_tokens=seq.reasoning_tokens,
                timings={
                    "queued_at": seq.generation.created_at,
                    "started_at": seq.started_at,
                    "first_token_at": seq.first_token_at or now,
                    "finished_at": now,
                },
                peak_memory_bytes=mx.get_peak_memory(),
                samples=tuple(seq.samples),
                **_speculation(seq.spec),
            )
        )

    def _flush(self, seqs: list[_Sequence], ack: threading.Event | None = None) -> None:
        batch = [(s.generation, s.pending) for s in seqs if s.pending]
        for s in seqs:
            s.pending = []
        by_loop: dict[Any, list[tuple[Generation, list[Event]]]] = {}
        for item in batch:
            by_loop.setdefault(item[0]._loop, []).append(item)
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop closed (shutdown, tests)
                loop.call_soon_threadsafe(_deliver, items, ack)

    def _fail_all(self, exc: BaseException | None) -> None:
        seqs = list(self._active.values())
        self._active.clear()
        self._unflushed.clear()
        if self._generator is not None:
            with contextlib.suppress(Exception):
                self._generator.close()
        if exc is not None:
            self._generator = self._new_generator()
        message = (
            "The model failed while generating." if exc is not None
            else "The server is shutting down."
        )
        error = ServerError(message, code="generation_failed" if exc else "shutting_down")
        for seq in seqs:
            loop = seq.generation._loop
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(seq.generation.fail, error)
        # Generations still in the inbox at shutdown are failed too.
        if exc is None:
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, Generation):
                    with contextlib.suppress(RuntimeError):
                        item._loop.call_soon_threadsafe(item.fail, error)


def _speculation(spec: RowSpec | None) -> dict[str, Any]:
    if spec is None:
        return {}
    accepted, rejected = spec.usage()
    return {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": rejected,
            "speculation": spec.stats() if spec.enabled else {}}


def _deliver(
    batch: list[tuple[Generation, list[Event]]], ack: threading.Event | None = None
) -> None:
    for generation, events in batch:
        generation.push(events)
    if ack is not None:
        # Queued behind the consumers that push() just woke: set once they have run.
        asyncio.get_running_loop().call_soon(ack.set)
