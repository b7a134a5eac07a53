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

from afmd.errors import GatewayTimeoutError, RateLimitError


class Cancelled(Exception):
    """The request was cancelled while it waited for a slot."""


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
