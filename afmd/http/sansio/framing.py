"""HTTP/1.1 request framing without I/O: where a head ends, what it says, where a body ends.

Split the way h11 splits a protocol: a :class:`HeadScanner` finds a complete head in the
connection's buffer, :func:`parse_head` turns its bytes into a frozen :class:`RequestHead`
(or refuses them), and one reader per body framing (:class:`ContentLengthBody`,
:class:`ChunkedBody`) takes the body's bytes from the buffer until it is complete. Every
verdict is the same however the bytes were split into packets. Everything refuses by
raising :class:`~afmd.http.sansio.wire.GateRefusal`; nothing here knows policy (Host,
Origin, routes, keys), which is :mod:`afmd.http.sansio.screen`'s.
"""

from __future__ import annotations

from typing import NamedTuple

from afmd.errors import (
    ExpectationFailedError,
    HeaderFieldsTooLargeError,
    HTTPVersionNotSupportedError,
    InvalidRequestError,
    NotImplementedHTTPError,
    PayloadTooLargeError,
)
from afmd.http.sansio import wire
from afmd.http.sansio.wire import GateRefusal, bad, show

__all__ = ["ChunkedBody", "ContentLengthBody", "HeadScanner", "RequestHead", "parse_head"]

# Header lines that are re-expressed (or dropped) when a request is forwarded.
REFRAMED = frozenset({b"content-length", b"transfer-encoding", b"expect", b"connection",
                      b"upgrade", b"keep-alive"})
# Header names the framing reads (the rest are kept untouched).
_SPECIAL = REFRAMED | {b"host", b"content-type", b"content-encoding", b"authorization",
                       b"origin", b"access-control-request-method"}


class RequestHead(NamedTuple):
    """One request head, parsed and normalised; the gate's only view of a request.

    A named tuple (immutable, and built once per request for the cost of a tuple).
    """

    method: str
    path: str  # the target's path, without its query
    #: The request line with an origin-form target (an absolute-form one rewritten).
    request_line: bytes
    #: The header lines that are passed on, as ``Name: value`` with optional whitespace
    #: (SP and HTAB) trimmed, in order; the framing and hop-by-hop ones are left out.
    lines: tuple[bytes, ...]
    size: int  # bytes of the head as received, its final CRLFCRLF included
    host: bytes | None  # the Host header, or the absolute-form target's authority
    origin: str | None
    authorization: bytes | None
    content_type: bytes | None
    #: The body's content codings (Content-Encoding), lowercased, ``identity`` left out.
    content_codings: tuple[bytes, ...]
    preflight_method: bytes | None  # Access-Control-Request-Method
    length: int  # Content-Length (0 when chunked or absent)
    chunked: bool
    expect_continue: bool  # the client waits for ``100 Continue`` before its body
    close: bool  # the connection closes after this request's answer
    keep_alive_10: bool  # an HTTP/1.0 request that keeps the connection

    @property
    def has_body(self) -> bool:
        return self.chunked or self.length > 0


def _head_too_large(limit: int) -> GateRefusal:
    return GateRefusal(HeaderFieldsTooLargeError(
        f"The request head is larger than max_header_bytes ({limit} bytes)."))


class HeadScanner:
    """Finds the end of each head in a connection's growing buffer.

    Only bytes not checked on an earlier call are searched, so a trickled head costs one
    pass, and the verdict is the same however the bytes were split: a bare LF within the
    first ``limit`` bytes is a 400, else a head longer than that is a 431.
    """

    __slots__ = ("_scan", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._scan = 0

    def take(self, buf: bytearray) -> bytes | None:
        """The next head (without its final CRLFCRLF), removed from ``buf``; None while
        it is incomplete."""
        skip = 0
        while buf.startswith(b"\r\n", skip):  # empty lines before a request-line are allowed
            skip += 2
        if skip:
            del buf[:skip]
            self._scan = 0
            if not buf:
                return None
        limit = self.limit
        end = buf.find(b"\r\n\r\n", self._scan)
        stop = limit if end < 0 else min(end + 4, limit)
        if wire.BARE_LF.search(buf, self._scan, stop):
            raise GateRefusal(bad("Lines must end with CRLF, not a bare LF."))
        if end < 0:
            if len(buf) > limit:
                raise _head_too_large(limit)
            self._scan = max(0, len(buf) - 3)
            return None
        self._scan = 0
        if end + 4 > limit:
            raise _head_too_large(limit)
        head = bytes(buf[:end])
        del buf[: end + 4]
        return head


def parse_head(head: bytes) -> RequestHead:
    """The request line and header section of one request (no final CRLFCRLF)."""
    lines = head.split(b"\r\n")
    request_line = lines[0]
    parts = request_line.split(b" ")
    if len(parts) != 3:
        if wire.CONTROL.search(request_line):
            raise GateRefusal(bad("The request line contains a control character."))
        raise GateRefusal(bad(
            "The request line must be 'METHOD target HTTP/1.1', single spaces apart."))
    method, target, version = parts
    if not wire.TOKEN.fullmatch(method):
        raise GateRefusal(bad("The request method is not a valid token."))
    if not wire.VERSION.fullmatch(version):
        raise GateRefusal(bad(
            "The HTTP version must be 'HTTP/' followed by ASCII digits, like HTTP/1.1."))
    if version != b"HTTP/1.1" and version != b"HTTP/1.0":
        raise GateRefusal(HTTPVersionNotSupportedError(
            f"HTTP version {show(version)} is not supported; use HTTP/1.1."))
    if len(target) > wire.MAX_TARGET:
        raise GateRefusal(InvalidRequestError(
            "The request URL is too long.", code="malformed_request", status=414))
    authority: bytes | None = None
    if not wire.TARGET.fullmatch(target):
        authority, target = wire.split_absolute(target)
        request_line = b"%s %s %s" % (method, target, version)

    fields = lines[1:]
    if fields and not wire.FIELDS.fullmatch(head, len(lines[0]) + 2):
        for line in fields:  # find the culprit, for a precise message
            if not wire.FIELD.fullmatch(line):
                raise GateRefusal(bad(wire.field_problem(line)))
        raise GateRefusal(bad("The header section is malformed."))
    kept: list[bytes] = []
    host: bytes | None = None
    host_line = -1
    hosts = 0
    length = 0
    lengths = 0
    te_seen = False
    codings: list[bytes] = []
    connection: list[bytes] = []
    expect: bytes | None = None
    content_type: bytes | None = None
    content_codings: list[bytes] = []
    authorization: bytes | None = None
    origin: bytes | None = None
    preflight: bytes | None = None
    for line in fields:
        raw_name, _, value = line.partition(b":")
        name = raw_name.lower()
        value = value.strip(b" \t")
        if name not in _SPECIAL:
            kept.append(raw_name + b": " + value)
            continue
        if name not in REFRAMED:
            kept.append(raw_name + b": " + value)
        if name == b"host":
            hosts += 1
            host = value
            host_line = len(kept) - 1
        elif name == b"content-length":
            lengths += 1
            if lengths > 1:
                raise GateRefusal(bad("Content-Length must appear exactly once."))
            if not wire.DIGITS.fullmatch(value):
                raise GateRefusal(bad(
                    "Content-Length must be a plain decimal number of ASCII digits."))
            digits = value.lstrip(b"0")
            # Anything longer than 18 digits is over any limit and not worth an int.
            length = (int(digits) if digits else 0) if len(digits) <= 18 else 1 << 62
        elif name == b"transfer-encoding":
            te_seen = True
            codings.extend(c.strip(b" \t").lower() for c in value.split(b","))
        elif name == b"content-type":
            if content_type is not None:
                raise _repeated(raw_name)
            content_type = value
        elif name == b"content-encoding":
            content_codings.extend(
                c for c in (c.strip(b" \t").lower() for c in value.split(b","))
                if c and c != b"identity")
        elif name == b"authorization":
            if authorization is not None:
                raise _repeated(raw_name)
            authorization = value
        elif name == b"origin":
            if origin is not None:
                raise _repeated(raw_name)
            origin = value
        elif name == b"expect":
            expect = value.lower() if expect is None else expect + b"," + value
        elif name == b"connection":
            connection.extend(t.strip(b" \t").lower() for t in value.split(b","))
        elif name == b"access-control-request-method":
            preflight = value

    is_11 = version == b"HTTP/1.1"
    if hosts > 1 or (is_11 and hosts == 0):
        raise GateRefusal(bad("An HTTP/1.1 request needs exactly one Host header."))
    if host is not None and (problem := wire.host_problem(host)):
        raise GateRefusal(bad(f"The Host header {problem}."))
    if authority is not None:
        # RFC 9112 3.2.2: the target's authority is the host; the Host header (present
        # and valid, as checked above) is ignored, and replaced for what reads it later.
        host = authority
        if host_line >= 0:
            kept[host_line] = kept[host_line].partition(b":")[0] + b": " + authority
    chunked = False
    if te_seen:
        codings = [c for c in codings if c]
        if lengths:
            raise GateRefusal(bad(
                "A request must not have both Content-Length and Transfer-Encoding."))
        if not codings:
            raise GateRefusal(bad("Transfer-Encoding must name a coding."))
        if not is_11:
            raise GateRefusal(bad("Transfer-Encoding is not allowed in an HTTP/1.0 request."))
        if codings != [b"chunked"]:
            raise GateRefusal(NotImplementedHTTPError(
                "Only the chunked transfer coding is supported, not "
                f"'{show(b', '.join(codings))}'."))
        chunked = True
    if expect is not None and expect != b"100-continue":
        raise GateRefusal(ExpectationFailedError(
            f"Unsupported expectation '{show(expect)}'; only 100-continue is supported."))
    close = b"close" in connection or (not is_11 and b"keep-alive" not in connection)
    return RequestHead(  # positionally: this runs for every request
        method.decode("ascii"),
        target.split(b"?", 1)[0].decode("ascii"),  # path
        request_line,
        tuple(kept),  # lines
        len(head) + 4,  # size
        host,
        origin.decode("latin-1") if origin is not None else None,
        authorization,
        content_type,
        tuple(content_codings),
        preflight,  # preflight_method
        length,
        chunked,
        # expect_continue: HTTP/1.0 clients must not get a 1xx; no body, no wait.
        expect is not None and is_11 and (chunked or length > 0),
        close,
        not is_11 and not close,  # keep_alive_10
    )


def _repeated(raw_name: bytes) -> GateRefusal:
    return GateRefusal(bad(f"The {raw_name.decode()} header must not be repeated."))


class ContentLengthBody:
    """A body framed by Content-Length: complete once that many bytes have arrived."""

    __slots__ = ("need",)

    def __init__(self, length: int) -> None:
        self.need = length

    @property
    def held(self) -> int:
        return 0  # the bytes wait in the connection's buffer until all are there

    def read(self, buf: bytearray) -> bytes | None:
        """The whole body, removed from ``buf``; None while it is incomplete."""
        need = self.need
        if len(buf) < need:
            return None
        body = bytes(buf[:need])
        del buf[:need]
        return body


_SIZE_LINE, _DATA, _DATA_END, _TRAILER = range(4)


class ChunkedBody:
    """A chunked body, de-chunked as it arrives; trailer fields are checked, then dropped.

    ``max_body`` bounds the de-chunked body (413), ``max_trailer`` the trailer section
    (431), as ``max_request_body_bytes`` and ``max_header_bytes`` do for plain requests.
    """

    __slots__ = ("_body", "_need", "_scan", "_state", "_trailer_bytes", "max_body",
                 "max_trailer")

    def __init__(self, max_body: int, max_trailer: int) -> None:
        self.max_body = max_body
        self.max_trailer = max_trailer
        self._body = bytearray()
        self._state = _SIZE_LINE
        self._need = 0
        self._scan = 0
        self._trailer_bytes = 0

    @property
    def held(self) -> int:
        """De-chunked bytes held until the body is complete."""
        return len(self._body)

    def read(self, buf: bytearray) -> bytes | None:
        """The whole de-chunked body once its trailer section has ended (the framing
        removed from ``buf``); None while it is incomplete."""
        while buf:
            state = self._state
            if state == _DATA:
                take = min(len(buf), self._need)
                self._body += buf[:take]
                del buf[:take]
                self._need -= take
                if self._need == 0:
                    self._state = _DATA_END
            elif state == _SIZE_LINE:
                if not self._size_line(buf):
                    return None
            elif state == _DATA_END:
                if buf[0] != 0x0D or (len(buf) > 1 and buf[1] != 0x0A):
                    raise GateRefusal(bad("Chunk data must be followed by CRLF."))
                if len(buf) < 2:
                    return None
                del buf[:2]
                self._state = _SIZE_LINE
            else:
                ended = self._trailer_line(buf)
                if ended is None:
                    return None
                if ended:
                    body = bytes(self._body)
                    self._body = bytearray()
                    return body
        return None

    def _size_line(self, buf: bytearray) -> bool:
        end = buf.find(b"\r\n")
        if end < 0:
            if len(buf) > wire.MAX_CHUNK_LINE or b"\n" in buf:
                raise GateRefusal(bad("Malformed chunk size line."), cors=True)
            return False
        line = bytes(buf[:end])
        del buf[: end + 2]
        m = wire.CHUNK_SIZE.fullmatch(line)
        if m is None or end > wire.MAX_CHUNK_LINE:
            raise GateRefusal(bad(
                "A chunk size must be hexadecimal ASCII digits, optionally followed by a "
                "';' extension."), cors=True)
        digits = m.group(1).lstrip(b"0")
        size = (int(digits, 16) if digits else 0) if len(digits) <= 15 else 1 << 62
        if size == 0:
            self._state = _TRAILER
            self._scan = 0
            self._trailer_bytes = 0
            return True
        if len(self._body) + size > self.max_body:
            raise GateRefusal(PayloadTooLargeError(
                f"The request body is larger than max_request_body_bytes "
                f"({self.max_body} bytes)."), cors=True)
        self._need = size
        self._state = _DATA
        return True

    def _trailer_line(self, buf: bytearray) -> bool | None:
        """True at the empty line that ends the trailer section, False after a trailer
        field (checked and dropped), None while the line is incomplete."""
        scan = self._scan  # bytes of this line before it were checked by an earlier call
        end = buf.find(b"\r\n", scan)
        room = self.max_trailer - self._trailer_bytes  # for this line and its CRLF
        if end == 0:
            del buf[:2]
            self._scan = 0
            return True
        # As for the head: a bare LF within the allowed size first, then the size.
        if wire.BARE_LF.search(buf, scan, room if end < 0 else min(end, room)):
            raise GateRefusal(bad("Lines must end with CRLF, not a bare LF."), cors=True)
        if (len(buf) if end < 0 else end + 2) > room:
            raise GateRefusal(HeaderFieldsTooLargeError(
                "The chunked trailer is larger than max_header_bytes."), cors=True)
        if end < 0:
            self._scan = max(0, len(buf) - 1)
            return None
        self._scan = 0
        line = bytes(buf[:end])
        if wire.FIELD.fullmatch(line) is None:
            raise GateRefusal(bad(wire.field_problem(line)), cors=True)
        self._trailer_bytes += end + 2
        del buf[: end + 2]
        return False
