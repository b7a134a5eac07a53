"""Which models stay in memory: the budget, leases and keep-alive, and unloading the least
recently used model when loading another would exceed the memory budget or the model count.

**The budget** (``[models] memory_budget_bytes``) defaults to a fraction of the machine's
memory, because what else runs on it differs by platform:

- **macOS** (Apple silicon): the GPU computes from the same physical memory, and Metal
  lets one process wire only about two thirds to three quarters of it; 60 % keeps the
  models inside that and leaves the system, the client (an editor, a browser) and the
  page cache room to live.
- **Linux** (MLX's CPU backend): the weights live in afmd's own heap while the page cache
  may still hold the files they were read from, and a long prefill allocates large
  temporary buffers; 50 % leaves that room. A container's memory limit (cgroup v2
  ``memory.max``) counts as the machine's memory when it is lower. On a discrete GPU (MLX's
  CUDA backend) the limit is the GPU's memory, which this cannot see: set the budget.

A model's size before loading is the size of its safetensors files on disk: MLX loads
them as they are stored, so that is what its weights will take (measured again once
loaded).

**Leases and keep-alive.** A request holds a :class:`Lease` on its model from the moment it
gets it until its response is over (rendering its prompt, queued for a slot, generating): a
model with a lease, or with requests waiting for its load, is busy and is never unloaded.
When its last lease ends its keep-alive starts: after that many idle seconds it is
unloaded; ``-1`` never, ``0`` at once. The keep-alive is the one of the request that got
the model last (its ``keep_alive``, else the model's, else ``[models] keep_alive``), not of
the one that happens to release it last: as in Ollama, where each request sets the
session's duration, an unload (``keep_alive`` 0) sent while a long stream runs takes
effect when the stream ends, which ``ollama stop`` relies on. A keep-alive longer than
:data:`FOR_GOOD` (ten years) counts as never: a client may send ``"99999999999h"`` or
``1e20``, and an instant that far ahead is not one a clock or a date can hold.

**Making room.** Loading a model that would take the loaded set past
``memory_budget_bytes`` or ``max_loaded`` first unloads idle models, least recently used
first, and only as many as needed; when the idle ones would not make enough room the load
waits for a busy one to become idle, up to the request's deadline, then the request gets
503 ``model_unavailable``. Meanwhile the busy models it waits for take no request that
came after it (:meth:`Residency.held_for`): those wait behind it, queued but not making
the model busy, or a model in steady use would never become idle and the load would wait
in vain while every later request for the busy model was served. Memory is what the
models measure (weights plus KV caches), what loads in progress will take (their weight
files) and what unloads in progress still hold.

**Unloading** takes the model out of the loaded set at once (no request can get it any
more), then stops its thread and frees its arrays off the event loop: freeing blocks, so it
runs in a thread, and until it is done the model's memory still counts against the budget,
or a load making room would take more than there is.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from afmd.config.sections import BUILTIN_SYSTEM_PATH
from afmd.config.tables import ModelEntry
from afmd.engine.models import kinds
from afmd.errors import ConflictError, ServiceUnavailableError

if TYPE_CHECKING:
    from afmd.engine.models.loaded_model import LoadedModel
    from afmd.service.scheduler import Ticket

log = logging.getLogger("afmd.engine")

# ------------------------------------------------------------------------------ the budget

#: The share of physical memory the default budget allows, per platform (module doc).
DEFAULT_FRACTION = 0.6 if sys.platform == "darwin" else 0.5

_CGROUP_LIMIT = Path("/sys/fs/cgroup/memory.max")


def physical_memory_bytes() -> int:
    """The machine's memory, or its container's limit when that is lower."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = 0
    try:
        limit = _CGROUP_LIMIT.read_text().strip()
    except OSError:
        limit = "max"
    if limit.isdigit() and (total <= 0 or 0 < int(limit) < total):
        total = int(limit)
    return total


def effective_budget(configured: int) -> int:
    """``configured`` bytes, or (0) the platform's share of physical memory."""
    if configured > 0:
        return configured
    return int(physical_memory_bytes() * DEFAULT_FRACTION)


def weights_on_disk(folder: Path) -> int:
    """Bytes of the model's weight files (a hub snapshot's links followed to the blobs)."""
    total = 0
    for path in folder.glob("*.safetensors"):
        try:
            total += path.stat().st_size
        except OSError:
            continue
    return total


def size_before_loading(entry: ModelEntry) -> int | None:
    """What ``entry``'s weights will take, read from disk; None while unknown (a Hugging
    Face repo not downloaded yet: its load downloads it, and it is measured then).

    A built-in demo is built here if it was not yet (a moment's work its load would do
    anyway), so it is sized like any other folder.
    """
    if entry.path == BUILTIN_SYSTEM_PATH:
        return None  # Apple's model: its weights are the system's, not in afmd's memory
    if entry.path.startswith(kinds.BUILTIN_PREFIX):
        from afmd.engine.demo import builtin as demo

        folder: Path | None = demo.materialize(entry.path[len(kinds.BUILTIN_PREFIX):])
    else:
        folder = kinds.model_folder(entry.path)
    if folder is None:
        return None
    size = weights_on_disk(folder)
    return size or None


def format_bytes(count: int) -> str:
    """``1.5 GiB``: sizes in messages people read."""
    value = float(count)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{count} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # unreachable; keeps type checkers content


# ------------------------------------------------------------------ leases and keep-alive


#: The longest keep-alive a clock counts; anything longer keeps the model loaded for good.
FOR_GOOD = 10 * 365 * 86400.0


@dataclass(eq=False, slots=True)
class Lease:
    """One request's hold on a loaded model; :meth:`release` once its response is over."""

    model: LoadedModel
    #: Seconds the model stays loaded once idle, unless a later request gets it.
    keep_alive: float
    _owner: Residency | None  # None: a model no registry manages (tests, tools)
    #: The request's scheduler ticket once it has one: holding a slot is being active.
    ticket: Ticket | None = None
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
class ModelUsage:
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


# ------------------------------------------------------------------------------ unloading


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


# ------------------------------------------------------------------------------ residency


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
        on_retire: Callable[[LoadedModel], None] = lambda model: None,
    ) -> None:
        self.budget = budget
        self.max_loaded = max_loaded
        self.loaded: dict[str, LoadedModel] = {}
        self._changes = Changes()
        #: The loaded models' leases and keep-alive clocks.
        self.residents: dict[str, Resident] = {}
        #: Requests waiting for a model's load, per model id: they make it busy.
        self.waiting: Counter[str] = Counter()
        #: Closed (the server stops): no clock unloads anything any more.
        self.closed = False
        #: Stops a model's thread and frees its arrays; blocking, so run off the event loop.
        self.free = free or free_model
        self._on_unload = on_unload
        #: Told of a model leaving the loaded set while its caches can still be read.
        self._on_retire = on_retire
        self._unloading: dict[int, int] = {}  # per model object being freed: bytes it holds
        self._unload_tasks: set[asyncio.Task[None]] = set()
        self._reserved: dict[str, int] = {}  # loads under way: bytes their weights will take
        #: Loads waiting for room: their sizes, and whether they may unload idle models.
        self._wanted: dict[str, tuple[int, bool]] = {}
        #: Per load waiting for room: when it was asked for (see :meth:`_behind`).
        self._wanted_since: dict[str, float] = {}
        #: Per load waiting for room: since when, and the busy models it waits for. They
        #: take no request that came after that (see :meth:`held_for`).
        self._claims: dict[str, tuple[float, frozenset[str]]] = {}
        #: Requests held back from a claimed model, per model id: queued, but not busy.
        self.held_back: Counter[str] = Counter()

    # -- leases and keep-alive --
    def hold(self, model: LoadedModel, keep_alive: float) -> Lease:
        resident = self.residents[model.id]
        resident.stop_clock()
        resident.since = time.monotonic()
        resident.keep_alive = keep_alive
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
        elif 0 < keep <= FOR_GOOD:
            resident.expire_in(keep, self._expire)
        self._changes.pulse()

    def _expire(self, resident: Resident) -> None:
        if self.closed:
            return
        if self.residents.get(resident.model.id) is resident and resident.clock:
            self._unload(resident, f"idle for keep_alive {resident.keep_alive:g}s")

    def _idle(self, keep: str | None = None) -> list[Resident]:
        """The models that may be unloaded, least recently used first (a launched group's
        shard never: its other ranks cannot load it again alone)."""
        return sorted(
            (r for r in self.residents.values()
             if r.model.id != keep and not self.busy(r.model.id)
             and getattr(r.model, "shard", None) is None),
            key=lambda r: r.since,
        )

    def usage(self, model_id: str) -> ModelUsage | None:
        resident = self.residents.get(model_id)
        if resident is None:
            return None
        active = sum(1 for lease in resident.leases if lease.active)
        queued = (len(resident.leases) - active + self.waiting[model_id]
                  + self.held_back[model_id])
        busy = self.busy(model_id)
        return ModelUsage(
            memory_bytes=resident.model.memory_bytes,
            active=active,
            queued=queued,
            idle_since=None if busy else round(resident.model.last_used, 3),
            expires_at=None if busy else resident.expires_wall,
        )

    # -- loading and unloading --
    def admit(self, model: LoadedModel, keep_alive: float) -> None:
        """A load finished: ``model`` is loaded, idle until a request holds it."""
        self._reserved.pop(model.id, None)
        self.loaded[model.id] = model
        self.residents[model.id] = Resident(model, keep_alive)
        self.settle(model.id)
        self._trim(keep=model.id)
        # Loads waiting for room look again: a model they need gone is there now, and
        # requests for it that come after them must wait behind them from now on.
        self._changes.pulse()

    def unreserve(self, model_id: str) -> None:
        """A load failed or gave up: what it had reserved is free again."""
        if self._reserved.pop(model_id, None) is not None:
            self._changes.pulse()

    def used_bytes(self) -> int:
        return (sum(m.memory_bytes for m in self.loaded.values())
                + sum(self._reserved.values()) + sum(self._unloading.values()))

    def _count(self) -> int:
        """Models counted against ``max_loaded``: Apple's model holds nothing of afmd's."""
        held = sum(1 for m in self.loaded.values() if not m.reads_conversation)
        return held + len(self._reserved) + len(self._unloading)

    def _victims(self, size: int, keep: str | None = None) -> list[Resident] | None:
        """The idle models to unload, least recently used first, so that ``size`` more
        bytes and one more model fit (none needed: ``[]``; not enough idle: None)."""
        extra = 0 if keep is not None else 1
        over_count = self._count() + extra - self.max_loaded
        over_bytes = self.used_bytes() + size - self.budget
        victims: list[Resident] = []
        for resident in self._idle(keep):
            if over_count <= 0 and over_bytes <= 0:
                break
            if resident.model.reads_conversation:
                continue  # unloading it frees nothing
            victims.append(resident)
            over_count -= 1
            over_bytes -= resident.model.memory_bytes
        return victims if over_count <= 0 and over_bytes <= 0 else None

    async def make_room(
        self, model_id: str, size: int, deadline: float, *, evict: bool = True,
        since: float | None = None,
    ) -> None:
        """Reserve room for loading ``model_id`` (``size`` bytes of weights), unloading
        idle models as needed (unless not ``evict``); wait for busy ones until
        ``deadline`` (then 503). ``since``: when the load was asked for (default: now);
        requests for the busy models it waits for that come later wait behind it."""
        self._wanted[model_id] = (size, evict)
        if since is None:
            since = time.monotonic()
        self._wanted_since[model_id] = since
        try:
            while True:
                if self._behind(model_id, since):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise self._unavailable(model_id, size)
                    await self._changes.wait(remaining)
                    continue
                victims = self._victims(size)
                if victims == []:
                    self._reserved[model_id] = size
                    return
                if evict:
                    self._claim(model_id, size, since)
                if victims and evict:
                    await self.freed(*(self._unload(r, f"making room for {model_id}")
                                       for r in victims))
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._unavailable(model_id, size)
                await self._changes.wait(remaining)
        finally:
            del self._wanted[model_id]
            del self._wanted_since[model_id]
            self.drop_claim(model_id)
            self._changes.pulse()  # a load behind this one goes on

    def _behind(self, model_id: str, since: float) -> bool:
        """Whether a load asked for before this one waits for room it could take now (the
        room is there, or idle models it may unload): this one waits its turn. Without
        the order, a load whose unload had just freed the room found it taken, in the
        moment before it woke, by a later load, whose model it then unloaded as soon as
        it was idle, before its requests could hold it: with ``max_loaded = 1`` and
        requests for four models at once, a dozen requests took sixty loads."""
        for other, asked in self._wanted_since.items():
            if other == model_id or asked >= since:
                continue
            size, evict = self._wanted[other]
            victims = self._victims(size)
            if victims == [] or (victims and evict):
                return True
        return False

    def expect(self, model_id: str, since: float) -> None:
        """A load of ``model_id`` was asked for at ``since`` and is reading its size:
        until it knows which models it needs gone, every loaded one is held for it (see
        :meth:`held_for`), or a request that came after it could take a model it needs in
        that moment, for as long as that request runs."""
        self._claims[model_id] = (since, frozenset(
            r.model.id for r in self.residents.values()
            if getattr(r.model, "shard", None) is None and not r.model.reads_conversation))

    def drop_claim(self, model_id: str) -> None:
        """The load of ``model_id`` found its room, gave up or ended: the requests it
        held back go on."""
        if self._claims.pop(model_id, None) is not None:
            self._changes.pulse()

    def _claim(self, model_id: str, size: int, since: float) -> None:
        """Mark the models a load waiting for room needs gone, the idle ones first (they
        go now), then the busy ones least recently used first: requests for them that come
        from now on wait behind the load, or a model in steady use would keep it waiting
        for good, and a model being unloaded for it would be loaded again into its room."""
        over_count = self._count() + 1 - self.max_loaded
        over_bytes = self.used_bytes() + size - self.budget
        needed: list[str] = []
        for resident in sorted(
            (r for r in self.residents.values()
             if getattr(r.model, "shard", None) is None and not r.model.reads_conversation),
            key=lambda r: (self.busy(r.model.id), r.since),
        ):
            if over_count <= 0 and over_bytes <= 0:
                break
            needed.append(resident.model.id)
            over_count -= 1
            over_bytes -= resident.model.memory_bytes
        # Not enough even with every busy model gone (loads under way, unloads still
        # freeing): nothing to claim yet; those end by themselves.
        fits = over_count <= 0 and over_bytes <= 0
        claim = (since, frozenset(needed if fits else ()))
        if self._claims.get(model_id) != claim:
            before = self._claims.get(model_id, (since, frozenset()))[1]
            self._claims[model_id] = claim
            if before - claim[1]:
                self._changes.pulse()  # a model no longer needed takes requests again

    def held_for(self, model_id: str, arrived: float) -> str | None:
        """The model a load that came before a request arriving at ``arrived`` waits for
        ``model_id``'s room to load (None: the request may have ``model_id``)."""
        for claimant, (since, models) in self._claims.items():
            if model_id in models and since < arrived:
                return claimant
        return None

    async def wait_turn(self, model_id: str, arrived: float, deadline: float) -> None:
        """Until no load that came before the request waits for ``model_id``'s room (that
        load has it, or gave up); past ``deadline`` 503 ``model_unavailable``. Counted as
        queued for the model, not as busy: the model must be able to go idle for that
        load. The model being unloaded for it is not the end of the wait: until the load
        has reserved its room, loading the model again would take that room back."""
        self.held_back[model_id] += 1
        try:
            while (claimant := self.held_for(model_id, arrived)) is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise _held_back(model_id, claimant)
                await self._changes.wait(remaining)
        finally:
            self.held_back[model_id] -= 1
            if not self.held_back[model_id]:
                del self.held_back[model_id]

    def room_error(self, model_id: str) -> ServiceUnavailableError | None:
        """The 503 for a request that gave up on ``model_id`` while its load was still
        waiting for room (None: the load itself is under way, or has its room now and
        only has not woken yet to take it). A deadline can pass in the moment between a
        model going idle, or an unload ending, and the load running again (a stalled
        event loop makes it long): told then that busy models kept the load out, the
        request read "busy: none", or the budget with nothing in use."""
        wanted = self._wanted.get(model_id)
        if wanted is None:
            return None
        size, evict = wanted
        victims = self._victims(size)
        if victims == [] or (victims and evict):
            return None
        return self._unavailable(model_id, size)

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
        resident = self.residents.get(model_id)
        if resident is None:
            return None
        if getattr(resident.model, "shard", None) is not None:
            raise ConflictError(
                f"The model '{model_id}' is sharded over a launched group and stays loaded "
                "while the group runs.", code="model_busy", param="model")
        if self.busy(model_id):
            usage = self.usage(model_id)
            held = f"{usage.active} running, {usage.queued} queued" if usage else "waiting"
            raise ConflictError(
                f"The model '{model_id}' is serving requests ({held}); unload it when it "
                "is idle.", code="model_busy", param="model")
        return self._unload(resident, reason)

    def _unload(self, resident: Resident, reason: str) -> asyncio.Task[None]:
        """Out of the loaded set now; freed in a thread, its memory counted until then."""
        model = resident.model
        resident.stop_clock()
        del self.residents[model.id]
        del self.loaded[model.id]
        held = model.memory_bytes
        self._unloading[id(model)] = held
        self._on_retire(model)
        task = asyncio.get_running_loop().create_task(self._free_later(model, held, reason))
        self._unload_tasks.add(task)
        task.add_done_callback(self._unload_tasks.discard)
        return task

    @staticmethod
    async def freed(*unloads: asyncio.Task[None]) -> None:
        """Until ``unloads`` (tasks :meth:`unload` returned) have freed their models.

        Whoever waits may stop waiting (a load dropped by its last client, a client that
        left) but never stops the unload: one cancelled before its first step never ran
        its clean-up, so its model was never freed and stayed counted as unloading, which
        kept every later load out once ``max_loaded`` was reached."""
        await asyncio.shield(asyncio.gather(*unloads))

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
            self._changes.pulse()  # loads waiting for room look again

    def _unavailable(self, model_id: str, size: int) -> ServiceUnavailableError:
        busy = ", ".join(sorted(m for m in self.loaded if self.busy(m))) or "none"
        # What else holds the room: other models' loads under way and unloads still
        # freeing, named too, or a wait behind them read "busy: none", as if nothing did.
        loading = sorted(m for m in self._reserved if m != model_id)
        if loading:
            busy += f"; loading: {', '.join(loading)}"
        if self._unloading:
            busy += f"; unloading: {len(self._unloading)}"
        if self._count() + 1 > self.max_loaded:
            limit = f"max_loaded ({self.max_loaded} models)"
        else:
            limit = (f"the memory budget ({format_bytes(self.budget)}; "
                     f"{format_bytes(self.used_bytes())} in use, {format_bytes(size)} needed)")
        return _unavailable(model_id, limit, busy)

    async def drain(self) -> None:
        """Wait for the unloads under way (tests, shutdown)."""
        while self._unload_tasks:
            await self.freed(*self._unload_tasks)

    def close(self) -> list[LoadedModel]:
        """Stop every timer (safe from any thread: a timer that fires finds nothing); the
        models still loaded, for the caller to stop."""
        self.closed = True
        for resident in self.residents.values():
            resident.clock = False
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


def _held_back(model_id: str, claimant: str) -> ServiceUnavailableError:
    return ServiceUnavailableError(
        f"The model '{model_id}' cannot take requests now: it is finishing the ones it has, "
        f"to make room for '{claimant}', which was asked for first. Retry shortly.",
        code="model_unavailable",
        param="model",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


__all__ = [
    "DEFAULT_FRACTION",
    "RETRY_AFTER_S",
    "Lease",
    "ModelUsage",
    "Residency",
    "effective_budget",
    "format_bytes",
    "free_model",
    "physical_memory_bytes",
    "size_before_loading",
    "weights_on_disk",
]
