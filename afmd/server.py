"""Running afmd: sockets we bind ourselves, Sanic inside our own event loop, clean shutdown.

Sanic's runner would fork workers, install its own signal handlers and bind Unix sockets
world-writable; afmd instead binds each listener itself (TCP and/or a 0600 Unix socket),
hands the socket to ``create_server`` and keeps the lifecycle: start, serve, drain on
SIGTERM within a grace period, remove the socket file, exit 0. This is also the seat of the
listener supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import stat
import time
from dataclasses import dataclass
from typing import Any

from afmd.config import Config
from afmd.engine.models import ModelRegistry
from afmd.http.app import AppState, create_app
from afmd.logs import get_logger
from afmd.pipeline import ChatPipeline
from afmd.scheduler import Scheduler

log = get_logger("afmd.server")


class StartupError(Exception):
    """A problem that stops the server before it serves (exit code 1)."""


@dataclass
class Listener:
    kind: str  # "tcp" | "unix"
    address: Any  # (host, port) or path
    sock: socket.socket
    server: Any = None  # sanic AsyncioServer

    def describe(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.address}"
        host, port = self.address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(
                f"cannot listen on {host}:{port}: the port is already in use "
                "(is another afmd running? `afmd doctor` tells what holds it)"
            ) from None
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock


def _socket_is_live(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def bind_unix(path: str) -> socket.socket:
    """Bind a Unix socket readable and writable by its owner only.

    A regular file at the path is never touched; a socket with a live server behind it is
    not stolen; a stale socket file left by a crash is replaced.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise StartupError(
                f"cannot listen on unix socket {path}: a file that is not a socket exists "
                "there; remove it or choose another path"
            )
        if _socket_is_live(path):
            raise StartupError(
                f"cannot listen on unix socket {path}: another server is listening on it"
            )
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the file is born 0600: no window where others can connect
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on unix socket {path}: {exc.strerror}") from None
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class Server:
    """afmd's HTTP server over one or more listeners."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.registry = ModelRegistry(config)
        self.scheduler = Scheduler(
            config.queue.max_concurrent_requests, config.queue.max_queued_requests
        )
        self.pipeline = ChatPipeline(
            self.registry, self.scheduler, request_timeout=config.server.request_timeout
        )
        self.state = AppState(config=config, registry=self.registry, pipeline=self.pipeline)
        self.app = create_app(self.state)
        self.listeners: list[Listener] = []
        self._stop = asyncio.Event()
        self._stopping = False
        self._started = False
        self.exit_code = 0

    # -- lifecycle --
    def _bind_all(self) -> None:
        server = self.config.server
        if server.host:
            sock = bind_tcp(server.host, server.port)
            self.listeners.append(Listener("tcp", sock.getsockname(), sock))
        if server.unix_socket:
            sock = bind_unix(server.unix_socket)
            self.listeners.append(Listener("unix", server.unix_socket, sock))

    async def _serve_listener(self, listener: Listener) -> None:
        listener.server = await self.app.create_server(
            sock=listener.sock,
            return_asyncio_server=True,
            asyncio_server_kwargs={"start_serving": False},
        )
        if not self._started:
            await listener.server.startup()
            await listener.server.before_start()
            self._started = True
        await listener.server.start_serving()

    async def start(self) -> None:
        self._bind_all()
        for listener in self.listeners:
            await self._serve_listener(listener)
        default = self.config.resolve_model(None)
        if default is not None:
            task = self.registry.begin_load(default)
            task.add_done_callback(self._on_default_loaded)
        log.info(
            "listening",
            addresses=[listener.describe() for listener in self.listeners],
            model=default.id if default else None,
            config=self.config.source,
        )
        if default is not None and default.path.startswith("afmd:"):
            log.warning(
                "serving the built-in demo model: it has random weights and answers with "
                "nonsense text; configure a real model in [[models.model]] or pass --model",
                model=default.id,
            )

    def _on_default_loaded(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            loaded = task.result()
            log.info("model ready", model=loaded.id, context_length=loaded.context_length)
        # failures are logged by the registry and reported by /health

    def request_stop(self, reason: str = "signal") -> None:
        if not self._stop.is_set():
            log.info("stopping", reason=reason)
            self._stop.set()

    async def wait_stopped(self) -> None:
        await self._stop.wait()

    def _connections(self) -> set[Any]:
        conns: set[Any] = set()
        for listener in self.listeners:
            if listener.server is not None:
                conns |= set(listener.server.connections)
        return conns

    async def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        for listener in self.listeners:
            if listener.server is not None and listener.server.server is not None:
                listener.server.server.close()
        deadline = time.monotonic() + self.config.server.shutdown_grace
        while time.monotonic() < deadline:
            conns = self._connections()
            for conn in conns:
                conn.close_if_idle()
            if not self._connections():
                break
            await asyncio.sleep(0.05)
        for conn in self._connections():
            with contextlib.suppress(Exception):
                conn.close()
        for listener in self.listeners:
            with contextlib.suppress(Exception):
                listener.sock.close()
            if listener.kind == "unix":
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(listener.address)
        if self._started and self.listeners and self.listeners[0].server is not None:
            with contextlib.suppress(Exception):
                await self.listeners[0].server.before_stop()
                await self.listeners[0].server.after_stop()
        await asyncio.to_thread(self.registry.close)
        log.info("stopped", exit_code=self.exit_code)

    async def serve(self, *, install_signal_handlers: bool = True) -> int:
        """Run until SIGINT/SIGTERM (or :meth:`request_stop`); return the exit code."""
        loop = asyncio.get_running_loop()
        if install_signal_handlers:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.request_stop, signal.Signals(sig).name)
        try:
            await self.start()
            await self.wait_stopped()
        finally:
            await self.shutdown()
            if install_signal_handlers:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
        return self.exit_code


def run(config: Config) -> int:
    """Serve until stopped; the process exit code."""
    async def main() -> int:
        server = Server(config)
        return await server.serve()

    try:
        return asyncio.run(main())
    except StartupError as exc:
        log.error("startup failed", error=str(exc))
        return 1
