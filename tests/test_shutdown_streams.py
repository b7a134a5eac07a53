"""SIGTERM with streams still running past ``shutdown_grace``, on the real server.

A stream the shutdown cuts ends like any failure after the 200: an error event
(``server_shutting_down``), ``data: [DONE]`` and the chunked body's last chunk, so a
client can tell a stopped server from a broken connection; a request still waiting for
a slot gets a plain 503 with the same code; the process still exits 0.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import ServerProcess, parse_sse, start_server

pytestmark = pytest.mark.slow  # servers stopped mid-stream

CHAT = "/v1/chat/completions"
LONG = 8000  # tokens: far longer than the test runs
SLOTS = 4


def _body(text: str, *, stream: bool) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": LONG,
            "temperature": 0, "stream": stream}


@dataclass
class Stream:
    """One streamed request read by httpx in a thread; httpx raises on a chunked body
    that ends without its last chunk."""

    url: str
    rid: str
    first: threading.Event = field(default_factory=threading.Event)
    text: str = ""
    status: int | None = None
    error: BaseException | None = None

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        parts: list[str] = []
        try:
            with httpx.stream("POST", self.url + CHAT, json=_body(self.rid, stream=True),
                              headers={"X-Request-ID": self.rid}, timeout=60) as response:
                self.status = response.status_code
                for chunk in response.iter_text():
                    parts.append(chunk)
                    if '"content"' in "".join(parts[-2:]):
                        self.first.set()
        except BaseException as exc:  # recorded for the test to report
            self.error = exc
        finally:
            self.text = "".join(parts)
            self.first.set()


def _raw_stream(server: ServerProcess, rid: str) -> socket.socket:
    body = json.dumps(_body(rid, stream=True)).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(
        f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"X-Request-ID: {rid}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    )
    return sock


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _assert_ends_with_shutdown_error(text: str) -> None:
    events = parse_sse(text)
    assert events[-1] == "[DONE]", text[-500:]
    error = events[-2]
    assert set(error) == {"error"}, error
    assert error["error"]["code"] == "server_shutting_down"
    assert error["error"]["type"] == "server_error"
    assert "stopping" in error["error"]["message"]
    assert any(isinstance(e, dict) and e.get("choices") for e in events[:-2])


def test_sigterm_ends_cut_streams_with_an_error_event(tmp_path: Path) -> None:
    server = start_server(
        tmp_path,
        config=f"[server]\nshutdown_grace = 1.0\n[queue]\nmax_concurrent_requests = {SLOTS}\n",
    )
    try:
        tag = uuid.uuid4().hex[:8]
        streams = [Stream(server.url, f"cut-{tag}-{i}") for i in range(SLOTS - 1)]
        threads = [s.start() for s in streams]
        raw_rid = f"raw-{tag}"
        raw = _raw_stream(server, raw_rid)  # the fourth slot: read byte for byte
        for s in streams:
            assert s.first.wait(60), s.rid
        head = b""
        while b'"content"' not in head:
            chunk = raw.recv(65536)
            assert chunk, head
            head += chunk
        # One more request waits in the queue when the grace period ends.
        queued: dict[str, Any] = {}

        def wait_in_queue() -> None:
            try:
                r = httpx.post(server.url + CHAT, json=_body("queued", stream=False),
                               headers={"X-Request-ID": f"queued-{tag}"}, timeout=60)
                queued["status"], queued["body"] = r.status_code, r.json()
            except BaseException as exc:
                queued["error"] = exc

        waiter = threading.Thread(target=wait_in_queue, daemon=True)
        waiter.start()
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/health", timeout=5).json()["queued_requests"] < 1:
            assert time.monotonic() < deadline, "the extra request never queued"
            time.sleep(0.02)

        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rest = _read_all(raw)
        raw.close()
        for t in threads:
            t.join(30)
        waiter.join(30)
        code = server.proc.wait(30)
        elapsed = time.monotonic() - t0
    finally:
        server.stop()

    for s in streams:
        assert s.error is None, (s.rid, repr(s.error), s.text[-300:])
        assert s.status == 200
        _assert_ends_with_shutdown_error(s.text)

    data = head + rest
    assert data.startswith(b"HTTP/1.1 200 ")
    assert data.endswith(b"\r\n0\r\n\r\n"), data[-300:]  # the last chunk is there
    body = b"".join(_dechunk(data.split(b"\r\n\r\n", 1)[1]))
    _assert_ends_with_shutdown_error(body.decode())

    assert "error" not in queued, repr(queued.get("error"))
    assert queued["status"] == 503, queued
    assert queued["body"]["error"]["code"] == "server_shutting_down"

    assert code == 0, server.log_text()[-3000:]
    assert elapsed < 10, elapsed

    access = {e["request_id"]: e for e in server.events if e.get("event") == "request"}
    for rid in [s.rid for s in streams] + [raw_rid]:
        event = access[rid]
        assert event["status"] == 200
        assert event["stream_error"] == "server_shutting_down"
        assert "disconnected" not in event
    assert access[f"queued-{tag}"]["status"] == 503
    assert access[f"queued-{tag}"]["error_code"] == "server_shutting_down"
    assert not [e for e in server.events if e.get("level") == "error"]


def _dechunk(data: bytes) -> list[bytes]:
    """The chunks of a complete chunked body (asserting its framing)."""
    out: list[bytes] = []
    while True:
        size_line, data = data.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            assert data == b"\r\n", data
            return out
        out.append(data[:size])
        assert data[size:size + 2] == b"\r\n"
        data = data[size + 2:]
