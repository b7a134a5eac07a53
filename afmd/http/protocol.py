"""afmd's HTTP/1.1 connection: Sanic's protocol behind the gate, with server-wide caps.

Each connection feeds its bytes to a :class:`~afmd.http.gate.Gate`; only complete,
screened, normalised requests reach Sanic's parser. On top of that the protocol enforces:

* ``max_connections`` slots across all listeners, shed under pressure, so that clients
  trickling head bytes (a slowloris) cannot hold every slot until ``idle_timeout`` and
  lock everyone else out. At the cap a newcomer waits in an admission pool (as large
  again) until its head is complete, then takes the slot of the connection that has
  waited longest without a request in progress: one idle between requests (closed
  silently, as a keep-alive timeout would) or one whose head is still incomplete
  (answered 503 ``too_many_connections``). Slow newcomers therefore displace only each
  other, in the pool (oldest first, when it is full), never a slot: were they to, every
  attacker shed would reconnect and shed another, and legitimate newcomers would be shed
  in that churn before their first bytes were read. A connection whose request is being
  received past its head, processed or streamed is never shed, nor one accepted under
  :data:`FRESH_GRACE` ago that has not sent a byte yet. When no slot can be freed, the
  complete request is answered 503 ``too_many_connections`` (with ``Retry-After``) and
  the connection closed. A connection that has been answered and is draining (lingering)
  holds no slot;
* ``max_buffered_request_bytes`` across all connections, counting what the gate holds
  and what Sanic holds (pipelined requests, and the body of a request being processed,
  released when Sanic starts its next request): beyond it 503 ``server_overloaded``;
* a deadline per request, from its first byte (``idle_timeout``: a slowloris is cut with
  408 ``request_timeout``), and the keep-alive idle timeout.

Replies the gate writes itself (``100 Continue``, preflights, refusals) are written only
while Sanic is idle on the connection, so they never interleave with a response being
sent; a refusal is written, the write side is shut, and what the client still sends is
drained briefly (a lingering close), so the client reads the refusal instead of a reset.

Plain ``GET`` requests for the :data:`~afmd.http.routes.STATE_ROUTES` (``/health``,
``/v1/models``) come out of the gate as :class:`~afmd.http.gate.Direct` and are answered
here, under the same rule, without Sanic: health checks arrive in floods, and Sanic's
per-request machinery (signals, routing, middleware, request objects) is most of their
cost. The answer is the route's own (:meth:`~afmd.http.routes.StateRoute.answer`), with the
headers Sanic's path adds (CORS, ``Connection``), and the same access-log event. Behind a
request Sanic has not finished, when the client is not reading (the transport paused
writing), or when the builder fails, the request goes to Sanic instead, as it always did:
Sanic answers it in order, waits for the client, or answers the failure as usual.
"""

from __future__ import annotations

import types
from collections import deque
from collections.abc import Iterable
from time import monotonic, perf_counter
from typing import Any, ClassVar

from sanic import Sanic
from sanic import headers as sanic_headers
from sanic import helpers as sanic_helpers
from sanic.compat import Header
from sanic.exceptions import MethodNotAllowed, NotFound, ServiceUnavailable
from sanic.http import Http, Stage
from sanic.server.protocols.http_protocol import HttpProtocol

from afmd.config import ServerConfig
from afmd.errors import RequestTimeoutError, ServiceUnavailableError, TooManyConnectionsError
from afmd.http.access import log_request
from afmd.http.gate import Direct, Forward, Gate, Output, Reply
from afmd.http.routes import StateRoute
from afmd.http.screen import GatePolicy, RouteCheck
from afmd.http.wire import Rejection, render_json
from afmd.logs import get_logger

log = get_logger("afmd.http")

#: How long a refused connection is drained after its answer before it is closed.
LINGER_SECONDS = 2.0
#: How long a new connection that has not sent a byte yet is safe from shedding: its
#: request is normally already in flight when it is accepted.
FRESH_GRACE = 1.0

_OPEN, _LINGERING, _CLOSED = range(3)


def _patch_reason_phrases() -> None:
    """Sanic has no reason phrase for 421 (it would send "421 UNKNOWN")."""
    for status, phrase in ((421, b"Misdirected Request"),
                           (431, b"Request Header Fields Too Large")):
        sanic_helpers.STATUS_CODES[status] = phrase
        sanic_headers._HTTP1_STATUSLINES[status] = b"HTTP/1.1 %d %b\r\n" % (status, phrase)


_patch_reason_phrases()


def route_checker(app: Sanic) -> RouteCheck:
    """The gate's route check, answered by the app's own router (so they always agree)."""
    router = app.router

    def check(method: str, path: str) -> tuple[int, tuple[str, ...]]:
        try:
            router.get(path, method, None)
        except MethodNotAllowed as exc:
            allowed = getattr(exc, "allowed_methods", None) or ()
            return 405, tuple(sorted(str(m) for m in allowed))
        except NotFound:
            return 404, ()
        except Exception:
            return 404, ()
        return 200, ()

    return check


class GateContext:
    """What every connection of one server shares, across listeners and their restarts."""

    def __init__(self, server: ServerConfig, route: RouteCheck, *, access_log: bool = True,
                 direct: Iterable[StateRoute] = ()):
        self.server = server
        self.route = route
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
        self.connections: set[AfmdProtocol] = set()  # open ones, lingering ones included
        #: The admission pool: newcomers at the cap, oldest first, until their head is in.
        self.waiting: dict[AfmdProtocol, None] = {}

    def shed_one(self) -> bool:
        """Free a slot: shed the slot holder that has waited longest without a request in
        progress; False when none may be shed."""
        now = monotonic()
        victim: AfmdProtocol | None = None
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

    def policy(self, *, check_host: bool, extra_hosts: tuple[str, ...] = ()) -> GatePolicy:
        return GatePolicy.from_config(self.server, self.route, check_host=check_host,
                                      extra_hosts=extra_hosts, direct_paths=self.direct)


_TOO_MANY = Rejection.from_error(TooManyConnectionsError(
    "The server has too many open connections; retry shortly.",
    headers={"Retry-After": "1"}))
_SHED = Rejection.from_error(TooManyConnectionsError(
    "The server is at max_connections and this connection's request head was still "
    "incomplete, so it was closed to admit another client; retry.",
    headers={"Retry-After": "1"}))
_OVERLOADED = Rejection.from_error(ServiceUnavailableError(
    "The server is holding too many request bytes (max_buffered_request_bytes); retry "
    "shortly.", code="server_overloaded", headers={"Retry-After": "1"}))


class AfmdHttp(Http):
    """Sanic's HTTP/1.1 cycle, telling the protocol each time it goes idle."""

    # The gate already bounds the head (max_header_bytes, answered with 431); Sanic's own
    # ceiling (16 KiB, answered with 413) must never cut a head the gate accepted.
    HEADER_MAX_SIZE = 1 << 62

    def init_for_request(self) -> None:
        super().init_for_request()
        self.protocol.afmd_sanic_idle()

    async def http1_request_header(self) -> None:
        """Sanic's head parser, with the header values exactly as the gate forwarded them.

        Sanic ``str.lstrip()``s each value after decoding it as UTF-8, which also drops a
        leading U+00A0, U+2029, U+3000... (the gate refuses ASCII control characters and
        trims SP and HTAB itself): ``X-Request-ID: \\u00a0abc`` would reach the handlers as
        ``abc``. An all-ASCII head (nearly all of them) parses the same either way.
        """
        await Http.http1_request_header(self)
        request = self.request
        if request is not None and not request.head.isascii():
            request.headers = Header(exact_fields(request.head))


def exact_fields(head: bytes) -> list[tuple[str, str]]:
    """``(lowercase name, value)`` pairs of a head the gate forwarded: every header line is
    ``name: value``, the value already trimmed of optional whitespace."""
    fields = []
    for line in head.decode(errors="surrogateescape").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        fields.append((name.lower(), value[1:] if value[:1] == " " else value))
    return fields


class AfmdProtocol(HttpProtocol):
    """One HTTP/1.1 connection; subclassed per listener by :func:`make_protocol`."""

    HTTP_CLASS = AfmdHttp
    __slots__ = ("_afmd_counted", "_afmd_fresh", "_afmd_gate", "_afmd_held", "_afmd_linger",
                 "_afmd_pending", "_afmd_sanic_held", "_afmd_since", "_afmd_state",
                 "_afmd_waiting")

    context: ClassVar[GateContext]
    policy: ClassVar[GatePolicy]

    # -- asyncio callbacks --
    def connection_made(self, transport: Any) -> None:
        ctx = self.context
        self._afmd_pending: deque[Output] = deque()
        self._afmd_held = 0
        self._afmd_sanic_held = 0
        self._afmd_linger: Any = None
        self._afmd_gate: Gate | None = None
        self._afmd_counted = False
        self._afmd_waiting = False
        self._afmd_fresh = True
        self._afmd_since = monotonic()
        if ctx.open_connections < ctx.max_connections:
            self._afmd_counted = True
            ctx.open_connections += 1
        else:
            if len(ctx.waiting) >= ctx.max_connections:
                ctx.shed += 1
                next(iter(ctx.waiting)).afmd_shed()  # the pool is full: its oldest goes
            self._afmd_waiting = True
            ctx.waiting[self] = None
        self._afmd_state = _OPEN
        ctx.connections.add(self)
        self._afmd_gate = Gate(self.policy)
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._afmd_linger is not None:
            self._afmd_linger.cancel()
            self._afmd_linger = None
        if self._afmd_state == _CLOSED:
            return
        self._afmd_state = _CLOSED
        self._release_slot()
        ctx = self.context
        ctx.connections.discard(self)
        ctx.buffered -= self._afmd_held
        self._afmd_held = 0
        self._afmd_pending.clear()
        if self._afmd_gate is not None:
            self._afmd_gate.kill()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        try:
            if self._afmd_state != _OPEN:
                return  # answered and lingering: drained and discarded
            if not data:
                self.close()
                return
            self._afmd_fresh = False
            gate = self._afmd_gate
            assert gate is not None
            if gate.dead:
                return
            self._time = monotonic()
            ctx = self.context
            if ctx.buffered + len(data) > ctx.max_buffered:
                self._refuse(_OVERLOADED)
                return
            outputs = gate.feed(data)
            if self._afmd_waiting and not self._admit(outputs):
                return
            if outputs:
                self._afmd_pending.extend(outputs)
                self._drain()
            self._account()
        except Exception:
            log.exception("connection error")
            self.close()

    # -- Sanic hooks --
    def afmd_sanic_idle(self) -> None:
        """Sanic starts a request-loop turn: the previous request is finished."""
        if self._afmd_state != _OPEN:
            return
        self._afmd_since = monotonic()
        self._afmd_sanic_held = len(self.recv_buffer)
        gate = self._afmd_gate
        if gate is not None:
            gate.restart_clock()  # its wait behind the previous request was not its fault
        self._drain()
        self._account()

    def check_timeouts(self) -> None:
        """Deadlines: a request from its first byte, keep-alive idleness, response silence."""
        try:
            if not self._task or self._afmd_state != _OPEN:
                return
            now = monotonic()
            http = self.http
            stage = http.stage if http is not None else Stage.IDLE
            idle = stage is Stage.IDLE and not self.recv_buffer
            gate = self._afmd_gate
            started = gate.started_at if gate is not None else None
            if idle and started is not None:
                left = started + self.context.idle_timeout - now
                if left <= 0:
                    self._expire()
                    return
            elif idle and not self._afmd_pending:
                left = self._time + self.keep_alive_timeout - now
                if left <= 0:
                    self._task.cancel()
                    return
            elif http is not None and stage in (Stage.HANDLER, Stage.RESPONSE, Stage.FAILED):
                if http.upgrade_websocket:
                    return
                left = self._time + self.response_timeout - now
                if left <= 0:
                    http.exception = ServiceUnavailable("Response Timeout")
                    self._task.cancel()
                    return
            else:
                left = 0.5
            self._callback_check_timeouts = self.loop.call_later(
                min(max(left, 0.05), 5.0), self.check_timeouts)
        except Exception:
            log.exception("connection timeout check failed")

    # -- shedding --
    def afmd_idle_since(self, now: float) -> float | None:
        """Since when this connection has waited without a request in progress (idle
        between requests, or its head incomplete); None when it must not be shed."""
        if self._afmd_state != _OPEN or not self._afmd_counted or self._afmd_pending:
            return None
        gate = self._afmd_gate
        if gate is None or not gate.awaiting_head or not self._sanic_idle():
            return None
        if self._afmd_fresh and now - self._afmd_since < FRESH_GRACE:
            return None
        return self._afmd_since

    def _admit(self, outputs: list[Output]) -> bool:
        """A waiting connection that has sent a complete head takes a slot, freeing one if
        need be; False when there is none to be had (it is refused)."""
        gate = self._afmd_gate
        assert gate is not None
        if not any(type(o) is not Reply or o.rejection is None for o in outputs) and (
                gate.dead or gate.awaiting_head):
            return True  # no complete head yet, or only a refusal to write: no slot needed
        ctx = self.context
        ctx.waiting.pop(self, None)
        self._afmd_waiting = False
        if ctx.open_connections >= ctx.max_connections and not ctx.shed_one():
            ctx.refused += 1
            self._refuse(_TOO_MANY)
            return False
        self._afmd_counted = True
        ctx.open_connections += 1
        return True

    def afmd_shed(self) -> None:
        """Give up this connection's slot (or place in the pool) now: a started head is
        answered 503, an idle connection is just closed."""
        gate = self._afmd_gate
        if gate is not None and gate.buffered:
            self._refuse(_SHED)  # Sanic is idle: written at once, then a lingering close
        else:
            if gate is not None:
                gate.kill()
            self._afmd_state = _LINGERING
            if self._callback_check_timeouts is not None:
                self._callback_check_timeouts.cancel()
                self._callback_check_timeouts = None
            self._close_transport()
        self._release_slot()  # the newcomer takes it now, whatever the close still waits on

    def close_if_idle(self) -> bool:
        if self._afmd_state != _OPEN:
            self._close_transport()
            return True
        return super().close_if_idle()

    # -- internals --
    def _sanic_idle(self) -> bool:
        http = self.http
        return (http is None or http.stage is Stage.IDLE) and not self.recv_buffer

    def _drain(self) -> None:
        """Hand complete requests to Sanic; write the gate's replies and the direct answers
        when their turn comes."""
        pending = self._afmd_pending
        while pending and self._afmd_state == _OPEN:
            item = pending[0]
            if isinstance(item, Direct):
                pending.popleft()
                # Answered here only when it is next in line (Sanic idle) and the client
                # reads (a paused transport would otherwise buffer without bound); else
                # Sanic answers it in turn, with its own backpressure, exactly as before.
                if self._sanic_idle() and self._can_write.is_set() and self._answer(item):
                    if item.close:
                        return
                    continue
                self._to_sanic(item.forward)
                continue
            if type(item) is Forward:
                pending.popleft()
                self._to_sanic(item)
                continue
            if not self._sanic_idle():
                return
            pending.popleft()
            if self.transport is None or self.transport.is_closing():
                return
            self.transport.write(item.data)
            self._time = monotonic()
            if item.is_continue and self._afmd_gate is not None:
                self._afmd_gate.restart_clock()
            if item.rejection is not None:
                self._log_refusal(item.rejection)
            if item.close:
                self._linger()
                return

    def _to_sanic(self, forward: Forward) -> None:
        """Sanic re-reads the request from its canonical rendering, which it cannot parse
        differently from the gate."""
        data = forward.render()
        self._afmd_sanic_held += len(data)
        HttpProtocol.data_received(self, data)

    def _answer(self, item: Direct) -> bool:
        """Write the answer to ``item`` without Sanic (it is idle: the answer is next in
        order); False when the request should go to Sanic after all."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return True  # nobody to answer
        started = perf_counter()
        state = self.app.ctx.state
        try:
            status, body = self.context.direct[item.path].answer(state)
        except Exception:
            return False  # Sanic runs the same builder and answers its failure as usual
        transport.write(render_json(status, body, item.headers, close=item.close))
        self._time = self._afmd_since = monotonic()
        log_request(state, "GET", item.path, status, len(body), started=started)
        if item.close:
            self.close()  # as Sanic does after a Connection: close response
        return True

    def _account(self) -> None:
        gate = self._afmd_gate
        held = (gate.buffered if gate is not None else 0) + self._afmd_sanic_held
        for item in self._afmd_pending:
            if type(item) is Forward:
                held += item.size
            elif isinstance(item, Direct):
                held += item.forward.size
        if held != self._afmd_held:
            self.context.buffered += held - self._afmd_held
            self._afmd_held = held

    def _refuse(self, rejection: Rejection) -> None:
        """Stop reading requests and answer ``rejection`` once Sanic is idle."""
        if self._afmd_gate is not None:
            self._afmd_gate.kill()
        self._afmd_pending.append(Reply(rejection.render(), close=True, rejection=rejection))
        self._drain()
        self._account()

    def _expire(self) -> None:
        timeout = self.context.idle_timeout
        self._refuse(Rejection.from_error(RequestTimeoutError(
            f"The request was not received completely within idle_timeout ({timeout:g} s).")))

    def _release_slot(self) -> None:
        """Give up this connection's slot or place in the admission pool (once)."""
        if self._afmd_counted:
            self._afmd_counted = False
            self.context.open_connections -= 1
        elif self._afmd_waiting:
            self._afmd_waiting = False
            self.context.waiting.pop(self, None)

    def _linger(self) -> None:
        """Shut the write side after the answer, drain the client briefly, then close; the
        slot is free from now on (draining is bounded by LINGER_SECONDS)."""
        if self._afmd_state == _OPEN:
            self._afmd_state = _LINGERING
        self._release_slot()
        if self._callback_check_timeouts is not None:
            self._callback_check_timeouts.cancel()
            self._callback_check_timeouts = None
        if self._afmd_gate is not None:
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

    def _log_refusal(self, rejection: Rejection) -> None:
        if self.context.access_log:
            log.info("refused", status=rejection.status, code=rejection.code,
                     message=rejection.message)


def make_protocol(context: GateContext, policy: GatePolicy, name: str) -> type[AfmdProtocol]:
    """A protocol class for one listener (Sanic instantiates it per connection)."""

    def body(ns: dict[str, Any]) -> None:
        ns["context"] = context
        ns["policy"] = policy

    return types.new_class(f"AfmdProtocol_{name}", (AfmdProtocol,), {}, body)
