"""A strict HTTP/1.1 request framer and screen that runs before Sanic sees a byte.

Sanic's own parser is lenient in ways that matter for request smuggling and for a server
that browsers can reach (whitespace before colons, folded headers, loose chunk sizes, a
missing Host...), and it reads the body and sends ``100 Continue`` before any of afmd's
code can refuse a request. So every connection's bytes go through a :class:`Gate` first:

* it buffers each request until it is COMPLETE (head and whole body), validating the
  framing as bytes arrive, and screens the head (Host, Origin, route, API key, media type,
  size) as soon as it is parsed, before any body byte is read;
* a request that passes is forwarded to Sanic normalised: an origin-form target (an
  absolute-form ``http://authority/path`` one is rewritten, its authority replacing the
  Host header), its header lines trimmed of optional whitespace (SP and HTAB, nothing
  else), no ``Expect`` (the gate itself answers ``100 Continue``), no
  ``Connection``/``Upgrade`` games, and a de-chunked body framed by ``Content-Length``.
  Sanic therefore only ever parses complete, well-formed, Content-Length-framed requests;
* a request that fails becomes a :class:`Rejection`: an OpenAI error envelope sent with
  ``Connection: close``, after which the gate discards everything;
* a bodiless ``GET`` of one of the policy's ``direct_paths`` (answers built from server
  state alone, like ``/health``) passes the same screen and comes out as a :class:`Direct`,
  which the caller may answer itself instead of handing it to Sanic.

This module knows nothing about Sanic or asyncio: :meth:`Gate.feed` takes bytes and returns
what to do, so it is tested (and fuzzed) on its own. Routing is a callable supplied by the
HTTP layer.
"""

from __future__ import annotations

import hmac
import re
import string
import time
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from http import HTTPStatus

import orjson

from afmd.config import ServerConfig
from afmd.errors import (
    APIError,
    AuthenticationError,
    ExpectationFailedError,
    HeaderFieldsTooLargeError,
    HTTPVersionNotSupportedError,
    InvalidRequestError,
    MethodNotAllowedError,
    MisdirectedRequestError,
    NotFoundError,
    NotImplementedHTTPError,
    PayloadTooLargeError,
    PermissionDeniedError,
    UnsupportedMediaTypeError,
)

__all__ = [
    "CONTINUE",
    "CORS_ALLOW_HEADERS",
    "CORS_EXPOSE_HEADERS",
    "Cors",
    "Direct",
    "Gate",
    "GatePolicy",
    "Rejection",
    "Reply",
    "RouteCheck",
    "method_not_allowed",
    "normalize_origin",
    "render_json",
    "unknown_url",
]

#: ``route(method, path)`` -> ``(200, ())`` routable, ``(404, ())`` unknown URL, or
#: ``(405, allowed_methods)`` when the path exists for other methods only.
RouteCheck = Callable[[str, str], tuple[int, tuple[str, ...]]]

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
CORS_ALLOW_HEADERS = "Authorization, Content-Type, X-Request-ID, X-AFM-Profile"
CORS_EXPOSE_HEADERS = (
    "X-Request-ID, OpenAI-Request-ID, X-Grammar-Constraints, X-AFM-Trimmed-Messages"
)
CORS_MAX_AGE = "600"
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(rb"HTTP/[0-9]\.[0-9]")
# origin-form (a path, optional query; no fragment) or the asterisk-form of OPTIONS.
_TARGET = re.compile(rb"/[\x21\x22\x24-\x7e]*|\*")
# absolute-form (RFC 9112 3.2.2), which servers must accept: "http://" (any case), an
# authority screened like a Host header, then a path and/or a query, or nothing ("/").
_ABSOLUTE = re.compile(rb"[Hh][Tt][Tt][Pp]://([^/?#]*)([/?][\x21\x22\x24-\x7e]*)?")
_SCHEME = re.compile(rb"[A-Za-z][A-Za-z0-9+.\-]*:")
# A header line: token ":" then a value of visible bytes (obs-text included), spaces and
# tabs. Control characters are refused, not passed on: NUL, CR and LF are what parsers
# disagree on (smuggling), and the others are whitespace to some readers (Python's
# str.strip() drops \x1c-\x1f, VT and FF), so a value could pass for another one.
_FIELD = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):([\t\x20-\x7e\x80-\xff]*)")
# Every header line of a head at once (each line ends with CRLF but the last): one pass.
_FIELDS = re.compile(rb"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*"
                     rb"(?:\r\n(?=.)|\Z))*", re.DOTALL)
_DIGITS = re.compile(rb"[0-9]+")
# chunk-size, then optionally whitespace and a ';' extension; nothing else.
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]+)(?:[ \t]*;[\t\x20-\x7e\x80-\xff]*)?")
# host [ ":" port ], where RFC 3986 allows an empty port; its value is checked apart.
_HOST = re.compile(rb"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\-._~%!$&'()*+,;=]*)(?::([0-9]*))?")
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_NUL_CR_LF = re.compile(rb"[\x00\r\n]")
_BARE_LF = re.compile(rb"(?<!\r)\n")

_MAX_CHUNK_LINE = 4096
_MAX_TARGET = 65535  # httptools stores URL offsets as uint16

# Header lines that are re-expressed (or dropped) when a request is forwarded.
_REFRAMED = frozenset({b"content-length", b"transfer-encoding", b"expect", b"connection",
                       b"upgrade", b"keep-alive"})

# Header names the gate reads (the rest are passed through untouched).
_SPECIAL = _REFRAMED | {b"host", b"content-type", b"authorization", b"origin",
                        b"access-control-request-method"}

_HEAD, _BODY, _CHUNK_SIZE_LINE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER = range(6)


_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def normalize_origin(origin: str) -> str:
    """The form origins are compared in: only optional whitespace is trimmed and only
    ASCII letters are folded, so that no other character (a leading U+00A0, a KELVIN SIGN
    that ``str.lower`` turns into ``k``) can make a foreign origin match the allow-list."""
    return origin.strip(" \t").translate(_ASCII_LOWER).rstrip("/")


def unknown_url(method: str, path: str) -> NotFoundError:
    return NotFoundError(
        f"Unknown request URL: {method} {path}. Please check the URL for typos.",
        code="unknown_url")


def method_not_allowed(method: str, path: str, allowed: Iterable[str]) -> MethodNotAllowedError:
    methods = ", ".join(allowed)
    return MethodNotAllowedError(f"Method {method} is not allowed for {path}.",
                                 headers={"Allow": methods} if methods else None)


@dataclass(frozen=True, slots=True)
class Cors:
    """Which origins may read afmd's answers, and the headers that tell browsers so: for
    the gate's own answers and for Sanic's responses alike."""

    allowed: frozenset[str] = frozenset()  # normalised (:func:`normalize_origin`)
    any_origin: bool = False

    @classmethod
    def from_origins(cls, origins: Iterable[str]) -> Cors:
        origins = tuple(origins)
        return cls(frozenset(normalize_origin(o) for o in origins), "*" in origins)

    def allows(self, origin: str) -> bool:
        return self.any_origin or normalize_origin(origin) in self.allowed

    def headers(self, origin: str | None) -> tuple[tuple[str, str], ...]:
        """What a response to ``origin`` carries so that its page may read it (nothing
        for no Origin or an empty one)."""
        if not origin or not self.allows(origin):
            return ()
        return (("Access-Control-Allow-Origin", origin),
                ("Access-Control-Expose-Headers", CORS_EXPOSE_HEADERS),
                ("Vary", "Origin"))

    def apply(self, origin: str | None, headers: MutableMapping[str, str]) -> None:
        """Add :meth:`headers` to a response's own (a ``Vary`` it has is extended)."""
        for name, value in self.headers(origin):
            if name == "Vary" and (vary := headers.get("Vary")):
                if value.lower() not in vary.lower():
                    headers["Vary"] = f"{vary}, {value}"
            else:
                headers[name] = value

    @staticmethod
    def preflight(origin: str, allowed: Iterable[str], *, close: bool) -> bytes:
        """The whole ``204`` answer to an allowed origin's preflight."""
        lines = [status_line(204),
                 b"access-control-allow-origin: " + origin.encode("latin-1"),
                 b"access-control-allow-methods: " + ", ".join(allowed).encode("ascii"),
                 b"access-control-allow-headers: " + CORS_ALLOW_HEADERS.encode(),
                 b"access-control-max-age: " + CORS_MAX_AGE.encode(),
                 b"vary: Origin"]
        if close:
            lines.append(b"connection: close")
        return b"\r\n".join(lines) + b"\r\n\r\n"


def _normalize_host_entry(entry: str) -> str:
    entry = entry.strip().lower()
    if entry.count(":") > 1 and not entry.startswith("["):
        entry = f"[{entry}]"  # a bare IPv6 address as written in a config file
    return entry


def _host_problem(host: bytes) -> str | None:
    """Why ``host`` is not a valid ``host[:port]`` (None when it is)."""
    m = _HOST.fullmatch(host)
    if m is None:
        return "is not a valid host[:port]"
    port = (m.group(2) or b"").lstrip(b"0")
    if len(port) > 5 or (port and int(port) > 65535):
        return "has a port out of the range 0-65535"
    return None


def _show(value: bytes, limit: int = 100) -> str:
    text = value.decode("ascii", "backslashreplace")
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True, slots=True)
class Rejection:
    """A refusal afmd answers itself, with ``Connection: close``: the error's own
    envelope (the one Sanic's error handler sends too) and its headers."""

    error: APIError
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_error(
        cls, error: APIError, extra: Iterable[tuple[str, str]] = ()
    ) -> Rejection:
        return cls(error, (*error.headers.items(), *extra))

    @property
    def status(self) -> int:
        return self.error.status

    @property
    def code(self) -> str:
        return self.error.code

    @property
    def message(self) -> str:
        return self.error.message

    def render(self) -> bytes:
        return render_json(self.status, orjson.dumps(self.error.envelope()), self.headers,
                           close=True)


_STATUS_LINES: dict[int, bytes] = {}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Unknown"
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {phrase}".encode("ascii")
    return line


def render_json(status: int, body: bytes, headers: Iterable[tuple[str, str]] = (), *,
                close: bool) -> bytes:
    """A complete JSON response that afmd writes itself, without Sanic: a refusal, or a
    :class:`Direct` answer (so the two cannot drift apart in framing)."""
    lines = [status_line(status),
             b"content-type: application/json",
             b"content-length: %d" % len(body),
             b"connection: close" if close else b"connection: keep-alive"]
    lines.extend(f"{k}: {v}".encode("latin-1") for k, v in headers)
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@dataclass(frozen=True, slots=True)
class Reply:
    """Bytes the gate answers itself: ``100 Continue``, a preflight, or a rejection."""

    data: bytes
    close: bool = False
    rejection: Rejection | None = None
    is_continue: bool = False


CONTINUE_REPLY = Reply(CONTINUE, is_continue=True)


@dataclass(frozen=True, slots=True)
class Direct:
    """A screened, bodiless ``GET`` of one of ``GatePolicy.direct_paths``.

    Its answer depends on server state only, so the caller may build and write it itself
    (in order, once every earlier request has been answered), skipping Sanic's
    per-request machinery, which costs several times what building such an answer does.
    ``request`` is the normalised request, exactly what would otherwise have been
    forwarded, for when the caller hands it to Sanic after all.
    """

    request: bytes
    path: str
    headers: tuple[tuple[str, str], ...]  # CORS headers for an allowed Origin, else ()
    close: bool  # answer with ``Connection: close`` and close, as for a forwarded request


class _Refuse(Exception):  # internal control flow: never escapes the gate
    def __init__(self, rejection: Rejection) -> None:
        self.rejection = rejection


@dataclass(frozen=True)
class GatePolicy:
    """The screening decisions, from :class:`ServerConfig` plus a route check."""

    route: RouteCheck
    check_host: bool = True
    allowed_hosts: frozenset[str] = LOCAL_HOSTS
    allowed_origins: frozenset[str] = frozenset()
    any_origin: bool = False
    api_key: bytes = b""
    max_header_bytes: int = 65536
    max_body_bytes: int = 16 * 1024 * 1024
    open_paths: frozenset[str] = frozenset({"/health"})
    #: Paths whose bodiless GETs come out as :class:`Direct` instead of bytes.
    direct_paths: frozenset[str] = frozenset()
    cors: Cors = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cors", Cors(self.allowed_origins, self.any_origin))

    @classmethod
    def from_config(
        cls,
        server: ServerConfig,
        route: RouteCheck,
        *,
        check_host: bool,
        extra_hosts: Iterable[str] = (),
        direct_paths: Iterable[str] = (),
    ) -> GatePolicy:
        hosts = {_normalize_host_entry(h) for h in (*server.allowed_hosts, *extra_hosts)}
        cors = Cors.from_origins(server.allowed_origins)
        return cls(
            route=route,
            check_host=check_host and "*" not in hosts,
            allowed_hosts=frozenset(LOCAL_HOSTS | hosts),
            allowed_origins=cors.allowed,
            any_origin=cors.any_origin,
            api_key=server.api_key.encode(),
            max_header_bytes=server.max_header_bytes,
            max_body_bytes=server.max_request_body_bytes,
            direct_paths=frozenset(direct_paths),
        )

    def host_allowed(self, host: bytes) -> bool:
        value = host.decode("ascii").lower()
        m = _HOST.fullmatch(host)
        name = m.group(1).decode("ascii").lower() if m else value
        return name in self.allowed_hosts or value in self.allowed_hosts

    def origin_allowed(self, origin: str) -> bool:
        return self.cors.allows(origin)


class _Request:
    """What the gate learnt from one request head."""

    __slots__ = ("authority", "authorization", "chunked", "close", "content_type", "expect",
                 "has_cl", "host", "host_line", "hosts", "keep_alive_10", "kept", "length",
                 "local", "method", "origin", "path", "preflight_method", "request_line",
                 "version")

    def __init__(self) -> None:
        self.authority: bytes | None = None  # of an absolute-form target
        self.authorization: bytes | None = None
        self.chunked = False
        self.close = False
        self.content_type: bytes | None = None
        self.expect: bytes | None = None
        self.has_cl = False
        self.host: bytes | None = None
        self.host_line = -1  # index of the Host header in ``kept``
        self.hosts = 0
        self.keep_alive_10 = False
        self.kept: list[bytes] = []
        self.length = 0
        self.local: Reply | None = None
        self.method = ""
        self.origin: str | None = None
        self.path = ""
        self.preflight_method: bytes | None = None
        self.request_line = b""
        self.version = b""

    @property
    def has_body(self) -> bool:
        return self.chunked or self.length > 0


def _bad(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, code="malformed_request")


class Gate:
    """One connection's incremental request framer and screen.

    :meth:`feed` returns a list of outputs in order: ``bytes`` are one complete, normalised
    request to hand to Sanic; a :class:`Reply` is written to the client by the caller (in
    order, and only once every earlier request has been answered); a :class:`Direct` is a
    request the caller may answer itself, under the same rule. After a rejection (or a
    request that closes the connection) the gate is :attr:`dead` and discards input.
    """

    __slots__ = ("_body", "_buf", "_clock", "_need", "_req", "_scan", "_state",
                 "_trailer_bytes", "dead", "policy", "started_at")

    def __init__(self, policy: GatePolicy, clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self._clock = clock
        self._buf = bytearray()
        self._body = bytearray()
        self._state = _HEAD
        self._scan = 0
        self._need = 0
        self._trailer_bytes = 0
        self._req: _Request | None = None
        self.dead = False
        #: When the first byte of the request being received arrived (None: between requests).
        self.started_at: float | None = None

    # -- state the protocol reads --
    @property
    def buffered(self) -> int:
        """Bytes of request data the gate holds right now."""
        return len(self._buf) + len(self._body)

    @property
    def awaiting_head(self) -> bool:
        """Between requests or inside a head: no request is being received past its head."""
        return not self.dead and self._state == _HEAD

    def restart_clock(self) -> None:
        """Give the request being received a fresh deadline (its wait was not its fault)."""
        if self.started_at is not None:
            self.started_at = self._clock()

    def kill(self) -> None:
        """Stop parsing; drop what is buffered; discard all further input."""
        self.dead = True
        self._buf = bytearray()
        self._body = bytearray()
        self._req = None
        self.started_at = None

    # -- input --
    def feed(self, data: bytes) -> list[bytes | Reply | Direct]:
        if self.dead or not data:
            return []
        buf = self._buf
        if self.started_at is None:
            self.started_at = self._clock()
        buf += data
        out: list[bytes | Reply | Direct] = []
        try:
            while buf and not self.dead:
                state = self._state
                if state == _HEAD:
                    if not self._head(out):
                        break
                elif state == _BODY:
                    need = self._need
                    if len(buf) < need:
                        break
                    body = bytes(buf[:need])
                    del buf[:need]
                    self._complete(body, out)
                elif state == _CHUNK_DATA:
                    take = min(len(buf), self._need)
                    self._body += buf[:take]
                    del buf[:take]
                    self._need -= take
                    if self._need == 0:
                        self._state = _CHUNK_CRLF
                elif state == _CHUNK_SIZE_LINE:
                    if not self._chunk_size():
                        break
                elif state == _CHUNK_CRLF:
                    if len(buf) < 2:
                        if buf[0] != 0x0D:
                            raise self._refuse(
                                _bad("Chunk data must be followed by CRLF."))
                        break
                    if buf[0] != 0x0D or buf[1] != 0x0A:
                        raise self._refuse(
                            _bad("Chunk data must be followed by CRLF."))
                    del buf[:2]
                    self._state = _CHUNK_SIZE_LINE
                elif not self._trailer(out):
                    break
        except _Refuse as refused:
            self.kill()
            out.append(Reply(refused.rejection.render(), close=True,
                             rejection=refused.rejection))
        if not self.dead and self._state == _HEAD and not self._buf:
            self.started_at = None
        return out

    # -- head --
    def _head(self, out: list[bytes | Reply | Direct]) -> bool:
        buf = self._buf
        skip = 0
        while buf.startswith(b"\r\n", skip):  # empty lines before a request-line are allowed
            skip += 2
        if skip:
            del buf[:skip]
            self._scan = 0
            if not buf:
                return False
        limit = self.policy.max_header_bytes
        end = buf.find(b"\r\n\r\n", self._scan)
        # The same verdict however the bytes were split into packets: a bare LF within the
        # first max_header_bytes is a 400, else a head longer than that is a 431. Only bytes
        # not checked on an earlier call are searched, so a trickled head costs one pass.
        stop = limit if end < 0 else min(end + 4, limit)
        if _BARE_LF.search(buf, self._scan, stop):
            raise self._refuse(_bad("Lines must end with CRLF, not a bare LF."))
        if end < 0:
            if len(buf) > limit:
                raise self._refuse(HeaderFieldsTooLargeError(
                    f"The request head is larger than max_header_bytes ({limit} bytes)."))
            self._scan = max(0, len(buf) - 3)
            return False
        self._scan = 0
        if end + 4 > limit:
            raise self._refuse(HeaderFieldsTooLargeError(
                f"The request head is larger than max_header_bytes ({limit} bytes)."))
        head = bytes(buf[:end])
        del buf[: end + 4]
        req = self._parse(head)
        self._req = req
        self._screen(req)
        if req.chunked:
            self._body = bytearray()
            self._trailer_bytes = 0
            self._state = _CHUNK_SIZE_LINE
        elif req.length:
            self._need = req.length
            self._state = _BODY
        else:
            self._complete(b"", out)
            return True
        if req.expect is not None and req.local is None and not buf:
            out.append(CONTINUE_REPLY)
        return True

    def _parse(self, head: bytes) -> _Request:
        req = _Request()
        lines = head.split(b"\r\n")
        request_line = lines[0]
        parts = request_line.split(b" ")
        if len(parts) != 3:
            if _CONTROL.search(request_line):
                raise self._refuse(_bad("The request line contains a control character."))
            raise self._refuse(_bad(
                "The request line must be 'METHOD target HTTP/1.1', single spaces apart."))
        method, target, version = parts
        if not _TOKEN.fullmatch(method):
            raise self._refuse(_bad("The request method is not a valid token."))
        if not _VERSION.fullmatch(version):
            raise self._refuse(_bad(
                "The HTTP version must be 'HTTP/' followed by ASCII digits, like HTTP/1.1."))
        if version != b"HTTP/1.1" and version != b"HTTP/1.0":
            raise self._refuse(HTTPVersionNotSupportedError(
                f"HTTP version {_show(version)} is not supported; use HTTP/1.1."))
        if len(target) > _MAX_TARGET:
            raise self._refuse(InvalidRequestError(
                "The request URL is too long.", code="malformed_request", status=414))
        if not _TARGET.fullmatch(target):
            target = self._absolute(req, target)
            request_line = b"%s %s %s" % (method, target, version)
        req.request_line = request_line
        req.method = method.decode("ascii")
        req.path = target.split(b"?", 1)[0].decode("ascii")
        req.version = version

        kept = req.kept
        connection: list[bytes] = []
        codings: list[bytes] = []
        lengths = 0
        te_seen = False
        seen: set[bytes] = set()
        fields = lines[1:]
        if fields and not _FIELDS.fullmatch(head, len(lines[0]) + 2):
            for line in fields:  # find the culprit, for a precise message
                if not _FIELD.fullmatch(line):
                    raise self._refuse(_bad(self._field_problem(line)))
            raise self._refuse(_bad("The header section is malformed."))
        for line in fields:
            raw_name, _, value = line.partition(b":")
            name = raw_name.lower()
            value = value.strip(b" \t")
            if name not in _SPECIAL:
                kept.append(raw_name + b": " + value)
                continue
            if name not in _REFRAMED:
                kept.append(raw_name + b": " + value)
            if name == b"host":
                req.hosts += 1
                req.host = value
                req.host_line = len(kept) - 1
            elif name == b"content-length":
                lengths += 1
                if lengths > 1:
                    raise self._refuse(_bad(
                        "Content-Length must appear exactly once."))
                if not _DIGITS.fullmatch(value):
                    raise self._refuse(_bad(
                        "Content-Length must be a plain decimal number of ASCII digits."))
                digits = value.lstrip(b"0")
                # Anything longer than 18 digits is over any limit and not worth an int.
                req.length = (int(digits) if digits else 0) if len(digits) <= 18 else 1 << 62
                req.has_cl = True
            elif name == b"transfer-encoding":
                te_seen = True
                codings.extend(c.strip(b" \t").lower() for c in value.split(b","))
            elif name in (b"content-type", b"authorization", b"origin"):
                if name in seen:
                    raise self._refuse(_bad(
                        f"The {raw_name.decode()} header must not be repeated."))
                seen.add(name)
                if name == b"content-type":
                    req.content_type = value
                elif name == b"authorization":
                    req.authorization = value
                else:
                    req.origin = value.decode("latin-1")
            elif name == b"expect":
                req.expect = value.lower() if req.expect is None else req.expect + b"," + value
            elif name == b"connection":
                connection.extend(t.strip(b" \t").lower() for t in value.split(b","))
            elif name == b"access-control-request-method":
                req.preflight_method = value

        is_11 = version == b"HTTP/1.1"
        if req.hosts > 1 or (is_11 and req.hosts == 0):
            raise self._refuse(_bad("An HTTP/1.1 request needs exactly one Host header."))
        if req.host is not None and (problem := _host_problem(req.host)):
            raise self._refuse(_bad(f"The Host header {problem}."))
        if req.authority is not None:
            # RFC 9112 3.2.2: the target's authority is the host; the Host header (present
            # and valid, as checked above) is ignored, and replaced for what reads it later.
            req.host = req.authority
            if req.host_line >= 0:
                name = kept[req.host_line].partition(b":")[0]
                kept[req.host_line] = name + b": " + req.authority
        if te_seen:
            codings = [c for c in codings if c]
            if req.has_cl:
                raise self._refuse(_bad(
                    "A request must not have both Content-Length and Transfer-Encoding."))
            if not codings:
                raise self._refuse(_bad("Transfer-Encoding must name a coding."))
            if not is_11:
                raise self._refuse(_bad(
                    "Transfer-Encoding is not allowed in an HTTP/1.0 request."))
            if codings != [b"chunked"]:
                raise self._refuse(NotImplementedHTTPError(
                    "Only the chunked transfer coding is supported, not "
                    f"'{_show(b', '.join(codings))}'."))
            req.chunked = True
        if req.expect is not None:
            if req.expect != b"100-continue":
                raise self._refuse(ExpectationFailedError(
                    f"Unsupported expectation '{_show(req.expect)}'; only 100-continue is "
                    "supported."))
            if not is_11 or not req.has_body:
                req.expect = None  # HTTP/1.0 clients must not get a 1xx; no body, no wait
        req.close = b"close" in connection or (not is_11 and b"keep-alive" not in connection)
        req.keep_alive_10 = not is_11 and not req.close
        return req

    def _absolute(self, req: _Request, target: bytes) -> bytes:
        """The origin-form of an absolute-form ``target``; its authority goes to ``req``."""
        m = _ABSOLUTE.fullmatch(target)
        if m is None:
            scheme = _SCHEME.match(target)
            if scheme and scheme.group().lower() != b"http:":
                raise self._refuse(_bad(
                    f"The request target's scheme '{_show(scheme.group()[:-1], 20)}' is not "
                    "served here; send a path starting with '/' (or an http:// URL)."))
            raise self._refuse(_bad(
                "The request target must be a path starting with '/' (or an absolute "
                "http:// URL), in visible ASCII, without a fragment."))
        authority = m.group(1)
        if b"@" in authority:
            raise self._refuse(_bad("The request target's URL must not contain userinfo."))
        if (problem := _host_problem(authority)) or not authority.partition(b":")[0]:
            raise self._refuse(_bad(
                f"The request target's authority {problem or 'has no host'}."))
        req.authority = authority
        rest = m.group(2) or b""
        return rest if rest.startswith(b"/") else b"/" + rest

    @staticmethod
    def _field_problem(line: bytes) -> str:
        if line[:1] in (b" ", b"\t"):
            return "Obsolete line folding (a header line starting with whitespace) is not allowed."
        if _NUL_CR_LF.search(line):
            return "A header contains a NUL, a bare CR or a bare LF."
        name, colon, _ = line.partition(b":")
        if not colon:
            return "A header line has no colon."
        if name[-1:] in (b" ", b"\t"):
            return "Whitespace between a header name and its colon is not allowed."
        if _CONTROL.search(name):
            return "A header name contains a control character."
        if _TOKEN.fullmatch(name):
            return ("A header value contains a control character; only visible characters, "
                    "spaces and tabs are allowed.")
        return "A header name is not a valid token."

    # -- screening --
    def _screen(self, req: _Request) -> None:
        policy = self.policy
        # No Host at all is only possible in HTTP/1.0, which no browser speaks: it cannot
        # be a DNS-rebinding attempt, so only a Host that is present is checked.
        if policy.check_host and req.host is not None and not policy.host_allowed(req.host):
            raise self._refuse(MisdirectedRequestError(
                f"The Host '{_show(req.host)}' is not served here; use localhost or add "
                "it to server.allowed_hosts."))
        if req.origin is not None and not policy.origin_allowed(req.origin):
            raise self._refuse(PermissionDeniedError(
                f"Requests from the origin '{_show(req.origin.encode('latin-1'))}' are not "
                "allowed; add it to server.allowed_origins."))
        if req.method == "OPTIONS" and req.origin is not None and req.preflight_method:
            status, allowed = policy.route("OPTIONS", req.path)
            if status == 404:
                raise self._refuse(unknown_url(req.method, req.path), req)
            req.local = Reply(Cors.preflight(req.origin, allowed, close=req.close),
                              close=req.close)
            return
        status, allowed = policy.route(req.method, req.path)
        if status == 404:
            raise self._refuse(unknown_url(req.method, req.path), req)
        if status == 405:
            raise self._refuse(method_not_allowed(req.method, req.path, allowed), req)
        if policy.api_key and req.path not in policy.open_paths:
            self._authenticate(req)
        if req.method == "POST" and req.has_body:
            media = (req.content_type or b"").split(b";", 1)[0].strip(b" \t").lower()
            if media != b"application/json":
                raise self._refuse(UnsupportedMediaTypeError(
                    "The request body must be JSON, sent with 'Content-Type: "
                    "application/json'."), req)
        if req.length > policy.max_body_bytes:
            raise self._refuse(PayloadTooLargeError(
                f"The request body is larger than max_request_body_bytes "
                f"({policy.max_body_bytes} bytes)."), req)

    def _authenticate(self, req: _Request) -> None:
        token: bytes | None = None
        if req.authorization:
            scheme, _, rest = req.authorization.partition(b" ")
            if scheme.lower() == b"bearer":
                token = rest.strip(b" \t")
        if not token:
            raise self._refuse(AuthenticationError(
                "You didn't provide an API key. Send it in an Authorization header using "
                "Bearer auth (Authorization: Bearer YOUR_KEY).",
                headers={"WWW-Authenticate": "Bearer"}), req)
        if not hmac.compare_digest(token, self.policy.api_key):
            raise self._refuse(AuthenticationError(
                "Incorrect API key provided.", headers={"WWW-Authenticate": "Bearer"}), req)

    def _cors(self, req: _Request | None) -> tuple[tuple[str, str], ...]:
        return () if req is None else self.policy.cors.headers(req.origin)

    def _rejection(self, error: APIError, req: _Request | None = None) -> Rejection:
        return Rejection.from_error(error, self._cors(req))

    def _refuse(self, error: APIError, req: _Request | None = None) -> _Refuse:
        return _Refuse(self._rejection(error, req))

    # -- chunked body --
    def _chunk_size(self) -> bool:
        buf = self._buf
        end = buf.find(b"\r\n")
        if end < 0:
            if len(buf) > _MAX_CHUNK_LINE or b"\n" in buf:
                raise self._refuse(_bad("Malformed chunk size line."), self._req)
            return False
        line = bytes(buf[:end])
        del buf[: end + 2]
        m = _CHUNK_SIZE.fullmatch(line)
        if m is None or end > _MAX_CHUNK_LINE:
            raise self._refuse(_bad(
                "A chunk size must be hexadecimal ASCII digits, optionally followed by a "
                "';' extension."), self._req)
        digits = m.group(1).lstrip(b"0")
        size = (int(digits, 16) if digits else 0) if len(digits) <= 15 else 1 << 62
        if size == 0:
            self._state = _TRAILER
            self._scan = 0
            self._trailer_bytes = 0
            return True
        if len(self._body) + size > self.policy.max_body_bytes:
            raise self._refuse(PayloadTooLargeError(
                f"The request body is larger than max_request_body_bytes "
                f"({self.policy.max_body_bytes} bytes)."), self._req)
        self._need = size
        self._state = _CHUNK_DATA
        return True

    def _trailer(self, out: list[bytes | Reply | Direct]) -> bool:
        buf = self._buf
        scan = self._scan  # bytes of this line before it were checked by an earlier call
        end = buf.find(b"\r\n", scan)
        room = self.policy.max_header_bytes - self._trailer_bytes  # for this line and CRLF
        if end == 0:
            del buf[:2]
            self._scan = 0
            body = bytes(self._body)
            self._body = bytearray()
            self._complete(body, out)
            return True
        # As for the head: a bare LF within the allowed size first, then the size.
        if _BARE_LF.search(buf, scan, room if end < 0 else min(end, room)):
            raise self._refuse(_bad("Lines must end with CRLF, not a bare LF."), self._req)
        if (len(buf) if end < 0 else end + 2) > room:
            raise self._refuse(HeaderFieldsTooLargeError(
                "The chunked trailer is larger than max_header_bytes."), self._req)
        if end < 0:
            self._scan = max(0, len(buf) - 1)
            return False
        self._scan = 0
        line = bytes(buf[:end])
        if _FIELD.fullmatch(line) is None:
            raise self._refuse(_bad(self._field_problem(line)), self._req)
        self._trailer_bytes += end + 2
        del buf[: end + 2]  # trailers are validated, then dropped
        return True

    # -- completion --
    def _complete(self, body: bytes, out: list[bytes | Reply | Direct]) -> None:
        req = self._req
        assert req is not None
        self._req = None
        self._state = _HEAD
        if req.local is not None:
            out.append(req.local)
        else:
            lines = [req.request_line, *req.kept]
            if body:
                lines.append(b"content-length: %d" % len(body))
            if req.close:
                lines.append(b"connection: close")
            elif req.keep_alive_10:
                lines.append(b"connection: keep-alive")
            lines.append(b"")
            lines.append(body)
            request = b"\r\n".join(lines)
            if not body and req.method == "GET" and req.path in self.policy.direct_paths:
                out.append(Direct(request, req.path, self._cors(req), req.close))
            else:
                out.append(request)
        if req.close:
            # Sanic answers this one and closes: nothing after it is ever read.
            self.dead = True
            self._buf = bytearray()
            self.started_at = None
        else:
            self.started_at = self._clock() if self._buf else None
