"""The models' workers run on reused threads (afmd/engine/worker_threads.py): MLX's
per-thread streams, each with a native thread behind it, are created once per thread of
the pool, not once per load; a parked thread keeps nothing of the worker it ran."""

from __future__ import annotations

import gc
import threading
import weakref

from afmd.engine import worker_threads
from afmd.engine.worker_threads import PARKED_NAME, WorkerThread


def test_a_worker_after_another_runs_on_the_same_thread_under_its_own_name() -> None:
    seen: list[tuple[int, str]] = []

    def record() -> None:
        seen.append((threading.get_ident(), threading.current_thread().name))

    first = WorkerThread(record, "afmd-engine-a")
    first.start()
    first.join(5)
    assert not first.is_alive()
    second = WorkerThread(record, "afmd-engine-b")
    second.start()
    second.join(5)
    assert [name for _, name in seen] == ["afmd-engine-a", "afmd-engine-b"]
    assert seen[0][0] == seen[1][0]  # the same thread, and with it the same MLX streams
    assert worker_threads.parked() >= 1
    assert PARKED_NAME in [t.name for t in threading.enumerate()]


def test_workers_at_once_get_threads_of_their_own() -> None:
    release = threading.Event()
    running = threading.Barrier(3)
    idents: set[int] = set()

    def hold() -> None:
        idents.add(threading.get_ident())
        running.wait(5)
        release.wait(5)

    workers = [WorkerThread(hold, f"afmd-engine-{i}") for i in range(2)]
    for worker in workers:
        worker.start()
    running.wait(5)  # both run at the same time
    assert all(worker.is_alive() for worker in workers)
    release.set()
    for worker in workers:
        worker.join(5)
        assert not worker.is_alive()
    assert len(idents) == 2


def test_a_failing_worker_is_logged_and_the_thread_serves_the_next(caplog) -> None:
    def fail() -> None:
        raise RuntimeError("boom")

    broken = WorkerThread(fail, "afmd-engine-broken")
    broken.start()
    broken.join(5)
    assert not broken.is_alive()
    assert "thread afmd-engine-broken failed" in caplog.text
    ran = threading.Event()
    after = WorkerThread(ran.set, "afmd-engine-after")
    after.start()
    after.join(5)
    assert ran.is_set()


def test_a_parked_thread_holds_nothing_of_the_worker_it_ran() -> None:
    """The worker's function is its model's worker (a bound method): held by the parked
    thread, an unloaded model's weights stayed in memory until the next load."""

    class Model:
        def run(self) -> None:
            pass

    model = Model()
    gone = weakref.ref(model)
    worker = WorkerThread(model.run, "afmd-engine-m")
    worker.start()
    worker.join(5)
    del model, worker
    gc.collect()
    assert gone() is None
