"""A turn's server-sent events on the wire: when the 200 goes out, and what keeps a quiet
stream alive.

A handler encodes each batch of a run's events and writes it here; whether a failure is
still a plain error or already an error event depends on whether the stream was opened,
which is this object's to say (:attr:`EventStream.opened`).

Every write waits for the client only until a bound the handler gives: a client that
stops reading must not keep its handler, and through it the run's generation slot, waiting
on a write until Sanic's own inactivity timer gives up a minute later.
"""

from __future__ import annotations

import asyncio
import time
from typing import cast

from sanic import Request
from sanic.response import HTTPResponse

from afmd.dialects.dialect import KeepsAlive, OwnMediaType, ReplyEncoder

#: How long past its request's deadline a stream may still wait for its client to take
#: its last bytes (its end, or the error event that ends it) before the connection is cut.
STALL_GRACE = 2.0


class Stalled(Exception):
    """A write waited for the client past its bound: the client reads too slowly, or not
    at all. Nothing of that write went out (Sanic writes a chunk whole, once the transport
    takes writes again), so the stream is still whole unless :attr:`EventStream.torn`."""


class EventStream:
    """A turn's SSE response. Its status line waits for the first batch of events (until
    then any failure is a plain error), unless the dialect keeps quiet streams alive
    (:class:`~afmd.dialects.dialect.KeepsAlive`): then a wait past its interval (queued, a
    long prefill) opens the stream and sends its keep-alive, again after every quiet
    interval, and a later failure is an error event like any after the stream began."""

    __slots__ = ("_closed", "_first", "_headers", "_last", "_lock", "_media_type", "_pinger",
                 "_request", "_response", "_started", "sent", "torn")

    def __init__(self, request: Request, reply: ReplyEncoder, headers: dict[str, str]) -> None:
        self._request = request
        self._first = reply.stream_start()  # before any batch is encoded, as replies expect
        self._headers = headers
        self._media_type = (reply.media_type if isinstance(reply, OwnMediaType)
                            else "text/event-stream")
        self._response: HTTPResponse | None = None
        self._lock = asyncio.Lock()  # one write at a time: a batch, or a keep-alive
        self._last = time.monotonic()
        self._closed = False
        self._pinger: asyncio.Task[None] | None = None
        self._started = False  # the status line is out
        self.torn = False  # a write was given up before the status line went out
        self.sent = 0
        if isinstance(reply, KeepsAlive):
            self._pinger = asyncio.create_task(
                self._keep_alive(reply.keepalive_interval, reply.keepalive()))

    @property
    def opened(self) -> bool:
        return self._response is not None

    async def write(self, data: bytes, *, until: float, last: bool = False) -> None:
        """Send ``data``, or raise :class:`Stalled` if the client has not let it go out by
        ``until`` (a :func:`time.monotonic` reading); ``last``: nothing but this follows
        (no keep-alive after it)."""
        if last:
            self.stop()
        if self.torn:
            raise Stalled
        try:
            async with asyncio.timeout_at(until):
                async with self._lock:
                    await self._send(data)
        except TimeoutError:
            # Sanic moves to chunked framing before its status line is written: given up
            # there, a later chunk would go out with no status line before it.
            self.torn = not self._started and getattr(self._request.ctx, "streamed", False)
            raise Stalled from None

    async def _send(self, data: bytes) -> None:
        if self._response is None:
            self._request.ctx.streamed = True
            self._response = await self._request.respond(
                status=200, headers=self._headers, content_type=self._media_type)
            data = self._first + data
        self._last = time.monotonic()
        await self._response.send(data)
        self._started = True
        self.sent += len(data)

    async def _keep_alive(self, interval: float, ping: bytes) -> None:
        """Send ``ping`` whenever ``interval`` seconds pass without a write."""
        try:
            while True:
                await asyncio.sleep(max(0.0, self._last + interval - time.monotonic()))
                async with self._lock:
                    if self._closed:
                        return
                    if time.monotonic() - self._last >= interval:
                        await self._send(ping)
        except Exception:  # the connection went away: the handler learns it itself
            return

    def stop(self) -> None:
        """No more keep-alives. A keep-alive being written is left to finish (cut short,
        the stream would be left mid-event); a waiting one ends at once."""
        self._closed = True
        if self._pinger is not None and not self._lock.locked():
            self._drop_pinger()

    def _drop_pinger(self) -> None:
        """Cancel the keep-alive task and let go of it: the task keeps the CancelledError
        that ended it, whose traceback holds the task's frame, which holds this stream,
        which held the task. That cycle kept the stream, its Sanic request and the
        request's body (megabytes, an agent's every turn) until a garbage collection."""
        pinger, self._pinger = self._pinger, None
        if pinger is not None:
            pinger.cancel()

    async def eof(self, *, until: float) -> None:
        """End the stream (bounded like :meth:`write`)."""
        assert self._response is not None, "eof before the stream started"
        try:
            async with asyncio.timeout_at(until):
                await self._response.eof()
        except TimeoutError:
            raise Stalled from None

    def cut(self) -> None:
        """Close the connection now, dropping what the client has not read: a client that
        stalled past every bound would otherwise hold it until Sanic's own timer."""
        self._closed = True
        if self._pinger is not None:
            self._drop_pinger()  # its write, if waiting, has not begun (see Stalled)
        # Sanic types it as its own narrow protocol; it is the event loop's transport.
        transport = cast("asyncio.Transport | None", self._request.transport)
        if transport is not None and not transport.is_closing():
            transport.abort()
