"""The HTTP/1.1 transport over raw sockets against the real server.

Screening (Host, Origin, route, API key, media type, size) happens as soon as a request's
head is parsed: those cases send the head only, announcing a body they never send (with
``Expect: 100-continue``), and the answer must still arrive, without ``100 Continue``, and
the connection must close. Framing that could smuggle a request is refused with 400 (501
for an unknown transfer coding, 431 for a big head). Then the resource limits: the
connection cap, the buffered-bytes cap, the request deadline and the keep-alive timeout,
and SIGTERM draining a running stream.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import ServerProcess, parse_sse, start_server

KEY = "sk-transport-test"
GOOD_ORIGIN = "http://good.example"
AUTH = f"Authorization: Bearer {KEY}\r\n"
JSON_CT = "Content-Type: application/json\r\n"
CHAT = "/v1/chat/completions"
BODY_LIMIT = 4096
HEAD_LIMIT = 2048

SCREEN_CONFIG = f"""
[server]
api_key = "{KEY}"
allowed_origins = ["{GOOD_ORIGIN}"]
allowed_hosts = ["api.example"]
max_request_body_bytes = {BODY_LIMIT}
max_header_bytes = {HEAD_LIMIT}
"""


# --------------------------------------------------------------------------- raw client


@dataclass
class Response:
    status: int
    reason: str
    headers: dict[str, str]
    header_list: list[tuple[str, str]]
    body: bytes
    interim: list[int] = field(default_factory=list)

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def code(self) -> str:
        return self.json()["error"]["code"]


class RawConn:
    """A socket speaking HTTP/1.1 by hand, reading exactly one response at a time."""

    def __init__(self, port: int | None = None, unix: str | None = None,
                 timeout: float = 10.0) -> None:
        if unix is not None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(unix)
        else:
            assert port is not None
            self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.settimeout(timeout)
        self.buf = b""
        self.eof = False

    def __enter__(self) -> RawConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def send(self, data: bytes | str) -> None:
        self.sock.sendall(data.encode("latin-1") if isinstance(data, str) else data)

    def _fill(self) -> bool:
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            data = b""
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    def _until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            if not self._fill():
                raise AssertionError(f"connection closed before {marker!r}; got {self.buf!r}")
        part, _, self.buf = self.buf.partition(marker)
        return part

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise AssertionError(f"connection closed after {len(self.buf)}/{n} bytes")
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def read_interim(self, timeout: float = 3.0) -> bytes:
        """Wait for a 1xx head (e.g. ``100 Continue``) and return it."""
        old = self.sock.gettimeout()
        self.sock.settimeout(timeout)
        try:
            head = self._until(b"\r\n\r\n")
        finally:
            self.sock.settimeout(old)
        return head

    def read_response(self, method: str = "GET") -> Response:
        interim: list[int] = []
        while True:
            head = self._until(b"\r\n\r\n").decode("latin-1")
            status_line, *lines = head.split("\r\n")
            version, status_text, *reason = status_line.split(" ", 2)
            assert version == "HTTP/1.1", status_line
            status = int(status_text)
            header_list = []
            for line in lines:
                name, _, value = line.partition(":")
                header_list.append((name.strip().lower(), value.strip()))
            headers: dict[str, str] = {}
            for name, value in header_list:
                headers[name] = f"{headers[name]}, {value}" if name in headers else value
            if 100 <= status < 200:
                assert not lines or lines == [""], f"1xx with headers: {head!r}"
                interim.append(status)
                continue
            if status in (204, 304) or method == "HEAD":
                body = b""
            elif "content-length" in headers:
                body = self._exactly(int(headers["content-length"]))
            elif headers.get("transfer-encoding") == "chunked":
                parts = []
                while True:
                    size = int(self._until(b"\r\n"), 16)
                    if size == 0:
                        self._until(b"\r\n")
                        break
                    parts.append(self._exactly(size))
                    assert self._exactly(2) == b"\r\n"
                body = b"".join(parts)
            else:
                while self._fill():
                    pass
                body, self.buf = self.buf, b""
            return Response(status, reason[0] if reason else "", headers, header_list, body,
                            interim)

    def closed(self, timeout: float = 5.0) -> bool:
        """True when the server closes the connection (EOF) with nothing more to read."""
        if self.buf:
            return False
        if self.eof:
            return True
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
        if data:
            self.buf += data
            return False
        self.eof = True
        return True


def exchange(port: int, raw: bytes | str, method: str = "GET",
             wait: float = 5.0) -> tuple[Response, bool]:
    """One request on a fresh connection: the response, and whether the server closed."""
    with RawConn(port) as conn:
        conn.send(raw)
        response = conn.read_response(method)
        return response, conn.closed(timeout=wait)


def check_error(response: Response, status: int, code: str) -> dict[str, Any]:
    assert response.status == status, (response.status, response.body)
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code, error
    message = error["message"]
    assert message[:1].isupper() and " " in message and "\n" not in message, message
    return error


def chat_body(**fields: Any) -> bytes:
    payload = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2, **fields}
    return json.dumps(payload).encode()


# --------------------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def screen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """API key, one allowed origin and host, small body and head limits."""
    proc = start_server(tmp_path_factory.mktemp("screen"), config=SCREEN_CONFIG)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def limits(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Small connection cap, short deadline, a buffered-bytes cap a few requests wide."""
    proc = start_server(tmp_path_factory.mktemp("limits"), config="""
[server]
max_connections = 8
idle_timeout = 1.5
max_request_body_bytes = 65536
max_header_bytes = 4096
max_buffered_request_bytes = 0
""")
    yield proc
    proc.stop()


# --------------------------------------------------------------------------- screening


def _head(method: str = "POST", path: str = CHAT, *, host: str = "localhost",
          extra: str = AUTH + JSON_CT, length: int = 20, expect: bool = True) -> str:
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{extra}"
    if length:
        head += f"Content-Length: {length}\r\n"
    if expect:
        head += "Expect: 100-continue\r\n"
    return head + "\r\n"


SCREENING = [
    # (id, head, status, code)
    ("host-foreign", _head(host="evil.example"), 421, "invalid_host"),
    ("host-foreign-port", _head(host="evil.example:80"), 421, "invalid_host"),
    ("host-lookalike", _head(host="localhost.evil.example"), 421, "invalid_host"),
    ("host-before-origin", _head(host="evil.example", extra=AUTH + JSON_CT
                                 + "Origin: http://evil.example\r\n"), 421, "invalid_host"),
    ("origin-foreign", _head(extra=AUTH + JSON_CT + "Origin: http://evil.example\r\n"),
     403, "origin_not_allowed"),
    ("origin-null", _head(extra=AUTH + JSON_CT + "Origin: null\r\n"), 403,
     "origin_not_allowed"),
    ("origin-before-route", _head(path="/v1/nope", extra="Origin: http://evil.example\r\n"),
     403, "origin_not_allowed"),
    ("route-unknown", _head(path="/v1/nope"), 404, "unknown_url"),
    # (an unknown route: /v1/completions is served now)
    ("route-before-auth", _head(path="/v1/engines/davinci/completions", extra=JSON_CT), 404,
     "unknown_url"),
    ("method-wrong", _head(method="PUT"), 405, "method_not_allowed"),
    ("method-before-auth", _head(method="DELETE", extra=""), 405, "method_not_allowed"),
    ("auth-missing", _head(extra=JSON_CT), 401, "invalid_api_key"),
    ("auth-wrong", _head(extra="Authorization: Bearer sk-wrong\r\n" + JSON_CT), 401,
     "invalid_api_key"),
    ("auth-prefix", _head(extra=f"Authorization: Bearer {KEY[:-1]}\r\n" + JSON_CT), 401,
     "invalid_api_key"),
    ("auth-not-bearer", _head(extra=f"Authorization: Basic {KEY}\r\n" + JSON_CT), 401,
     "invalid_api_key"),
    ("auth-models", _head(method="GET", path="/v1/models", extra="", length=0,
                          expect=False), 401, "invalid_api_key"),
    ("auth-root-chat", _head(path="/chat/completions", extra=JSON_CT), 401,
     "invalid_api_key"),
    ("auth-before-media", _head(extra="Content-Type: text/plain\r\n"), 401,
     "invalid_api_key"),
    ("media-text", _head(extra=AUTH + "Content-Type: text/plain\r\n"), 415,
     "unsupported_media_type"),
    ("media-missing", _head(extra=AUTH), 415, "unsupported_media_type"),
    ("media-form", _head(extra=AUTH + "Content-Type: application/x-www-form-urlencoded\r\n"),
     415, "unsupported_media_type"),
    ("media-before-size", _head(extra=AUTH + "Content-Type: text/plain\r\n",
                                length=BODY_LIMIT + 1), 415, "unsupported_media_type"),
    ("body-too-large", _head(length=BODY_LIMIT + 1), 413, "malformed_request"),
    ("body-huge", _head(length=10**30), 413, "malformed_request"),
    ("cancel-too-large", _head(path=f"{CHAT}/abc/cancel", length=BODY_LIMIT + 1), 413,
     "malformed_request"),
]


@pytest.mark.parametrize(("head", "status", "code"), [c[1:] for c in SCREENING],
                         ids=[c[0] for c in SCREENING])
def test_screening_before_body(screen: ServerProcess, head: str, status: int,
                               code: str) -> None:
    """The answer comes before the announced body, without 100 Continue, then a close."""
    with RawConn(screen.port) as conn:
        conn.send(head)  # the announced body is never sent
        response = conn.read_response()
        check_error(response, status, code)
        assert response.interim == []
        assert response.headers["connection"] == "close"
        assert conn.closed()
    if status == 405:
        assert response.headers["allow"] == "POST"
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"
    if status == 421:
        assert response.reason == "Misdirected Request"


@pytest.mark.parametrize("host", ["localhost", "localhost:9999", "127.0.0.1", "127.0.0.1:1",
                                  "[::1]", "[::1]:9999", "LOCALHOST", "api.example",
                                  "api.example:443", "localhost:", "localhost:65535"])
def test_allowed_hosts(screen: ServerProcess, host: str) -> None:
    raw = f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    response, closed = exchange(screen.port, raw)
    assert response.status == 200, response.body
    assert closed


def test_health_is_open_and_valid_key_passes(screen: ServerProcess) -> None:
    with RawConn(screen.port) as conn:
        conn.send("GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert conn.read_response().status == 200
        conn.send(f"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n{AUTH}\r\n")
        response = conn.read_response()
        assert response.status == 200
        assert response.json()["object"] == "list"


def test_bodiless_post_needs_no_content_type(screen: ServerProcess) -> None:
    raw = f"POST {CHAT}/nothing-here/cancel HTTP/1.1\r\nHost: localhost\r\n{AUTH}\r\n"
    with RawConn(screen.port) as conn:
        conn.send(raw)
        response = conn.read_response()
        assert response.status == 404
        assert response.json()["cancelled"] is False
        assert not conn.closed(timeout=0.3)  # a handler's answer keeps the connection


def test_json_with_charset_is_accepted(screen: ServerProcess) -> None:
    body = chat_body()
    raw = (f"POST {CHAT} HTTP/1.1\r\nHost: localhost\r\n{AUTH}"
           f"Content-Type: Application/JSON; charset=utf-8\r\n"
           f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    response, _ = exchange(screen.port, raw, "POST", wait=0.01)
    assert response.status == 200, response.body


# --------------------------------------------------------------------------- CORS


def test_preflight(screen: ServerProcess) -> None:
    raw = (f"OPTIONS {CHAT} HTTP/1.1\r\nHost: localhost\r\nOrigin: {GOOD_ORIGIN}\r\n"
           "Access-Control-Request-Method: POST\r\n"
           "Access-Control-Request-Headers: authorization, content-type\r\n\r\n")
    with RawConn(screen.port) as conn:
        conn.send(raw)
        response = conn.read_response("OPTIONS")
        assert response.status == 204
        assert response.body == b""
        assert "content-length" not in response.headers
        assert "transfer-encoding" not in response.headers
        assert response.headers["access-control-allow-origin"] == GOOD_ORIGIN
        assert "POST" in response.headers["access-control-allow-methods"]
        allowed = {h.strip().lower()
                   for h in response.headers["access-control-allow-headers"].split(",")}
        assert {"authorization", "content-type", "x-request-id", "x-afm-profile"} <= allowed
        assert int(response.headers["access-control-max-age"]) > 0
        assert response.headers["vary"] == "Origin"
        # The connection stays usable for the real request.
        conn.send(f"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n{AUTH}"
                  f"Origin: {GOOD_ORIGIN}\r\n\r\n")
        follow = conn.read_response()
        assert follow.status == 200
        assert follow.headers["access-control-allow-origin"] == GOOD_ORIGIN


def test_preflight_from_foreign_origin_refused(screen: ServerProcess) -> None:
    raw = (f"OPTIONS {CHAT} HTTP/1.1\r\nHost: localhost\r\nOrigin: http://evil.example\r\n"
           "Access-Control-Request-Method: POST\r\n\r\n")
    response, closed = exchange(screen.port, raw, "OPTIONS")
    check_error(response, 403, "origin_not_allowed")
    assert "access-control-allow-origin" not in response.headers
    assert closed


def test_allowed_origin_headers_on_responses(screen: ServerProcess) -> None:
    body = chat_body(stream=True)
    raw = (f"POST {CHAT} HTTP/1.1\r\nHost: localhost\r\n{AUTH}{JSON_CT}"
           f"Origin: {GOOD_ORIGIN}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    with RawConn(screen.port) as conn:
        conn.send(raw)
        response = conn.read_response("POST")
        assert response.status == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["access-control-allow-origin"] == GOOD_ORIGIN
        assert "origin" in response.headers["vary"].lower()
        exposed = {h.strip().lower()
                   for h in response.headers["access-control-expose-headers"].split(",")}
        assert {"x-request-id", "openai-request-id", "x-grammar-constraints",
                "x-afm-trimmed-messages"} <= exposed
        assert parse_sse(response.body.decode())[-1] == "[DONE]"
        # An error from a handler carries them too, so a page can read it.
        bad = b"{"
        conn.send((f"POST {CHAT} HTTP/1.1\r\nHost: localhost\r\n{AUTH}{JSON_CT}"
                   f"Origin: {GOOD_ORIGIN}\r\nContent-Length: 1\r\n\r\n").encode() + bad)
        error = conn.read_response("POST")
        check_error(error, 400, "invalid_json")
        assert error.headers["access-control-allow-origin"] == GOOD_ORIGIN
    # And so does a refusal by the gate after the origin check.
    refused, _ = exchange(screen.port, f"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n"
                                       f"Origin: {GOOD_ORIGIN}\r\n\r\n")
    check_error(refused, 401, "invalid_api_key")
    assert refused.headers["access-control-allow-origin"] == GOOD_ORIGIN


def test_no_cors_headers_without_origin(screen: ServerProcess) -> None:
    response, _ = exchange(screen.port, "GET /health HTTP/1.1\r\nHost: localhost\r\n"
                                        "Connection: close\r\n\r\n")
    assert "access-control-allow-origin" not in response.headers


# --------------------------------------------------------------------------- strict framing

H = "Host: localhost\r\n"
GET = "GET /health HTTP/1.1\r\n"
POST_HEAD = f"POST {CHAT} HTTP/1.1\r\n{H}{AUTH}{JSON_CT}"
CHUNKED = POST_HEAD + "Transfer-Encoding: chunked\r\n\r\n"

MALFORMED = [
    # (id, raw request, status)
    ("cl-and-te", POST_HEAD + "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
     "0\r\n\r\n", 400),
    ("te-and-cl", POST_HEAD + "Transfer-Encoding: chunked\r\nContent-Length: 0\r\n\r\n", 400),
    ("cl-repeated-same", POST_HEAD + "Content-Length: 2\r\nContent-Length: 2\r\n\r\n{}", 400),
    ("cl-conflicting", POST_HEAD + "Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400),
    ("cl-list", POST_HEAD + "Content-Length: 2, 2\r\n\r\n{}", 400),
    ("cl-plus", POST_HEAD + "Content-Length: +2\r\n\r\n{}", 400),
    ("cl-minus", POST_HEAD + "Content-Length: -2\r\n\r\n{}", 400),
    ("cl-hex", POST_HEAD + "Content-Length: 0x2\r\n\r\n{}", 400),
    ("cl-underscore", POST_HEAD + "Content-Length: 1_0\r\n\r\n{}", 400),
    ("cl-fullwidth", (POST_HEAD + "Content-Length: ").encode() + "２".encode()
     + b"\r\n\r\n{}", 400),
    ("cl-empty", POST_HEAD + "Content-Length:\r\n\r\n", 400),
    ("space-before-colon", GET + "Host : localhost\r\n\r\n", 400),
    ("tab-before-colon", GET + H + "X-A\t: 1\r\n\r\n", 400),
    ("obs-fold", GET + H + "X-A: 1\r\n 2\r\n\r\n", 400),
    ("obs-fold-tab", GET + H + "X-A: 1\r\n\t2\r\n\r\n", 400),
    ("obs-fold-colon", GET + H + "X-A: 1\r\n X-B: 2\r\n\r\n", 400),
    ("nul-in-value", GET + H + "X-A: a\x00b\r\n\r\n", 400),
    ("cr-in-value", GET + H + "X-A: a\rb\r\n\r\n", 400),
    ("lf-in-value", GET + H + "X-A: a\nb\r\n\r\n", 400),
    ("nul-in-name", GET + H + "X-\x00A: 1\r\n\r\n", 400),
    ("cr-in-name", GET + H + "X\r-A: 1\r\n\r\n", 400),
    ("no-colon", GET + H + "X-A\r\n\r\n", 400),
    ("empty-name", GET + H + ": 1\r\n\r\n", 400),
    ("bare-lf-lines", "GET /health HTTP/1.1\nHost: localhost\n\n", 400),
    ("host-missing", GET + "\r\n", 400),
    ("host-duplicate", GET + H + H + "\r\n", 400),
    ("host-duplicate-foreign", GET + H + "Host: evil.example\r\n\r\n", 400),
    ("host-invalid", GET + "Host: local host\r\n\r\n", 400),
    ("host-userinfo", GET + "Host: user@localhost\r\n\r\n", 400),
    ("host-port-out-of-range", GET + "Host: localhost:99999\r\n\r\n", 400),
    ("host-port-sign", GET + "Host: localhost:-1\r\n\r\n", 400),
    ("ctl-in-value", GET + H + "X-A: \x1fa\r\n\r\n", 400),
    ("vt-in-value", GET + H + "X-A: \x0ba\r\n\r\n", 400),
    ("chunk-plus", CHUNKED + "+2\r\n{}\r\n0\r\n\r\n", 400),
    ("chunk-minus-zero", CHUNKED + "-0\r\n\r\n", 400),
    ("chunk-0x", CHUNKED + "0x2\r\n{}\r\n0\r\n\r\n", 400),
    ("chunk-fullwidth", CHUNKED.encode() + "２".encode() + b"\r\n{}\r\n0\r\n\r\n", 400),
    ("chunk-leading-space", CHUNKED + " 2\r\n{}\r\n0\r\n\r\n", 400),
    ("chunk-trailing-space", CHUNKED + "2 \r\n{}\r\n0\r\n\r\n", 400),
    ("chunk-empty-size", CHUNKED + "\r\n{}\r\n0\r\n\r\n", 400),
    ("chunk-underscore", CHUNKED + "1_0\r\n", 400),
    ("chunk-no-crlf-after-data", CHUNKED + "2\r\n{}XX0\r\n\r\n", 400),
    ("chunk-lf-after-data", CHUNKED + "2\r\n{}\n0\r\n\r\n", 400),
    ("chunk-bare-lf-size", CHUNKED + "2\n{}\r\n0\r\n\r\n", 400),
    ("chunk-trailer-fold", CHUNKED + "2\r\n{}\r\n0\r\nX-T: 1\r\n 2\r\n\r\n", 400),
    ("chunk-trailer-nul", CHUNKED + "2\r\n{}\r\n0\r\nX-T: \x00\r\n\r\n", 400),
    ("te-http10", f"POST {CHAT} HTTP/1.0\r\n{H}{AUTH}{JSON_CT}"
     "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    ("te-empty", POST_HEAD + "Transfer-Encoding:\r\n\r\n", 400),
    ("te-gzip", POST_HEAD + "Transfer-Encoding: gzip\r\n\r\n", 501),
    ("te-gzip-chunked", POST_HEAD + "Transfer-Encoding: gzip, chunked\r\n\r\n", 501),
    ("te-chunked-twice", POST_HEAD + "Transfer-Encoding: chunked\r\n"
     "Transfer-Encoding: chunked\r\n\r\n", 501),
    ("te-identity", POST_HEAD + "Transfer-Encoding: identity\r\n\r\n", 501),
    ("te-chunked-suffix", POST_HEAD + "Transfer-Encoding: chunkedx\r\n\r\n", 501),
    ("version-lower", "GET /health http/1.1\r\n" + H + "\r\n", 400),
    ("version-letters", "GET /health HTTP/1.x\r\n" + H + "\r\n", 400),
    ("version-fullwidth", b"GET /health HTTP/" + "１".encode() + b".1\r\n"
     + H.encode() + b"\r\n", 400),
    ("version-no-minor", "GET /health HTTP/1\r\n" + H + "\r\n", 400),
    ("version-long", "GET /health HTTP/1.10\r\n" + H + "\r\n", 400),
    ("version-https", "GET /health HTTPS/1.1\r\n" + H + "\r\n", 400),
    ("request-line-extra-space", "GET  /health HTTP/1.1\r\n" + H + "\r\n", 400),
    ("request-line-tab", "GET\t/health HTTP/1.1\r\n" + H + "\r\n", 400),
    ("request-line-short", "GET /health\r\n" + H + "\r\n", 400),
    ("target-absolute-https", "GET https://localhost/health HTTP/1.1\r\n" + H + "\r\n", 400),
    ("target-absolute-userinfo", "GET http://u@localhost/health HTTP/1.1\r\n" + H + "\r\n",
     400),
    ("target-absolute-port", "GET http://localhost:65536/health HTTP/1.1\r\n" + H + "\r\n",
     400),
    ("target-absolute-no-host-header", "GET http://localhost/health HTTP/1.1\r\n\r\n", 400),
    ("target-non-ascii", b"GET /health" + "é".encode() + b" HTTP/1.1\r\n"
     + H.encode() + b"\r\n", 400),
    ("method-not-token", "G(T /health HTTP/1.1\r\n" + H + "\r\n", 400),
    ("head-too-large", GET + H + "X-Big: " + "a" * HEAD_LIMIT + "\r\n\r\n", 431),
    ("head-too-large-unterminated", GET + H + "X-Big: " + "a" * (HEAD_LIMIT + 10), 431),
    ("trailer-too-large", CHUNKED + "2\r\n{}\r\n0\r\nX-Big: " + "a" * HEAD_LIMIT
     + "\r\n\r\n", 431),
    ("chunked-too-large", CHUNKED + f"{BODY_LIMIT:x}\r\n" + "a" * BODY_LIMIT + "\r\n"
     "1\r\na\r\n0\r\n\r\n", 413),
    ("chunk-size-huge", CHUNKED + "f" * 40 + "\r\n", 413),
    ("expect-unknown", POST_HEAD + "Content-Length: 2\r\nExpect: 200-ok\r\n\r\n", 417),
    ("version-2", "GET /health HTTP/2.0\r\n" + H + "\r\n", 505),
]

CODES = {400: "malformed_request", 413: "malformed_request", 417: "malformed_request",
         431: "malformed_request", 501: "malformed_request", 505: "malformed_request"}


@pytest.mark.parametrize(("raw", "status"), [c[1:] for c in MALFORMED],
                         ids=[c[0] for c in MALFORMED])
def test_malformed_framing(screen: ServerProcess, raw: str | bytes, status: int) -> None:
    with RawConn(screen.port) as conn:
        conn.send(raw)
        response = conn.read_response()
        check_error(response, status, CODES[status])
        assert response.interim == []
        assert response.headers["connection"] == "close"
        assert conn.closed()
    if status == 431:
        assert response.reason == "Request Header Fields Too Large"


def test_control_bytes_in_values_are_refused(screen: ServerProcess) -> None:
    """Only visible bytes (obs-text included), SP and HTAB make a value: an ESC or DEL is a
    400, as is a \\x1f that Python's str.strip() would silently drop."""
    raw = GET.encode() + H.encode() + b"User-Agent: a\x1b[2Jb\x7f\xff\r\nConnection: close\r\n\r\n"
    response, closed = exchange(screen.port, raw)
    check_error(response, 400, "malformed_request")
    assert closed
    for value in (b"\x1fabc", b"a\x1bb"):
        bad_id = (f"GET /v1/models HTTP/1.1\r\n{H}{AUTH}").encode() + b"X-Request-ID: " + value
        response, _ = exchange(screen.port, bad_id + b"\r\n\r\n", wait=0.01)
        check_error(response, 400, "malformed_request")
    raw = GET.encode() + H.encode() + b"User-Agent: a\tb\xff\xc2\xa0\r\nConnection: close\r\n\r\n"
    response, _ = exchange(screen.port, raw)
    assert response.status == 200


def test_smuggled_request_never_runs(screen: ServerProcess) -> None:
    """CL.TE: a front end honouring Content-Length would forward the 'G...' as a request."""
    smuggled = f"GET /v1/models HTTP/1.1\r\n{H}{AUTH}\r\n"
    raw = (POST_HEAD + f"Content-Length: {len(smuggled) + 5}\r\n"
           "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled)
    with RawConn(screen.port) as conn:
        conn.send(raw)
        response = conn.read_response()
        check_error(response, 400, "malformed_request")
        assert conn.closed()  # nothing else was answered


def test_chunked_body_is_dechunked(screen: ServerProcess) -> None:
    body = chat_body()
    parts = [body[:7], body[7:20], body[20:]]
    chunks = "".join(f"{len(p):X};ext=1\r\n{p.decode()}\r\n" for p in parts)
    raw = CHUNKED + chunks + "0\r\nX-Trailer: dropped\r\n\r\n"
    with RawConn(screen.port) as conn:
        conn.send(raw[: len(raw) // 2])  # in two pieces, split anywhere
        time.sleep(0.05)
        conn.send(raw[len(raw) // 2:])
        response = conn.read_response("POST")
        assert response.status == 200, response.body
        assert response.json()["object"] == "chat.completion"
        assert not conn.closed(timeout=0.2)


def test_chunk_extension_after_whitespace_is_allowed(screen: ServerProcess) -> None:
    body = chat_body()
    raw = CHUNKED + f"{len(body):x} ;name=value\r\n{body.decode()}\r\n0\r\n\r\n"
    response, _ = exchange(screen.port, raw, "POST", wait=0.01)
    assert response.status == 200, response.body


# --------------------------------------------------------------------------- HTTP/1.1 features


def test_keep_alive_and_pipelining(screen: ServerProcess) -> None:
    with RawConn(screen.port) as conn:
        for _ in range(3):  # sequential requests on one connection
            conn.send(GET + H + "\r\n")
            response = conn.read_response()
            assert response.status == 200
            assert response.headers["connection"] == "keep-alive"
        body = chat_body()
        post = (POST_HEAD + f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        # Pipelined: all at once, answered in order; a refusal at the end closes.
        conn.send(GET.encode() + H.encode() + b"\r\n" + post
                  + f"GET /v1/models HTTP/1.1\r\n{H}{AUTH}\r\n".encode()
                  + f"PUT /health HTTP/1.1\r\n{H}\r\n".encode()
                  + f"GET /health HTTP/1.1\r\n{H}\r\n".encode())
        assert conn.read_response().status == 200
        chat = conn.read_response("POST")
        assert chat.status == 200 and chat.json()["object"] == "chat.completion"
        assert conn.read_response().json()["object"] == "list"
        check_error(conn.read_response(), 405, "method_not_allowed")
        assert conn.closed()  # the request after the refusal is never answered


def test_pipelined_stream_then_refusal_do_not_interleave(screen: ServerProcess) -> None:
    body = chat_body(stream=True, max_tokens=20)
    raw = ((POST_HEAD + f"Content-Length: {len(body)}\r\n\r\n").encode() + body
           + b"GET /health HTTP/1.1\r\nHost: evil.example\r\n\r\n")
    with RawConn(screen.port) as conn:
        conn.send(raw)
        stream = conn.read_response("POST")
        assert stream.status == 200
        assert parse_sse(stream.body.decode())[-1] == "[DONE]"
        check_error(conn.read_response(), 421, "invalid_host")
        assert conn.closed()


def test_connection_close(screen: ServerProcess) -> None:
    with RawConn(screen.port) as conn:
        conn.send(GET + H + "Connection: close\r\n\r\n" + GET + H + "\r\n")
        response = conn.read_response()
        assert response.status == 200
        assert response.headers["connection"] == "close"
        assert conn.closed()


def test_http10(screen: ServerProcess) -> None:
    response, closed = exchange(screen.port, "GET /health HTTP/1.0\r\n\r\n")
    assert response.status == 200
    assert closed
    with RawConn(screen.port) as conn:
        conn.send("GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        assert conn.read_response().headers["connection"] == "keep-alive"
        conn.send("GET /health HTTP/1.0\r\nHost: localhost\r\n\r\n")
        assert conn.read_response().status == 200
        assert conn.closed()


def test_http10_foreign_host_refused(screen: ServerProcess) -> None:
    response, closed = exchange(screen.port, "GET /health HTTP/1.0\r\nHost: evil.example\r\n\r\n")
    check_error(response, 421, "invalid_host")
    assert closed


def test_expect_continue(screen: ServerProcess) -> None:
    body = chat_body()
    with RawConn(screen.port) as conn:
        conn.send(POST_HEAD + f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n")
        assert conn.read_interim() == b"HTTP/1.1 100 Continue"
        conn.send(body)
        response = conn.read_response("POST")
        assert response.status == 200, response.body
        assert response.interim == []  # exactly one 100, already read
        # Chunked with Expect too.
        conn.send(CHUNKED.replace("\r\n\r\n", "\r\nExpect: 100-continue\r\n\r\n"))
        assert conn.read_interim() == b"HTTP/1.1 100 Continue"
        conn.send(f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        assert conn.read_response("POST").status == 200


def test_expect_continue_without_body_gets_no_interim(screen: ServerProcess) -> None:
    with RawConn(screen.port) as conn:
        conn.send(GET + H + "Expect: 100-continue\r\n\r\n")
        response = conn.read_response()
        assert response.status == 200
        assert response.interim == []


def test_leading_empty_lines_are_ignored(screen: ServerProcess) -> None:
    response, _ = exchange(screen.port, "\r\n\r\n" + GET + H + "Connection: close\r\n\r\n")
    assert response.status == 200


def test_head_at_the_limit_is_accepted(screen: ServerProcess) -> None:
    base = GET + H + "Connection: close\r\nX-Pad: \r\n\r\n"
    raw = base.replace("X-Pad: ", "X-Pad: " + "a" * (HEAD_LIMIT - len(base)))
    assert len(raw) == HEAD_LIMIT
    response, _ = exchange(screen.port, raw)
    assert response.status == 200
    response, _ = exchange(screen.port, raw.replace("X-Pad: ", "X-Pad: a"))
    assert response.status == 431


def test_body_at_the_limit_is_accepted(screen: ServerProcess) -> None:
    body = chat_body()
    body = body[:-1] + b" " * (BODY_LIMIT - len(body)) + b"}"
    assert len(body) == BODY_LIMIT
    raw = (POST_HEAD + f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    response, _ = exchange(screen.port, raw, "POST", wait=0.01)
    assert response.status == 200, response.body


# --------------------------------------------------------------------------- limits


def test_slowloris_is_cut_by_the_deadline(limits: ServerProcess) -> None:
    """A request trickling a byte at a time is answered 408 idle_timeout after its start."""
    raw = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 100
    with RawConn(limits.port) as conn:
        started = time.monotonic()
        answered = threading.Event()

        def trickle() -> None:
            for byte in raw:
                if answered.is_set():
                    return
                with contextlib.suppress(OSError):
                    conn.sock.send(bytes([byte]))
                time.sleep(0.1)

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        response = conn.read_response()
        answered.set()
        elapsed = time.monotonic() - started
        check_error(response, 408, "request_timeout")
        assert 1.3 < elapsed < 3.0, elapsed
        assert conn.closed()
        sender.join(5)


def test_keep_alive_idle_connection_is_closed(limits: ServerProcess) -> None:
    with RawConn(limits.port) as conn:
        conn.send(GET + H + "\r\n")
        assert conn.read_response().status == 200
        started = time.monotonic()
        assert conn.closed(timeout=5)
        assert 1.2 < time.monotonic() - started < 3.5


def test_slow_but_timely_request_passes(limits: ServerProcess) -> None:
    raw = (GET + H + "Connection: close\r\n\r\n").encode()
    with RawConn(limits.port) as conn:
        for i in range(0, len(raw), 10):
            conn.send(raw[i:i + 10])
            time.sleep(0.05)
        assert conn.read_response().status == 200


UPLOAD = f"POST {CHAT} HTTP/1.1\r\n{H}{JSON_CT}Content-Length: 100\r\n\r\n{{"


def test_connection_cap(limits: ServerProcess) -> None:
    """With every slot busy (requests whose bodies are on their way are never shed, see
    tests/test_slowloris.py for what is), a newcomer's request gets 503."""
    held: list[RawConn] = []
    time.sleep(0.3)  # connections from earlier tests are gone
    try:
        for _ in range(7):
            conn = RawConn(limits.port)
            conn.send(UPLOAD)
            held.append(conn)
        held.append(RawConn(limits.port))
        held[-1].send(GET + H + "\r\n")  # the 8th is a real, working connection
        assert held[-1].read_response().status == 200
        held[-1].send(UPLOAD)
        time.sleep(0.1)
        with RawConn(limits.port) as extra:
            extra.send(GET + H + "\r\n")
            response = extra.read_response()
            check_error(response, 503, "too_many_connections")
            assert int(response.headers["retry-after"]) >= 1
            assert response.headers["connection"] == "close"
            assert extra.closed()
        held.pop(0).close()
        time.sleep(0.2)
        with RawConn(limits.port) as again:
            again.send(GET + H + "Connection: close\r\n\r\n")
            assert again.read_response().status == 200
    finally:
        for conn in held:
            conn.close()


def test_buffered_bytes_cap(limits: ServerProcess) -> None:
    """Partial uploads on several connections share one cap (here 64 KiB + 4 KiB + 256 KiB)."""
    head = (f"POST {CHAT} HTTP/1.1\r\n{H}{JSON_CT}Content-Length: 65536\r\n\r\n").encode()
    part = head + b" " * 60000
    held: list[RawConn] = []
    time.sleep(0.3)  # connections from earlier tests are gone
    try:
        for _ in range(5):  # 5 x ~60 KB = ~300 KB, under the ~324 KiB cap
            conn = RawConn(limits.port)
            conn.send(part)
            held.append(conn)
        time.sleep(0.3)
        for conn in held:
            assert not conn.closed(timeout=0.05)
        with RawConn(limits.port) as extra:
            extra.send(part)  # would take it past the cap
            response = extra.read_response()
            check_error(response, 503, "server_overloaded")
            assert extra.closed()
        # The held uploads are intact: finish one and it is answered by the handler.
        held[0].send(b" " * (65536 - 60000))
        check_error(held[0].read_response("POST"), 400, "invalid_json")
    finally:
        for conn in held:
            conn.close()
    time.sleep(0.3)
    with RawConn(limits.port) as conn:  # the bytes were released with the connections
        conn.send(part + b" " * (65536 - 60000))
        check_error(conn.read_response("POST"), 400, "invalid_json")


def test_default_connection_cap_is_64(tmp_path: Path) -> None:
    proc = start_server(tmp_path, ready=False)
    held: list[RawConn] = []
    try:
        for _ in range(64):
            held.append(RawConn(proc.port))
            held[-1].send(UPLOAD)  # busy: never shed
        time.sleep(0.2)
        with RawConn(proc.port) as extra:
            extra.send(GET + H + "\r\n")
            check_error(extra.read_response(), 503, "too_many_connections")
            assert extra.closed()
        held.pop(0).close()
        time.sleep(0.2)
        with RawConn(proc.port) as again:
            again.send(GET + H + "Connection: close\r\n\r\n")
            assert again.read_response().status in (200, 503)  # 503: model still loading
    finally:
        for conn in held:
            conn.close()
        proc.stop()


# --------------------------------------------------------------------------- shutdown


def _refused_soon(port: int, within: float = 2.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return True
        time.sleep(0.02)
    return False


#: Servers whose exit code a test asserts dump every thread's stack if they abort.
DIAGNOSE = {"PYTHONFAULTHANDLER": "1"}


def test_sigterm_drains_a_running_stream(tmp_path: Path) -> None:
    proc = start_server(tmp_path, env=DIAGNOSE)
    body = chat_body(stream=True, max_tokens=300, temperature=0)
    raw = (f"POST {CHAT} HTTP/1.1\r\n{H}{JSON_CT}Content-Length: {len(body)}\r\n\r\n"
           ).encode() + body
    try:
        with RawConn(proc.port) as conn:
            conn.send(raw)
            conn.sock.settimeout(30)
            while b"\r\n\r\n" not in conn.buf or b"data: " not in conn.buf:
                assert conn._fill()
            proc.proc.send_signal(signal.SIGTERM)
            before = conn.buf.count(b"data: ")
            proc.wait_event("stopping", timeout=10)
            assert _refused_soon(proc.port)  # the listener closes as the drain begins
            response = conn.read_response("POST")
            assert response.status == 200
            events = parse_sse(response.body.decode())
            assert events[-1] == "[DONE]"
            assert events[-2]["choices"][0]["finish_reason"] in ("length", "stop")
            assert len(events) - 1 > before  # it kept streaming after SIGTERM
        assert proc.proc.wait(30) == 0, proc.log_text()[-4000:]
    finally:
        proc.stop()
