"""The threads the models' workers run on, reused from one model to the next.

MLX gives each thread that computes a default stream of its own, and mlx-lm's and
mlx-vlm's ``generation_stream`` is thread-local too: a stream per thread, each with a
native thread of MLX's behind it on the CPU backend, none of them freed when the Python
thread ends (``mx.clear_streams`` leaves them as well). A Python thread per loaded model
therefore left one or two native threads and their stacks behind at every unload, for
good: a server switching models on every request (``keep_alive: 0``, or ``max_loaded =
1`` with clients taking turns) grew at every switch (docs/hardening.md). A worker runs on
a parked thread of this pool instead; when the worker's function returns the thread goes
back to the pool, and the next model's worker computes on the same streams.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("afmd.engine")

#: Idle threads kept for the next worker; one more ends instead (its streams are lost, as
#: before). More than this many workers at once is more models than a budget keeps.
MAX_PARKED = 8

#: The name of a thread waiting in the pool.
PARKED_NAME = "afmd-worker-parked"

_lock = threading.Lock()
_parked: list[_Slot] = []


class WorkerThread:
    """What a worker uses of a :class:`threading.Thread` (``start``, ``join``,
    ``is_alive``, ``name``), run on a thread of the pool; a daemon, as those were."""

    def __init__(self, target: Callable[[], None], name: str) -> None:
        self._target: Callable[[], None] | None = target
        self.name = name
        self._started = False
        self._done = threading.Event()

    def start(self) -> None:
        if self._started:
            raise RuntimeError("threads can only be started once")
        self._started = True
        with _lock:
            slot = _parked.pop() if _parked else None
        if slot is None:
            slot = _Slot()
            threading.Thread(target=slot.serve, name=self.name, daemon=True).start()
        slot.give(self)

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def is_alive(self) -> bool:
        return self._started and not self._done.is_set()

    def _run(self) -> None:
        thread = threading.current_thread()
        thread.name = self.name
        target, self._target = self._target, None
        try:
            if target is not None:
                target()
        except Exception:  # as a thread of its own would print it, and the pool goes on
            log.exception("thread %s failed", self.name)
        finally:
            del target
            thread.name = PARKED_NAME


class _Slot:
    """One thread of the pool: runs the workers given to it, one after the other."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next: WorkerThread | None = None

    def give(self, worker: WorkerThread) -> None:
        with self._cond:
            self._next = worker
            self._cond.notify()

    def serve(self) -> None:
        while True:
            with self._cond:
                while self._next is None:
                    self._cond.wait()
                worker, self._next = self._next, None
            worker._run()
            # Parked before the worker counts as ended: a model loaded right after an
            # unload finds this thread, not a new one.
            with _lock:
                parked = len(_parked) < MAX_PARKED
                if parked:
                    _parked.append(self)
            worker._done.set()
            # A parked thread holds nothing of the worker's: its model is freed on unload.
            del worker
            if not parked:
                return


def parked() -> int:
    """Threads waiting in the pool (tests)."""
    with _lock:
        return len(_parked)


__all__ = ["MAX_PARKED", "PARKED_NAME", "WorkerThread", "parked"]
