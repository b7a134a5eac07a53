"""Connection exhaustion: clients trickling head bytes must not lock everyone else out.

Against the real server over real sockets: at ``max_connections`` a newcomer's complete
request takes the slot of the connection that has waited longest without a request in
progress (answered 503 when its head was incomplete), slow newcomers never displace a
slot holder, and a request being received, processed or streamed is never shed. Then a
scaled-down slowloris (``bench/slowloris.py``) with more attackers than slots, during
which legitimate clients must still get their answers.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from afmd.http.transport.connection_limits import FRESH_GRACE

from conftest import ServerProcess, start_server
from helpers.paths import REPO_ROOT
from helpers.raw_http import RawConn, check_error

pytestmark = pytest.mark.slow  # servers under slow-client attacks, waiting out timeouts

ROOT = REPO_ROOT
GET = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
SLOW = b"GET /health HTTP/1.1\r\nHost: loc"  # a head that never completes
UPLOAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
          b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{   ")


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("small"), config="""
[server]
max_connections = 4
""")
    yield proc
    proc.stop()


def _open(port: int, data: bytes = b"") -> RawConn:
    conn = RawConn(port)
    if data:
        conn.send(data)
    time.sleep(0.05)  # the server has read it: the order of arrival is the order of waiting
    return conn


def _shed_with_503(conn: RawConn) -> None:
    error = check_error(conn.read_response(), 503, "too_many_connections")
    assert "incomplete" in error["message"]
    assert conn.closed()


def test_slow_heads_are_shed_oldest_first(small: ServerProcess) -> None:
    held = [_open(small.port, SLOW) for _ in range(4)]
    try:
        waiting = [_open(small.port), _open(small.port, SLOW)]  # at the cap: they wait
        first = _open(small.port, GET)
        assert first.read_response().status == 200  # it took held[0]'s slot
        _shed_with_503(held[0])
        for conn in held[1:]:  # the waiting newcomers displaced nobody
            assert not conn.closed(timeout=0.2)
        second = _open(small.port, GET)
        assert second.read_response().status == 200
        _shed_with_503(held[1])  # older than `first`, which has been idle only since its answer
        assert not held[2].closed(timeout=0.2)
        # `first` is a keep-alive connection that still works.
        first.send(GET)
        assert first.read_response().status == 200
        for conn in (*waiting, first, second):
            conn.close()
    finally:
        for conn in held:
            conn.close()


def test_a_new_connection_gets_time_to_send(small: ServerProcess) -> None:
    """One that has sent nothing yet is spared for FRESH_GRACE (its request is on its way),
    then it is the first to go."""
    time.sleep(0.3)  # the previous test's connections are gone
    started = time.monotonic()
    held = [RawConn(small.port) for _ in range(4)]
    try:
        with RawConn(small.port) as early:
            early.send(GET)
            response = early.read_response()
            if time.monotonic() - started < FRESH_GRACE / 2:  # else the grace may be over
                check_error(response, 503, "too_many_connections")
        time.sleep(max(0.0, started + FRESH_GRACE + 0.2 - time.monotonic()))
        with RawConn(small.port) as late:
            late.send(GET)
            assert late.read_response().status == 200
        assert held[0].closed(timeout=2) and held[0].buf == b""  # closed without a word
        for conn in held[1:]:
            assert not conn.closed(timeout=0.1)
    finally:
        for conn in held:
            conn.close()


def _stream(port: int) -> socket.socket:
    """A long streamed completion whose client reads nothing: kept in flight."""
    body = json.dumps({"messages": [{"role": "user", "content": "Hi."}], "stream": True,
                       "max_tokens": 3000, "temperature": 0}).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    assert sock.recv(1024).startswith(b"HTTP/1.1 200")
    return sock


def test_requests_in_flight_are_never_shed(small: ServerProcess) -> None:
    time.sleep(0.3)  # the previous test's connections are gone
    stream = _stream(small.port)
    upload = _open(small.port, UPLOAD)  # its head is complete: its body is on its way
    idle = _open(small.port, GET)
    assert idle.read_response().status == 200
    slow = _open(small.port, SLOW)
    try:
        # Two uploads take the two slots that can be freed...
        late = [_open(small.port, UPLOAD), _open(small.port, UPLOAD)]
        assert idle.closed(timeout=2) and idle.buf == b""  # closed silently: it was idle
        _shed_with_503(slow)
        # ...and then every slot is busy: a request is refused, nobody is shed.
        refused = _open(small.port, GET)
        check_error(refused.read_response(), 503, "too_many_connections")
        assert refused.closed()
        upload.send(b" " * 995 + b"}")  # a complete, if useless, body: the handler answers
        answer = upload.read_response("POST")
        assert answer.status == 400 and answer.json()["error"]["param"] == "messages", answer
        stream.settimeout(5)
        data = b""
        while b"data: " not in data:  # the stream is still flowing
            chunk = stream.recv(65536)
            assert chunk, "the stream was cut"
            data += chunk
        for conn in late:
            conn.close()
    finally:
        stream.close()
        for conn in (upload, idle, slow):
            conn.close()


# --------------------------------------------------------------------------- the attack


@pytest.fixture(scope="module")
def attacked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("attacked"), config="""
[server]
max_connections = 16
[log]
access_log = false
""")
    yield proc
    proc.stop()


def test_legit_clients_get_through_a_slowloris(attacked: ServerProcess) -> None:
    """40 attackers trickling a byte a second and reconnecting at once, against 16 slots."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "slowloris.py"), "--port", str(attacked.port),
         "--attackers", "40", "--legit", "2", "--seconds", "4", "--warmup", "1.0",
         "--chat-every", "4", "--json"],
        capture_output=True, text=True, timeout=60, check=True)
    report = json.loads(result.stdout)
    assert report["legit_tries"] >= 20, report
    assert report["legit_success"] >= 0.9, report
    assert report["attack_connections"] > 40, report  # the attackers were shed and came back
    assert attacked.proc.poll() is None
