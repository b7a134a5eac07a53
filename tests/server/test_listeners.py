"""Listeners: the Unix socket's safety rules, and self-healing when a listener breaks.

The Unix-socket rules run against the real ``afmd serve`` process. Breaking a listener
needs its socket, so those tests run :class:`afmd.server.Server` in this process, on its
own event loop in a thread, and shut down or close the listening socket underneath it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import afmd.http.transport.listeners as listeners_module
from afmd.http.transport.listeners import StartupError
from afmd.http.transport.supervisor import ListenerState

from conftest import DIAGNOSE, ServerProcess, afmd_command, parse_sse, start_server
from helpers.inprocess import InProcessServer
from helpers.raw_http import RawConn, chat_body, check_error

pytestmark = pytest.mark.slow  # a server per test, several stopped or broken on purpose

H = "Host: localhost\r\n"
HEALTH = "GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"


def _health_status(port: int | None = None, *, unix: str | None = None) -> int:
    """The status of one ``HEALTH`` request over a fresh connection (TCP port or Unix socket)."""
    with RawConn(port, unix=unix) as conn:
        conn.send(HEALTH)
        return conn.read_response().status


@pytest.fixture()
def sock_dir() -> Iterator[Path]:
    """A short directory for Unix sockets (sun_path is ~104 bytes; tmp_path can be long)."""
    path = Path(f"/tmp/afmd-t-{os.getpid()}-{time.monotonic_ns() % 10**8}")
    path.mkdir()
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def _settled(proc: ServerProcess) -> ServerProcess:
    """Wait for the default model: a SIGTERM during a model load can abort the process
    when it exits (the engine's load thread outlives the loop), whatever the transport."""
    proc.wait_event("model ready", timeout=60)
    return proc


def _serve(tmp_path: Path, *args: str) -> ServerProcess:
    return _settled(start_server(tmp_path, args=list(args), ready=False, env=DIAGNOSE))


def _run_to_exit(tmp_path: Path, *args: str,
                 timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*afmd_command(), "serve", "--log-format", "json", *args],
        capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path),
        env={k: v for k, v in os.environ.items() if k != "AFMD_CONFIG"},
    )


# --------------------------------------------------------------------------- Unix socket


def test_unix_socket_and_tcp_together(tmp_path: Path, sock_dir: Path) -> None:
    path = str(sock_dir / "afmd.sock")
    proc = _serve(tmp_path, "--unix-socket", path)
    try:
        assert f"unix:{path}" in proc.addresses
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        assert _health_status(unix=path) == 200
        with RawConn(unix=path) as conn:  # the Unix socket always checks Host
            conn.send("GET /v1/models HTTP/1.1\r\nHost: evil.example\r\n\r\n")
            check_error(conn.read_response(), 421, "invalid_host")
        assert _health_status(proc.port) == 200
        assert proc.stop() == 0, proc.log_text()[-4000:]
        assert not os.path.exists(path)  # removed on SIGTERM
    finally:
        proc.stop()


def test_unix_socket_only(tmp_path: Path, sock_dir: Path) -> None:
    path = str(sock_dir / "only.sock")
    proc = _serve(tmp_path, "--host", "", "--unix-socket", path)
    try:
        assert proc.addresses == [f"unix:{path}"]
        assert _health_status(unix=path) == 200
    finally:
        assert proc.stop() == 0, proc.log_text()[-4000:]


def test_no_listener_is_a_config_error(tmp_path: Path) -> None:
    result = _run_to_exit(tmp_path, "--host", "")
    assert result.returncode == 2
    assert "unix_socket" in result.stderr


def test_non_socket_file_is_never_replaced(tmp_path: Path, sock_dir: Path) -> None:
    path = sock_dir / "notes.txt"
    path.write_text("precious")
    result = _run_to_exit(tmp_path, "--port", "0", "--unix-socket", str(path))
    assert result.returncode == 1
    assert "not a socket" in result.stderr
    assert path.read_text() == "precious"
    assert stat.S_ISREG(os.lstat(path).st_mode)


def test_live_socket_is_not_stolen(tmp_path: Path, sock_dir: Path) -> None:
    path = str(sock_dir / "live.sock")
    first = _serve(tmp_path, "--unix-socket", path)
    try:
        result = _run_to_exit(tmp_path, "--port", "0", "--unix-socket", path)
        assert result.returncode == 1
        assert "another server is listening" in result.stderr
        assert _health_status(unix=path) == 200  # the first server still owns it
    finally:
        assert first.stop() == 0, first.log_text()[-4000:]


def test_stale_socket_is_replaced(tmp_path: Path, sock_dir: Path) -> None:
    path = str(sock_dir / "stale.sock")
    crashed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    crashed.bind(path)  # a server that died without removing its socket file
    crashed.close()
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    proc = _serve(tmp_path, "--host", "", "--unix-socket", path)
    try:
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        assert _health_status(unix=path) == 200
    finally:
        assert proc.stop() == 0, proc.log_text()[-4000:]


def test_removed_socket_file_is_recreated(tmp_path: Path, sock_dir: Path) -> None:
    path = str(sock_dir / "gone.sock")
    proc = _serve(tmp_path, "--unix-socket", path)
    try:
        os.unlink(path)
        proc.wait_event("listener_state", timeout=5, state="running", attempt=1)
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        assert _health_status(unix=path) == 200
    finally:
        assert proc.stop() == 0, proc.log_text()[-4000:]


def test_unrecoverable_listener_stops_the_process_with_exit_1(
    tmp_path: Path, sock_dir: Path
) -> None:
    """The socket file is replaced by a regular file: every rebind refuses to touch it."""
    path = sock_dir / "taken.sock"
    proc = _serve(tmp_path, "--unix-socket", str(path))
    try:
        os.unlink(path)
        path.write_text("someone else's file")
        stopped = proc.wait_event("listener_state", timeout=10, state="stopped")
        assert stopped["listener"] == f"unix:{path}"
        assert stopped["attempt"] == 5
        assert "not a socket" in stopped["reason"]
        restarting = [e for e in proc.events if e.get("event") == "listener_state"
                      and e.get("state") == "restarting"]
        assert [e["attempt"] for e in restarting] == [1, 2, 3, 4, 5]
        assert proc.proc.wait(30) == 1, proc.log_text()[-4000:]
        assert path.read_text() == "someone else's file"
    finally:
        proc.stop()


# --------------------------------------------------------------------------- in-process


@pytest.fixture()
def inproc() -> Iterator[InProcessServer]:
    server = InProcessServer()
    yield server
    server.stop()


def _serving_again(port: int, started: float, limit: float = 2.0) -> float:
    """Seconds from ``started`` until a request on ``port`` is answered."""
    while True:
        try:
            with RawConn(port, timeout=1) as conn:
                conn.send(HEALTH)
                if conn.read_response().status == 200:
                    return time.monotonic() - started
        except (OSError, AssertionError):
            pass
        if time.monotonic() - started > limit:
            raise AssertionError("the listener never came back")
        time.sleep(0.005)


def _start_stream(port: int) -> RawConn:
    body = chat_body(stream=True, max_tokens=400, temperature=0)
    conn = RawConn(port, timeout=30)
    conn.send((f"POST /v1/chat/completions HTTP/1.1\r\n{H}Content-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
    while b"data: " not in conn.buf:
        assert conn._fill()
    return conn


def _finish_stream(conn: RawConn) -> list[Any]:
    response = conn.read_response("POST")
    assert response.status == 200
    events = parse_sse(response.body.decode())
    assert events[-1] == "[DONE]"
    return events


@pytest.mark.parametrize("how", ["shutdown", "close-fd"])
def test_broken_listener_is_recreated_on_the_same_port(inproc: InProcessServer,
                                                       how: str) -> None:
    port = inproc.port
    stream = _start_stream(port)  # in flight on an existing connection
    try:
        seen = len(inproc.states)
        started = time.monotonic()
        if how == "shutdown":
            inproc.listener.sock.shutdown(socket.SHUT_RDWR)
        else:
            os.close(inproc.listener.sock.fileno())
        elapsed = _serving_again(port, started)
        assert elapsed < 0.5, elapsed
        restarting = inproc.wait_state("restarting", after=seen)
        assert restarting.attempt == 1
        assert restarting.listener == f"http://127.0.0.1:{port}"
        assert restarting.reason
        running = inproc.wait_state("running", after=seen)
        assert running.attempt == 1
        assert inproc.port == port
        events = _finish_stream(stream)  # the stream went on through the restart
        assert events[-2]["choices"][0]["finish_reason"] in ("length", "stop")
    finally:
        stream.close()
    assert inproc.stop() == 0


def test_listener_breaks_again_after_a_restart(inproc: InProcessServer) -> None:
    port = inproc.port
    for round_ in range(1, 3):
        seen = len(inproc.states)
        inproc.listener.sock.shutdown(socket.SHUT_RDWR)
        _serving_again(port, time.monotonic())
        inproc.wait_state("running", after=seen, attempt=1)
        assert len([s for s in inproc.states if s.state == "restarting"]) == round_


def test_rebind_failures_then_success(inproc: InProcessServer,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real_bind = listeners_module.bind_tcp
    calls: list[float] = []

    def flaky_bind(host: str, port: int) -> socket.socket:
        calls.append(time.monotonic())
        if len(calls) <= 2:
            raise StartupError(f"cannot listen on {host}:{port}: the port is already in use")
        return real_bind(host, port)

    monkeypatch.setattr(listeners_module, "bind_tcp", flaky_bind)
    port = inproc.port
    inproc.listener.sock.shutdown(socket.SHUT_RDWR)
    running = inproc.wait_state("running", after=1, timeout=5)
    assert running.attempt == 3
    attempts = [s for s in inproc.states if s.state == "restarting"]
    assert [s.attempt for s in attempts] == [1, 2, 3]
    assert "already in use" in (attempts[-1].reason or "")
    assert len(calls) == 3
    assert calls[2] - calls[1] > calls[1] - calls[0]  # the backoff grows
    assert _serving_again(port, time.monotonic()) < 1


def test_five_failed_rebinds_stop_the_server_with_exit_1(
    inproc: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_bind(host: str, port: int) -> socket.socket:
        raise StartupError(f"cannot listen on {host}:{port}: the port is already in use")

    monkeypatch.setattr(listeners_module, "bind_tcp", broken_bind)
    started = time.monotonic()
    inproc.listener.sock.shutdown(socket.SHUT_RDWR)
    stopped = inproc.wait_state("stopped", timeout=10)
    elapsed = time.monotonic() - started
    assert stopped.attempt == 5
    assert "already in use" in (stopped.reason or "")
    assert [s.attempt for s in inproc.states if s.state == "restarting"] == [1, 2, 3, 4, 5]
    assert 0.05 + 0.1 + 0.2 + 0.4 + 0.8 <= elapsed < 5, elapsed  # exponential backoff
    inproc.thread.join(30)
    assert inproc.exit_code == 1
    assert inproc.error is None


def test_states_as_an_async_iterator(inproc: InProcessServer) -> None:
    async def two_states() -> list[ListenerState]:
        seen: list[ListenerState] = []
        async for state in inproc.server.supervisor.subscribe():
            seen.append(state)
            if len(seen) == 2:
                return seen
        return seen

    future = asyncio.run_coroutine_threadsafe(two_states(), inproc.loop)
    time.sleep(0.1)  # subscribed
    inproc.listener.sock.shutdown(socket.SHUT_RDWR)
    states = future.result(5)
    assert [s.state for s in states] == ["restarting", "running"]
    assert inproc.server.supervisor.history[0].state == "running"


def test_connection_and_byte_accounting_returns_to_zero(inproc: InProcessServer) -> None:
    """Whatever way connections end, the shared counters come back to zero."""
    gate = inproc.server.gate
    port = inproc.port
    body = chat_body()
    post = (f"POST /v1/chat/completions HTTP/1.1\r\n{H}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with RawConn(port) as served:  # pipelined, all answered
        served.send(post + post + HEALTH.encode())
        for method in ("POST", "POST", "GET"):
            assert served.read_response(method).status == 200
    with RawConn(port) as partial:  # an upload cut off midway
        partial.send(post[: len(post) - 5])
        time.sleep(0.1)
        assert gate.buffered > 0
    with RawConn(port) as refused:  # a refusal, lingering
        refused.send("GET /nope HTTP/1.1\r\nHost: localhost\r\n\r\n")
        check_error(refused.read_response(), 404, "unknown_url")
    streaming = _start_stream(port)  # a stream the client abandons
    streaming.close()
    deadline = time.monotonic() + 5
    while (gate.buffered, gate.open_connections) != (0, 0):
        assert time.monotonic() < deadline, (gate.buffered, gate.open_connections)
        time.sleep(0.02)
    assert not gate.connections
