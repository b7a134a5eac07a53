"""afmd's HTTP/1.1 connection: the gate in front of Sanic, with server-wide caps.

Each connection feeds its bytes to a :class:`~afmd.http.sansio.gate.Gate`; only complete,
screened requests reach Sanic (through :mod:`afmd.http.compat`). On top of that the
connection enforces:

* ``max_connections`` slots across all listeners, shed under pressure
  (:mod:`afmd.http.transport.connection_limits`);
* ``max_buffered_request_bytes`` across all connections, counting what the gate holds
  and what Sanic holds (pipelined requests, and the body of a request being processed,
  released when Sanic starts its next request): beyond it 503 ``server_overloaded``;
* a deadline per request, from its first byte (``idle_timeout``: a slowloris is cut with
  408 ``request_timeout``), and the keep-alive idle timeout.

Replies the gate writes itself (``100 Continue``, preflights, refusals) are written only
while Sanic is idle on the connection, so they never interleave with a response being
sent; a refusal is written, the write side is shut, and what the client still sends is
drained briefly (a lingering close), so the client reads the refusal instead of a reset.

Plain ``GET`` requests for the :data:`~afmd.http.routes.handlers.STATE_ROUTES` (``/health``,
``/v1/models``) come out of the gate as :class:`~afmd.http.sansio.gate.Direct` and are answered
here, under the same rule, without Sanic: health checks arrive in floods, and Sanic's
per-request machinery (signals, routing, middleware, request objects) is most of their
cost. The answer is the same route code as Sanic's (:meth:`~afmd.http.routes.handlers.StateRoute.
answer`), rendered by :func:`~afmd.http.sansio.wire.render_json` with the headers Sanic's path
adds (CORS from the one :class:`~afmd.http.sansio.screen.Cors`, ``Connection``), and the same
access-log event. Behind a request Sanic has not finished, when the client is not reading
(the transport paused writing), or when the builder fails, the request goes to Sanic
instead: Sanic answers it in order, waits for the client, or answers the failure as usual.
"""

from __future__ import annotations

import asyncio
import types
from collections import deque
from time import monotonic, perf_counter
from typing import Any, ClassVar

from sanic import Sanic
from sanic.exceptions import MethodNotAllowed, NotFound

from afmd.core.ids import new_request_id
from afmd.dialects.dialect import ErrorStyle
from afmd.errors import NotFoundError, RequestTimeoutError
from afmd.http.access import log_request
from afmd.http.compat import SanicConnection
from afmd.http.routes.state_routes import StateRoute
from afmd.http.sansio.gate import Direct, Forward, Gate, Output, Reply
from afmd.http.sansio.screen import (
    GatePolicy,
    RouteCheck,
    RouteVerdict,
    presented_key,
    presented_request_id,
)
from afmd.http.sansio.wire import Rejection, render_json
from afmd.http.transport.connection_limits import (
    OVERLOADED,
    SHED,
    TOO_MANY,
    ConnectionSlot,
    GateContext,
)
from afmd.logs import get_logger

log = get_logger("afmd.http")

#: How long a refused connection is drained after its answer before it is closed.
LINGER_SECONDS = 2.0

_OPEN, _LINGERING, _CLOSED = range(3)


def route_checker(app: Sanic) -> RouteCheck:
    """The gate's route check, answered by the app's own router (so they always agree).

    It also names the envelope a refusal goes out in: the route's dialect, or for a path
    no route serves (or not with this method), the dialect of the routes it lies under
    (``/v1/messages/…``: Anthropic's), so that a client reads every error it can get.
    """
    router = app.router
    families: list[tuple[str, ErrorStyle]] = []  # (static path prefix, its routes' style)
    # A folder's routes all in one envelope make it a family too (``/api``: Ollama's), so
    # an endpoint afmd lacks there is refused as its neighbours' errors read; ``/v1``
    # holds OpenAI's and Anthropic's routes, and stays OpenAI's.
    folders: dict[str, list[ErrorStyle | None]] = {}
    probe = NotFoundError("probe")
    for route in router.routes:
        style = getattr(route.ctx, "dialect", None)
        prefix = "/" + route.uri.split("<", 1)[0].strip("/")
        if style is not None:
            families.append((prefix.rstrip("/"), style))
        parent = prefix.rsplit("/", 1)[0]
        if parent:
            folders.setdefault(parent, []).append(style)
    for folder, styles in folders.items():
        first = styles[0]
        if first is not None and all(
                s is not None and s.error_envelope(probe) == first.error_envelope(probe)
                for s in styles) and all(prefix != folder for prefix, _ in families):
            families.append((folder, first))
    families.sort(key=lambda family: -len(family[0]))

    def family(path: str) -> ErrorStyle | None:
        for prefix, style in families:
            if path == prefix or path.startswith(prefix + "/"):
                return style
        return None

    def check(method: str, path: str) -> RouteVerdict:
        try:
            route = router.get(path, method, None)[0]
        except MethodNotAllowed as exc:
            allowed = getattr(exc, "allowed_methods", None) or ()
            return RouteVerdict(405, tuple(sorted(str(m) for m in allowed)), family(path))
        except NotFound:
            return RouteVerdict(404, (), family(path))
        except Exception:
            return RouteVerdict(404, (), family(path))
        return RouteVerdict(200, (), getattr(route.ctx, "dialect", None))

    return check


def direct_routes(app: Sanic) -> tuple[StateRoute, ...]:
    """The routes a connection may answer without Sanic: those the app serves, on GET
    alone, with a :class:`~afmd.http.routes.handlers.StateRoute`'s handler, whose builder the
    direct answer then calls. So the fast path exists only as the app's own route code."""
    found = []
    for route in app.router.routes:
        state_route = getattr(route.handler, "__self__", None)
        if (isinstance(state_route, StateRoute) and route.uri == state_route.path
                and set(route.methods) == {"GET"}):
            found.append(state_route)
    return tuple(found)


class _Lifecycle(SanicConnection):
    """How a connection starts and ends: its slot, and closing at once or lingering."""

    # Sanic's metaclass: every attribute must be declared in __slots__ (see compat).
    __slots__ = ("_afmd_gate", "_afmd_held", "_afmd_linger", "_afmd_pending",
                 "_afmd_sanic_held", "_afmd_slot", "_afmd_state")

    context: ClassVar[GateContext]
    policy: ClassVar[GatePolicy]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._afmd_pending: deque[Output] = deque()
        self._afmd_held = 0
        self._afmd_sanic_held = 0
        self._afmd_linger: asyncio.TimerHandle | None = None
        self._afmd_slot = ConnectionSlot(self.context, self)
        self._afmd_state = _OPEN
        self.context.connections.add(self)
        self._afmd_gate = Gate(self.policy)
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._afmd_linger is not None:
            self._afmd_linger.cancel()
            self._afmd_linger = None
        if self._afmd_state == _CLOSED:
            return
        self._afmd_state = _CLOSED
        self._afmd_slot.release()
        ctx = self.context
        ctx.connections.discard(self)
        ctx.buffered -= self._afmd_held
        self._afmd_held = 0
        self._afmd_pending.clear()
        self._afmd_gate.kill()
        super().connection_lost(exc)

    def afmd_open(self) -> bool:
        return self._afmd_state == _OPEN

    def afmd_idle_since(self, now: float) -> float | None:
        """Since when this connection has waited without a request in progress (idle
        between requests, or its head incomplete); None when it must not be shed."""
        if self._afmd_state != _OPEN or self._afmd_pending:
            return None
        # An answer still on its way to a slow reader is a request in progress: shedding
        # would drop what the transport holds of it.
        sheddable = (self._afmd_gate.awaiting_head and self.afmd_sanic_is_idle()
                     and not self.afmd_unsent())
        return self._afmd_slot.idle_since(now, sheddable)

    def afmd_shed(self) -> None:
        """Give up this connection's slot (or place in the pool) now: a started head is
        answered 503, an idle connection is just closed."""
        gate = self._afmd_gate
        if gate.buffered:
            self._refuse(SHED)  # Sanic is idle: written at once, then a lingering close
        else:
            gate.kill()
            self._afmd_state = _LINGERING
            self.afmd_stop_timeouts()
            self._close_transport()
        self._afmd_slot.release()  # the newcomer takes it now, whatever the close waits on

    def close_if_idle(self) -> bool:
        if self._afmd_state != _OPEN:
            self._close_transport()
            return True
        return super().close_if_idle()

    def _refuse(self, rejection: Rejection) -> None:
        """Stop reading requests and answer ``rejection`` once Sanic is idle."""
        raise NotImplementedError

    def _linger(self) -> None:
        """Shut the write side after the answer, drain the client briefly, then close; the
        slot is free from now on (draining is bounded by LINGER_SECONDS)."""
        if self._afmd_state == _OPEN:
            self._afmd_state = _LINGERING
        self._afmd_slot.release()
        self.afmd_stop_timeouts()
        self._afmd_gate.kill()
        self._afmd_pending.clear()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        try:
            if not transport.can_write_eof():
                transport.close()
                return
            transport.write_eof()
        except Exception:
            self._close_transport()
            return
        self._afmd_linger = self.loop.call_later(LINGER_SECONDS, self._close_transport)

    def _close_transport(self) -> None:
        self._afmd_linger = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        try:
            if transport.get_write_buffer_size():
                transport.abort()  # the client stopped reading; do not wait on it
            else:
                transport.close()
        except Exception:
            transport.abort()


class AfmdProtocol(_Lifecycle):
    """One HTTP/1.1 connection; subclassed per listener by :func:`make_protocol`."""

    __slots__ = ()

    def data_received(self, data: bytes) -> None:
        try:
            if self._afmd_state != _OPEN:
                return  # answered and lingering: drained and discarded
            if not data:
                self.close()
                return
            self._afmd_slot.fresh = False
            gate = self._afmd_gate
            if gate.dead:
                return
            self.afmd_touch()
            ctx = self.context
            if ctx.buffered + len(data) > ctx.max_buffered:
                self._refuse(OVERLOADED)
                return
            outputs = gate.feed(data)
            if self._afmd_slot.waiting and not self._admit(outputs):
                return
            if outputs:
                self._afmd_pending.extend(outputs)
                self._drain()
            self._account()
        except Exception:
            log.exception("connection error")
            self.close()

    # -- hooks (compat) --
    def afmd_sanic_idle(self) -> None:
        if self._afmd_state != _OPEN:
            return
        self._afmd_slot.since = monotonic()
        self._afmd_sanic_held = self.afmd_sanic_buffered()
        self._afmd_gate.restart_clock()  # its wait behind the previous one was not its fault
        self._drain()
        self._account()

    def afmd_replies_waiting(self) -> bool:
        return bool(self._afmd_pending)

    def afmd_request_deadline(self) -> float | None:
        started = self._afmd_gate.started_at
        return None if started is None else started + self.context.idle_timeout

    def afmd_expire(self) -> None:
        timeout = self.context.idle_timeout
        self._refuse(Rejection.from_error(RequestTimeoutError(
            f"The request was not received completely within idle_timeout ({timeout:g} s).")))

    # -- internals --
    def _admit(self, outputs: list[Output]) -> bool:
        """A waiting connection that has sent a complete head takes a slot, freeing one if
        need be; False when there is none to be had (it is refused)."""
        gate = self._afmd_gate
        if not any(type(o) is not Reply or o.rejection is None for o in outputs) and (
                gate.dead or gate.awaiting_head):
            return True  # no complete head yet, or only a refusal to write: no slot needed
        if self._afmd_slot.admit():
            return True
        self._refuse(TOO_MANY)
        return False

    def _drain(self) -> None:
        """Hand complete requests to Sanic; write the gate's replies and the direct answers
        when their turn comes."""
        pending = self._afmd_pending
        while pending and self._afmd_state == _OPEN:
            item = pending[0]
            if isinstance(item, Forward):
                pending.popleft()
                self._afmd_sanic_held += self.afmd_to_sanic(item)
                continue
            if isinstance(item, Direct):
                pending.popleft()
                # Answered here only when it is next in line (Sanic idle) and the client
                # reads (a paused transport would otherwise buffer without bound); else
                # Sanic answers it in turn, with its own backpressure.
                if self.afmd_sanic_is_idle() and self.afmd_writable() and self._answer(item):
                    if item.close:
                        return
                    continue
                self._afmd_sanic_held += self.afmd_to_sanic(item.forward)
                continue
            if not self.afmd_sanic_is_idle():
                return
            pending.popleft()
            if self.transport is None or self.transport.is_closing():
                return
            self.transport.write(item.data)
            self.afmd_touch()
            if item.is_continue:
                self._afmd_gate.restart_clock()
            if item.rejection is not None:
                rejection = item.rejection
                self.app.ctx.state.metrics.refused(self.app, item.target, rejection.style,
                                                   rejection.status)
                if self.context.access_log:
                    log.info("refused", status=rejection.status, code=rejection.code,
                             message=rejection.message, request_id=rejection.request_id)
            if item.close:
                self._linger()
                return

    def _answer(self, item: Direct) -> bool:
        """Write the answer to ``item`` without Sanic (it is idle: the answer is next in
        order); False when the request should go to Sanic after all."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return True  # nobody to answer
        started = perf_counter()
        state = self.app.ctx.state
        route = self.context.direct[item.path]
        try:
            full = route.full_for(state, transport.get_extra_info("sockname"),
                                  presented_key(item.forward.head))
            status, body = route.answer(state, full=full)
        except Exception:
            return False  # Sanic runs the same builder and answers its failure as usual
        # Every answer names its request (as Sanic's path does: app.py's _request_id).
        rid = presented_request_id(item.forward.head) or new_request_id()
        transport.write(render_json(status, body, (*item.headers, ("X-Request-ID", rid)),
                                    close=item.close))
        self.afmd_touch()
        self._afmd_slot.since = monotonic()
        log_request(state, "GET", item.path, status, len(body), started=started,
                    request_id=rid)
        state.metrics.direct(item.path, status)
        if item.close:
            self.close()  # as Sanic does after a Connection: close response
        return True

    def _account(self) -> None:
        held = self._afmd_gate.buffered + self._afmd_sanic_held
        for item in self._afmd_pending:
            if isinstance(item, Forward):
                held += item.size
            elif isinstance(item, Direct):
                held += item.forward.size
        if held != self._afmd_held:
            self.context.buffered += held - self._afmd_held
            self._afmd_held = held

    def _refuse(self, rejection: Rejection) -> None:
        self._afmd_gate.kill()
        rejection = rejection.named()
        self._afmd_pending.append(Reply(rejection.render(), close=True, rejection=rejection))
        self._drain()
        self._account()


def make_protocol(context: GateContext, policy: GatePolicy, name: str) -> type[AfmdProtocol]:
    """A protocol class for one listener (Sanic instantiates it per connection)."""

    def body(ns: dict[str, Any]) -> None:
        ns["context"] = context
        ns["policy"] = policy

    return types.new_class(f"AfmdProtocol_{name}", (AfmdProtocol,), {}, body)
