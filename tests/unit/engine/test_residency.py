"""Which models stay loaded: the residency rules on stand-in models (fast, exact timing),
then the real registry on the demo models (memory measured and freed for real)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from afmd.config.load import load_config
from afmd.engine.models import model_registry as models_module
from afmd.engine.models.model_registry import ModelRegistry
from afmd.engine.models.residency import Lease, Residency
from afmd.errors import InvalidRequestError, ServiceUnavailableError

from helpers import memory_probes


@dataclass(eq=False)
class Fake:
    """What the residency reads of a loaded model."""

    id: str
    memory_bytes: int = 10
    last_used: float = field(default_factory=time.time)
    reads_conversation: bool = False  # Apple's model: none of afmd's memory

    def touch(self) -> None:
        self.last_used = time.time()


@dataclass
class Ticket:
    holds_slot: bool = False


def residency(budget: int = 100, max_loaded: int = 3) -> tuple[Residency, list[str]]:
    freed: list[str] = []
    return Residency(budget, max_loaded, free=lambda m: freed.append(m.id)), freed


#: How long a test waits for what should come at once before calling it a hang: each
#: unload collects the whole process's garbage, which in a worker deep in the suite, on two
#: busy cores, is not instant.
HANG_S = 30


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(main())


def admit(res: Residency, *models: Fake, keep_alive: float = 300.0) -> None:
    for model in models:
        res.admit(model, keep_alive)  # type: ignore[arg-type]


def use(res: Residency, model: Fake, keep_alive: float = 300.0) -> None:
    """One request that got the model and is over."""
    res.hold(model, keep_alive).release()  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the rules


def test_least_recently_used_idle_model_makes_room() -> None:
    async def main() -> list[str]:
        res, freed = residency(max_loaded=2)
        a, b = Fake("a"), Fake("b")
        admit(res, a, b)
        use(res, b)
        await asyncio.sleep(0.01)
        use(res, a)  # b is now the least recently used
        await res.make_room("c", 10, time.monotonic() + 1)
        await res.drain()
        assert sorted(res.loaded) == ["a"]
        return freed

    assert run(main) == ["b"]


def test_apples_model_neither_counts_nor_is_unloaded_for_room() -> None:
    """It holds nothing of afmd's: loading another model beside it unloads nothing, and
    making room never picks it (unloading it would free nothing)."""
    async def main() -> list[str]:
        res, freed = residency(max_loaded=2)
        system, a = Fake("system", 0, reads_conversation=True), Fake("a")
        admit(res, system, a)
        use(res, system)
        await asyncio.sleep(0.01)
        use(res, a)  # system is the least recently used
        await res.make_room("b", 10, time.monotonic() + 1)  # a and b: max_loaded
        await res.drain()
        assert sorted(res.loaded) == ["a", "system"]
        await res.make_room("c", 10, time.monotonic() + 1)
        await res.drain()
        assert sorted(res.loaded) == ["system"]
        return freed

    assert run(main) == ["a"]


def test_memory_budget_unloads_only_as_many_as_needed() -> None:
    async def main() -> None:
        res, freed = residency(budget=35)
        a, b, c = Fake("a", 10), Fake("b", 10), Fake("c", 10)
        admit(res, a, b, c)
        for model in (a, b, c):
            use(res, model)
            await asyncio.sleep(0.01)
        await res.make_room("d", 15, time.monotonic() + 1)  # 30 + 15 > 35: one must go
        await res.drain()
        assert freed == ["a"]
        assert res.used_bytes() == 35  # b, c and d's reservation

    run(main)


def test_busy_models_are_never_unloaded_and_the_load_gives_up_at_its_deadline() -> None:
    async def main() -> None:
        res, freed = residency(max_loaded=1)
        a = Fake("a")
        admit(res, a)
        lease = res.hold(a, 300.0)  # type: ignore[arg-type]
        started = time.monotonic()
        with pytest.raises(ServiceUnavailableError) as info:
            await res.make_room("b", 10, started + 0.2)
        assert time.monotonic() - started >= 0.2
        error = info.value
        assert (error.status, error.code, error.param) == (503, "model_unavailable", "model")
        assert int(error.headers["Retry-After"]) >= 1
        assert "'b'" in error.message and "max_loaded (1 models)" in error.message
        assert "busy: a" in error.message
        assert freed == [] and list(res.loaded) == ["a"]
        lease.release()

    run(main)


def test_requests_waiting_for_a_load_make_a_model_busy() -> None:
    async def main() -> None:
        res, freed = residency(max_loaded=1)
        a = Fake("a")
        admit(res, a)
        res.waiting["a"] += 1
        with pytest.raises(ServiceUnavailableError):
            await res.make_room("b", 10, time.monotonic() + 0.05)
        assert freed == []

    run(main)


def test_a_load_waits_for_a_busy_model_to_become_idle() -> None:
    async def main() -> float:
        res, freed = residency(max_loaded=1)
        a = Fake("a")
        admit(res, a)
        lease = res.hold(a, 300.0)  # type: ignore[arg-type]
        # The clock is read before the release is scheduled, so the wait is never shorter
        # than its 0.2 s (asyncio may run a timer a clock resolution early: the 1 ms).
        started = time.monotonic()
        asyncio.get_running_loop().call_later(0.2, lease.release)
        await res.make_room("b", 10, started + 5)
        await res.drain()
        assert freed == ["a"]
        return time.monotonic() - started

    waited = run(main)
    assert 0.199 <= waited < 2


def test_a_request_giving_up_as_its_room_appears_is_told_the_load_is_under_way() -> None:
    """A request whose deadline passes in the moment its load's room appeared, before the
    load woke to take it, is 503 ``busy`` (the model is loading), not ``model_unavailable``
    blaming busy models: that message named none ("busy: none"), or the budget with
    nothing in use. A stalled event loop makes the moment long (a chaos run, max_loaded 1,
    found both on a loaded machine)."""
    async def main() -> None:
        res, freed = residency(max_loaded=1)
        a = Fake("a")
        admit(res, a)
        lease = res.hold(a, 300.0)  # type: ignore[arg-type]
        load = asyncio.ensure_future(res.make_room("b", 10, time.monotonic() + 60))
        await asyncio.sleep(0.01)  # waiting for a, which is busy
        error = res.room_error("b")
        assert error is not None and error.code == "model_unavailable"
        assert "busy: a" in error.message
        lease.release()  # a is idle: the load unloads it as soon as it runs again
        assert res.room_error("b") is None
        await load
        await res.drain()
        assert freed == ["a"]
        assert res.room_error("b") is None  # found its room: no load waits for any

        # The same once the room is there outright (the unload done, nothing loaded),
        # and for a load that may not unload (a preload's) while an idle model is in
        # its way: that one does wait for room.
        res, _ = residency(max_loaded=1)
        c = Fake("c")
        admit(res, c)
        lease = res.hold(c, 300.0)  # type: ignore[arg-type]
        kept = asyncio.ensure_future(res.make_room("d", 10, time.monotonic() + 60,
                                                   evict=False))
        await asyncio.sleep(0.01)
        lease.release()
        error = res.room_error("d")
        assert error is not None and "max_loaded (1 models)" in error.message
        kept.cancel()

    run(main)


def test_a_load_waiting_behind_another_load_names_it_in_its_503() -> None:
    """With ``max_loaded`` taken by another model's load under way (no model busy yet),
    the 503 at the deadline names that load: it said only "busy: none", as if nothing
    kept the model out (a chaos run with max_loaded 1 and four models in turn)."""
    async def main() -> None:
        res, _ = residency(max_loaded=1)
        await res.make_room("a", 10, time.monotonic() + 1)  # reserved: a loads
        with pytest.raises(ServiceUnavailableError) as info:
            await res.make_room("b", 10, time.monotonic() + 0.05)
        message = info.value.message
        assert "max_loaded (1 models)" in message
        assert "busy: none; loading: a" in message
        res.unreserve("a")

    run(main)


def test_a_load_cancelled_as_it_unloads_a_model_still_frees_it() -> None:
    """A load making room is cancelled (its last client left) in the turn it started
    unloading the idle model in its way. Before, the cancel reached the unload before its
    first step, so its clean-up never ran: the model was never freed (its thread and
    arrays stayed) and was counted as unloading for good, which under ``max_loaded = 1``
    kept every later load out with 503 ``model_unavailable`` ("unloading: 1")."""
    async def main() -> tuple[list[str], list[str]]:
        res, freed = residency(max_loaded=1)
        admit(res, Fake("a"))
        making = asyncio.ensure_future(res.make_room("b", 10, time.monotonic() + 5))
        await asyncio.sleep(0)  # make_room has started a's unload and waits for it
        making.cancel()
        await asyncio.gather(making, return_exceptions=True)
        await res.drain()
        await asyncio.wait_for(res.make_room("c", 10, time.monotonic() + 1), HANG_S)
        return freed, sorted(res._reserved)

    freed, reserved = run(main)
    assert freed == ["a"]
    assert reserved == ["c"]


def test_keep_alive_zero_forever_and_seconds() -> None:
    async def main() -> None:
        res, freed = residency()
        now, forever, soon = Fake("now"), Fake("forever"), Fake("soon")
        admit(res, now, forever, soon)
        use(res, now, keep_alive=0.0)
        use(res, forever, keep_alive=-1.0)
        use(res, soon, keep_alive=0.3)
        await asyncio.sleep(0.05)
        assert freed == ["now"]
        usage = res.usage("soon")
        assert usage is not None and usage.expires_at is not None and usage.idle_since
        assert usage.expires_at == pytest.approx(usage.idle_since + 0.3, abs=0.1)
        kept = res.usage("forever")
        assert kept is not None and kept.expires_at is None and kept.idle_since is not None
        await asyncio.sleep(0.4)
        await res.drain()
        assert freed == ["now", "soon"]
        assert sorted(res.loaded) == ["forever"]

    run(main)


def test_a_request_stops_the_keep_alive_and_the_latest_one_sets_it() -> None:
    async def main() -> None:
        res, freed = residency()
        a = Fake("a")
        admit(res, a, keep_alive=0.2)
        lease = res.hold(a, -1.0)  # type: ignore[arg-type]
        await asyncio.sleep(0.3)  # held: the 0.2 s it was loaded with never ran out
        assert freed == []
        other = res.hold(a, 0.1)  # type: ignore[arg-type]
        lease.release()  # -1, but a later request got it since
        other.release()  # the latest request's 0.1 s
        await asyncio.sleep(0.25)
        await res.drain()
        assert freed == ["a"]

    run(main)


def test_the_latest_request_sets_the_keep_alive_not_the_last_to_end() -> None:
    """An unload (keep_alive 0) sent while a long request holds the model unloads it
    when that request ends, as in Ollama; the long request's own keep-alive, released
    last, kept it loaded."""
    async def main() -> None:
        res, freed = residency()
        a = Fake("a")
        admit(res, a)
        stream = res.hold(a, 300.0)  # type: ignore[arg-type]
        res.hold(a, 0.0).release()  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        assert freed == []  # still streaming
        stream.release()
        await res.drain()
        assert freed == ["a"]

    run(main)


def test_usage_counts_active_queued_and_waiting_requests() -> None:
    async def main() -> None:
        res, _ = residency()
        a = Fake("a", memory_bytes=123)
        admit(res, a)
        running, queued = res.hold(a, 300.0), res.hold(a, 300.0)  # type: ignore[arg-type]
        running.ticket, queued.ticket = Ticket(holds_slot=True), Ticket()
        res.waiting["a"] += 1
        usage = res.usage("a")
        assert usage is not None
        assert (usage.memory_bytes, usage.active, usage.queued) == (123, 1, 2)
        assert usage.idle_since is None and usage.expires_at is None  # busy
        res.waiting["a"] -= 1
        running.release()
        queued.release()
        queued.release()  # twice: nothing more happens
        idle = res.usage("a")
        assert idle is not None and (idle.active, idle.queued) == (0, 0)
        assert idle.idle_since == pytest.approx(time.time(), abs=1)
        assert Lease.detached(a).release() is None  # type: ignore[arg-type]

    run(main)


# --------------------------------------------------------------------------- the registry


def config_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "afmd.toml"
    path.write_text(text)
    return path


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads RSS from /proc")
def test_unloading_frees_the_memory_for_real() -> None:
    """MLX's active memory drops by the weights' size, and RSS by most of it: measured in
    a process of its own (tests/helpers/memory_probes.py), where nothing else allocates
    or frees meanwhile."""
    got = memory_probes.run("unload")
    weights, grew_mx, freed_mx = got["weights"], got["grew_mx"], got["freed_mx"]
    assert weights > 15_000_000
    assert got["accounted"]  # memory_bytes: the weights plus the (idle) cache, measured
    assert grew_mx >= weights * 0.95
    assert not got["ready_after"] and got["unloads"] == 1
    assert freed_mx == pytest.approx(grew_mx, rel=0.05)
    assert freed_mx >= weights * 0.95
    assert got["freed_rss"] >= weights * 0.5, got


def test_a_model_larger_than_the_budget_is_refused_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads: list[str] = []
    monkeypatch.setattr(models_module, "load_sync", lambda entry, config: loads.append(entry.id))
    path = config_file(tmp_path, "[models]\nmemory_budget_bytes = 10000000\n")
    registry = ModelRegistry(load_config(path, env={}))

    async def main() -> InvalidRequestError:
        with pytest.raises(InvalidRequestError) as info:
            await registry.lease(registry.resolve("demo-32k"))
        return info.value

    error = run(main)
    assert loads == []  # refused from the files' size, before any load
    assert (error.status, error.code, error.param) == (400, "model_too_large", "model")
    assert "'demo-32k'" in error.message
    assert "10000000 bytes" in error.message and "9.5 MiB" in error.message
    assert "15.9 MiB" in error.message  # its safetensors file
    assert registry.status()["demo-32k"].startswith("unavailable: larger than the memory")


def test_a_load_after_a_failure_says_loading_while_it_runs() -> None:
    """A load started again after a failure (the dashboard's, a preload's) is what
    ``/health`` reports, not the failure before it."""
    from afmd.engine.models.loading import LoadCounts, Loads

    config = load_config(None, env={})
    entry = config.models.model[0]
    started, release = asyncio.Event(), asyncio.Event()
    loop_of: list[asyncio.AbstractEventLoop] = []
    calls = 0

    def load(entry: Any, config: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:  # the second load waits until the test has looked
            loop_of[0].call_soon_threadsafe(started.set)
            asyncio.run_coroutine_threadsafe(release.wait(), loop_of[0]).result(10)
        raise RuntimeError("no weights here")

    async def scenario() -> tuple[str, str, str]:
        loop_of.append(asyncio.get_running_loop())
        loads = Loads(config, Residency(1 << 40, 4), LoadCounts(), load=load,
                      on_loaded=lambda model_id: None)
        with pytest.raises(Exception, match="could not be loaded"):
            await loads.begin(entry)
        failed = loads.status()[entry.id]
        task = loads.begin(entry)  # as the dashboard starts one: the failure stays on record
        await started.wait()
        during = loads.status()[entry.id]
        release.set()
        with pytest.raises(Exception, match="could not be loaded"):
            await task
        return failed, during, loads.status()[entry.id]

    failed, during, after = asyncio.run(scenario())
    assert failed.startswith("unavailable: ") and "no weights here" in failed
    assert during == "unavailable: loading"
    assert after == failed


@dataclass(eq=False)
class Loaded(Fake):
    """What the registry reads of a model its (stand-in) load made."""

    kind: str = "chat"
    weights_bytes: int = 10
    worker: Any = None
    embedder: Any = None
    vision: Any = None
    model: Any = None
    kv_cache: Any = None


def test_a_load_no_request_waits_for_any_more_is_dropped_before_it_finds_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that stops waiting for its model (cancelled, or its client left) while
    the loaded one is busy takes its load with it. Before, the load waited on, and once
    the busy model went idle unloaded it for a model nobody asked for. A request that
    comes as the load is dropped gets a load of its own, not the dropped one's cancel."""
    loads: list[str] = []

    def load(entry: Any, config: Any) -> Loaded:
        loads.append(entry.id)
        return Loaded(entry.id)

    monkeypatch.setattr(models_module, "load_sync", load)
    registry = ModelRegistry(load_config(config_file(tmp_path, "[models]\nmax_loaded = 1\n"),
                                         env={}))
    demo, other = registry.resolve("demo"), registry.resolve("demo-32k")

    async def waiting(lease: Awaitable[Lease]) -> asyncio.Future[Lease]:
        task = asyncio.ensure_future(lease)
        for _ in range(200):
            if registry.status()[other.id] == "unavailable: loading":
                return task
            await asyncio.sleep(0.01)
        raise AssertionError("the request never waited for its model")

    async def main() -> tuple[list[str], list[str], list[str], str]:
        busy = await registry.lease(demo)
        waiter = await waiting(registry.lease(other))
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        await asyncio.sleep(0.01)
        status = registry.status()[other.id]
        busy.release()
        await asyncio.sleep(0.2)
        first = (list(loads), sorted(registry.residency.loaded))
        # The last waiter leaves, and another comes in the same turn of the loop.
        busy = await registry.lease(demo)
        leaving = await waiting(registry.lease(other))
        leaving.cancel()
        coming = asyncio.ensure_future(registry.lease(other))
        await asyncio.gather(leaving, return_exceptions=True)
        busy.release()
        got = await asyncio.wait_for(coming, HANG_S)
        got.release()
        return *first, list(loads), status

    loads_then, loaded_then, loads_after, status = run(main)
    registry.close()
    assert status == "available"  # not "loading": nothing loads it
    assert loads_then == ["demo"] and loaded_then == ["demo"]  # nothing unloaded for it
    assert loads_after == ["demo", "demo-32k"]  # the request that came got its model


def one_model_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                       loads: list[str], gate: dict[str, asyncio.Event] | None = None,
                       ) -> ModelRegistry:
    """A registry with ``max_loaded = 1`` whose loads are stand-ins, recorded in ``loads``;
    a model named in ``gate`` loads once its event is set (set from the test's loop)."""
    loop: list[asyncio.AbstractEventLoop] = []

    def load(entry: Any, config: Any) -> Loaded:
        event = (gate or {}).get(entry.id)
        if event is not None:
            asyncio.run_coroutine_threadsafe(event.wait(), loop[0]).result(10)
        loads.append(entry.id)
        return Loaded(entry.id)

    monkeypatch.setattr(models_module, "load_sync", load)
    registry = ModelRegistry(load_config(config_file(tmp_path, "[models]\nmax_loaded = 1\n"),
                                         env={}))
    registry.loop_of = loop  # type: ignore[attr-defined]
    return registry


async def take_turn(registry: ModelRegistry, entry: Any, tag: str, order: list[str]) -> None:
    """One request: lease the model, note its turn in ``order``, hold it a moment."""
    lease = await registry.lease(entry)
    order.append(tag)
    await asyncio.sleep(0.05)
    lease.release()


async def until(predicate: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


def test_a_load_waiting_for_room_comes_before_later_requests_for_the_busy_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model in steady use (a new request for it before the last one ends) never went
    idle, so a request for another model waited out its whole deadline (503) while every
    later request for the busy one was served at once. Now a request for the busy model
    that comes after the other load began waiting waits behind it: the busy model
    finishes what it has, is unloaded, the other model serves its request, and the held
    back request gets its model loaded again."""
    loads: list[str] = []
    registry = one_model_registry(tmp_path, monkeypatch, loads)
    demo, other = registry.resolve("demo"), registry.resolve("demo-32k")
    order: list[str] = []

    async def main() -> None:
        busy = await registry.lease(demo)
        waiter = asyncio.ensure_future(take_turn(registry, other, "other", order))
        await until(lambda: registry.status()[other.id] == "unavailable: loading", "waits")
        await asyncio.sleep(0.05)  # waiting for room now
        later = asyncio.ensure_future(take_turn(registry, demo, "later demo", order))
        await asyncio.sleep(0.2)
        assert not later.done() and not waiter.done()  # held back: it came after
        usage = registry.residency.usage(demo.id)
        # /health counts it as queued, beside the busy request (holding no slot here)
        assert usage is not None and usage.queued == 2
        busy.release()  # demo goes idle: unloaded for the request that came first
        await asyncio.wait_for(asyncio.gather(waiter, later), HANG_S)

    run(main)
    registry.close()
    assert order == ["other", "later demo"]
    assert loads == ["demo", "demo-32k", "demo"]


def test_a_held_back_request_does_not_load_its_model_back_while_it_is_unloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The held-back request went on as soon as its model left the loaded set for the
    other load, while the unload was still freeing it: it began loading the model again,
    and on a busy machine that load took the room before the other load could (a load
    and an unload for nothing, the turns late). It waits until the other load has its
    room."""
    loads: list[str] = []
    registry = one_model_registry(tmp_path, monkeypatch, loads)
    demo, other = registry.resolve("demo"), registry.resolve("demo-32k")
    order: list[str] = []
    freeing, released = threading.Event(), threading.Event()
    free = registry.residency.free

    def slow_free(model: Any) -> None:
        freeing.set()
        released.wait(10)
        free(model)

    registry.residency.free = slow_free

    async def main() -> bool:
        busy = await registry.lease(demo)
        waiter = asyncio.ensure_future(take_turn(registry, other, "other", order))
        await until(lambda: registry.status()[other.id] == "unavailable: loading", "waits")
        await asyncio.sleep(0.05)
        later = asyncio.ensure_future(take_turn(registry, demo, "later demo", order))
        await asyncio.sleep(0.05)
        busy.release()
        await until(freeing.is_set, "demo is unloaded for the other load")
        await asyncio.sleep(0.1)
        reloading = registry.loads.is_loading(demo.id)
        released.set()
        await asyncio.wait_for(asyncio.gather(waiter, later), HANG_S)
        return reloading

    reloading = run(main)
    registry.close()
    assert not reloading
    assert order == ["other", "later demo"]
    assert loads == ["demo", "demo-32k", "demo"]


def test_a_held_back_request_gets_503_at_its_deadline_and_the_busy_one_is_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads: list[str] = []
    registry = one_model_registry(tmp_path, monkeypatch, loads)
    demo, other = registry.resolve("demo"), registry.resolve("demo-32k")

    async def main() -> ServiceUnavailableError:
        busy = await registry.lease(demo)
        waiter = asyncio.ensure_future(registry.lease(other))
        await until(lambda: registry.status()[other.id] == "unavailable: loading", "waits")
        await asyncio.sleep(0.05)
        with pytest.raises(ServiceUnavailableError) as info:
            await registry.lease(demo, deadline=time.monotonic() + 0.2)
        usage = registry.residency.usage(demo.id)
        assert usage is not None and usage.queued == 1 and not busy.released  # (the busy one)
        busy.release()
        got = await asyncio.wait_for(waiter, HANG_S)
        got.release()
        return info.value

    error = run(main)
    registry.close()
    assert (error.status, error.code, error.param) == (503, "model_unavailable", "model")
    assert int(error.headers["Retry-After"]) >= 1
    assert "'demo'" in error.message and "'demo-32k', which was asked for first" in \
        error.message
    assert loads == ["demo", "demo-32k"]


def test_requests_that_waited_for_a_load_get_it_before_a_later_load_takes_its_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests waiting for a model's load came before a request for another model that
    arrives meanwhile: they get the model once it loads (no load for nothing, no turns
    taken back and forth), then the other model's load takes the room."""
    loads: list[str] = []
    gate = {"demo": asyncio.Event()}
    registry = one_model_registry(tmp_path, monkeypatch, loads, gate)
    demo, other = registry.resolve("demo"), registry.resolve("demo-32k")
    order: list[str] = []

    async def main() -> None:
        registry.loop_of.append(asyncio.get_running_loop())  # type: ignore[attr-defined]
        first = [asyncio.ensure_future(take_turn(registry, demo, f"demo {i}", order))
                 for i in range(3)]
        await until(lambda: registry.status()[demo.id] == "unavailable: loading", "loads")
        waiter = asyncio.ensure_future(take_turn(registry, other, "other", order))
        await asyncio.sleep(0.1)
        gate["demo"].set()
        await asyncio.wait_for(asyncio.gather(*first, waiter), HANG_S)

    run(main)
    registry.close()
    assert order == ["demo 0", "demo 1", "demo 2", "other"]
    assert loads == ["demo", "demo-32k"]


def test_a_load_dropped_in_the_turn_it_began_is_not_left_under_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load cancelled before its coroutine ran a line skips its ``finally``: it stayed
    under way for good (``/health``: loading), and a later request for the model found
    the dead load, went round waiting for it again, and spun on the event loop."""
    loads: list[str] = []
    registry = one_model_registry(tmp_path, monkeypatch, loads)
    entry = registry.resolve("demo-32k")

    async def main() -> tuple[bool, str, bool]:
        registry.loads.begin(entry, for_request=True)
        registry.loads.abandon(entry.id)  # its last waiter left in the same turn
        await asyncio.sleep(0.05)
        during = registry.loads.is_loading(entry.id), registry.status()[entry.id]
        lease = await asyncio.wait_for(registry.lease(entry), HANG_S)
        lease.release()
        return *during, registry.is_ready(entry.id)

    loading, status, ready = run(main)
    registry.close()
    assert (loading, status) == (False, "available")
    assert ready and loads == ["demo-32k"]


def test_an_unload_whose_client_leaves_at_once_still_frees_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dashboard's unload (``ModelRegistry.unload``) waits for the unload's task: a
    client leaving in the same turn cancelled that task before its first step, so the
    model was never freed and stayed counted as unloading, and with ``max_loaded = 1`` no
    model could load again (503 ``model_unavailable``, "unloading: 1")."""
    loads: list[str] = []
    registry = one_model_registry(tmp_path, monkeypatch, loads)
    demo, other = registry.resolve("demo"), registry.resolve("demo-32k")

    async def main() -> list[str]:
        (await registry.lease(demo)).release()
        leaving = asyncio.ensure_future(registry.unload(demo.id))
        await asyncio.sleep(0)  # the unload has begun and is waited for
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        lease = await asyncio.wait_for(registry.lease(other), HANG_S)
        lease.release()
        return sorted(registry.residency.loaded)

    loaded = run(main)
    registry.close()
    assert loads == ["demo", "demo-32k"]
    assert loaded == ["demo-32k"]


def test_turns_go_on_after_the_switch_a_later_request_for_the_new_model_waits_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the switch the request held back loads its model again, which waits for
    room beside the model just loaded for the other request: requests for that one that
    come later wait behind it in turn. Its load looked at the models it needs gone only
    when woken, and a model's load finishing woke nobody: the new model, kept in steady
    use, held the held-back request off until its deadline."""
    loads: list[str] = []
    registry = one_model_registry(tmp_path, monkeypatch, loads)
    demo, other = registry.resolve("demo"), registry.resolve("demo-32k")
    order: list[str] = []

    async def main() -> None:
        busy = await registry.lease(demo)
        first_other = asyncio.ensure_future(registry.lease(other))
        await until(lambda: registry.status()[other.id] == "unavailable: loading", "waits")
        await asyncio.sleep(0.05)
        held = asyncio.ensure_future(registry.lease(demo))  # held back behind other
        await asyncio.sleep(0.05)
        busy.release()
        got_other = await asyncio.wait_for(first_other, HANG_S)
        # The held back request now waits for demo's load, which waits for room.
        await until(lambda: registry.status()[demo.id] == "unavailable: loading", "reloads")
        await asyncio.sleep(0.05)
        later_other = asyncio.ensure_future(registry.lease(other))
        await asyncio.sleep(0.1)
        assert not later_other.done(), "a later request for other went ahead of demo's"
        later_other.add_done_callback(lambda _: order.append("later other"))
        held.add_done_callback(lambda _: order.append("held demo"))
        got_other.release()
        (await asyncio.wait_for(held, HANG_S)).release()
        (await asyncio.wait_for(later_other, HANG_S)).release()

    run(main)
    registry.close()
    assert order == ["held demo", "later other"]
    assert loads == ["demo", "demo-32k", "demo", "demo-32k"]
