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
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import DIAGNOSE, ServerProcess, parse_sse, start_server
from helpers.raw_http import RawConn, chat_body, check_error, exchange
from helpers.screening import (
    AUTH,
    BODY_LIMIT,
    CHAT,
    CHUNKED,
    CODES,
    GET,
    GOOD_ORIGIN,
    HEAD_LIMIT,
    JSON_CT,
    MALFORMED,
    POST_HEAD,
    SCREEN_CONFIG,
    SCREENING,
    H,
)

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
    if "Content-Encoding" in head:
        assert response.headers["accept-encoding"] == "identity"
        assert "uncompressed" in response.json()["error"]["message"]


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
                "x-afm-trimmed-messages", "retry-after", "x-should-retry"} <= exposed
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


def test_answers_carry_no_empty_header(screen: ServerProcess) -> None:
    """Sanic puts an empty ``alt-svc`` on every answer it writes, for a start-up pass
    (its touchup) to fill or drop; with that pass off, as afmd runs Sanic, it went out
    as sent: not an Alt-Svc value (RFC 7838 section 3: ``clear`` or alternatives), and on
    every answer a client's SDK shows it. An answer, a stream, a direct one, an error."""
    body, streamed = chat_body(), chat_body(stream=True, max_tokens=2)
    with RawConn(screen.port) as conn:
        conn.send((POST_HEAD + f"Content-Length: {len(body)}\r\n\r\n").encode() + body
                  + (POST_HEAD + f"Content-Length: {len(streamed)}\r\n\r\n").encode()
                  + streamed + f"GET /v1/models HTTP/1.1\r\n{H}{AUTH}\r\n".encode()
                  + f"GET /v1/models/nope HTTP/1.1\r\n{H}{AUTH}\r\n".encode())
        answers = [conn.read_response("POST"), conn.read_response("POST"),
                   conn.read_response(), conn.read_response()]
    assert [a.status for a in answers] == [200, 200, 200, 404]
    for answer in answers:
        assert all(value for _, value in answer.header_list), answer.header_list
        assert "alt-svc" not in answer.headers


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


@pytest.mark.parametrize("connection", ["", "Connection: keep-alive\r\n"])
def test_http10_stream_ends_with_the_connection(screen: ServerProcess, connection: str) -> None:
    """HTTP/1.0 has no chunked coding (a server must not send it Transfer-Encoding, RFC
    9112 6.1): a stream of unknown length is delimited by the close, whatever keep-alive
    the client asked for."""
    body = chat_body(stream=True, max_tokens=5)
    head = POST_HEAD.replace(" HTTP/1.1", " HTTP/1.0")
    response, closed = exchange(
        screen.port, (head + connection + f"Content-Length: {len(body)}\r\n\r\n").encode()
        + body, method="POST")
    assert response.status == 200
    assert "transfer-encoding" not in response.headers, response.headers
    assert "content-length" not in response.headers
    assert response.headers["connection"] == "close"
    assert parse_sse(response.body.decode())[-1] == "[DONE]"
    assert closed
    # A whole answer keeps its length, and the keep-alive the client asked for.
    plain = chat_body(max_tokens=2)
    with RawConn(screen.port) as conn:
        conn.send((head + connection + f"Content-Length: {len(plain)}\r\n\r\n").encode()
                  + plain)
        answer = conn.read_response("POST")
        assert answer.status == 200
        assert int(answer.headers["content-length"]) == len(answer.body)
        assert answer.json()["object"] == "chat.completion"


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_keep_alive_idle_connection_is_closed(limits: ServerProcess) -> None:
    with RawConn(limits.port) as conn:
        conn.send(GET + H + "\r\n")
        assert conn.read_response().status == 200
        started = time.monotonic()
        assert conn.closed(timeout=5)
        assert 1.2 < time.monotonic() - started < 3.5


@pytest.mark.slow
def test_slow_but_timely_request_passes(limits: ServerProcess) -> None:
    raw = (GET + H + "Connection: close\r\n\r\n").encode()
    with RawConn(limits.port) as conn:
        for i in range(0, len(raw), 10):
            conn.send(raw[i:i + 10])
            time.sleep(0.05)
        assert conn.read_response().status == 200


UPLOAD = f"POST {CHAT} HTTP/1.1\r\n{H}{JSON_CT}Content-Length: 100\r\n\r\n{{"


@pytest.mark.slow
def test_connection_cap(limits: ServerProcess) -> None:
    """With every slot busy (requests whose bodies are on their way are never shed, see
    tests/server/test_slowloris.py for what is), a newcomer's request gets 503."""
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
