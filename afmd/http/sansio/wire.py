"""HTTP/1.1 as bytes: the grammar the gate checks, and the responses afmd writes itself.

The lowest layer of the HTTP edge, with no state and no policy: the regular expressions of
RFC 9110/9112's grammar (each anchored with ``fullmatch`` by its user), the diagnostics
that turn a failed match into a precise message, status lines, and the rendering of a
JSON response, which every answer written without Sanic goes through: a refusal
(:class:`Rejection`) or a direct answer. :mod:`afmd.http.sansio.framing` and
:mod:`afmd.http.sansio.screen` raise :class:`GateRefusal`; the gate turns it into a
:class:`Rejection`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from http import HTTPStatus

import orjson

from afmd.core.ids import new_request_id
from afmd.dialects.dialect import ErrorStyle, error_response
from afmd.errors import APIError, InvalidRequestError

__all__ = [
    "CONTINUE",
    "GateRefusal",
    "Rejection",
    "bad",
    "field_problem",
    "host_problem",
    "render_json",
    "show",
    "split_absolute",
    "status_line",
]

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
VERSION = re.compile(rb"HTTP/[0-9]\.[0-9]")
# origin-form (a path, optional query; no fragment) or the asterisk-form of OPTIONS.
TARGET = re.compile(rb"/[\x21\x22\x24-\x7e]*|\*")
# absolute-form (RFC 9112 3.2.2), which servers must accept: "http://" (any case), an
# authority screened like a Host header, then a path and/or a query, or nothing ("/").
ABSOLUTE = re.compile(rb"[Hh][Tt][Tt][Pp]://([^/?#]*)([/?][\x21\x22\x24-\x7e]*)?")
SCHEME = re.compile(rb"[A-Za-z][A-Za-z0-9+.\-]*:")
# A header line: token ":" then a value of visible bytes (obs-text included), spaces and
# tabs. Control characters are refused, not passed on: NUL, CR and LF are what parsers
# disagree on (smuggling), and the others are whitespace to some readers (Python's
# str.strip() drops \x1c-\x1f, VT and FF), so a value could pass for another one.
FIELD = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):([\t\x20-\x7e\x80-\xff]*)")
# Every header line of a head at once (each line ends with CRLF but the last): one pass.
FIELDS = re.compile(rb"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*"
                    rb"(?:\r\n(?=.)|\Z))*", re.DOTALL)
DIGITS = re.compile(rb"[0-9]+")
# chunk-size, then optionally whitespace and a ';' extension; nothing else.
CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]+)(?:[ \t]*;[\t\x20-\x7e\x80-\xff]*)?")
# host [ ":" port ], where RFC 3986 allows an empty port; its value is checked apart.
HOST = re.compile(rb"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\-._~%!$&'()*+,;=]*)(?::([0-9]*))?")
CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
NUL_CR_LF = re.compile(rb"[\x00\r\n]")
BARE_LF = re.compile(rb"(?<!\r)\n")

MAX_CHUNK_LINE = 4096
MAX_TARGET = 65535  # httptools stores URL offsets as uint16


def show(value: bytes, limit: int = 100) -> str:
    """A client's bytes as they may be quoted in a message: ASCII, cut at ``limit``."""
    text = value.decode("ascii", "backslashreplace")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def bad(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, code="malformed_request")


def host_problem(host: bytes) -> str | None:
    """Why ``host`` is not a valid ``host[:port]`` (None when it is)."""
    m = HOST.fullmatch(host)
    if m is None:
        return "is not a valid host[:port]"
    port = (m.group(2) or b"").lstrip(b"0")
    if len(port) > 5 or (port and int(port) > 65535):
        return "has a port out of the range 0-65535"
    return None


def field_problem(line: bytes) -> str:
    """Why a header (or trailer) line that failed :data:`FIELD` is malformed."""
    if line[:1] in (b" ", b"\t"):
        return "Obsolete line folding (a header line starting with whitespace) is not allowed."
    if NUL_CR_LF.search(line):
        return "A header contains a NUL, a bare CR or a bare LF."
    name, colon, _ = line.partition(b":")
    if not colon:
        return "A header line has no colon."
    if name[-1:] in (b" ", b"\t"):
        return "Whitespace between a header name and its colon is not allowed."
    if CONTROL.search(name):
        return "A header name contains a control character."
    if TOKEN.fullmatch(name):
        return ("A header value contains a control character; only visible characters, "
                "spaces and tabs are allowed.")
    return "A header name is not a valid token."


class GateRefusal(Exception):
    """A request the gate must refuse (control flow inside the gate: never escapes it).

    ``cors``: the refusal concerns a request whose head was screened, so an allowed
    Origin gets the CORS headers that let its page read the error.
    """

    def __init__(self, error: APIError, *, cors: bool = False) -> None:
        super().__init__(error.message)
        self.error = error
        self.cors = cors


def split_absolute(target: bytes) -> tuple[bytes, bytes]:
    """The authority and the origin-form of an absolute-form ``target``."""
    m = ABSOLUTE.fullmatch(target)
    if m is None:
        scheme = SCHEME.match(target)
        if scheme and scheme.group().lower() != b"http:":
            raise GateRefusal(bad(
                f"The request target's scheme '{show(scheme.group()[:-1], 20)}' is not "
                "served here; send a path starting with '/' (or an http:// URL)."))
        raise GateRefusal(bad(
            "The request target must be a path starting with '/' (or an absolute "
            "http:// URL), in visible ASCII, without a fragment."))
    authority = m.group(1)
    if b"@" in authority:
        raise GateRefusal(bad("The request target's URL must not contain userinfo."))
    if (problem := host_problem(authority)) or not authority.partition(b":")[0]:
        raise GateRefusal(bad(f"The request target's authority {problem or 'has no host'}."))
    rest = m.group(2) or b""
    return authority, rest if rest.startswith(b"/") else b"/" + rest


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
                close: bool, head_only: bool = False) -> bytes:
    """A complete JSON response that afmd writes itself, without Sanic: a refusal, or a
    direct answer (so the two cannot drift apart in framing). ``head_only`` answers a HEAD
    request: the headers GET would get, no content (RFC 9110 section 9.3.2)."""
    lines = [status_line(status),
             b"content-type: application/json",
             b"content-length: %d" % len(body),
             b"connection: close" if close else b"connection: keep-alive"]
    lines.extend(f"{k}: {v}".encode("latin-1") for k, v in headers)
    return b"\r\n".join(lines) + b"\r\n\r\n" + (b"" if head_only else body)


@dataclass(frozen=True, slots=True)
class Rejection:
    """A refusal afmd answers itself, with ``Connection: close``: the error in the
    envelope of the route it was meant for (the one Sanic's error handler sends too; see
    :func:`afmd.dialects.dialect.error_response`) and its headers.

    It names a request id (``X-Request-ID``, and the header the style's SDK reads) as
    every other answer does, so a client reports a refusal as it reports any error and
    the access log's line for it is found by that id: the client's own id when it sent a
    valid one, else a fresh one."""

    error: APIError
    headers: tuple[tuple[str, str], ...] = ()
    style: ErrorStyle | None = None  # None: OpenAI's envelope
    request_id: str = ""  # "": one is made for each answer (:meth:`named`)

    @classmethod
    def from_error(
        cls, error: APIError, extra: Iterable[tuple[str, str]] = (),
        style: ErrorStyle | None = None, request_id: str | None = None,
    ) -> Rejection:
        return cls(error, (*error.headers.items(), *extra), style, request_id or "")

    def named(self) -> Rejection:
        """This refusal with a request id of its own (one made once and sent to many
        connections, as the connection limits' are, gets a fresh one each time)."""
        return self if self.request_id else replace(self, request_id=new_request_id())

    @property
    def status(self) -> int:
        return error_response(self.style, self.error)[0]

    @property
    def code(self) -> str:
        return self.error.code

    @property
    def message(self) -> str:
        return self.error.message

    def render(self, *, head_only: bool = False) -> bytes:
        rid = self.request_id or new_request_id()
        status, body, headers = error_response(self.style, self.error, rid)
        return render_json(status, orjson.dumps(body),
                           {**dict(self.headers), "X-Request-ID": rid, **headers}.items(),
                           close=True, head_only=head_only)
