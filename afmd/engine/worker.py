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
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from afmd.engine.base import Event, Generation, PromptLogprobs, SamplingParams
from afmd.engine.detokenize import ExactDetokenizer
from afmd.engine.lockstep import Admission, Lockstep, StepPlan
from afmd.engine.logprobs import prompt_logprobs
from afmd.engine.sampling import RowSampler
from afmd.engine.sequence import Row
from afmd.engine.speculative import RowSpec, Standing
from afmd.engine.stepper import Stepper
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
class _Admission:
    """A request about to join: its sequence, what the plan says of it, and the cached
    prefix it resumes from (fetched when the plan was made, so the plan can say so)."""

    seq: Row
    plan: Admission
    cache: Any
    rest: list[int]


class BatchWorker:
    """Turns a :class:`~afmd.engine.stepper.Stepper`'s tokens into each request's events,
    on the thread that steps it.

    With a :class:`~afmd.engine.lockstep.Lockstep` (rank 0 of a sharded model), each
    iteration's admissions and cancellations are broadcast as a plan before they are
    applied, so the other ranks run the same model work (:mod:`afmd.engine.follower`).
    """

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
        lockstep: Lockstep | None = None,
    ) -> None:
        self._stepper = Stepper(
            model, tokenizer, name=name, max_batch=max_batch,
            prefill_step_size=prefill_step_size, prompt_cache_bytes=prompt_cache_bytes,
            prompt_cache_entries=prompt_cache_entries, lockstep=lockstep,
        )
        self._model = model
        self._lockstep = lockstep
        # A sharded model never speculates (see ShardedDecodeBatch).
        self._speculates = lockstep is None
        self._prompt_lookup = prompt_lookup
        self._draft_model = draft_model
        # Owned by the thread: how each kind of proposal source fared lately.
        self._standing: dict[str, Standing] = {}
        self._tokenizer = tokenizer
        self._eos = self._stepper.eos
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._active: dict[int, Row] = {}
        self._thread = threading.Thread(target=self._run, name=f"afmd-engine-{name}", daemon=True)
        self._started = False
        # Sequences with events not yet handed to the event loop, and when we last did.
        self._unflushed: dict[int, Row] = {}
        self._last_flush = 0.0
        #: When the thread started its current iteration (0.0: idle, waiting for work):
        #: a watchdog of a sharded model reads it to find a step that never ends.
        self.busy_since = 0.0
        #: Called on the thread, instead of recovering, when a sharded model's step fails:
        #: the other ranks are now out of step, and only a restart of the group helps.
        self.on_fatal: Callable[[BaseException], None] | None = None
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
        return self._stepper.cache_bytes

    @property
    def live_cache_bytes(self) -> int:
        """Bytes of KV state the running batch holds, read from the event loop: a cache
        the thread swaps meanwhile is counted at the next read."""
        return self._stepper.live_cache_bytes

    def wake(self) -> None:
        """Make the thread look at cancellation flags even if it is idle."""
        self._inbox.put(_WAKE)

    def stop(self, timeout: float = 5.0) -> None:
        if self._started:
            self._inbox.put(_STOP)
            self._thread.join(timeout)

    # -- thread side --
    def _run(self) -> None:
        self._stepper.reset()
        while True:
            try:
                items = self._take_inbox(block=not self._active)
                if items is None:
                    break
                self.busy_since = time.monotonic()
                self._iterate(items)
            except Exception as exc:  # a model failure must not kill the thread
                if self._lockstep is not None and self.on_fatal is not None:
                    log.exception("a step of the sharded model failed")
                    self.on_fatal(exc)
                    return
                log.exception("generation step failed")
                self._fail_all(exc)
            finally:
                self.busy_since = 0.0
        if self._lockstep is not None:
            with contextlib.suppress(Exception):  # the other ranks may be gone already
                self._lockstep.share_plan(StepPlan(stop=True))
        self._fail_all(None)

    def _take_inbox(self, *, block: bool) -> list[Generation] | None:
        """The requests that arrived (``None``: stop)."""
        items: list[Any] = []
        if block:
            items.append(self._inbox.get())
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        if any(item is _STOP for item in items):
            for item in items:
                if isinstance(item, Generation):
                    self._inbox.put(item)  # failed with the rest by _fail_all
            return None
        return [item for item in items if isinstance(item, Generation)]

    def _iterate(self, arrivals: list[Generation]) -> None:
        """Admit what arrived, drop what was cancelled, step the batch."""
        admissions = [a for a in map(self._prepare, arrivals) if a is not None]
        cancelled = [s for s in self._active.values() if s.generation.cancel_requested]
        if self._lockstep is not None:
            joining = sum(1 for a in admissions if a.plan.max_tokens > 0)
            plan = StepPlan(
                admit=[a.plan for a in admissions],
                remove=[s.uid for s in cancelled],
                active=len(self._active) + joining - len(cancelled),
            )
            self._lockstep.share_plan(plan)
        for admission in admissions:
            self._admit(admission)
        self._remove(cancelled)
        if self._active:
            self._step()
        if self._lockstep is not None:
            self._lockstep.idle = not self._active

    def _prepare(self, generation: Generation) -> _Admission | None:
        """A request's sequence and the model work it needs (``None``: none, it ended)."""
        request = generation.request
        seq = Row(
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
            return None
        cache, rest = (None, request.prompt)
        if request.max_tokens > 0:
            cache, rest = self._stepper.cached_prefix(request.prompt)
        seq.cached_tokens = len(request.prompt) - len(rest)
        plan = Admission(
            prompt=list(request.prompt),
            cached=seq.cached_tokens,
            max_tokens=request.max_tokens,
            stop_ids=sorted(request.stop_ids),
            prompt_logprobs=request.prompt_logprobs,
        )
        return _Admission(seq, plan, cache, rest)

    def _admit(self, admission: _Admission) -> None:
        seq, plan = admission.seq, admission.plan
        request = seq.generation.request
        if plan.prompt_logprobs is not None:
            seq.pending.append(PromptLogprobs(
                prompt_logprobs(self._model, plan.prompt, plan.prompt_logprobs)
            ))
        if plan.max_tokens <= 0:  # the prompt's numbers were all that was asked
            seq.first_token_at = time.perf_counter()
            self._finish(seq, "length")
            self._flush([seq])
            return
        processors = list(request.logits_processors)
        if request.sampling.repetition_penalty:
            processors.extend(make_logits_processors(
                repetition_penalty=request.sampling.repetition_penalty
            ))
        sampler = make_sampler(request.sampling)
        if self._speculates:
            seq.spec = RowSpec.for_request(
                request, processors, sampler, seq.stop_ids, tokenizer=self._tokenizer,
                prompt_lookup=self._prompt_lookup, draft=self._draft_model,
                standing=self._standing,
            )
        seq.uid = self._stepper.insert(
            plan.prompt, admission.rest, admission.cache, max_tokens=plan.max_tokens,
            sampler=sampler, processors=processors, stop_ids=plan.stop_ids,
        )
        self._active[seq.uid] = seq
        batch = self._stepper.batch
        if seq.logprobs is not None and batch is not None:
            batch.logprob_rows[seq.uid] = seq.logprobs
        if seq.spec is not None and batch is not None:
            batch.spec_rows[seq.uid] = seq.spec

    def _remove(self, cancelled: list[Row]) -> None:
        if not cancelled:
            return
        self._stepper.remove([s.uid for s in cancelled])
        for seq in cancelled:
            del self._active[seq.uid]
            self._forget_logprobs(seq)
            self._finish(seq, "cancelled")
        self._flush(cancelled)

    def _step(self) -> None:
        if self._inject_failures > 0:
            self._inject_failures -= 1
            raise RuntimeError("[metal::malloc] injected failure (AFMD_INJECT_FAILURES)")
        responses = self._stepper.next()
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
            seq.take(response.token, reason, response.logprobs, now)
            if reason is not None:
                del self._active[response.uid]
                self._forget_logprobs(seq)
                self._stepper.remember(response.all_tokens, response.prompt_cache)
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

    def _forget_logprobs(self, seq: Row) -> None:
        batch = self._stepper.batch
        if seq.logprobs is not None and batch is not None:
            batch.logprob_rows.pop(seq.uid, None)
        if seq.spec is not None and batch is not None:
            batch.spec_rows.pop(seq.uid, None)

    def _finish(self, seq: Row, reason: str) -> None:
        seq.finish(reason)

    def _flush(self, seqs: list[Row], ack: threading.Event | None = None) -> None:
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
        with contextlib.suppress(Exception):
            self._stepper.close()
        if exc is not None:
            self._stepper.reset()
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


def _deliver(
    batch: list[tuple[Generation, list[Event]]], ack: threading.Event | None = None
) -> None:
    for generation, events in batch:
        generation.push(events)
    if ack is not None:
        # Queued behind the consumers that push() just woke: set once they have run.
        asyncio.get_running_loop().call_soon(ack.set)
