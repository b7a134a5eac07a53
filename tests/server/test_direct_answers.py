"""``GET /health`` and ``GET /v1/models`` answered by the connection protocol, not Sanic.

The gate marks a screened, bodiless GET of a state route as :class:`Direct`, and the
protocol writes the route's answer itself. These tests pin down that nothing else changes:
the same status, body and headers as Sanic's path for the same request (a request with a
one-byte body still goes through Sanic, to the same handler), keep-alive and
``Connection: close``, answers in order behind pipelined requests Sanic handles, the
same access-log event, truthful counts in ``/health``, and a client that does not read.

Sanic's path adds an empty ``alt-svc`` header (a leftover of its disabled touch-up, and
not a valid Alt-Svc value); the direct path does not, which is also how these tests tell
which path answered.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sanic import Sanic

from afmd.config.load import load_config
from afmd.http.routes.state_routes import StateRoute
from afmd.http.sansio.gate import Direct, Forward, Gate
from afmd.http.sansio.screen import CORS_EXPOSE_HEADERS, GatePolicy
from afmd.http.transport.connection import direct_routes
from afmd.server import Server

from conftest import ServerProcess, parse_sse, start_server
from helpers.inprocess import InProcessServer
from helpers.raw_http import RawConn, Response, chat_body, check_error

KEY = "sk-direct-test"
ORIGIN = "http://good.example"
H = "Host: localhost\r\n"
AUTH = f"Authorization: Bearer {KEY}\r\n"
CHAT = "/v1/chat/completions"

CONFIG = f"""
[server]
api_key = "{KEY}"
allowed_origins = ["{ORIGIN}"]

[queue]
max_concurrent_requests = 1
max_queued_requests = 4

[log]
access_log = true

[models.aliases]
"gpt-4o-mini" = "demo"
"""


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("direct"), config=CONFIG)
    yield proc
    proc.stop()


def direct(resp: Response) -> bool:
    """Whether the protocol answered: its head (afmd.http.sansio.wire.render_json) opens
    with content-type, where Sanic's opens with the X-Request-ID its response middleware
    sets on every answer."""
    return next(iter(resp.headers)) == "content-type"


def get(path: str, extra: str = "", version: str = "HTTP/1.1") -> str:
    return f"GET {path} {version}\r\n{H}{extra}\r\n"


def via_sanic(path: str, extra: str = "", version: str = "HTTP/1.1") -> str:
    """The same GET with a one-byte body, which the gate hands to Sanic."""
    return f"GET {path} {version}\r\n{H}{extra}Content-Length: 1\r\n\r\nx"


def ask(port: int, raw: str) -> Response:
    with RawConn(port) as conn:
        conn.send(raw)
        return conn.read_response()


def ask_closed(port: int, raw: str) -> tuple[Response, bool]:
    """The response, and whether the server closed the connection after it: a connection
    still open is waited on for 0.3 s, so only the tests that assert it ask."""
    with RawConn(port) as conn:
        conn.send(raw)
        resp = conn.read_response()
        return resp, conn.closed(timeout=0.3)


def comparable(resp: Response) -> tuple[int, Any, dict[str, str]]:
    """The answer less its request id (a fresh one each time: checked apart)."""
    headers = {k: v for k, v in resp.headers.items() if k != "x-request-id"}
    return resp.status, resp.json(), headers


def post_chat(extra: str = "", **fields: Any) -> bytes:
    body = chat_body(**fields)
    return (f"POST {CHAT} HTTP/1.1\r\n{H}{AUTH}{extra}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


# --------------------------------------------------------------------------- the gate


def _route(method: str, path: str) -> tuple[int, tuple[str, ...]]:
    if path in ("/health", "/health/", "/v1/models"):
        return (200, ()) if method == "GET" else (405, ("GET",))
    return 404, ()


PLAIN = GatePolicy(route=_route, allowed_origins=frozenset({ORIGIN}))
DIRECT = GatePolicy(route=_route, allowed_origins=frozenset({ORIGIN}),
                    direct_paths=frozenset({"/health", "/v1/models"}))


@pytest.mark.parametrize(("raw", "close", "cors"), [
    (get("/health"), False, False),
    (get("/v1/models?limit=1", "X-Request-ID: abc\r\n"), False, False),
    (get("/health", f"Origin: {ORIGIN}\r\n"), False, True),
    (get("/health", "Connection: close\r\n"), True, False),
    (get("/health", "Content-Length: 0\r\n"), False, False),
    ("GET /health HTTP/1.0\r\n\r\n", True, False),
    ("GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", False, False),
])
def test_gate_marks_direct_requests(raw: str, close: bool, cors: bool) -> None:
    [forwarded] = Gate(PLAIN).feed(raw.encode())
    [out] = Gate(DIRECT).feed(raw.encode())
    assert isinstance(out, Direct)
    assert out.forward == forwarded  # what Sanic would get, if it must answer after all
    assert out.path == raw.split()[1].split("?")[0]
    assert out.close is close
    expected = ((("Access-Control-Allow-Origin", ORIGIN),
                 ("Access-Control-Expose-Headers", CORS_EXPOSE_HEADERS),
                 ("Vary", "Origin")) if cors else ())
    assert out.headers == expected


@pytest.mark.parametrize("raw", [
    via_sanic("/health"),
    f"GET /health HTTP/1.1\r\n{H}Transfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n",
    get("/health/"),
])
def test_gate_forwards_other_requests(raw: str) -> None:
    assert all(type(out) is Forward for out in Gate(DIRECT).feed(raw.encode()))


def test_empty_origin_gets_no_cors_headers() -> None:
    """With any origin allowed, an empty Origin is still no origin: no CORS headers on a
    direct answer or a refusal, as on Sanic's responses (one CORS rule for all three)."""
    anyone = GatePolicy(route=_route, allowed_origins=frozenset({"*"}),
                        direct_paths=frozenset({"/health", "/v1/models"}))
    [out] = Gate(anyone).feed(get("/health", "Origin: \r\n").encode())
    assert isinstance(out, Direct) and out.headers == ()
    [out] = Gate(anyone).feed(get("/nope", "Origin: \r\n").encode())
    assert b"access-control" not in getattr(out, "data", b"").lower()
    [out] = Gate(anyone).feed(get("/health", "Origin: http://x.example\r\n").encode())
    assert isinstance(out, Direct) and out.headers[0] == ("Access-Control-Allow-Origin",
                                                          "http://x.example")


def test_gate_refusals_come_first() -> None:
    """A direct path gets the same screening: refusals, not Direct."""
    [out] = Gate(DIRECT).feed(b"HEAD /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert not isinstance(out, Direct) and b" 405 " in getattr(out, "data", b"")
    [out] = Gate(DIRECT).feed(get("/health", "Origin: http://evil.example\r\n").encode())
    assert not isinstance(out, Direct) and b" 403 " in getattr(out, "data", b"")


# --------------------------------------------------------------------------- the server


@pytest.mark.parametrize(("path", "extra"), [
    ("/health", ""),
    ("/health?x=1", "X-Request-ID: client-id-1\r\n"),
    ("/health", f"Origin: {ORIGIN}\r\n"),
    ("/v1/models", AUTH),
    ("/v1/models?a=b", AUTH + "Origin: HTTP://GOOD.example/\r\n"),
    ("/health", "Connection: close\r\n"),
    ("/v1/models", AUTH + "Connection: close\r\n"),
])
def test_same_answer_as_sanic(srv: ServerProcess, path: str, extra: str) -> None:
    fast, fast_closed = ask_closed(srv.port, get(path, extra))
    slow, slow_closed = ask_closed(srv.port, via_sanic(path, extra))
    assert direct(fast) and not direct(slow)
    assert comparable(fast) == comparable(slow)
    assert fast.status == 200
    assert fast.headers["content-type"] == "application/json"
    assert int(fast.headers["content-length"]) == len(fast.body)
    # Both paths name the request: the client's id when it sent one, else a fresh one.
    sent = extra.split("X-Request-ID: ")[1].split("\r\n")[0] if "X-Request-ID" in extra \
        else None
    for answer in (fast, slow):
        assert answer.headers["x-request-id"] == sent if sent else \
            answer.headers["x-request-id"].startswith("req_")
    if "Origin" in extra:
        origin = extra.split("Origin: ")[1].split("\r\n")[0]
        assert fast.headers["access-control-allow-origin"] == origin
        assert fast.headers["vary"] == "Origin"
    else:
        assert "access-control-allow-origin" not in fast.headers
    closes = "Connection: close" in extra
    assert fast.headers["connection"] == ("close" if closes else "keep-alive")
    assert fast_closed is slow_closed is closes


def test_http10(srv: ServerProcess) -> None:
    for extra, closes in (("", True), ("Connection: keep-alive\r\n", False)):
        fast, fast_closed = ask_closed(srv.port, get("/health", extra, "HTTP/1.0"))
        slow, slow_closed = ask_closed(srv.port, via_sanic("/health", extra, "HTTP/1.0"))
        assert direct(fast) and comparable(fast) == comparable(slow)
        assert fast_closed is slow_closed is closes


def test_screening_still_applies(srv: ServerProcess) -> None:
    resp, closed = ask_closed(srv.port, get("/v1/models"))
    check_error(resp, 401, "invalid_api_key")
    assert closed
    resp = ask(srv.port, get("/health", "Origin: http://evil.example\r\n"))
    check_error(resp, 403, "origin_not_allowed")
    # HEAD gets GET's refusal without its content (RFC 9110): nothing follows the head.
    get_resp = ask(srv.port, f"PUT /health HTTP/1.1\r\n{H}Content-Length: 0\r\n\r\n")
    check_error(get_resp, 405, "method_not_allowed")
    for path in ("/health", "/metrics", "/v1/models", "/nope"):
        with RawConn(srv.port) as conn:
            conn.send(f"HEAD {path} HTTP/1.1\r\n{H}\r\n")
            resp = conn.read_response("HEAD")
            assert resp.status in (401, 404, 405), (path, resp.status)
            assert int(resp.headers["content-length"]) > 0, resp.headers
            assert conn.closed(timeout=2), f"HEAD {path}: content after the head: {conn.buf!r}"


def test_keep_alive_for_many_requests(srv: ServerProcess) -> None:
    with RawConn(srv.port) as conn:
        for i in range(200):
            conn.send(get("/health") if i % 2 else get("/v1/models", AUTH))
            resp = conn.read_response()
            assert resp.status == 200 and direct(resp)
            assert resp.headers["connection"] == "keep-alive"
            assert ("status" in resp.json()) is bool(i % 2)
        # And pipelined, in one write: answered in order.
        conn.send("".join(get("/health") if i % 2 else get("/v1/models", AUTH)
                          for i in range(200)))
        for i in range(200):
            resp = conn.read_response()
            assert resp.status == 200 and direct(resp)
            assert ("status" in resp.json()) is bool(i % 2)
        assert not conn.closed(timeout=0.2)


def test_pipelined_behind_sanic_requests_in_order(srv: ServerProcess) -> None:
    """Behind a request Sanic has not finished, Sanic answers: in order, never ahead."""
    with RawConn(srv.port, timeout=60) as conn:
        conn.send(post_chat() + get("/health").encode() + get("/v1/models", AUTH).encode()
                  + post_chat(stream=True, max_tokens=12) + get("/health").encode()
                  + get("/health", "Connection: close\r\n").encode() + get("/health").encode())
        chat = conn.read_response("POST")
        assert chat.status == 200 and chat.json()["object"] == "chat.completion"
        health = conn.read_response()
        # The chat before it has finished and released its slot: nothing runs.
        assert health.status == 200 and health.json()["active_requests"] == 0
        assert conn.read_response().json()["object"] == "list"
        stream = conn.read_response("POST")
        assert stream.status == 200 and parse_sse(stream.body.decode())[-1] == "[DONE]"
        assert conn.read_response().json()["active_requests"] == 0
        last = conn.read_response()
        assert last.status == 200 and last.headers["connection"] == "close"
        assert conn.closed()  # the request after Connection: close is never answered


def test_sent_during_a_stream_answered_after_it(srv: ServerProcess) -> None:
    """A GET /health arriving while a stream runs on its connection waits for the stream;
    once Sanic is idle again, the next ones are answered directly."""
    with RawConn(srv.port, timeout=60) as conn:
        conn.send(post_chat(stream=True, max_tokens=200, temperature=0))
        while b"data: " not in conn.buf:
            assert conn._fill()
        conn.send(get("/health") + get("/v1/models", AUTH))
        stream = conn.read_response("POST")
        assert stream.status == 200 and parse_sse(stream.body.decode())[-1] == "[DONE]"
        assert conn.read_response().json()["active_requests"] == 0
        assert conn.read_response().json()["object"] == "list"
        conn.send(get("/health") + get("/health"))
        assert all(direct(conn.read_response()) for _ in range(2))


def test_health_counts_are_truthful(srv: ServerProcess) -> None:
    """One slot: a running stream is active, a second one queued; both paths agree."""
    def health() -> tuple[dict[str, Any], dict[str, Any]]:
        fast = ask(srv.port, get("/health"))
        slow = ask(srv.port, via_sanic("/health"))
        assert direct(fast) and not direct(slow)
        return fast.json(), slow.json()

    def wait(active: int, queued: int) -> None:
        deadline = time.monotonic() + 30
        while True:
            fast, slow = health()
            if (fast["active_requests"], fast["queued_requests"]) == (active, queued) == (
                    slow["active_requests"], slow["queued_requests"]):
                return
            assert time.monotonic() < deadline, (fast, slow, active, queued)
            time.sleep(0.02)

    wait(0, 0)
    first = RawConn(srv.port, timeout=60)
    second = RawConn(srv.port, timeout=60)
    try:
        # 8000 greedy tokens take far longer than this test (sampled, the random demo
        # model may pick its end token early); it is cancelled below.
        first.send(post_chat("X-Request-ID: direct-hog\r\n", stream=True, max_tokens=8000,
                              temperature=0))
        while b"data: " not in first.buf:
            assert first._fill()
        wait(1, 0)
        second.send(post_chat(stream=True, max_tokens=2))
        wait(1, 1)
        cancelled = ask(srv.port, f"POST {CHAT}/direct-hog/cancel HTTP/1.1\r\n{H}{AUTH}"
                               "Content-Length: 0\r\n\r\n")
        assert cancelled.json()["cancelled"] is True
        assert second.read_response("POST").status == 200  # it got the freed slot
        wait(0, 0)
    finally:
        first.close()
        second.close()


def _access_events(srv: ServerProcess, path: str) -> list[dict[str, Any]]:
    with srv._cond:
        return [e for e in srv.events if e.get("event") == "request" and e.get("path") == path]


def _wait_events(srv: ServerProcess, path: str, count: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 10
    while len(events := _access_events(srv, path)) < count:
        assert time.monotonic() < deadline, events
        time.sleep(0.02)
    return events


def _settled_count(srv: ServerProcess, path: str) -> int:
    """How many access lines ``path`` has once the earlier tests' stop arriving: a line is
    written after its answer has gone, so the last of a test before may still come."""
    count = -1
    while (now := len(_access_events(srv, path))) != count:
        count = now
        time.sleep(0.3)
    return count


@pytest.mark.parametrize(("path", "extra"), [("/health", "X-Request-ID: log-id-1\r\n"),
                                             ("/v1/models", AUTH)])
def test_access_log(srv: ServerProcess, path: str, extra: str) -> None:
    before = _settled_count(srv, path)
    fast = ask(srv.port, get(path + "?q=1", extra))
    assert direct(fast)
    [event] = _wait_events(srv, path, before + 1)[before:]
    slow = ask(srv.port, via_sanic(path + "?q=1", extra))
    assert not direct(slow)
    [reference] = _wait_events(srv, path, before + 2)[before + 1:]
    assert set(event) == set(reference)
    assert event["method"] == "GET" and event["path"] == path
    assert event["status"] == 200 and event["level"] == "info"
    assert event["bytes"] == len(fast.body) == reference["bytes"]
    # Each line names the id its answer carries (the client's own where it sent one), as
    # through Sanic.
    assert event["request_id"] == fast.headers["x-request-id"]
    assert reference["request_id"] == slow.headers["x-request-id"]
    if "X-Request-ID" in extra:
        assert event["request_id"] == reference["request_id"] == "log-id-1"
    assert isinstance(event["duration_ms"], int | float) and event["duration_ms"] >= 0


def _send_buffer_max() -> int:
    """How large a TCP socket's send buffer grows (Linux: tcp_wmem's maximum); 4 MiB,
    the usual maximum (macOS's too), where the system does not say."""
    try:
        return int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, IndexError, ValueError):
        return 4 << 20


def test_client_that_does_not_read(srv: ServerProcess) -> None:
    """Pipelined requests from a client that stops reading, then reads: none is lost or
    reordered (whether the kernel's buffers held them all, or the transport paused and
    the rest went to Sanic, which the next test pins down)."""
    with RawConn(srv.port, timeout=60) as conn:
        # Answers (each over 1,000 bytes) twice what the kernel can hold between the two
        # ends: the server's send buffer at its largest and this socket's receive buffer.
        held = _send_buffer_max() + conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        count = 2 * held // 1000
        requests = [get("/health") if i % 2 else get("/v1/models", AUTH) for i in range(count)]
        raw = "".join(requests).encode()
        sender = threading.Thread(target=conn.sock.sendall, args=(raw,), daemon=True)
        sender.start()
        time.sleep(1.0)  # the server fills the buffers and is told to stop writing
        for i in range(count):
            resp = conn.read_response()
            assert resp.status == 200
            assert ("status" in resp.json()) is bool(i % 2), i
        sender.join(10)
        assert not conn.closed(timeout=0.2)


def test_paused_transport_hands_requests_to_sanic() -> None:
    """While the transport is paused (the client is not reading), a request goes to
    Sanic, which waits for the transport; what follows it is answered after it."""
    inproc = InProcessServer()
    loop = inproc.loop

    def in_loop(fn: Callable[[], None]) -> None:
        async def call() -> None:
            fn()
        asyncio.run_coroutine_threadsafe(call(), loop).result(5)

    try:
        with RawConn(inproc.port) as conn:
            conn.send(get("/health"))
            assert direct(conn.read_response())
            [proto] = inproc.server.gate.connections
            in_loop(proto.pause_writing)
            conn.send(get("/health") + get("/v1/models"))
            assert not conn.closed(timeout=0.5) and not conn.buf  # Sanic waits
            in_loop(proto.resume_writing)
            first = conn.read_response()
            assert not direct(first) and first.json()["status"] == "ok"
            second = conn.read_response()
            assert not direct(second) and second.json()["object"] == "list"
            conn.send(get("/health"))  # writable and idle again: answered directly
            assert direct(conn.read_response())
    finally:
        inproc.stop()


def test_only_the_apps_own_state_routes_are_answered_directly() -> None:
    """The fast path is the app's route code or nothing: a path is answered directly only
    where the app serves it, on GET alone, with that very StateRoute's handler."""
    def build(state: Any) -> tuple[int, Any]:
        return 200, {}

    served, shared, moved = (StateRoute(f"/{n}", n, build)
                             for n in ("served", "shared", "moved"))
    app = Sanic(f"direct_routes_{time.monotonic_ns()}", configure_logging=False)
    app.add_route(served.handler, "/served", methods=["GET"], name="served")
    app.add_route(shared.handler, "/shared", methods=["GET", "POST"], name="shared")
    app.add_route(moved.handler, "/elsewhere", methods=["GET"], name="moved")
    assert direct_routes(app) == (served,)
    server = Server(load_config(None, env={}, overrides={"server.port": 0}))
    registered = {r.uri: r.handler.__self__ for r in server.app.router.routes
                  if isinstance(getattr(r.handler, "__self__", None), StateRoute)}
    assert server.gate.direct == registered
    assert set(registered) == {"/health", "/v1/models", "/models"}


def test_a_failing_builder_is_answered_by_sanic() -> None:
    """When the route's builder fails, the request goes to Sanic, which runs the same
    builder and answers the failure as any handler's: an error envelope, not a dropped
    connection."""
    inproc = InProcessServer()
    route = inproc.server.gate.direct["/health"]
    build = route.build

    def broken(state: Any) -> tuple[int, Any]:
        raise RuntimeError("the builder broke")

    object.__setattr__(route, "build", broken)  # the one object both paths call
    try:
        resp = ask(inproc.port, get("/health"))
        assert not direct(resp)
        check_error(resp, 500, "internal_error")
        object.__setattr__(route, "build", build)
        resp = ask(inproc.port, get("/health"))
        assert direct(resp) and resp.status == 200
    finally:
        object.__setattr__(route, "build", build)
        inproc.stop()


def test_health_body_shape(srv: ServerProcess) -> None:
    resp = ask(srv.port, get("/health"))
    body = json.loads(resp.body)
    assert body["status"] == "ok" and body["models"]["demo"]
    assert set(body) == {"status", "models", "active_requests", "queued_requests",
                         "model_details"}
