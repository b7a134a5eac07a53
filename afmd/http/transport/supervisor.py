"""Listener self-healing: watch each listening socket and recreate it when it breaks.

A listener can fail while the server runs: its socket is shut down or errors, or its file
descriptor is closed underneath (a plain asyncio loop then logs an accept() error on every
turn; uvloop stays silent), or a Unix socket's file is removed. The supervisor checks every
listener every ``interval`` seconds (and at once when poked, e.g. by the loop's exception
handler on an accept() failure), and recreates a broken one on the same address: up to
``max_attempts`` times, waiting ``base_delay * 2**k`` before attempt ``k + 1``. After the
last failure it reports ``stopped`` and calls ``on_exhausted`` (the server then stops with
exit code 1). Connections already accepted are untouched, so streams keep going.

Each transition is a :class:`ListenerState`, logged as a ``listener_state`` event and
delivered to ``callbacks`` and to :meth:`ListenerSupervisor.subscribe` iterators.

This module only needs objects with ``describe()`` and ``problem()``; tearing a listener
down and binding it again are callables supplied by the server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from afmd.logs import get_logger

log = get_logger("afmd.server")

RUNNING = "running"
RESTARTING = "restarting"
STOPPED = "stopped"


@dataclass(frozen=True)
class ListenerState:
    """``running`` (attempt 0 at start, k after the k-th restart attempt succeeded),
    ``restarting`` (before attempt k, with the reason) or ``stopped`` (gave up)."""

    state: str
    listener: str
    attempt: int = 0
    reason: str | None = None


class Supervised(Protocol):
    def describe(self) -> str: ...

    def problem(self) -> str | None: ...


class ListenerSupervisor:
    def __init__(
        self,
        *,
        teardown: Callable[[Supervised], None],
        rebind: Callable[[Supervised], Awaitable[None]],
        on_exhausted: Callable[[ListenerState], None],
        # A quarter second finds a broken listener soon enough (an accept() failure pokes
        # at once) and keeps an idle server idle: 50 ms polling cost ~0.7% of a core.
        interval: float = 0.25,
        max_attempts: int = 5,
        base_delay: float = 0.05,
    ) -> None:
        self.listeners: list[Supervised] = []
        self.callbacks: list[Callable[[ListenerState], None]] = []
        self.history: list[ListenerState] = []
        self.interval = interval
        self.max_attempts = max_attempts
        self.base_delay = base_delay
        self._teardown = teardown
        self._rebind = rebind
        self._on_exhausted = on_exhausted
        self._queues: set[asyncio.Queue[ListenerState]] = set()
        self._poked: dict[int, tuple[Supervised, str]] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    # -- observing --
    def emit(self, state: ListenerState) -> None:
        level = {RUNNING: log.info, RESTARTING: log.warning}.get(state.state, log.error)
        level("listener_state", state=state.state, listener=state.listener,
              attempt=state.attempt, reason=state.reason)
        self.history.append(state)
        del self.history[:-1000]
        for callback in list(self.callbacks):
            try:
                callback(state)
            except Exception:
                log.exception("listener state callback failed")
        for queue in self._queues:
            queue.put_nowait(state)

    async def subscribe(self) -> AsyncIterator[ListenerState]:
        """Every state from now on, as it happens."""
        queue: asyncio.Queue[ListenerState] = asyncio.Queue()
        self._queues.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._queues.discard(queue)

    # -- lifecycle --
    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="afmd-supervisor")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def poke(self, listener: Supervised, reason: str) -> None:
        """Treat ``listener`` as failed now (e.g. its accept() raised)."""
        self._poked.setdefault(id(listener), (listener, reason))
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)
            self._wake.clear()
            for listener in list(self.listeners):
                poked = self._poked.pop(id(listener), None)
                try:
                    reason = poked[1] if poked else listener.problem()
                except Exception as exc:  # a health check must never kill the supervisor
                    reason = f"health check failed: {exc}"
                if reason is None:
                    continue
                if not await self._recover(listener, reason):
                    return

    async def _recover(self, listener: Supervised, reason: str) -> bool:
        name = listener.describe()
        log.error("listener failed", listener=name, reason=reason)
        try:
            self._teardown(listener)
        except Exception as exc:
            log.error("listener teardown failed", listener=name, error=str(exc))
        for attempt in range(1, self.max_attempts + 1):
            self.emit(ListenerState(RESTARTING, name, attempt, reason))
            await asyncio.sleep(self.base_delay * 2 ** (attempt - 1))
            try:
                await self._rebind(listener)
            except Exception as exc:
                reason = f"rebind failed: {exc}"
                log.error("listener rebind failed", listener=name, attempt=attempt,
                          error=str(exc))
                continue
            self._poked.pop(id(listener), None)
            self.emit(ListenerState(RUNNING, name, attempt))
            return True
        final = ListenerState(STOPPED, name, self.max_attempts, reason)
        self.emit(final)
        self._on_exhausted(final)
        return False
