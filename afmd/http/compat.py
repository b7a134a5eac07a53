"""Every Sanic and asyncio private afmd depends on, and nothing else.

Written against **sanic 25.12.1** (``sanic/http/http1.py``,
``sanic/server/protocols/{base,http}_protocol.py``, ``sanic/headers.py``) and **Python
3.11's asyncio** (the selector event loop, ``asyncio/selector_events.py``). No other afmd
module reaches into either (``tests/meta/test_compat.py`` checks that too), and
:func:`upstream_problems` names whatever an upgrade moved or rewrote of what is used here;
``tests/meta/test_compat.py`` fails loudly with its list.

What afmd needs from them, and how:

* **The seam between the gate and Sanic.** Sanic has no public way to take a parsed
  request, so a :class:`~afmd.http.sansio.gate.Forward` is handed over as bytes: its canonical
  rendering (:meth:`~afmd.http.sansio.gate.Forward.render`, Content-Length framed, values
  trimmed) fed to Sanic's own ``HttpProtocol.data_received``, which Sanic's
  ``Http.http1_request_header`` re-reads; that parse cannot disagree with the gate's, and
  :class:`ExactHttp` restores the header values exactly as the gate kept them. Building
  Sanic's ``Request`` from the parsed head instead would mean re-implementing
  ``http1_request_header`` and its dozen private attributes, and its wait for bytes.
* **Connection state** (:class:`SanicConnection`): Sanic's receive buffer
  (``recv_buffer``), its write-pause event (``_can_write``), its activity clock
  (``_time``), its connection task (``_task``) and timeout timer
  (``_callback_check_timeouts``), and ``check_timeouts``, replaced so that a request's
  deadline runs from its first byte and keep-alive idleness from the moment the client has
  taken the last answer (the transport's write buffer, public asyncio, says when).
* **The current request** (:func:`forget_current_request`): Sanic's ``Request._current``
  context variable, emptied once a head is parsed so that timers do not hold requests.
* **The last request of a connection** (:meth:`ExactHttp.http1`): Sanic's ``Http.request``,
  ``response`` and ``response_func`` and their ``stream``, unlinked when a client went away
  mid-answer, which Sanic leaves referring to each other (a cycle holding the body).
* **Reason phrases** Sanic lacks (421, 431), patched into its status-line table.
* **An answer's head without the empty ``alt-svc``** (:func:`_format_head`): Sanic's
  ``Http.http1_response_header`` sets ``alt-svc: ""`` for its touchup pass to fill or
  remove at start, a pass afmd turns off (it rewrites Sanic's source, which a frozen
  build cannot read); the head formatter its module calls is replaced by one that leaves
  that empty header out.
* **The head of an HTTP/1.0 stream** (:meth:`ExactHttp.http1_response_header`): Sanic's
  framing state (``response_func``, ``stage``, ``_send``), to end such a body with the
  connection where Sanic would send chunked coding HTTP/1.0 does not have.
* **The listener's accept reader** (:func:`accept_failure`, :func:`forget_accept_reader`):
  asyncio's ``Handle._callback``/``_args``, ``BaseSelectorEventLoop._accept_connection``
  and the loop's ``_selector``, to stop an accept() error storm on a broken listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import inspect
from collections.abc import Callable, Iterable
from time import monotonic
from typing import TYPE_CHECKING, Any

import sanic
from sanic import headers as sanic_headers
from sanic import helpers as sanic_helpers
from sanic.compat import Header
from sanic.http import Http, Stage
from sanic.http import http1 as sanic_http1
from sanic.request import Request
from sanic.response import BaseHTTPResponse
from sanic.server.protocols.base_protocol import SanicProtocol
from sanic.server.protocols.http_protocol import HttpProtocol

from afmd.errors import request_timeout_error
from afmd.logs import get_logger

if TYPE_CHECKING:
    import asyncio

    from afmd.http.sansio.gate import Forward

log = get_logger("afmd.http")

SANIC_VERSION = "25.12.1"

_REASONS = ((421, b"Misdirected Request"), (431, b"Request Header Fields Too Large"))


def _patch_reason_phrases() -> None:
    """Sanic has no reason phrase for 421 (it would send "421 UNKNOWN")."""
    for status, phrase in _REASONS:
        sanic_helpers.STATUS_CODES[status] = phrase
        sanic_headers._HTTP1_STATUSLINES[status] = b"HTTP/1.1 %d %b\r\n" % (status, phrase)


_patch_reason_phrases()

#: What Sanic's ``Http.http1_response_header`` adds to every head, for its touchup pass.
_EMPTY_ALT_SVC = (b"alt-svc", b"")


def _format_head(status: int, headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """Sanic's head formatter, less the empty ``alt-svc`` Sanic sets for its touchup pass
    to fill or remove: with that pass off it went out empty on every answer, which is no
    Alt-Svc value (RFC 7838 section 3: ``clear`` or alternatives)."""
    return sanic_headers.format_http1_response(
        status, (field for field in headers if field != _EMPTY_ALT_SVC))


sanic_http1.format_http1_response = _format_head


def exact_fields(head: bytes) -> list[tuple[str, str]]:
    """``(lowercase name, value)`` pairs of a head the gate rendered: every header line is
    ``name: value``, the value already trimmed of optional whitespace."""
    fields = []
    for line in head.decode(errors="surrogateescape").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        fields.append((name.lower(), value[1:] if value[:1] == " " else value))
    return fields


class ExactHttp(Http):
    """Sanic's HTTP/1.1 cycle over the gate's requests, telling the connection each time
    it goes idle."""

    # The gate already bounds the head (max_header_bytes, answered with 431); Sanic's own
    # ceiling (16 KiB, answered with 413) must never cut a head the gate accepted.
    HEADER_MAX_SIZE = 1 << 62
    protocol: SanicConnection  # Sanic's Http only knows the HttpProtocol it subclasses

    def init_for_request(self) -> None:
        super().init_for_request()
        self.protocol.afmd_sanic_idle()

    async def http1(self) -> None:
        """Sanic's request loop, letting go of its last request when the connection ends.

        Sanic unlinks a finished request from the connection (``request.stream``) at the
        end of a loop turn, but a client gone mid-answer ends the loop before that, with
        the request, its response and the writer bound to this object
        (``response_func``) still referring to each other: the request and its body
        (megabytes, an agent's every turn) waited for a garbage collection.
        """
        try:
            await Http.http1(self)
        finally:
            request, response = self.request, self.response
            if request is not None:
                request.stream = None
            if response is not None:
                response.stream = None
            self.request = self.response = None  # type: ignore[assignment]  # Sanic types them never None
            self.response_func = None  # type: ignore[assignment]  # as Sanic's own writers end

    async def http1_request_header(self) -> None:
        """Sanic's head parser, with the header values exactly as the gate kept them.

        Sanic ``str.lstrip()``s each value after decoding it as UTF-8, which also drops a
        leading U+00A0, U+2029, U+3000... (the gate refuses ASCII control characters and
        trims SP and HTAB itself): ``X-Request-ID: \\u00a0abc`` would reach the handlers as
        ``abc``. An all-ASCII head (nearly all of them) parses the same either way.
        """
        await Http.http1_request_header(self)
        request = self.request
        if request is not None and not request.head.isascii():
            request.headers = Header(exact_fields(request.head))
        forget_current_request()

    async def http1_response_header(self, data: bytes, end_stream: bool) -> None:
        """Sanic's, except that a body of unknown length to an HTTP/1.0 client ends with
        the connection.

        Sanic frames every such body chunked, a coding HTTP/1.0 does not have (a server
        must not send Transfer-Encoding to it, RFC 9112 6.1): a 1.0 client would read the
        chunk sizes as part of the event stream. Only this case is written here; every
        other goes to Sanic's as it is.
        """
        res = self.response
        request = self.request
        if (end_stream or self.head_only or request is None or request.version != "1.0"
                or res is None or "content-length" in res.headers
                or not sanic_helpers.has_message_body(res.status)
                or (not data and getattr(res, "body", None))):
            await Http.http1_response_header(self, data, end_stream)
            return
        self.keep_alive = False
        self.response_size = len(data)
        res.headers["connection"] = "close"
        head = sanic_headers.format_http1_response(res.status, res.processed_headers)
        if self.expecting_continue:
            self.expecting_continue = False  # the answer came first: no 100 Continue now
        self.response_func = self._until_close
        if self.protocol.access_log:
            self.log_response()
        await self._send(head + data)
        self.stage = Stage.RESPONSE

    async def _until_close(self, data: bytes, end_stream: bool) -> None:
        """A part of a close-delimited body; the last leaves the connection to close (it is
        not kept alive)."""
        if data:
            await self._send(data)
        if end_stream:
            self.response_func = None  # type: ignore[assignment]  # as Sanic's own writers end
            self.stage = Stage.IDLE


def forget_current_request() -> None:
    """Take the request out of the connection task's context, where Sanic puts it for
    ``Request.get_current()`` (which afmd never calls).

    Every timer asyncio schedules copies the context it is made in (``call_at``, and
    through it ``asyncio.timeout``, ``wait_for`` and ``sleep``), and a cancelled one stays
    in the loop's heap, context and all, until it would have fired. A request's deadline
    timer, cancelled as the response ends, thus held the request for the rest of
    ``request_timeout``: its body, its run and its generations, and through them a model
    the request had used, tokenizer and all, after that model was unloaded (a
    ``keep_alive`` 0 client grew the server by a tokenizer a request). Without the request
    in the context, a cancelled timer holds nothing of it.
    """
    Request._current.set(None)  # type: ignore[arg-type]  # Sanic types it ContextVar[Request]; get(None) is how it reads "none"


class SanicConnection(HttpProtocol):
    """Sanic's HTTP/1.1 connection, reduced to what afmd's protocol uses.

    The subclass supplies the ``afmd_*`` hooks below. Sanic's metaclass gives every
    subclass ``__slots__``: an attribute a subclass does not declare there cannot be set,
    and the connection fails.
    """

    HTTP_CLASS = ExactHttp
    __slots__ = ("_afmd_unsent",)
    _callback_check_timeouts: asyncio.TimerHandle | None  # type: ignore[assignment]  # Sanic's, inferred from its None in __init__

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._afmd_unsent = 0  # what check_timeouts last saw waiting for the client
        super().connection_made(transport)

    # -- hooks for the subclass --
    def afmd_sanic_idle(self) -> None:
        """Sanic starts a request-loop turn: the previous request is finished."""

    def afmd_open(self) -> bool:
        """Whether the connection still reads requests (not answered and lingering)."""
        raise NotImplementedError

    def afmd_replies_waiting(self) -> bool:
        """Whether answers afmd writes itself wait for Sanic to finish."""
        raise NotImplementedError

    def afmd_request_deadline(self) -> float | None:
        """When the request being received (by the gate) runs out of time, if one is."""
        raise NotImplementedError

    def afmd_expire(self) -> None:
        """The request being received ran out of time."""
        raise NotImplementedError

    # -- what the subclass may use --
    def afmd_to_sanic(self, forward: Forward) -> int:
        """Hand a request to Sanic (the seam); the bytes it now holds for it."""
        data = forward.render()
        HttpProtocol.data_received(self, data)
        return len(data)

    def afmd_sanic_buffered(self) -> int:
        """Request bytes Sanic holds and has not parsed yet."""
        return len(self.recv_buffer)

    def afmd_sanic_is_idle(self) -> bool:
        """Sanic has answered everything it was handed on this connection."""
        http = self.http
        return (http is None or http.stage is Stage.IDLE) and not self.recv_buffer

    def afmd_writable(self) -> bool:
        """The transport takes writes (the client reads); not paused."""
        return self._can_write.is_set()

    def afmd_unsent(self) -> int:
        """Bytes of answers the transport still holds for the client (it has not read them
        yet); at least 1 while writing is paused."""
        transport = self.transport
        unsent = transport.get_write_buffer_size() if transport is not None else 0
        return max(unsent, 0 if self._can_write.is_set() else 1)

    def afmd_touch(self) -> None:
        """Activity now: the keep-alive and response timers start again."""
        self._time = monotonic()

    def afmd_stop_timeouts(self) -> None:
        if self._callback_check_timeouts is not None:
            self._callback_check_timeouts.cancel()
            self._callback_check_timeouts = None

    def check_timeouts(self) -> None:
        """Deadlines: a request from its first byte, keep-alive idleness, response silence.

        Replaces Sanic's, whose request timeout restarts with every packet (a slowloris
        never hits it) and which cannot see requests still inside the gate.
        """
        try:
            if not self._task or not self.afmd_open():
                return
            now = monotonic()
            http = self.http
            stage = http.stage if http is not None else Stage.IDLE
            idle = stage is Stage.IDLE and not self.recv_buffer
            deadline = self.afmd_request_deadline() if idle else None
            if deadline is not None:
                left = deadline - now
                if left <= 0:
                    self.afmd_expire()
                    return
            elif idle and not self.afmd_replies_waiting():
                # An answer the client is still taking is no idleness, however slowly it
                # reads (the transport writes on only as the client frees its buffer, so
                # there may be no sign of it for a while): it is held to the response
                # timeout, as in the middle of an answer, from the last change in what
                # waits for it, and keep-alive counts from when the last byte left.
                unsent = self.afmd_unsent()
                if unsent != self._afmd_unsent:
                    self._afmd_unsent = unsent
                    self._time = now
                timeout = self.response_timeout if unsent else self.keep_alive_timeout
                left = self._time + timeout - now
                if left > 0 and unsent:
                    left = min(left, 0.5)  # to see the moment the last byte leaves
                if left <= 0:
                    self._task.cancel()
                    return
            elif http is not None and stage in (Stage.HANDLER, Stage.RESPONSE, Stage.FAILED):
                if http.upgrade_websocket:
                    return
                left = self._time + self.response_timeout - now
                if left <= 0:
                    # The request's own deadline passed long before this one (the response
                    # timeout is request_timeout and a margin): the same 504, in the route's
                    # envelope, where Sanic's 503 became a 500 "server error".
                    http.exception = request_timeout_error()
                    self._task.cancel()
                    return
            else:
                left = 0.5
            self._callback_check_timeouts = self.loop.call_later(
                min(max(left, 0.05), 5.0), self.check_timeouts)
        except Exception:
            log.exception("connection timeout check failed")


# ------------------------------------------------------------------------------ asyncio

_ACCEPT = "_accept_connection"  # BaseSelectorEventLoop's accept callback


def accept_failure(context: dict[str, Any]) -> object | None:
    """The listening socket whose accept() raised, from a loop exception handler's
    ``context``; None when the exception is anything else."""
    exc = context.get("exception")
    handle = context.get("handle")
    callback = getattr(handle, "_callback", None)
    if not isinstance(exc, OSError) or getattr(callback, "__name__", "") != _ACCEPT:
        return None
    args: tuple[object, ...] = getattr(handle, "_args", None) or ()
    return args[1] if len(args) > 1 else None  # (protocol_factory, sock, ...)


def forget_accept_reader(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    """Drop the loop's accept reader for ``fd`` (and only an accept reader: after the fd
    was closed underneath, its number may already belong to someone else)."""
    selector = getattr(loop, "_selector", None)
    if selector is None or fd < 0:
        return
    try:
        key = selector.get_key(fd)
    except (KeyError, ValueError, RuntimeError):
        return
    reader = key.data[0] if key.data else None
    if getattr(getattr(reader, "_callback", None), "__name__", "") == _ACCEPT:
        with contextlib.suppress(Exception):
            loop.remove_reader(fd)


# ------------------------------------------------------------------------------ upgrades


def _fingerprint(obj: Callable[..., Any]) -> str:
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


#: Sanic's code this module relies on in detail, with a fingerprint of its source in
#: sanic 25.12.1 (the version pyproject.toml pins): an upgrade that rewrites any of it must
#: be re-read against this module before its fingerprint is updated here.
SANIC_CODE: dict[str, tuple[Callable[..., Any], str]] = {
    # re-reads the gate's bytes; ExactHttp wraps it
    "Http.http1_request_header": (Http.http1_request_header, "d3cd937dc1821c5e"),
    # framing, keep-alive and 100-continue of an answer's head; ExactHttp takes over the
    # HTTP/1.0 stream of unknown length, with the same state (response_func, stage,
    # response_size, expecting_continue, _send, log_response); sets the empty alt-svc
    # _format_head drops, and formats through its module's format_http1_response
    "Http.http1_response_header": (Http.http1_response_header, "dff02555548d5f37"),
    # runs init_for_request at each request-loop turn, then waits on recv_buffer; returns
    # on a lost connection before unlinking its request (ExactHttp.http1 does it then)
    "Http.http1": (Http.http1, "919e9cb430e3bbf9"),
    "Http.init_for_request": (Http.init_for_request, "dd13f0b10a937525"),
    # the seam's entry: fills recv_buffer, sets _time, wakes the request loop
    "HttpProtocol.data_received": (HttpProtocol.data_received, "05f33fb9eb1ba3e5"),
    # replaced by SanicConnection.check_timeouts
    "HttpProtocol.check_timeouts": (HttpProtocol.check_timeouts, "23ee247afb5da72b"),
    # creates recv_buffer and _task
    "HttpProtocol.connection_made": (HttpProtocol.connection_made, "980c201d9ed09795"),
    # creates _can_write, _time, _task
    "SanicProtocol.__init__": (SanicProtocol.__init__, "69adfb3f5f617ac0"),
    # reads the status lines _patch_reason_phrases completes
    "format_http1_response": (sanic_headers.format_http1_response, "1bab457d36a01b9e"),
}


def upstream_problems() -> list[str]:
    """What an upgrade of Sanic or Python changed of what this module relies on; empty
    when nothing did. Each entry names what to re-read."""
    import asyncio
    import asyncio.selector_events

    problems = []
    for name, (obj, fingerprint) in SANIC_CODE.items():
        try:
            seen = _fingerprint(obj)
        except (OSError, TypeError):
            problems.append(f"sanic {name}: its source cannot be read")
            continue
        if seen != fingerprint:
            problems.append(f"sanic {name} is not the one of sanic {SANIC_VERSION} "
                            f"(sanic {sanic.__version__} installed; fingerprint {seen})")
    slots = {s for cls in HttpProtocol.__mro__ for s in getattr(cls, "__slots__", ())}
    for attribute in ("recv_buffer", "_can_write", "_time", "_task",
                      "_callback_check_timeouts", "keep_alive_timeout", "response_timeout"):
        if attribute not in slots:
            problems.append(f"sanic HttpProtocol has no {attribute}")
    for cls, attributes in ((Http, ("request", "response", "response_func")),
                            (Request, ("stream",)), (BaseHTTPResponse, ("stream",))):
        slots = {s for c in cls.__mro__ for s in getattr(c, "__slots__", ())}
        missing = [a for a in attributes if a not in slots]
        if missing:  # ExactHttp.http1 unlinks them when a connection ends
            problems.append(f"sanic {cls.__name__} has no {', '.join(missing)}")
    if getattr(sanic_http1, "format_http1_response", None) is not _format_head:
        problems.append("sanic.http.http1.format_http1_response is not afmd's _format_head")
    current = getattr(Request, "_current", None)
    if not isinstance(current, contextvars.ContextVar):
        problems.append("sanic Request._current is not a ContextVar")
    table = getattr(sanic_headers, "_HTTP1_STATUSLINES", None)
    if not isinstance(table, list) or len(table) < 1000:
        problems.append("sanic.headers._HTTP1_STATUSLINES is not a list indexed by status")
    loop_class = asyncio.selector_events.BaseSelectorEventLoop
    for method in (_ACCEPT, "_start_serving"):
        params = list(inspect.signature(getattr(loop_class, method, None) or (
            lambda: None)).parameters)
        if params[:3] != ["self", "protocol_factory", "sock"]:
            problems.append(f"asyncio BaseSelectorEventLoop.{method} does not take "
                            f"(protocol_factory, sock, ...): {params}")
    loop = asyncio.new_event_loop()
    try:
        handle = loop.call_soon(print, "x")
        if getattr(handle, "_callback", None) is not print or (
                getattr(handle, "_args", None) != ("x",)):
            problems.append("asyncio Handle keeps no _callback/_args")
        if not hasattr(getattr(loop, "_selector", None), "get_key"):
            problems.append("asyncio's event loop has no _selector.get_key")
    finally:
        loop.close()
    return problems
