"""The strict HTTP/1.1 gate every connection's bytes go through before Sanic sees any.

Sanic's own parser is lenient in ways that matter for request smuggling and for a server
that browsers can reach (whitespace before colons, folded headers, loose chunk sizes, a
missing Host...), and it reads the body and sends ``100 Continue`` before any of afmd's
code can refuse a request. So a :class:`Gate` per connection is afmd's one HTTP/1.1
parser and screen, over :mod:`afmd.http.sansio.framing` (heads and bodies) and
:mod:`afmd.http.sansio.screen` (policy):

* it buffers each request until it is COMPLETE (head and whole body), validating the
  framing as bytes arrive, and screens the head (Host, Origin, route, API key, media type,
  size) as soon as it is parsed, before any body byte is read;
* a request that passes comes out as a :class:`Forward`: its parsed head and its
  de-chunked body, which the connection hands to Sanic (:mod:`afmd.http.compat`);
* a request that fails becomes a :class:`~afmd.http.sansio.wire.Rejection`: an error in the
  envelope of the route it was for (OpenAI's, Anthropic's) sent with ``Connection:
  close``, after which the gate discards everything;
* a bodiless ``GET`` of one of the policy's ``direct_paths`` (answers built from server
  state alone, like ``/health``) passes the same screen and comes out as a :class:`Direct`,
  which the caller may answer itself instead of handing it to Sanic.

This module knows nothing about Sanic or asyncio: :meth:`Gate.feed` takes bytes and returns
what to do, so it is tested (and fuzzed) on its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from afmd.http.sansio.framing import (
    ChunkedBody,
    ContentLengthBody,
    HeadScanner,
    RequestHead,
    parse_head,
)
from afmd.http.sansio.screen import GatePolicy, presented_request_id, screen
from afmd.http.sansio.wire import CONTINUE, GateRefusal, Rejection

__all__ = ["CONTINUE_REPLY", "Direct", "Forward", "Gate", "Output", "Reply"]


class Forward(NamedTuple):
    """A complete request that passed the gate, for Sanic to answer."""

    head: RequestHead
    body: bytes  # de-chunked

    @property
    def size(self) -> int:
        """Its bytes as the gate held them (the head as received, the body de-chunked)."""
        return self.head.size + len(self.body)

    def render(self) -> bytes:
        """The request in canonical HTTP/1.1: the head's request line and kept header
        lines, the body framed by ``Content-Length``, and ``Connection`` only to say what
        the client asked for. Nothing in it is ambiguous to any parser."""
        head = self.head
        body = self.body
        lines = [head.request_line, *head.lines]
        if body:
            lines.append(b"content-length: %d" % len(body))
        if head.close:
            lines.append(b"connection: close")
        elif head.keep_alive_10:
            lines.append(b"connection: keep-alive")
        lines.append(b"")
        lines.append(body)
        return b"\r\n".join(lines)


@dataclass(frozen=True, slots=True)
class Reply:
    """Bytes the gate answers itself: ``100 Continue``, a preflight, or a rejection."""

    data: bytes
    close: bool = False
    rejection: Rejection | None = None
    is_continue: bool = False
    #: A rejection's method and path, when its head was parsed (``/metrics`` counts it).
    target: tuple[str, str] | None = None


CONTINUE_REPLY = Reply(CONTINUE, is_continue=True)


class Direct(NamedTuple):
    """A screened, bodiless ``GET`` of one of ``GatePolicy.direct_paths``.

    Its answer depends on server state only, so the caller may build and write it itself
    (in order, once every earlier request has been answered), skipping Sanic's
    per-request machinery, which costs several times what building such an answer does.
    ``forward`` is the request as it would otherwise have come out, for when the caller
    hands it to Sanic after all.
    """

    forward: Forward
    path: str
    headers: tuple[tuple[str, str], ...]  # CORS headers for an allowed Origin, else ()
    close: bool  # answer with ``Connection: close`` and close, as for a forwarded request


#: What :meth:`Gate.feed` returns, in order.
Output = Forward | Reply | Direct


class Gate:
    """One connection's incremental request framer and screen.

    :meth:`feed` returns a list of outputs in order: a :class:`Forward` is a complete
    request to hand to Sanic; a :class:`Reply` is written to the client by the caller (in
    order, and only once every earlier request has been answered); a :class:`Direct` is a
    request the caller may answer itself, under the same rule. After a rejection (or a
    request that closes the connection) the gate is :attr:`dead` and discards input.
    """

    __slots__ = ("_body", "_buf", "_clock", "_head", "_heads", "_local", "dead", "policy",
                 "started_at")

    def __init__(self, policy: GatePolicy, clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self._clock = clock
        self._buf = bytearray()
        self._heads = HeadScanner(policy.max_header_bytes)
        self._head: RequestHead | None = None  # of the request being received
        self._body: ContentLengthBody | ChunkedBody | None = None  # its body, if one comes
        self._local: bytes | None = None  # the answer afmd gives it itself (a preflight)
        self.dead = False
        #: When the first byte of the request being received arrived (None: between requests).
        self.started_at: float | None = None

    # -- state the protocol reads --
    @property
    def buffered(self) -> int:
        """Bytes of request data the gate holds right now."""
        return len(self._buf) + (self._body.held if self._body is not None else 0)

    @property
    def awaiting_head(self) -> bool:
        """Between requests or inside a head: no request is being received past its head."""
        return not self.dead and self._body is None

    def restart_clock(self) -> None:
        """Give the request being received a fresh deadline (its wait was not its fault)."""
        if self.started_at is not None:
            self.started_at = self._clock()

    def kill(self) -> None:
        """Stop parsing; drop what is buffered; discard all further input."""
        self.dead = True
        self._buf = bytearray()
        self._body = None
        self._head = None
        self._local = None
        self.started_at = None

    # -- input --
    def feed(self, data: bytes) -> list[Output]:
        if self.dead or not data:
            return []
        buf = self._buf
        if self.started_at is None:
            self.started_at = self._clock()
        buf += data
        out: list[Output] = []
        try:
            while buf and not self.dead:
                reader = self._body
                if reader is None:
                    if not self._next_head(out):
                        break
                else:
                    body = reader.read(buf)
                    if body is None:
                        break
                    self._complete(body, out)
        except GateRefusal as refused:
            head = self._head
            extra = self.policy.cors.headers(head.origin) if refused.cors and head else ()
            # Once a head is parsed, its refusal reads like its route's own errors.
            style = self.policy.style_of(head) if head else None
            rejection = Rejection.from_error(
                refused.error, extra, style,
                presented_request_id(head) if head else None).named()
            self.kill()
            head_only = head is not None and head.method == "HEAD"
            out.append(Reply(rejection.render(head_only=head_only), close=True,
                             rejection=rejection,
                             target=(head.method, head.path) if head else None))
        if not self.dead and self._body is None and not self._buf:
            self.started_at = None
        return out

    def _next_head(self, out: list[Output]) -> bool:
        raw = self._heads.take(self._buf)
        if raw is None:
            return False
        head = self._head = parse_head(raw)
        self._local = screen(self.policy, head)
        if head.chunked:
            self._body = ChunkedBody(self.policy.max_body_bytes, self.policy.max_header_bytes)
        elif head.length:
            buf = self._buf
            if len(buf) >= head.length:  # all there already (most requests): no reader
                body = bytes(buf[: head.length])
                del buf[: head.length]
                self._complete(body, out)
                return True
            self._body = ContentLengthBody(head.length)
        else:
            self._complete(b"", out)
            return True
        if head.expect_continue and self._local is None and not self._buf:
            out.append(CONTINUE_REPLY)
        return True

    def _complete(self, body: bytes, out: list[Output]) -> None:
        head = self._head
        assert head is not None
        local = self._local
        self._head = self._body = self._local = None
        if local is not None:
            out.append(Reply(local, close=head.close))
        elif not body and head.method == "GET" and head.path in self.policy.direct_paths:
            cors = self.policy.cors.headers(head.origin) if head.origin else ()
            out.append(Direct(Forward(head, body), head.path, cors, head.close))
        else:
            out.append(Forward(head, body))
        if head.close:
            # Its answer closes the connection: nothing after it is ever read.
            self.dead = True
            self._buf = bytearray()
            self.started_at = None
        else:
            self.started_at = self._clock() if self._buf else None
