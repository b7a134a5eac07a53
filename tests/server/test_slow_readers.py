"""Clients that read their answers slowly, or not at all, over real sockets.

A client that stops reading holds what it was given: its connection. It must not hold a
generation slot past its request's deadline (queued requests would wait behind it), and a
response still on its way to a slow reader is neither shed at ``max_connections`` nor cut
by the keep-alive idle timeout.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from afmd.http.routes.event_stream import STALL_GRACE

from conftest import ServerProcess, start_server
from helpers.raw_http import RawConn, Response, check_error

pytestmark = pytest.mark.slow  # servers waiting out deadlines

#: Every token comes with its 20 alternatives, so a few seconds of them fill any socket
#: buffer; a forced token keeps the model from ever ending on its own.
BIG = {"logprobs": True, "top_logprobs": 20, "logit_bias": {"5": 100}}


def _stalled(unix: Path, path: str, body: dict[str, object]) -> socket.socket:
    """A request whose client never reads a byte of its answer. Over a Unix socket: its
    buffers are fixed and small, where loopback TCP grows the server's to megabytes, so
    the server's writes stall within a fraction of a second."""
    data = json.dumps(body).encode()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(unix))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
                 f"\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _over(sock: socket.socket, within: float) -> bool:
    """Whether the answer is over within ``within`` seconds (reading it all): the server
    cut the connection, or, where the machine was slow enough that everything generated
    before the deadline fit in the socket's buffers and no write ever stalled, the stream
    ended in full with the deadline's error (the connection then kept alive, as HTTP/1.1
    keeps it)."""
    sock.settimeout(0.5)
    deadline = time.monotonic() + within
    received = b""
    while time.monotonic() < deadline:
        try:
            data = sock.recv(1 << 20)
        except ConnectionResetError:
            return True
        except TimeoutError:
            continue
        if not data:
            return True
        received = (received + data)[-4096:]
        if received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
            assert b'"code":"timeout"' in received, received[-600:]
            return True
    return False


def _unix(server: ServerProcess) -> Path:
    return next(Path(a.removeprefix("unix:")) for a in server.addresses
                if not a.startswith("http"))


#: The one_slot server's request_timeout: the stalled stream's deadline. The queued
#: request is sent 2 s in, while the stalled one still holds the slot.
DEADLINE = 3.0


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("one_slot")
    proc = start_server(folder, config=f"""
[server]
unix_socket = "{folder / 'afmd.sock'}"
request_timeout = {DEADLINE}
[queue]
max_concurrent_requests = 1
max_queued_requests = 4
""")
    yield proc
    proc.stop()


STREAMS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi."}],
                              "max_tokens": 100000, "stream": True, **BIG}),
    ("/v1/completions", {"prompt": "Hi.", "max_tokens": 100000, "stream": True, "logprobs": 5,
                         "logit_bias": {"5": 100}}),
]


@pytest.mark.parametrize(("path", "body"), STREAMS, ids=[p for p, _ in STREAMS])
def test_a_stream_nobody_reads_frees_its_slot_at_its_deadline(
        one_slot: ServerProcess, path: str, body: dict[str, object]) -> None:
    """The stalled stream's slot goes to the queued request when the stalled one's
    request_timeout ends, not when Sanic's own timer gives up a minute later."""
    sent = time.monotonic()
    stalled = _stalled(_unix(one_slot), path, body)
    try:
        time.sleep(2.0)  # generating, and soon blocked writing
        queued = httpx.post(one_slot.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 3})
        assert queued.status_code == 200, queued.text
        # Still not reading past the deadline and its grace: the connection is cut.
        time.sleep(max(0.0, sent + DEADLINE + STALL_GRACE + 0.5 - time.monotonic()))
        assert _over(stalled, 2.0), "the stalled connection was left open"
    finally:
        stalled.close()


# --------------------------------------------------------- an answer on its way to a reader


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("capped")
    proc = start_server(folder, config=f"""
[server]
unix_socket = "{folder / 'afmd.sock'}"
max_connections = 1
idle_timeout = 1.0
""")
    yield proc
    proc.stop()


def _answered(server: ServerProcess, request_id: str) -> RawConn:
    """A finished answer larger than the socket's buffers, the rest held by the server's
    transport for a client that has not read yet (its head is what Sanic waits for next)."""
    body = json.dumps({"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 300,
                       **BIG}).encode()
    conn = RawConn(unix=str(_unix(server)), timeout=10)
    conn.send(f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nX-Request-ID: "
              f"{request_id}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
              f"\r\n\r\n".encode() + body)
    server.wait_event("request", request_id=request_id)  # logged as its answer is written
    time.sleep(0.2)
    return conn


def _whole(response: Response) -> None:
    assert response.status == 200
    assert len(response.body) == int(response.headers["content-length"])
    assert len(response.json()["choices"][0]["logprobs"]["content"]) == 300


def _complete(got: bytes) -> bool:
    head, found, body = got.partition(b"\r\n\r\n")
    length = [line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
    return bool(found and length) and len(body) >= int(length[0].split(b":")[1])


def test_an_answer_being_delivered_is_never_shed(capped: ServerProcess) -> None:
    """At max_connections the connection whose answer a slow client is still taking is not
    the idle one to shed: the newcomer is refused, and the answer arrives whole."""
    with _answered(capped, "shed-1") as slow:
        with RawConn(capped.port) as newcomer:
            newcomer.send(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            check_error(newcomer.read_response(), 503, "too_many_connections")
        _whole(slow.read_response("POST"))


def test_the_keep_alive_clock_waits_for_a_slow_reader(capped: ServerProcess) -> None:
    """A client reading its answer slowly, for longer than idle_timeout and Sanic's
    graceful close after it, gets all of it: its connection is not idle while it reads."""
    time.sleep(0.3)  # the previous test's connections are gone
    with _answered(capped, "keep-1") as slow:
        got = b""
        while not _complete(got):  # about 8 s for its 400 KB: past idle_timeout and the close
            data = slow.sock.recv(32768)
            if not data:
                break
            got += data
            time.sleep(0.6)
        slow.buf = got
        _whole(slow.read_response("POST"))


@pytest.mark.parametrize(("path", "body", "envelope"), [
    ("/v1/chat/completions",
     {"model": "demo", "messages": [{"role": "user", "content": "Hi."}]}, "openai"),
    ("/v1/messages",
     # Messages has no logit_bias; the demo's greedy answer runs to max_tokens instead.
     {"model": "demo", "max_tokens": 4000, "temperature": 0,
      "messages": [{"role": "user", "content": "Hi."}]},
     "anthropic"),
])
def test_a_handler_past_sanics_response_timeout_is_the_deadlines_504(
        path: str, body: dict[str, object], envelope: str) -> None:
    """Sanic's response timeout is a margin past ``request_timeout`` that only a handler
    stuck past its own deadline reaches: what the client gets then is that deadline's 504 in
    its route's envelope, not a 500 "server error", and the server serves on. The timeout is
    lowered under a running server so that an ordinary long answer reaches it."""
    from helpers.inprocess import InProcessServer

    inproc = InProcessServer()
    try:
        config = inproc.server.app.config  # read by each new connection
        # The keep-alive timeout paces the connection's first timeout check.
        config.RESPONSE_TIMEOUT, config.KEEP_ALIVE_TIMEOUT = 0.3, 1.0
        url = f"http://127.0.0.1:{inproc.port}"
        reply = httpx.post(url + path, json={**body, "max_tokens": 4000, **BIG}, timeout=30)
        assert reply.status_code == 504, reply.text
        if envelope == "openai":
            assert reply.json()["error"]["code"] == "timeout"
        else:
            assert reply.json()["type"] == "error"
            assert reply.json()["error"]["type"] == "timeout_error"
        config.RESPONSE_TIMEOUT, config.KEEP_ALIVE_TIMEOUT = 60.0, 60.0
        ok = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi."}]})
        assert ok.status_code == 200, ok.text
    finally:
        inproc.stop()
