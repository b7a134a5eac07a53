"""The generation thread: one per loaded model, decoding every running request together.

MLX work must stay off the event loop (a decode step holds the GIL for milliseconds, and a
long prefill for seconds), so each model owns a thread that drives mlx-lm's
``BatchGenerator``. Requests join the running batch between steps and leave when done;
cancellation is a flag checked once per step, so a cancelled or disconnected request frees
its slot within one decode step. Results of a step go to the event loop in one
``call_soon_threadsafe`` hop for all requests, not one per token.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from afmd.engine.batch import backend
from afmd.engine.batch.admission import Admissions, Warming
from afmd.engine.batch.handoff import Handoff, fail, flush
from afmd.engine.batch.inbox import Inbox
from afmd.engine.batch.sequence import Row
from afmd.engine.batch.stepper import Stepper
from afmd.engine.batch.steptrace import StepTrace
from afmd.engine.batch.warmup import compile_template, warm_up
from afmd.engine.generation import Generation
from afmd.engine.kvcache.blocks import BlockCache
from afmd.engine.sharded.lockstep import Lockstep, StepPlan
from afmd.engine.worker_threads import WorkerThread
from afmd.errors import ServerError

__all__ = ["BatchWorker"]

log = logging.getLogger("afmd.engine")


class _InjectedFailures:
    """Fault injection for tests of the retry path: the first N decode steps fail as a
    transient MLX error would (``AFMD_INJECT_FAILURES=N``, documented in docs/tools.md)."""

    def __init__(self) -> None:
        self.left = int(os.environ.get("AFMD_INJECT_FAILURES", "0") or 0)

    def check(self) -> None:
        if self.left > 0:
            self.left -= 1
            raise RuntimeError("[metal::malloc] injected failure (AFMD_INJECT_FAILURES)")


def _ending(exc: BaseException | None) -> ServerError:
    """What the requests still running hear when the thread fails (``exc``) or stops."""
    if exc is not None:
        return ServerError("The model failed while generating.", code="generation_failed")
    return ServerError("The server is shutting down.", code="shutting_down")


def _deliver(responses: list[Any], active: dict[int, Row], stepper: Stepper,
             handoff: Handoff) -> None:
    """A step's tokens into their rows' events; finished rows leave the batch and their
    KV state goes to the prefix cache."""
    now = time.perf_counter()
    urgent = False  # a first token or a finish goes out at once
    first = False
    for response in responses:
        seq = active.get(response.uid)
        if seq is None:
            continue
        handoff.touched(seq)
        # The client's first token is this one or still to come (after a reasoning
        # model's opening think marker, or leading whitespace): it goes out at once,
        # not a flush interval later.
        if seq.take(response.token, response.finish_reason, response.logprobs, now):
            urgent = first = True
        if response.finish_reason is not None:
            del active[response.uid]
            stepper.forget(seq.uid)
            stepper.remember(response.all_tokens, response.prompt_cache)
            seq.finish(response.finish_reason)
            urgent = True
    handoff.pace(now, urgent=urgent or not active, first=first)


class BatchWorker:
    """Turns a :class:`~afmd.engine.batch.stepper.Stepper`'s tokens into each request's events,
    on the thread that steps it.

    With a :class:`~afmd.engine.sharded.lockstep.Lockstep` (rank 0 of a sharded model), each
    iteration's admissions and cancellations are broadcast as a plan before they are
    applied, so the other ranks run the same model work (:mod:`afmd.engine.sharded.follower`).
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
        identity: bytes | None = None,
        block_tokens: int = 256,
        disk_dir: Path | None = None,
        disk_bytes: int = 0,
        disk_min_free: int | None = None,
    ) -> None:
        self._stepper = Stepper(
            model, tokenizer, name=name, max_batch=max_batch,
            prefill_step_size=prefill_step_size, prompt_cache_bytes=prompt_cache_bytes,
            prompt_cache_entries=prompt_cache_entries, lockstep=lockstep, identity=identity,
            block_tokens=block_tokens, disk_dir=disk_dir, disk_bytes=disk_bytes,
            disk_min_free=disk_min_free,
        )
        self._lockstep = lockstep
        # A sharded model never speculates (see ShardedDecodeBatch).
        self._admissions = Admissions(
            self._stepper, prompt_lookup=prompt_lookup, draft_model=draft_model,
            speculates=lockstep is None,
        )
        self._inbox = Inbox()
        self._active: dict[int, Row] = {}
        # This round's requests prepared but not yet in the batch: a failure admitting one
        # must fail them too, or they would wait for their deadline unanswered.
        self._joining: list[Generation] = []
        # Warm-ups (requests for no tokens) running their prompts a chunk per iteration.
        self._warming: collections.deque[Warming] = collections.deque()
        self._thread = WorkerThread(self._run, f"afmd-engine-{name}")
        self._started = False
        self._handoff = Handoff()
        #: When the thread started its current iteration (0.0: idle, waiting for work):
        #: a watchdog of a sharded model reads it to find a step that never ends.
        self.busy_since = 0.0
        #: Called on the thread, instead of recovering, when a sharded model's step fails:
        #: the other ranks are now out of step, and only a restart of the group helps.
        self.on_fatal: Callable[[BaseException], None] | None = None
        self._faults = _InjectedFailures()
        self._warm = threading.Event()
        self._trace = StepTrace.from_env(name)

    # -- event-loop side --
    def start(self) -> None:
        if not self._started:
            self._started = True
            # The decode thread needs the GIL back the moment MLX returns; with the default
            # 5 ms switch interval it can wait a whole interval behind the event loop.
            sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
            self._thread.start()

    def ready(self, timeout: float | None = None) -> bool:
        """Wait until the thread is ready to serve (the model warmed up on the GPU path:
        requests submitted before wait behind it)."""
        return self._warm.wait(timeout)

    def submit(self, generation: Generation) -> None:
        self._inbox.put(generation)

    @property
    def cache_bytes(self) -> int:
        """Bytes of KV state the prefix cache holds (a plain counter: safe to read from
        the event loop while the thread updates it)."""
        return self._stepper.cache_bytes

    @property
    def blocks(self) -> BlockCache | None:
        """The block KV cache (``None``: the model keeps mlx-lm's whole-sequence cache or
        none): its counters are read, and it is cleared, from the event loop."""
        return self._stepper.blocks

    @property
    def live_cache_bytes(self) -> int:
        """Bytes of KV state the running batch holds, read from the event loop: a cache
        the thread swaps meanwhile is counted at the next read."""
        return self._stepper.live_cache_bytes

    def wake(self) -> None:
        """Make the thread look at cancellation flags even if it is idle."""
        self._inbox.wake()

    def stop(self, timeout: float = 5.0) -> None:
        if self._started:
            self._inbox.stop()
            self._thread.join(timeout)

    # -- thread side --
    def _run(self) -> None:
        self._stepper.reset()
        self._warm_up()
        while True:
            try:
                items = self._inbox.take(block=not self._active and not self._warming)
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
        if self._trace is not None:
            self._trace.close()
        self._fail_all(None)

    def _warm_up(self) -> None:
        """The chat template compiled, and the GPU path's warm-up (:mod:`afmd.engine.batch.warmup`);
        a sharded model's ranks would have to run that in step, so they do not."""
        try:
            compile_template(self._stepper.tokenizer)
            if self._lockstep is None and backend.current().warms_up:
                log.info("model warmed up in %.2f s", warm_up(self._stepper))
        except Exception:  # a model that fails here fails its first request the same way
            log.exception("warming the model up failed")
            self._stepper.reset()
        finally:
            self._warm.set()

    def _iterate(self, arrivals: list[Generation]) -> None:
        """Admit what arrived, drop what was cancelled, step the batch."""
        started = time.perf_counter()
        admissions = []
        for generation in arrivals:
            try:
                admission = self._admissions.prepare(generation)
            except Exception as exc:
                if self._lockstep is not None:
                    raise  # the ranks must plan alike: the group's failure, not a row's
                # Its prefix lookup read what another process may have written: its
                # failure is this request's, not the batch's.
                log.exception("preparing a request failed")
                fail(generation, _ending(exc))
                continue
            if admission is not None:
                admissions.append(admission)
        cancelled = [s for s in self._active.values() if s.generation.cancel_requested]
        if self._lockstep is not None:
            self._lockstep.share_plan(StepPlan.before_step(
                [a.plan for a in admissions], [s.uid for s in cancelled], len(self._active)))
        self._joining = [a.row.generation for a in admissions]
        for admission in admissions:
            warming = (self._admissions.warming(admission) if self._lockstep is None
                       else None)
            if warming is not None:
                self._joining.remove(admission.row.generation)
                self._warming.append(warming)
                continue
            row = self._admissions.admit(admission)
            self._joining.remove(admission.row.generation)
            if row is not None:
                self._active[row.uid] = row
        self._remove(cancelled)
        if self._warming:
            # One chunk of a warm-up per step, as a joining prompt is run; in turns, so
            # that a long one holds none of the others up.
            warming = self._warming[0]
            try:
                ended = self._admissions.advance(warming)
            except Exception as exc:
                self._warming.popleft()
                log.exception("warming a prompt failed")
                fail(warming.row.generation, _ending(exc))
            else:
                if ended:
                    self._warming.popleft()
                    if warming.joined is not None:  # scored, it writes tokens now
                        self._active[warming.joined.uid] = warming.joined
                else:
                    self._warming.rotate(-1)
        if self._active:
            self._step(started)
        if self._lockstep is not None:
            self._lockstep.idle = not self._active

    def _remove(self, cancelled: list[Row]) -> None:
        if not cancelled:
            return
        self._stepper.remove([s.uid for s in cancelled])
        for seq in cancelled:
            del self._active[seq.uid]
            self._stepper.forget(seq.uid)
            seq.finish("cancelled")
        flush(cancelled)

    def _step(self, started: float) -> None:
        self._faults.check()
        trace, batch = self._trace, self._stepper.batch
        if trace is None or batch is None:
            responses = self._stepper.next()
            if responses:
                _deliver(responses, self._active, self._stepper, self._handoff)
            return
        rows, waited, stepping = len(self._active), batch.waited, time.perf_counter()
        responses = self._stepper.next()
        delivering = time.perf_counter()
        if responses:
            _deliver(responses, self._active, self._stepper, self._handoff)
        trace.record(rows=rows, tokens=len(responses), admit_s=stepping - started,
                     next_s=delivering - stepping, wait_s=batch.waited - waited,
                     deliver_s=time.perf_counter() - delivering)

    def _fail_all(self, exc: BaseException | None) -> None:
        seqs = list(self._active.values())
        self._active.clear()
        self._handoff.clear()
        with contextlib.suppress(Exception):
            self._stepper.close()
        if exc is not None:
            self._stepper.reset()
        error = _ending(exc)
        for seq in seqs:
            fail(seq.generation, error)
        for generation in self._joining:
            fail(generation, error)
        self._joining = []
        for warming in self._warming:
            fail(warming.row.generation, error)
        self._warming.clear()
        # Generations still in the inbox at shutdown are failed too.
        if exc is None:
            for generation in self._inbox.drain():
                fail(generation, error)
