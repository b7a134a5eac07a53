"""A client that goes away is logged as the client's doing, on the real server.

Whether it leaves while queued, while its answer is being generated, or in the middle of
a stream, its access line says ``disconnected: true`` (499, nginx's "client closed
request", when nothing was sent; the 200 that was sent otherwise), and nothing is logged
at error level.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from conftest import ServerProcess, start_server

CHAT = "/v1/chat/completions"
LONG = 8000  # tokens: far longer than any test here waits
#: Bodies each side of the 64 KiB at which Sanic stops reading a connection until it asks
#: for more, which a handed-over request never does: a large body must not hide the close.
SIZES = {"small": 0, "large": 100_000}


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with one generation slot, so a second request waits in the queue."""
    proc = start_server(tmp_path_factory.mktemp("disconnect"),
                        config="[queue]\nmax_concurrent_requests = 1\n")
    yield proc
    proc.stop()


def _body(*, stream: bool, max_tokens: int = LONG, padding: int = 0) -> bytes:
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if padding:
        body["user"] = "u" * padding  # an agent's long system prompt, without its prefill
    return json.dumps(body).encode()


def _open(server: ServerProcess, rid: str, *, stream: bool, padding: int = 0) -> socket.socket:
    body = _body(stream=stream, padding=padding)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(
        f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"X-Request-ID: {rid}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    )
    return sock


def _read_until(sock: socket.socket, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    return data


def _health(server: ServerProcess) -> dict[str, Any]:
    return httpx.get(server.url + "/health", timeout=5).json()


def _wait(predicate: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.02)


def _access(server: ServerProcess, rid: str) -> list[dict[str, Any]]:
    with server._cond:
        return [e for e in server.events
                if e.get("event") == "request" and e.get("request_id") == rid]


def _new_lines(server: ServerProcess, before: int) -> list[dict[str, Any]]:
    with server._cond:
        return [json.loads(line) for line in server.raw_lines[before:]]


def _assert_quiet(server: ServerProcess, before: int) -> None:
    time.sleep(0.3)  # whatever the disconnect logs has arrived by now
    for event in _new_lines(server, before):
        assert event.get("level") not in ("error", "critical"), event
        assert "Traceback" not in json.dumps(event), event


@pytest.fixture()
def occupied(single: ServerProcess) -> Iterator[socket.socket]:
    """The one slot held by a long stream, until the test is over."""
    _wait(lambda: _health(single)["active_requests"] == 0)
    sock = _open(single, f"hold-{uuid.uuid4().hex[:8]}", stream=True)
    _read_until(sock, b'"content"')
    yield sock
    sock.close()
    _wait(lambda: _health(single)["active_requests"] == 0)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_client_leaving_while_queued_is_a_disconnect(single: ServerProcess,
                                                      occupied: socket.socket,
                                                      stream: bool, size: str) -> None:
    rid = f"queued-{uuid.uuid4().hex[:8]}"
    before = len(single.raw_lines)
    sock = _open(single, rid, stream=stream, padding=SIZES[size])
    try:
        assert _wait(lambda: _health(single)["queued_requests"] == 1)
    finally:
        sock.close()
    events = _wait(lambda: _access(single, rid))
    assert len(events) == 1, events
    event = events[0]
    assert event["status"] == 499
    assert event["disconnected"] is True
    assert event["level"] == "info"
    assert "error_code" not in event
    _assert_quiet(single, before)
    assert not any(e.get("event") == "unhandled error" for e in _new_lines(single, before))


@pytest.mark.parametrize("size", SIZES)
def test_client_leaving_during_a_plain_answer_is_a_disconnect(single: ServerProcess,
                                                               size: str) -> None:
    _wait(lambda: _health(single)["active_requests"] == 0)
    rid = f"plain-{uuid.uuid4().hex[:8]}"
    before = len(single.raw_lines)
    sock = _open(single, rid, stream=False, padding=SIZES[size])
    try:
        assert _wait(lambda: _health(single)["active_requests"] == 1)
    finally:
        sock.close()
    events = _wait(lambda: _access(single, rid))
    assert len(events) == 1, events
    assert (events[0]["status"], events[0].get("disconnected")) == (499, True)
    _assert_quiet(single, before)


def test_client_leaving_mid_stream_is_marked(single: ServerProcess) -> None:
    """The 200 went out, so the line keeps it, but says the client left."""
    _wait(lambda: _health(single)["active_requests"] == 0)
    rid = f"mid-{uuid.uuid4().hex[:8]}"
    before = len(single.raw_lines)
    sock = _open(single, rid, stream=True)
    with sock:
        head = _read_until(sock, b'"content"')
        assert head.startswith(b"HTTP/1.1 200 ")
    events = _wait(lambda: _access(single, rid))
    assert len(events) == 1, events
    event = events[0]
    assert event["status"] == 200
    assert event["disconnected"] is True
    assert "stream_error" not in event
    _assert_quiet(single, before)


def test_a_complete_stream_is_not_marked(single: ServerProcess) -> None:
    _wait(lambda: _health(single)["active_requests"] == 0)
    rid = f"whole-{uuid.uuid4().hex[:8]}"
    response = httpx.post(single.url + CHAT, content=_body(stream=True, max_tokens=4),
                          headers={"X-Request-ID": rid, "Content-Type": "application/json"},
                          timeout=30)
    assert response.status_code == 200
    assert response.text.endswith("data: [DONE]\n\n")
    events = _wait(lambda: _access(single, rid))
    assert len(events) == 1
    assert "disconnected" not in events[0]
