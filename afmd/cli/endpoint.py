"""Finding a running afmd and asking it things, for the commands that talk to one.

``afmd doctor``, ``ps``, ``list`` and ``rm`` must find the server a plugin would: the TCP
endpoint the config names (a wildcard address dialled as loopback), else its Unix socket,
or a ``--url`` given outright (``http://HOST:PORT`` or ``unix:/path/to.sock``). Plain
http.client over the standard library: no proxy settings apply (exactly like a local
plugin dialling 127.0.0.1), and nothing heavy is imported. When the config sets an API
key, it is sent, since ``/health`` is screened by it on non-loopback listeners.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from afmd.config.sections import Config
from afmd.ports import host_port

#: The longest ``--timeout`` taken: past it a deadline overflows the platform's clock.
MAX_WAIT_S = 86_400.0


def wait_seconds(text: str) -> float:
    """``--timeout``'s type. Zero would put the socket in non-blocking mode, where a live
    server's connect reports "in progress" and reads as "no server here"; negative, NaN and
    huge values make the socket layer raise errors that are not about the server at all."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= MAX_WAIT_S):
        raise argparse.ArgumentTypeError(
            f"must be more than 0 and at most {MAX_WAIT_S:g} seconds, got {text!r}")
    return value


class ServerUnreachable(Exception):
    """No afmd answered; the message says where it was looked for."""


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def connect_host(host: str) -> str:
    """The address to dial for a listen address (wildcards mean "this machine")."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def url_of(host: str, port: int) -> str:
    return f"http://{host_port(host, port)}"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a server is dialled: ``label`` for messages, ``connect(timeout)`` for a request."""

    label: str
    connect: Callable[[float], http.client.HTTPConnection]
    api_key: str = ""
    #: Named by ``--url`` rather than found in the config: then "pass --url" is no advice.
    given: bool = False

    def health_label(self) -> str:
        return f"{self.label} /health" if self.label.startswith("unix:") else (
            self.label + "/health")


def key_advice(sent: bool) -> str:
    """What to do about a server that wants a key this command did not send, or sent wrong.
    The client commands read the key where the server does, so the operator is told both
    places (the docs prefer the variable to a secret in a file), and a key that was sent is
    said to be wrong rather than missing: "put it in the config" misled whoever had."""
    where = ("AFMD_SERVER_API_KEY, else [server] api_key of the config this command reads "
             "(--config FILE)")
    if sent:
        return f"the API key this command sent is not the server's (it is read from {where})"
    return f"this command sends the key it finds in {where}: set one to the server's key"


def tcp(host: str, port: int, api_key: str = "") -> Endpoint:
    dial = connect_host(host)
    return Endpoint(url_of(dial, port),
                    lambda timeout: http.client.HTTPConnection(dial, port, timeout=timeout),
                    api_key)


def unix(path: str, api_key: str = "") -> Endpoint:
    return Endpoint(f"unix:{path}", lambda timeout: _UnixHTTPConnection(path, timeout), api_key)


def from_config(config: Config) -> Endpoint | None:
    """The config's endpoint: TCP first, the Unix socket when there is no TCP listener
    (None: port 0, the OS picks one at start, so nothing can be dialled)."""
    server = config.server
    if server.host and server.port:
        return tcp(server.host, server.port, server.api_key)
    if server.unix_socket:
        return unix(server.unix_socket, server.api_key)
    return None


def from_url(url: str, api_key: str = "") -> Endpoint:
    """``--url``: ``http://HOST:PORT`` (a trailing ``/v1`` is fine) or ``unix:/path``.
    No socket path, or port 0 (no server listens there: the OS picks a port when a server
    asks for 0), is a malformed URL, not a server that does not answer."""
    malformed = ValueError(f"--url must be http://HOST:PORT or unix:/path/to.sock, not {url!r}")
    if url.startswith("unix:"):
        if url == "unix:":
            raise malformed
        return replace(unix(url[len("unix:"):], api_key), given=True)
    parts = urlsplit(url if "://" in url else "http://" + url)
    try:
        port = parts.port  # urllib's own words ("Port out of range") name no option
    except ValueError:
        port = None
        parts = parts._replace(netloc="")
    if parts.scheme != "http" or not parts.hostname or port == 0:
        raise malformed
    return replace(tcp(parts.hostname, port or 80, api_key), given=True)


def request_headers(api_key: str = "") -> dict[str, str]:
    """The headers every command's request to the server carries: JSON wanted, and the
    key when the command has one."""
    headers = {"Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def probe_health(conn: http.client.HTTPConnection, api_key: str = "") -> dict[str, Any]:
    """GET /health on a connection; never raises."""
    headers = request_headers(api_key)
    try:
        conn.request("GET", "/health", headers=headers)
        response = conn.getresponse()
        raw = response.read(1 << 20)
    except (OSError, http.client.HTTPException) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return {"answering": False, "error": reason or type(exc).__name__}
    finally:
        conn.close()
    result: dict[str, Any] = {"answering": True, "http_status": response.status}
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and "status" in body and "models" in body:
        result["afmd"] = True
        result["health"] = body
    elif isinstance(body, dict) and "status" in body and body.keys() <= {"status", "reason"}:
        # afmd's answer to a request without the key on a keyed, non-loopback listener:
        # the status alone (the key this command sent, if any, was not the server's).
        result["afmd"] = True
        result["limited"] = True
        result["health"] = body
    else:
        result["afmd"] = False
        result["server_header"] = response.getheader("Server")
    return result


def refuses_key(conn: http.client.HTTPConnection, api_key: str = "") -> bool:
    """Whether the server refuses an API request with ``api_key`` (none: ""), which
    /health cannot tell: it answers a loopback client without a key whatever the server
    wants of the others. A server started with a key this command does not read (another
    config, the variable set in the service's environment only) is one whose clients
    need a key all the same. Never raises (no answer: False)."""
    headers = request_headers(api_key)
    try:
        conn.request("GET", "/v1/models", headers=headers)
        response = conn.getresponse()
        response.read(1 << 20)
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()
    return response.status == 401


def health(endpoint: Endpoint | None, timeout: float = 2.0) -> dict[str, Any]:
    """The running server's /health body (any status); raises ServerUnreachable."""
    if endpoint is None:
        raise ServerUnreachable("no server to ask: the config listens on port 0 (the OS "
                                "picks one at start) and has no unix_socket; pass --url")
    probe = probe_health(endpoint.connect(timeout), endpoint.api_key)
    if not probe["answering"]:
        elsewhere = "" if endpoint.given else ", or pass --url"
        raise ServerUnreachable(f"no afmd server is running at {endpoint.label} "
                                f"({probe['error']}); start one with `afmd serve`{elsewhere}")
    if probe["http_status"] == 401:
        raise ServerUnreachable(f"the server at {endpoint.label} wants an API key: "
                                f"{key_advice(bool(endpoint.api_key))}")
    if not probe["afmd"]:
        raise ServerUnreachable(f"something that is not afmd answers at {endpoint.label} "
                                f"(HTTP {probe['http_status']})")
    if probe.get("limited"):
        raise ServerUnreachable(f"the server at {endpoint.label} shows its details only with "
                                f"its API key: {key_advice(bool(endpoint.api_key))}")
    body: dict[str, Any] = probe["health"]
    return body
