"""Policy over a parsed request head: whether afmd serves it at all.

:func:`screen` decides, from a :class:`~afmd.http.sansio.framing.RequestHead` alone and before
any body byte is read, on the Host (DNS rebinding), the Origin (CORS), the route and
method, the API key, the media type and the announced size. It also owns CORS: the
preflight answer and the headers an allowed origin's responses carry, for the gate and
for Sanic's responses alike (:class:`Cors`), and the 404 and 405 errors, whichever layer
finds the URL unknown. Routing itself is a callable supplied by the HTTP layer, so this
module knows nothing about Sanic.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import string
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import NamedTuple

from afmd.config.sections import ServerConfig
from afmd.dialects.dialect import AnyBodyMediaType, ErrorStyle
from afmd.errors import (
    AuthenticationError,
    MethodNotAllowedError,
    MisdirectedRequestError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    UnsupportedMediaTypeError,
)
from afmd.http.sansio import wire
from afmd.http.sansio.framing import RequestHead
from afmd.http.sansio.wire import GateRefusal, bad, show

__all__ = [
    "CORS_ALLOW_HEADERS",
    "CORS_EXPOSE_HEADERS",
    "Cors",
    "GatePolicy",
    "RouteCheck",
    "RouteVerdict",
    "method_not_allowed",
    "normalize_origin",
    "presented_request_id",
    "same_origin",
    "screen",
    "unknown_url",
]


class RouteVerdict(NamedTuple):
    """What the app's router says of a request line."""

    status: int  # 200 routable, 404 unknown URL, 405 the path exists for other methods
    allowed: tuple[str, ...] = ()  # with 405: the methods it exists for
    #: The envelope errors about this path go out in (None: OpenAI's): a route's own
    #: dialect, and for an unknown path that of the routes it lies under.
    style: ErrorStyle | None = None


#: ``route(method, path)`` -> a :class:`RouteVerdict`, or its first two fields alone.
RouteCheck = Callable[[str, str], RouteVerdict | tuple[int, tuple[str, ...]]]

#: The request headers an allowed page may send: afmd's own, and those the official SDKs
#: send from a browser or an Electron app (ollama-js its ``User-Agent``, OpenAI's and
#: Anthropic's their ``x-stainless-*`` ones; Ollama allows the same): a preflight that
#: leaves out one header the page sends fails its every request.
CORS_ALLOW_HEADERS = ", ".join((
    "Authorization", "Content-Type", "Accept", "User-Agent", "X-Requested-With",
    "X-Request-ID", "X-AFM-Profile", "X-API-Key",
    "Anthropic-Version", "Anthropic-Beta", "Anthropic-Dangerous-Direct-Browser-Access",
    "OpenAI-Beta", "OpenAI-Organization", "OpenAI-Project",
    *(f"X-Stainless-{name}" for name in (
        "Arch", "Async", "Custom-Poll-Interval", "Helper", "Helper-Method", "Lang", "OS",
        "Package-Version", "Poll-Helper", "Read-Timeout", "Retry-Count", "Runtime",
        "Runtime-Version", "Timeout")),
))
#: What a page may read of an answer. ``Retry-After`` and ``X-Should-Retry`` are what the
#: JavaScript SDKs' retries read; no CORS rule lets a page see them unless named here, so
#: a page's SDK retried a 429 on its own backoff and a cancelled request as any 409.
CORS_EXPOSE_HEADERS = (
    "X-Request-ID, OpenAI-Request-ID, Request-Id, X-Grammar-Constraints, "
    "X-AFM-Trimmed-Messages, X-AFM-Trimmed-Context, X-AFM-Ignored-Fields, "
    "Retry-After, X-Should-Retry"
)
CORS_MAX_AGE = "600"
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
#: Paths read without the API key: the health check everywhere (load balancers, ``afmd
#: doctor``), ``/`` (a constant answer clients probe; a browser is sent on to the
#: dashboard), and the metrics too on a listener only this machine reaches (loopback TCP,
#: the Unix socket); on any other listener a configured key guards them.
OPEN_PATHS = frozenset({"/health", "/"})
LOCAL_OPEN_PATHS = OPEN_PATHS | {"/metrics"}
#: The dashboard's page and its static files (afmd.http.routes.dashboard) are read without the
#: key too: a browser loads them before the page can ask for the key, and they hold no
#: secret. What the page reads and does, under :data:`UI_API_PREFIX`, is screened as the
#: API is.
UI_PREFIX = "/ui/"
UI_API_PREFIX = "/ui/api/"

_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def normalize_origin(origin: str) -> str:
    """The form origins are compared in: only optional whitespace is trimmed and only
    ASCII letters are folded, so that no other character (a leading U+00A0, a KELVIN SIGN
    that ``str.lower`` turns into ``k``) can make a foreign origin match the allow-list."""
    origin = origin.strip(" \t").translate(_ASCII_LOWER)
    bare = origin.rstrip("/")
    return origin if bare.endswith(":") else bare  # ``file://`` names no host: kept whole


def unknown_url(method: str, path: str) -> NotFoundError:
    return NotFoundError(
        f"Unknown request URL: {method} {path}. Please check the URL for typos.",
        code="unknown_url")


def method_not_allowed(method: str, path: str, allowed: Iterable[str]) -> MethodNotAllowedError:
    methods = ", ".join(allowed)
    return MethodNotAllowedError(f"Method {method} is not allowed for {path}.",
                                 headers={"Allow": methods} if methods else None)


#: Origins only an app on this machine sends, never a web page (a browser names a page by
#: its ``http(s)`` origin, and a local file's or a sandboxed page as ``null``): Electron's
#: and Obsidian's ``app://`` and ``file://``, Tauri's, VS Code's webviews. They are always
#: allowed, as Ollama's default ``OLLAMA_ORIGINS`` allows them, so that desktop apps and
#: editor plugins calling the API from their own pages work unchanged.
APP_ORIGINS = ("app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*")


def origin_pattern(entry: str) -> re.Pattern[str]:
    """An allowed-origin entry with ``*`` (``chrome-extension://*``, ``http://localhost:*``)
    as a pattern: each ``*`` stands for any run of characters but ``/``, so no pattern
    reaches past an origin's host and port."""
    parts = normalize_origin(entry).split("*")
    return re.compile("[^/]*".join(re.escape(part) for part in parts))


@dataclass(frozen=True, slots=True)
class Cors:
    """Which origins may read afmd's answers, and the headers that tell browsers so."""

    allowed: frozenset[str] = frozenset()  # normalised (:func:`normalize_origin`)
    any_origin: bool = False
    #: Entries with ``*``, and :data:`APP_ORIGINS`.
    patterns: tuple[re.Pattern[str], ...] = tuple(origin_pattern(o) for o in APP_ORIGINS)

    @classmethod
    def from_origins(cls, origins: Iterable[str]) -> Cors:
        origins = tuple(origins)
        globbed = tuple(o for o in origins if "*" in o and o.strip(" \t") != "*")
        return cls(frozenset(normalize_origin(o) for o in origins if "*" not in o),
                   any(o.strip(" \t") == "*" for o in origins),
                   tuple(origin_pattern(o) for o in (*APP_ORIGINS, *globbed)))

    def allows(self, origin: str) -> bool:
        if self.any_origin:
            return True
        origin = normalize_origin(origin)
        return origin in self.allowed or any(p.fullmatch(origin) for p in self.patterns)

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
        lines = [wire.status_line(204),
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


@dataclass(frozen=True)
class GatePolicy:
    """The screening decisions, from :class:`ServerConfig` plus a route check."""

    route: RouteCheck
    check_host: bool = True
    allowed_hosts: frozenset[str] = LOCAL_HOSTS
    #: ``server.allowed_origins``' entries, ``*`` and patterns included.
    allowed_origins: frozenset[str] = frozenset()
    api_key: bytes = b""
    max_header_bytes: int = 65536
    max_body_bytes: int = 16 * 1024 * 1024
    open_paths: frozenset[str] = OPEN_PATHS
    #: Paths whose bodiless GETs the gate marks for a direct answer.
    direct_paths: frozenset[str] = frozenset()
    #: ``(header, style)``: a header one API's SDKs send on every request and no other
    #: API's client does (Anthropic's ``anthropic-version``). A refusal on a path no
    #: dialect owns (``/v1/models``, which two APIs' SDKs call, or an unknown URL under
    #: ``/v1``) goes out in the envelope of the SDK that sent it, which is the one it reads.
    client_styles: tuple[tuple[bytes, ErrorStyle], ...] = ()
    cors: Cors = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cors", Cors.from_origins(self.allowed_origins))

    @classmethod
    def from_config(
        cls,
        server: ServerConfig,
        route: RouteCheck,
        *,
        check_host: bool,
        extra_hosts: Iterable[str] = (),
        direct_paths: Iterable[str] = (),
        local: bool = False,
        client_styles: Iterable[tuple[str, ErrorStyle]] = (),
    ) -> GatePolicy:
        """``local``: the listener is reachable from this machine alone (loopback TCP or
        the Unix socket), where :data:`LOCAL_OPEN_PATHS` need no key."""
        hosts = {_normalize_host_entry(h) for h in (*server.allowed_hosts, *extra_hosts)}
        return cls(
            route=route,
            check_host=check_host and "*" not in hosts,
            allowed_hosts=frozenset(LOCAL_HOSTS | hosts),
            allowed_origins=frozenset(server.allowed_origins),
            api_key=server.api_key.encode(),
            max_header_bytes=server.max_header_bytes,
            max_body_bytes=server.max_request_body_bytes,
            direct_paths=frozenset(direct_paths),
            open_paths=LOCAL_OPEN_PATHS if local else OPEN_PATHS,
            client_styles=tuple((name.lower().encode("ascii") + b":", style)
                                for name, style in client_styles),
        )

    def host_allowed(self, host: bytes) -> bool:
        value = host.decode("ascii").lower()
        m = wire.HOST.fullmatch(host)
        name = m.group(1).decode("ascii").lower() if m else value
        return name in self.allowed_hosts or value in self.allowed_hosts

    def origin_allowed(self, origin: str) -> bool:
        return self.cors.allows(origin)

    def verdict(self, method: str, path: str) -> RouteVerdict:
        found = self.route(method, path)
        return found if isinstance(found, RouteVerdict) else RouteVerdict(*found)

    def style_of(self, head: RequestHead) -> ErrorStyle | None:
        """The envelope of errors about the request ``head`` (None: OpenAI's): its route's,
        else that of the client it comes from (:attr:`client_styles`)."""
        style = self.verdict(head.method, head.path).style
        if style is None and self.client_styles:
            for line in head.lines:
                for name, client_style in self.client_styles:
                    if line[:len(name)].lower() == name:
                        return client_style
        return style


def screen(policy: GatePolicy, head: RequestHead) -> bytes | None:
    """Refuse ``head`` (raise :class:`~afmd.http.sansio.wire.GateRefusal`), or pass it: None, or the
    answer to a CORS preflight, which afmd gives itself."""
    # No Host at all is only possible in HTTP/1.0, which no browser speaks: it cannot be
    # a DNS-rebinding attempt, so only a Host that is present is checked.
    if policy.check_host and head.host is not None and not policy.host_allowed(head.host):
        raise GateRefusal(MisdirectedRequestError(
            f"The Host '{show(head.host)}' is not served here; use localhost or add it to "
            "server.allowed_hosts."))
    origin = head.origin
    if origin is not None and not policy.cors.allows(origin) and not same_origin(policy, head):
        raise GateRefusal(PermissionDeniedError(
            f"Requests from the origin '{show(origin.encode('latin-1'))}' are not allowed; "
            "add it to server.allowed_origins."))
    if head.method == "OPTIONS" and origin is not None and head.preflight_method:
        status, allowed, _ = policy.verdict("OPTIONS", head.path)
        if status == 404:
            raise GateRefusal(unknown_url(head.method, head.path), cors=True)
        return policy.cors.preflight(origin, allowed, close=head.close)
    status, allowed, style = policy.verdict(head.method, head.path)
    if status == 404:
        raise GateRefusal(unknown_url(head.method, head.path), cors=True)
    if status == 405:
        raise GateRefusal(method_not_allowed(head.method, head.path, allowed), cors=True)
    if policy.api_key and _needs_key(policy, head.path):
        _authenticate(head, policy.api_key)
    any_media = origin is None and _reads_any_body(style)
    if head.content_codings and head.has_body:
        # RFC 7694: a 415 naming the codings the server reads (none but identity).
        raise GateRefusal(UnsupportedMediaTypeError(
            f"The request body's Content-Encoding '{show(b', '.join(head.content_codings))}'"
            " is not supported; send the body uncompressed.",
            headers={"Accept-Encoding": "identity"}), cors=True)
    if head.method == "POST" and head.has_body and not any_media:
        media = (head.content_type or b"").split(b";", 1)[0].strip(b" \t").lower()
        if media != b"application/json":
            raise GateRefusal(UnsupportedMediaTypeError(
                "The request body must be JSON, sent with 'Content-Type: "
                "application/json'."), cors=True)
    if head.length > policy.max_body_bytes:
        raise GateRefusal(PayloadTooLargeError(
            f"The request body is larger than max_request_body_bytes "
            f"({policy.max_body_bytes} bytes)."), cors=True)
    return None


def _reads_any_body(style: object) -> bool:
    return isinstance(style, AnyBodyMediaType) and style.any_body_media_type


def same_origin(policy: GatePolicy, head: RequestHead) -> bool:
    """Whether the request's Origin is the server itself, as the client dialled it: a page
    afmd served (the dashboard) calling back. Only for a Host this server answers to (a
    DNS-rebinding page's Host is its own name, not one of ours), so an origin that names
    the Host it was sent to is afmd's own. afmd speaks plain HTTP: the scheme is ``http``."""
    host, origin = head.host, head.origin
    if host is None or origin is None or not policy.host_allowed(host):
        return False
    return normalize_origin(origin) == "http://" + host.decode("ascii").lower()


def _needs_key(policy: GatePolicy, path: str) -> bool:
    if path in policy.open_paths:
        return False
    return not path.startswith(UI_PREFIX) or path.startswith(UI_API_PREFIX)


#: What an X-Request-ID a client sends may be: it goes back out in a header and into the
#: log, and names a run to cancel in a URL.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def presented_request_id(head: RequestHead) -> str | None:
    """The client's X-Request-ID when it is one :data:`REQUEST_ID` allows; never raises
    (for answers that only echo it, not for refusing)."""
    for line in head.lines:
        if line[:13].lower() == b"x-request-id:":
            sent = line[13:].strip(b" \t").decode("latin-1")
            return sent if REQUEST_ID.fullmatch(sent) else None
    return None


def presented_key(head: RequestHead) -> bytes | None:
    """The key a request carries (``x-api-key``, else ``Authorization: Bearer``), if any;
    never raises (for answers that only vary with it, not for refusing)."""
    for line in head.lines:
        if line[:10].lower() == b"x-api-key:":
            return line[10:].strip(b" \t")
    return _bearer(head.authorization)


def _bearer(authorization: bytes | None) -> bytes | None:
    if not authorization:
        return None
    scheme, _, rest = authorization.partition(b" ")
    return rest.strip(b" \t") if scheme.lower() == b"bearer" else None


def local_connection(sockname: object) -> bool:
    """Whether a connection (by its own end's address) could only come from this machine:
    the Unix socket (a path), or a loopback address."""
    if isinstance(sockname, str | bytes):
        return True
    if isinstance(sockname, tuple) and sockname and isinstance(sockname[0], str):
        try:
            return ipaddress.ip_address(sockname[0].split("%", 1)[0]).is_loopback
        except ValueError:
            return False
    return False


def reveals_machine(api_key: bytes, local: bool, key: bytes | None) -> bool:
    """Whether an open path (``/health``) may describe the machine: model folders, pids,
    the hosts of a distributed group. Always without a configured key (the whole API is
    open then), on a connection only this machine can make (loopback, the Unix socket),
    and to a request that carries the key; anyone else who reaches a keyed listener gets
    the status alone."""
    if not api_key or local:
        return True
    return key is not None and hmac.compare_digest(key, api_key)


def _api_key_header(head: RequestHead) -> bytes | None:
    """The ``x-api-key`` header (Anthropic's clients send the key there), if sent once."""
    found: bytes | None = None
    for line in head.lines:  # kept lines read "Name: value"
        if line[:10].lower() == b"x-api-key:":
            if found is not None:
                raise GateRefusal(bad("The x-api-key header must not be repeated."), cors=True)
            found = line[10:].strip(b" \t")
    return found


def _authenticate(head: RequestHead, api_key: bytes) -> None:
    """The key from ``x-api-key`` when sent, else from ``Authorization: Bearer``; on every
    route alike (a key is a key, whichever client's habit carried it). An empty
    ``x-api-key`` is none: an SDK given an empty key and a bearer token sends both."""
    token = _api_key_header(head)
    if not token:
        token = _bearer(head.authorization)
    if not token:
        raise GateRefusal(AuthenticationError(
            "You didn't provide an API key. Send it in an Authorization header using "
            "Bearer auth (Authorization: Bearer YOUR_KEY) or in an x-api-key header.",
            headers={"WWW-Authenticate": "Bearer"}), cors=True)
    if not hmac.compare_digest(token, api_key):
        raise GateRefusal(AuthenticationError(
            "Incorrect API key provided.", headers={"WWW-Authenticate": "Bearer"}),
            cors=True)
