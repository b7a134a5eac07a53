"""Which models stay in memory: leases, keep-alive, and unloading the least recently used
model when loading another would exceed the memory budget or the model count.

A request holds a :class:`Lease` on its model from the moment it gets it until its response
is over (rendering its prompt, queued for a slot, generating): a model with a lease, or with
requests waiting for its load, is busy and is never unloaded. When its last lease ends its
keep-alive starts (the last request's ``keep_alive``, else the model's, else ``[models]
keep_alive``): after that many idle seconds it is unloaded; ``-1`` never, ``0`` at once.

Loading a model that would take the loaded set past ``memory_budget_bytes`` or
``max_loaded`` first unloads idle models, least recently used first, and only as many as
needed; when the idle ones would not make enough room the load waits for a busy one to
become idle, up to the request's deadline, then the request gets 503
``model_unavailable``. Memory is what the models measure (weights plus KV caches), what
loads in progress will take (their weight files) and what unloads in progress still hold.

Unloading takes the model out of the loaded set at once (no request can get it any more),
then stops its thread and frees its arrays off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from afmd.engine.budget import format_bytes
from afmd.errors import ServiceUnavailableError

if TYPE_CHECKING:
    from afmd.engine.loaded import LoadedModel

log = logging.getLogger("afmd.engine")

#: What a 503 ``model_unavailable`` tells a client to wait before retrying (seconds).
RETRY_AFTER_S = 2


class Slot(Protocol):
    """A request's place with the scheduler (:class:`afmd.scheduler.Ticket`)."""

    holds_slot: bool


@dataclass(eq=False, slots=True)
class Lease:
    """One request's hold on a loaded model; :meth:`release` once its response is over."""

    model: LoadedModel
    #: Seconds the model stays loaded once idle, if this is the last request to release it.
    keep_alive: float
    _owner: Residency | None  # None: a model no registry manages (tests, tools)
    #: The request's scheduler ticket once it has one: holding a slot is being active.
    ticket: Slot | None = None
    released: bool = False

    @classmethod
    def detached(cls, model: LoadedModel) -> Lease:
        """A lease on a model loaded outside any registry: releasing it does nothing."""
        return cls(model, -1.0, None)

    @property
    def active(self) -> bool:
        return self.ticket is not None and self.ticket.holds_slot

    def release(self) -> None:
        """Idempotent: a request's end may be reached by more than one path."""
        if self._owner is not None:
            self._owner.release(self)


@dataclass(slots=True)
class _Resident:
    model: LoadedModel
    keep_alive: float
    leases: set[Lease] = field(default_factory=set)
    since: float = field(default_factory=time.monotonic)  # last got or released
    expires_at: float | None = None  # idle with a finite keep-alive: when it unloads
    expires_wall: float | None = None  # the same in Unix time, for /health
    timer: asyncio.TimerHandle | None = None
    clock: bool = False  # the keep-alive is running (idle since ``since``)


@dataclass(frozen=True, slots=True)
class Usage:
    """A loaded model's numbers for ``/health`` and ``afmd ps``. Times are instants (Unix
    time), so that two answers with nothing changed in between are the same bytes."""

    memory_bytes: int
    active: int  # requests generating (holding a scheduler slot)
    queued: int  # requests waiting: for its load, for a slot, or being prepared
    idle_since: float | None  # when its last request released it; None while busy
    expires_at: float | None  # when its keep-alive unloads it; None: busy or kept for good


def free_model(model: LoadedModel) -> None:
    """Stop the model's thread and drop its arrays, so that MLX frees them now (blocking).

    The handle itself may outlive this (a finished request's objects, a log line): its
    references to the weights, the batch and the prefix cache are cut so they cannot pin
    them.
    """
    import mlx.core as mx

    if model.worker is not None:
        model.worker.stop()
    if model.embedder is not None:
        model.embedder.stop()
    model.worker = None
    model.embedder = None
    model.vision = None  # a vision model's image side
    model.model = None
    gc.collect()  # the model's modules hold cycles (parents and children)
    mx.clear_cache()  # and MLX's pool of freed buffers gives them back


class Residency:
    """The loaded models and the rules that unload them (module doc)."""

    def __init__(
        self,
        budget: int,
        max_loaded: int,
        *,
        free: Callable[[LoadedModel], None] | None = None,
        on_unload: Callable[[str], None] = lambda model_id: None,
    ) -> None:
        self.budget = budget
        self.max_loaded = max_loaded
        self.loaded: dict[str, LoadedModel] = {}
        #: Requests waiting for a model's load, per model id: they make it busy.
        self.waiting: Counter[str] = Counter()
        self.free = free or free_model  # blocking: run off the event loop
        self._on_unload = on_unload
        self._residents: dict[str, _Resident] = {}
        self._reserved: dict[str, int] = {}  # loads under way: bytes their weights will take
        self._unloading: dict[int, int] = {}  # unloads under way: bytes still held
        self._wanted: dict[str, int] = {}  # loads waiting for room: their sizes
        self._tasks: set[asyncio.Task[None]] = set()
        self._changed: asyncio.Event | None = None
        self.closed = False

    # -- leases --
    def hold(self, model: LoadedModel, keep_alive: float) -> Lease:
        resident = self._residents[model.id]
        self._stop_clock(resident)
        resident.since = time.monotonic()
        model.touch()
        lease = Lease(model, keep_alive, self)
        resident.leases.add(lease)
        return lease

    def release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        resident = self._residents.get(lease.model.id)
        if resident is None or lease not in resident.leases:
            return  # unloaded meanwhile (the server is stopping)
        resident.leases.discard(lease)
        resident.keep_alive = lease.keep_alive
        resident.since = time.monotonic()
        lease.model.touch()
        self.settle(lease.model.id)

    def busy(self, model_id: str) -> bool:
        resident = self._residents.get(model_id)
        return bool(self.waiting[model_id] or (resident is not None and resident.leases))

    def settle(self, model_id: str) -> None:
        """Start an idle model's keep-alive (once nothing holds it or waits for it)."""
        resident = self._residents.get(model_id)
        if resident is None or resident.clock or self.busy(model_id) or self.closed:
            return
        resident.clock = True
        # A shard of a launched group stays: its other ranks cannot load it again alone.
        keep = -1.0 if getattr(resident.model, "shard", None) else resident.keep_alive
        if keep == 0:
            self._unload(resident, "keep_alive 0")
        elif keep > 0:
            resident.expires_at = resident.since + keep
            resident.expires_wall = round(time.time() + keep, 3)
            loop = asyncio.get_running_loop()
            resident.timer = loop.call_later(keep, self._expire, resident)
        self._pulse()

    def _stop_clock(self, resident: _Resident) -> None:
        if resident.timer is not None:
            resident.timer.cancel()
        resident.timer = None
        resident.expires_at = resident.expires_wall = None
        resident.clock = False

    def _expire(self, resident: _Resident) -> None:
        if self.closed:
            return
        if self._residents.get(resident.model.id) is resident and resident.clock:
            self._unload(resident, f"idle for keep_alive {resident.keep_alive:g}s")

    # -- loading and unloading --
    def admit(self, model: LoadedModel, keep_alive: float) -> None:
        """A load finished: ``model`` is loaded, idle until a request holds it."""
        self._reserved.pop(model.id, None)
        self.loaded[model.id] = model
        self._residents[model.id] = _Resident(model, keep_alive)
        self.settle(model.id)
        self._trim(keep=model.id)

    def unreserve(self, model_id: str) -> None:
        """A load failed or gave up: what it had reserved is free again."""
        if self._reserved.pop(model_id, None) is not None:
            self._pulse()

    def used_bytes(self) -> int:
        return (sum(m.memory_bytes for m in self.loaded.values())
                + sum(self._reserved.values()) + sum(self._unloading.values()))

    def _count(self) -> int:
        return len(self.loaded) + len(self._reserved) + len(self._unloading)

    def _victims(self, size: int, keep: str | None = None) -> list[_Resident] | None:
        """The idle models to unload, least recently used first, so that ``size`` more
        bytes and one more model fit (none needed: ``[]``; not enough idle: None)."""
        extra = 0 if keep is not None else 1
        over_count = self._count() + extra - self.max_loaded
        over_bytes = self.used_bytes() + size - self.budget
        idle = sorted(
            (r for r in self._residents.values()
             if r.model.id != keep and not self.busy(r.model.id)
             and getattr(r.model, "shard", None) is None),
            key=lambda r: r.since,
        )
        victims: list[_Resident] = []
        for resident in idle:
            if over_count <= 0 and over_bytes <= 0:
                break
            victims.append(resident)
            over_count -= 1
            over_bytes -= resident.model.memory_bytes
        return victims if over_count <= 0 and over_bytes <= 0 else None

    async def make_room(
        self, model_id: str, size: int, deadline: float, *, evict: bool = True
    ) -> None:
        """Reserve room for loading ``model_id`` (``size`` bytes of weights), unloading
        idle models as needed (unless not ``evict``); wait for busy ones until
        ``deadline`` (then 503)."""
        self._wanted[model_id] = size
        try:
            while True:
                victims = self._victims(size)
                if victims == []:
                    self._reserved[model_id] = size
                    return
                if victims and evict:
                    tasks = [self._unload(r, f"making room for {model_id}") for r in victims]
                    await asyncio.gather(*tasks)
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._unavailable(model_id, size)
                await self._wait_for_change(remaining)
        finally:
            del self._wanted[model_id]

    def room_error(self, model_id: str) -> ServiceUnavailableError | None:
        """The 503 for a request that gave up on ``model_id`` while its load was still
        waiting for room (None: the load itself is under way)."""
        size = self._wanted.get(model_id)
        return None if size is None else self._unavailable(model_id, size)

    def _trim(self, keep: str) -> None:
        """After a load whose size was not known beforehand: unload idle models until the
        loaded set fits the budget again (``keep`` stays)."""
        victims = self._victims(0, keep=keep)
        for resident in victims or ():
            self._unload(resident, f"making room for {keep}")

    def _unload(self, resident: _Resident, reason: str) -> asyncio.Task[None]:
        model = resident.model
        self._stop_clock(resident)
        del self._residents[model.id]
        del self.loaded[model.id]
        held = model.memory_bytes
        self._unloading[id(model)] = held
        task = asyncio.get_running_loop().create_task(self._free_later(model, held, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _free_later(self, model: LoadedModel, held: int, reason: str) -> None:
        try:
            # Callbacks already scheduled (a finished request's last events) may still hold
            # the model: let them run before its arrays are dropped.
            await asyncio.sleep(0)
            await asyncio.to_thread(self.free, model)
        except Exception:
            log.exception("unloading %s failed", model.id)
        finally:
            self._unloading.pop(id(model), None)
            self._on_unload(model.id)
            log.info("model unloaded: %s (%s; %s freed)", model.id, reason,
                     format_bytes(held))
            self._pulse()

    def _unavailable(self, model_id: str, size: int) -> ServiceUnavailableError:
        busy = ", ".join(sorted(m for m in self.loaded if self.busy(m))) or "none"
        if self._count() + 1 > self.max_loaded:
            limit = f"max_loaded ({self.max_loaded} models)"
        else:
            limit = (f"the memory budget ({format_bytes(self.budget)}; "
                     f"{format_bytes(self.used_bytes())} in use, {format_bytes(size)} needed)")
        return ServiceUnavailableError(
            f"The model '{model_id}' cannot be loaded now: it would exceed {limit}, and "
            f"the models it would replace are serving requests (busy: {busy}). Retry "
            "shortly.",
            code="model_unavailable",
            param="model",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    # -- waiting for a change --
    def _pulse(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _wait_for_change(self, timeout: float) -> None:
        """Until a model becomes idle, a load ends or an unload frees memory (or timeout)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        changed = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), timeout)

    async def drain(self) -> None:
        """Wait for the unloads under way (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # -- what /health reports --
    def usage(self, model_id: str) -> Usage | None:
        resident = self._residents.get(model_id)
        if resident is None:
            return None
        active = sum(1 for lease in resident.leases if lease.active)
        queued = len(resident.leases) - active + self.waiting[model_id]
        busy = self.busy(model_id)
        return Usage(
            memory_bytes=resident.model.memory_bytes,
            active=active,
            queued=queued,
            idle_since=None if busy else round(resident.model.last_used, 3),
            expires_at=None if busy else resident.expires_wall,
        )

    def close(self) -> list[LoadedModel]:
        """Stop every timer (safe from any thread: a timer that fires finds nothing); the
        models still loaded, for the caller to stop."""
        self.closed = True
        models = list(self.loaded.values())
        for resident in self._residents.values():
            resident.clock = False
        return models


__all__ = ["RETRY_AFTER_S", "Lease", "Residency", "Usage", "free_model"]
