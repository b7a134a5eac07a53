"""Admission control: a fixed number of generation slots and a bounded FIFO queue.

A shared local server must never wedge: past ``max_concurrent_requests`` running
generations, requests wait in arrival order; past ``max_queued_requests`` waiting, they are
refused at once with 429 and ``Retry-After``. A waiter leaves the queue when its deadline
passes (504), when its client goes away, or when it is cancelled by id — and a freed slot
always goes to the oldest waiter still there.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from afmd.errors import GatewayTimeoutError, RateLimitError

T = TypeVar("T")


class Cancelled(Exception):
    """The request was cancelled while it waited for a slot (or, :class:`Arrival`, for its
    model)."""


class Ticket:
    """A request's place in line; ``cancel()`` takes it out of the queue."""

    __slots__ = ("_future", "cancelled", "holds_slot")

    def __init__(self) -> None:
        self._future: asyncio.Future[None] | None = None
        self.holds_slot = False
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        if self._future is not None and not self._future.done():
            self._future.set_exception(Cancelled())


class Arrival:
    """A request from its arrival until its run exists (its model loading or waited for,
    its prompt rendered): findable by id, so a cancel ends it there and a second request
    under its id is refused, before either waits for anything."""

    __slots__ = ("_woken", "cancelled")

    def __init__(self) -> None:
        self.cancelled = False
        self._woken: asyncio.Future[None] | None = None

    def cancel(self) -> None:
        self.cancelled = True
        if self._woken is not None and not self._woken.done():
            self._woken.set_result(None)

    async def unless_cancelled(self, work: Coroutine[Any, Any, T],
                               drop: Callable[[T], object]) -> T:
        """``work``'s result, or :class:`Cancelled` once the request is cancelled. ``work``
        is then cancelled, as a client leaving would cancel it, and a result it comes to
        all the same (it ended as the cancel came) goes to ``drop``, as it does when the
        request itself is cancelled meanwhile."""
        if self.cancelled:
            work.close()
            raise Cancelled()
        task = asyncio.ensure_future(work)
        self._woken = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait((task, self._woken), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            _abandon(task, drop)
            raise
        finally:
            self._woken = None
        if not task.done():
            _abandon(task, drop)
            raise Cancelled()
        return task.result()


def _abandon(task: asyncio.Future[T], drop: Callable[[T], object]) -> None:
    """Cancel ``task``; a result it still comes to goes to ``drop``, a failure nowhere."""

    def settle(done: asyncio.Future[T]) -> None:
        if not done.cancelled() and done.exception() is None:
            drop(done.result())

    task.add_done_callback(settle)
    task.cancel()


class Scheduler:
    def __init__(self, max_active: int, max_queued: int, *, retry_after: int = 1) -> None:
        self.max_active = max_active
        self.max_queued = max_queued
        self.retry_after = retry_after
        self._active = 0
        self._waiters: deque[Ticket] = deque()

    @property
    def active(self) -> int:
        return self._active

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self, ticket: Ticket, timeout: float) -> None:
        """Take a slot for ``ticket`` or raise 429 / 504 / :class:`Cancelled`."""
        if ticket.cancelled:
            raise Cancelled()
        if self._active < self.max_active and not self._waiters:
            self._active += 1
            ticket.holds_slot = True
            return
        if len(self._waiters) >= self.max_queued:
            raise RateLimitError(
                f"The server is busy: {self._active} requests are running and "
                f"{len(self._waiters)} are queued (max_queued_requests). Retry shortly.",
                code="rate_limited",
                headers={"Retry-After": str(self.retry_after)},
            )
        future = asyncio.get_running_loop().create_future()
        ticket._future = future
        self._waiters.append(ticket)
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                await future
        except BaseException as exc:
            if future.done() and not future.cancelled() and future.exception() is None:
                # The slot was handed over just as we gave up: pass it on.
                self._release_slot()
            if isinstance(exc, TimeoutError):
                raise GatewayTimeoutError(
                    "The request waited in the queue past the server's request_timeout.",
                    code="timeout",
                ) from None
            raise
        finally:
            ticket._future = None
            if ticket in self._waiters:
                self._waiters.remove(ticket)
        ticket.holds_slot = True

    def release(self, ticket: Ticket) -> None:
        if ticket.holds_slot:
            ticket.holds_slot = False
            self._release_slot()

    def _release_slot(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            future = waiter._future
            if future is not None and not future.done():
                future.set_result(None)  # the slot moves to the waiter without a gap
                return
        self._active -= 1
