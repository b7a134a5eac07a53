"""Leases and keep-alive clocks: when a loaded model is busy, and when an idle one's time is up.

A request holds a :class:`Lease` on its model from the moment it gets it until its response
is over (rendering its prompt, queued for a slot, generating): a model with a lease, or with
requests waiting for its load, is busy and is never unloaded. When its last lease ends its
keep-alive starts (the last request's ``keep_alive``, else the model's, else ``[models]
keep_alive``): after that many idle seconds it is unloaded; ``-1`` never, ``0`` at once.
The unloading itself, and the room it makes, are :mod:`afmd.engine.residency`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from afmd.engine.loaded import LoadedModel


class Slot(Protocol):
    """A request's place with the scheduler (:class:`afmd.scheduler.Ticket`)."""

    holds_slot: bool


@dataclass(eq=False, slots=True)
class Lease:
    """One request's hold on a loaded model; :meth:`release` once its response is over."""

    model: LoadedModel
    #: Seconds the model stays loaded once idle, if this is the last request to release it.
    keep_alive: float
    _owner: Leases | None  # None: a model no registry manages (tests, tools)
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


@dataclass(frozen=True, slots=True)
class Usage:
    """A loaded model's numbers for ``/health`` and ``afmd ps``. Times are instants (Unix
    time), so that two answers with nothing changed in between are the same bytes."""

    memory_bytes: int
    active: int  # requests generating (holding a scheduler slot)
    queued: int  # requests waiting: for its load, for a slot, or being prepared
    idle_since: float | None  # when its last request released it; None while busy
    expires_at: float | None  # when its keep-alive unloads it; None: busy or kept for good


@dataclass(slots=True)
class Resident:
    """A loaded model's leases and keep-alive clock."""

    model: LoadedModel
    keep_alive: float
    leases: set[Lease] = field(default_factory=set)
    since: float = field(default_factory=time.monotonic)  # last got or released
    expires_at: float | None = None  # idle with a finite keep-alive: when it unloads
    expires_wall: float | None = None  # the same in Unix time, for /health
    timer: asyncio.TimerHandle | None = None
    clock: bool = False  # the keep-alive is running (idle since ``since``)

    def expire_in(self, keep: float, expire: Callable[[Resident], None]) -> None:
        self.expires_at = self.since + keep
        self.expires_wall = round(time.time() + keep, 3)
        self.timer = asyncio.get_running_loop().call_later(keep, expire, self)

    def stop_clock(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = None
        self.expires_at = self.expires_wall = None
        self.clock = False


class Leases:
    """The loaded models' leases and clocks; ``unload`` is called when a clock runs out."""

    def __init__(
        self, unload: Callable[[Resident, str], object], changed: Callable[[], None]
    ) -> None:
        self.residents: dict[str, Resident] = {}
        #: Requests waiting for a model's load, per model id: they make it busy.
        self.waiting: Counter[str] = Counter()
        self._unload = unload
        self._changed = changed  # a model may have become idle: loads waiting for room look
        self.closed = False

    def add(self, model: LoadedModel, keep_alive: float) -> None:
        self.residents[model.id] = Resident(model, keep_alive)

    def hold(self, model: LoadedModel, keep_alive: float) -> Lease:
        resident = self.residents[model.id]
        resident.stop_clock()
        resident.since = time.monotonic()
        model.touch()
        lease = Lease(model, keep_alive, self)
        resident.leases.add(lease)
        return lease

    def release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        resident = self.residents.get(lease.model.id)
        if resident is None or lease not in resident.leases:
            return  # unloaded meanwhile (the server is stopping)
        resident.leases.discard(lease)
        resident.keep_alive = lease.keep_alive
        resident.since = time.monotonic()
        lease.model.touch()
        self.settle(lease.model.id)

    def busy(self, model_id: str) -> bool:
        resident = self.residents.get(model_id)
        return bool(self.waiting[model_id] or (resident is not None and resident.leases))

    def settle(self, model_id: str) -> None:
        """Start an idle model's keep-alive (once nothing holds it or waits for it)."""
        resident = self.residents.get(model_id)
        if resident is None or resident.clock or self.busy(model_id) or self.closed:
            return
        resident.clock = True
        # A shard of a launched group stays: its other ranks cannot load it again alone.
        keep = -1.0 if getattr(resident.model, "shard", None) else resident.keep_alive
        if keep == 0:
            self._unload(resident, "keep_alive 0")
        elif keep > 0:
            resident.expire_in(keep, self._expire)
        self._changed()

    def _expire(self, resident: Resident) -> None:
        if self.closed:
            return
        if self.residents.get(resident.model.id) is resident and resident.clock:
            self._unload(resident, f"idle for keep_alive {resident.keep_alive:g}s")

    def idle(self, keep: str | None = None) -> list[Resident]:
        """The models that may be unloaded, least recently used first (a launched group's
        shard never: its other ranks cannot load it again alone)."""
        return sorted(
            (r for r in self.residents.values()
             if r.model.id != keep and not self.busy(r.model.id)
             and getattr(r.model, "shard", None) is None),
            key=lambda r: r.since,
        )

    def usage(self, model_id: str) -> Usage | None:
        resident = self.residents.get(model_id)
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

    def close(self) -> None:
        """Safe from any thread: a timer that fires finds nothing to do."""
        self.closed = True
        for resident in self.residents.values():
            resident.clock = False


__all__ = ["Lease", "Leases", "Resident", "Slot", "Usage"]
