"""Which models stay in memory: leases, keep-alive, and unloading the least recently used
model when loading another would exceed the memory budget or the model count.

A request holds a :class:`Lease` on its model from the moment it gets it until its response
is over: a model with a lease, or with requests waiting for its load, is busy and is never
unloaded; once idle, its keep-alive decides when it goes (:mod:`afmd.engine.keepalive`).

Loading a model that would take the loaded set past ``memory_budget_bytes`` or
``max_loaded`` first unloads idle models, least recently used first, and only as many as
needed; when the idle ones would not make enough room the load waits for a busy one to
become idle, up to the request's deadline, then the request gets 503
``model_unavailable``. Memory is what the models measure (weights plus KV caches), what
loads in progress will take (their weight files) and what unloads in progress still hold.

Unloading takes the model out of the loaded set at once (no request can get it any more),
then stops its thread and frees its arrays off the event loop (:mod:`afmd.engine.unloading`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from afmd.engine.budget import format_bytes
from afmd.engine.keepalive import Lease, Leases, Resident, Slot, Usage
from afmd.engine.unloading import Unloads, free_model
from afmd.errors import ConflictError, ServiceUnavailableError

if TYPE_CHECKING:
    from afmd.engine.loaded import LoadedModel

#: What a 503 ``model_unavailable`` tells a client to wait before retrying (seconds).
RETRY_AFTER_S = 2


class Changes:
    """Wakes the loads waiting for room: a model became idle, a load ended or an unload
    freed memory, and there may be room now."""

    def __init__(self) -> None:
        self._changed: asyncio.Event | None = None

    def pulse(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait(self, timeout: float) -> None:
        """Until the next :meth:`pulse` (or timeout)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        changed = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), timeout)


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
        self._changes = Changes()
        self._leases = Leases(self._unload, self._changes.pulse)
        #: Requests waiting for a model's load, per model id: they make it busy.
        self.waiting = self._leases.waiting
        self._unloads = Unloads(free or free_model, on_unload, self._changes.pulse)
        self._reserved: dict[str, int] = {}  # loads under way: bytes their weights will take
        self._wanted: dict[str, int] = {}  # loads waiting for room: their sizes

    @property
    def free(self) -> Callable[[LoadedModel], None]:
        """Blocking: run off the event loop."""
        return self._unloads.free

    @property
    def closed(self) -> bool:
        return self._leases.closed

    # -- leases (the keep-alive's) --
    def hold(self, model: LoadedModel, keep_alive: float) -> Lease:
        return self._leases.hold(model, keep_alive)

    def release(self, lease: Lease) -> None:
        self._leases.release(lease)

    def busy(self, model_id: str) -> bool:
        return self._leases.busy(model_id)

    def settle(self, model_id: str) -> None:
        """Start an idle model's keep-alive (once nothing holds it or waits for it)."""
        self._leases.settle(model_id)

    def usage(self, model_id: str) -> Usage | None:
        return self._leases.usage(model_id)

    # -- loading and unloading --
    def admit(self, model: LoadedModel, keep_alive: float) -> None:
        """A load finished: ``model`` is loaded, idle until a request holds it."""
        self._reserved.pop(model.id, None)
        self.loaded[model.id] = model
        self._leases.add(model, keep_alive)
        self.settle(model.id)
        self._trim(keep=model.id)

    def unreserve(self, model_id: str) -> None:
        """A load failed or gave up: what it had reserved is free again."""
        if self._reserved.pop(model_id, None) is not None:
            self._changes.pulse()

    def used_bytes(self) -> int:
        return (sum(m.memory_bytes for m in self.loaded.values())
                + sum(self._reserved.values()) + self._unloads.held_bytes())

    def _count(self) -> int:
        """Models counted against ``max_loaded``: Apple's model holds nothing of afmd's."""
        held = sum(1 for m in self.loaded.values() if not m.reads_conversation)
        return held + len(self._reserved) + self._unloads.count()

    def _victims(self, size: int, keep: str | None = None) -> list[Resident] | None:
        """The idle models to unload, least recently used first, so that ``size`` more
        bytes and one more model fit (none needed: ``[]``; not enough idle: None)."""
        extra = 0 if keep is not None else 1
        over_count = self._count() + extra - self.max_loaded
        over_bytes = self.used_bytes() + size - self.budget
        victims: list[Resident] = []
        for resident in self._leases.idle(keep):
            if over_count <= 0 and over_bytes <= 0:
                break
            if resident.model.reads_conversation:
                continue  # unloading it frees nothing
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
                await self._changes.wait(remaining)
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

    def unload(self, model_id: str, reason: str) -> asyncio.Task[None] | None:
        """Unload ``model_id`` now, as its keep-alive would (None: it is not loaded).
        Refused with 409 while requests hold it or wait for it, and for a launched
        group's shard, which its other ranks cannot load again alone."""
        resident = self._leases.residents.get(model_id)
        if resident is None:
            return None
        if getattr(resident.model, "shard", None) is not None:
            raise ConflictError(
                f"The model '{model_id}' is sharded over a launched group and stays loaded "
                "while the group runs.", code="model_busy", param="model")
        if self.busy(model_id):
            usage = self._leases.usage(model_id)
            held = f"{usage.active} running, {usage.queued} queued" if usage else "waiting"
            raise ConflictError(
                f"The model '{model_id}' is serving requests ({held}); unload it when it "
                "is idle.", code="model_busy", param="model")
        return self._unload(resident, reason)

    def _unload(self, resident: Resident, reason: str) -> asyncio.Task[None]:
        model = resident.model
        resident.stop_clock()
        del self._leases.residents[model.id]
        del self.loaded[model.id]
        return self._unloads.start(model, reason)

    def _unavailable(self, model_id: str, size: int) -> ServiceUnavailableError:
        busy = ", ".join(sorted(m for m in self.loaded if self.busy(m))) or "none"
        if self._count() + 1 > self.max_loaded:
            limit = f"max_loaded ({self.max_loaded} models)"
        else:
            limit = (f"the memory budget ({format_bytes(self.budget)}; "
                     f"{format_bytes(self.used_bytes())} in use, {format_bytes(size)} needed)")
        return _unavailable(model_id, limit, busy)

    async def drain(self) -> None:
        """Wait for the unloads under way (tests, shutdown)."""
        await self._unloads.drain()

    def close(self) -> list[LoadedModel]:
        """Stop every timer (safe from any thread: a timer that fires finds nothing); the
        models still loaded, for the caller to stop."""
        self._leases.close()
        return list(self.loaded.values())


def _unavailable(model_id: str, limit: str, busy: str) -> ServiceUnavailableError:
    return ServiceUnavailableError(
        f"The model '{model_id}' cannot be loaded now: it would exceed {limit}, and "
        f"the models it would replace are serving requests (busy: {busy}). Retry "
        "shortly.",
        code="model_unavailable",
        param="model",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


__all__ = ["RETRY_AFTER_S", "Lease", "Residency", "Slot", "Usage", "free_model"]
