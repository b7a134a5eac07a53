"""Server-wide connection limits: ``max_connections`` slots, the admission pool, shedding.

Slots are shed under pressure, so that clients trickling head bytes (a slowloris) cannot
hold every slot until ``idle_timeout`` and lock everyone else out. At the cap a newcomer
waits in an admission pool (as large again) until its head is complete, then takes the
slot of the connection that has waited longest without a request in progress: one idle
between requests (closed silently, as a keep-alive timeout would) or one whose head is
still incomplete (answered 503 ``too_many_connections``). Slow newcomers therefore displace
only each other, in the pool (oldest first, when it is full), never a slot: were they to,
every attacker shed would reconnect and shed another, and legitimate newcomers would be
shed in that churn before their first bytes were read. A connection whose request is being
received past its head, processed or streamed is never shed, nor one accepted under
:data:`FRESH_GRACE` ago that has not sent a byte yet. When no slot can be freed, the
complete request is answered 503 ``too_many_connections`` (with ``Retry-After``) and the
connection closed. A connection that has been answered and is draining (lingering) holds
no slot.

The connections themselves are :class:`Member` objects (the protocol): this module only
counts, orders and picks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from time import monotonic
from typing import Protocol

from afmd.config.sections import ServerConfig
from afmd.dialects.dialect import ErrorStyle
from afmd.errors import ServiceUnavailableError, TooManyConnectionsError
from afmd.http.routes.state_routes import StateRoute
from afmd.http.sansio.screen import GatePolicy, RouteCheck
from afmd.http.sansio.wire import Rejection

#: How long a new connection that has not sent a byte yet is safe from shedding: its
#: request is normally already in flight when it is accepted.
FRESH_GRACE = 1.0

TOO_MANY = Rejection.from_error(TooManyConnectionsError(
    "The server has too many open connections; retry shortly.",
    headers={"Retry-After": "1"}))
SHED = Rejection.from_error(TooManyConnectionsError(
    "The server is at max_connections and this connection's request head was still "
    "incomplete, so it was closed to admit another client; retry.",
    headers={"Retry-After": "1"}))
OVERLOADED = Rejection.from_error(ServiceUnavailableError(
    "The server is holding too many request bytes (max_buffered_request_bytes); retry "
    "shortly.", code="server_overloaded", headers={"Retry-After": "1"}))


class Member(Protocol):
    """A connection as the limits see it."""

    def afmd_idle_since(self, now: float) -> float | None: ...

    def afmd_shed(self) -> None: ...

    def close_if_idle(self) -> bool: ...

    def close(self) -> None: ...


class GateContext:
    """What every connection of one server shares, across listeners and their restarts."""

    def __init__(self, server: ServerConfig, route: RouteCheck, *, access_log: bool = True,
                 direct: Iterable[StateRoute] = (),
                 client_styles: Iterable[tuple[str, ErrorStyle]] = ()):
        self.server = server
        self.route = route
        self.client_styles = tuple(client_styles)
        self.access_log = access_log
        #: The routes answered without Sanic, by path (the app must serve them too).
        self.direct: dict[str, StateRoute] = {r.path: r for r in direct}
        self.max_connections = server.max_connections
        self.max_buffered = server.max_buffered_request_bytes
        self.idle_timeout = server.idle_timeout
        self.open_connections = 0  # the connections holding one of max_connections slots
        self.buffered = 0  # request bytes held by gates and Sanic, all connections
        self.refused = 0
        self.shed = 0
        self.connections: set[Member] = set()  # open ones, lingering ones included
        #: The admission pool: newcomers at the cap, oldest first, until their head is in.
        self.waiting: dict[Member, None] = {}

    def shed_one(self) -> bool:
        """Free a slot: shed the slot holder that has waited longest without a request in
        progress; False when none may be shed."""
        now = monotonic()
        victim: Member | None = None
        oldest = now
        for conn in self.connections:
            since = conn.afmd_idle_since(now)
            if since is not None and since <= oldest:
                victim, oldest = conn, since
        if victim is None:
            return False
        self.shed += 1
        victim.afmd_shed()
        return True

    async def close_when_idle(
        self, deadline: float, each_turn: Callable[[], None] | None = None
    ) -> None:
        """Close connections as they go idle until none is left or ``deadline`` (a
        :func:`time.monotonic` reading) passes; ``each_turn`` runs before every round."""
        while True:
            if each_turn is not None:
                each_turn()
            for conn in list(self.connections):
                conn.close_if_idle()
            if not self.connections or monotonic() >= deadline:
                return
            await asyncio.sleep(0.02 if each_turn is not None else 0.05)

    def close_all(self) -> None:
        for conn in list(self.connections):
            with contextlib.suppress(Exception):
                conn.close()

    def policy(self, *, check_host: bool, extra_hosts: tuple[str, ...] = (),
               local: bool = False) -> GatePolicy:
        return GatePolicy.from_config(self.server, self.route, check_host=check_host,
                                      extra_hosts=extra_hosts, direct_paths=self.direct,
                                      local=local, client_styles=self.client_styles)


class ConnectionSlot:
    """One connection's claim on ``max_connections``: a slot, or a place in the pool."""

    __slots__ = ("conn", "counted", "ctx", "fresh", "since", "waiting")

    def __init__(self, ctx: GateContext, conn: Member) -> None:
        self.ctx = ctx
        self.conn = conn
        self.counted = False  # holds a slot
        self.waiting = False  # in the admission pool
        self.fresh = True  # has not sent a byte yet
        #: Since when the connection has waited without a request in progress.
        self.since = monotonic()
        if ctx.open_connections < ctx.max_connections:
            self.counted = True
            ctx.open_connections += 1
        else:
            if len(ctx.waiting) >= ctx.max_connections:
                ctx.shed += 1
                next(iter(ctx.waiting)).afmd_shed()  # the pool is full: its oldest goes
            self.waiting = True
            ctx.waiting[conn] = None

    def admit(self) -> bool:
        """Leave the pool for a slot, freeing one if need be; False when there is none
        to be had (counted as refused)."""
        ctx = self.ctx
        ctx.waiting.pop(self.conn, None)
        self.waiting = False
        if ctx.open_connections >= ctx.max_connections and not ctx.shed_one():
            ctx.refused += 1
            return False
        self.counted = True
        ctx.open_connections += 1
        return True

    def idle_since(self, now: float, sheddable: bool) -> float | None:
        """:attr:`since`, when the connection holds a slot it may lose (``sheddable``: no
        request in progress) and is past its :data:`FRESH_GRACE`; else None."""
        if not self.counted or not sheddable:
            return None
        if self.fresh and now - self.since < FRESH_GRACE:
            return None
        return self.since

    def release(self) -> None:
        """Give up the slot or the place in the pool (once)."""
        if self.counted:
            self.counted = False
            self.ctx.open_connections -= 1
        elif self.waiting:
            self.waiting = False
            self.ctx.waiting.pop(self.conn, None)
