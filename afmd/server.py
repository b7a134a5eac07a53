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
import ipaddress
import os
import signal
import socket
import stat
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from afmd.config import Config
from afmd.engine.models import ModelRegistry
from afmd.http.app import AppState, create_app
from afmd.http.protocol import GateContext, make_protocol, route_checker
from afmd.http.routes import STATE_ROUTES, interrupt_requests, server_stopping_error
from afmd.http.supervisor import ListenerState, ListenerSupervisor, Supervised
from afmd.logs import get_logger
from afmd.pipeline import ChatPipeline
from afmd.scheduler import Scheduler

log = get_logger("afmd.server")


#: After shutdown_grace, how long the requests still running get to write their ending
#: (an error) before their connections are closed regardless.
FINAL_WRITE_SECONDS = 1.0


class StartupError(Exception):
    """A problem that stops the server before it serves (exit code 1)."""


_SO_ACCEPTCONN = getattr(socket, "SO_ACCEPTCONN", None)


@dataclass
class Listener:
    kind: str  # "tcp" | "unix"
    address: Any  # (host, port) as bound (the real port, also when port 0 was asked) or path
    sock: socket.socket
    protocol: Any = None  # the AfmdProtocol subclass for this listener
    server: Any = None  # sanic AsyncioServer
    fd: int = -1
    ident: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket
    path_ident: tuple[int, int] | None = None  # of the Unix socket's file

    def __post_init__(self) -> None:
        self.adopt(self.sock)

    def adopt(self, sock: socket.socket) -> None:
        """Make ``sock`` this listener's socket, remembering what it is to spot swaps."""
        self.sock = sock
        self.fd = sock.fileno()
        st = os.fstat(self.fd)
        self.ident = (st.st_dev, st.st_ino)
        self.path_ident = None
        if self.kind == "unix":
            with contextlib.suppress(OSError):
                pst = os.lstat(self.address)
                self.path_ident = (pst.st_dev, pst.st_ino)

    def describe(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.address}"
        host, port = self.address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def fd_is_ours(self) -> bool:
        try:
            st = os.fstat(self.fd)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.ident

    def owns_path(self) -> bool:
        try:
            st = os.lstat(self.address)
        except OSError:
            return False
        return self.path_ident is not None and (st.st_dev, st.st_ino) == self.path_ident

    def problem(self) -> str | None:
        """Why this listener cannot accept connections, or None when it is healthy."""
        if self.server is None:
            return None  # not started yet
        try:
            st = os.fstat(self.fd)
        except OSError:
            return "the listening socket's file descriptor was closed"
        if (st.st_dev, st.st_ino) != self.ident:
            return "the listening socket's file descriptor was closed and reused"
        if not self.server.is_serving():
            return "the listener stopped serving"
        if _SO_ACCEPTCONN is not None:
            try:
                accepting = self.sock.getsockopt(socket.SOL_SOCKET, _SO_ACCEPTCONN)
            except OSError as exc:
                return f"the listening socket failed: {exc.strerror or exc}"
            if not accepting:
                return "the listening socket is no longer listening (shut down)"
        if self.kind == "unix" and not self.owns_path():
            return "the socket file was removed or replaced"
        return None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
        self.gate = GateContext(config.server, route_checker(self.app),
                                access_log=config.log.access_log, direct=STATE_ROUTES)
        self.listeners: list[Listener] = []
        self.supervisor = ListenerSupervisor(
            teardown=self._teardown_listener,
            rebind=self._rebind_listener,
            on_exhausted=self._listener_gave_up,
        )
        self._stop = asyncio.Event()
        self._stopping = False
        self._started = False
        self._previous_exception_handler: Any = None
        self._handler_installed = False
        self._lifecycle: Any = None
        self.exit_code = 0

    @property
    def listener_state_callbacks(self) -> list[Callable[[ListenerState], None]]:
        """Called (in the server's loop) with every :class:`ListenerState`; the states so
        far are in ``self.supervisor.history``."""
        return self.supervisor.callbacks

    def listener_states(self) -> AsyncIterator[ListenerState]:
        """Every :class:`ListenerState` from now on (iterate in the server's loop)."""
        return self.supervisor.subscribe()

    # -- lifecycle --
    def _protocol_for(self, kind: str, host: str = "") -> Any:
        """One protocol class per listener: whether it checks Host depends on where it is.

        The Unix socket and loopback TCP are what a DNS-rebinding page would reach, so they
        always check; a listener on another interface checks only when allowed_hosts says
        which names are valid. ``"*"`` in allowed_hosts turns the check off.
        """
        allowed = self.config.server.allowed_hosts
        loopback = kind == "tcp" and _is_loopback(host)
        check = kind == "unix" or loopback or bool(allowed)
        extra = (host,) if loopback else ()
        policy = self.gate.policy(check_host=check, extra_hosts=extra)
        return make_protocol(self.gate, policy, kind)

    def _bind_all(self) -> None:
        server = self.config.server
        if server.host:
            sock = bind_tcp(server.host, server.port)
            listener = Listener("tcp", sock.getsockname(), sock)
            listener.protocol = self._protocol_for("tcp", server.host)
            self.listeners.append(listener)
        if server.unix_socket:
            sock = bind_unix(server.unix_socket)
            listener = Listener("unix", server.unix_socket, sock)
            listener.protocol = self._protocol_for("unix")
            self.listeners.append(listener)

    async def _serve_listener(self, listener: Listener) -> None:
        listener.server = await self.app.create_server(
            sock=listener.sock,
            protocol=listener.protocol,
            return_asyncio_server=True,
            asyncio_server_kwargs={"start_serving": False},
        )
        if not self._started:
            await listener.server.startup()
            await listener.server.before_start()
            self._started = True
            self._lifecycle = listener.server  # runs the app's stop events at shutdown
        await listener.server.start_serving()

    async def start(self) -> None:
        try:
            self._bind_all()
            for listener in self.listeners:
                await self._serve_listener(listener)
        except BaseException:
            for listener in self.listeners:
                with contextlib.suppress(Exception):
                    listener.sock.close()
                if listener.kind == "unix" and listener.owns_path():
                    with contextlib.suppress(OSError):
                        os.unlink(listener.address)
            raise
        loop = asyncio.get_running_loop()
        self._previous_exception_handler = loop.get_exception_handler()
        loop.set_exception_handler(self._loop_exception)
        self._handler_installed = True
        self.supervisor.listeners = list(self.listeners)
        self.supervisor.start()
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
        for listener in self.listeners:
            self.supervisor.emit(ListenerState("running", listener.describe()))
        if default is not None and default.path.startswith("afmd:"):
            log.warning(
                "serving the built-in demo model: it has random weights and answers with "
                "nonsense text; configure a real model in [[models.model]] or pass --model",
                model=default.id,
            )

    # -- listener supervision --
    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """An accept() that raises (a listener shut down underneath makes plain asyncio
        retry and log on every loop turn): stop the storm and have the listener rebuilt."""
        exc = context.get("exception")
        handle = context.get("handle")
        callback = getattr(handle, "_callback", None)
        if isinstance(exc, OSError) and getattr(callback, "__name__", "") == "_accept_connection":
            args = getattr(handle, "_args", ())
            sock = args[1] if len(args) > 1 else None
            for listener in self.listeners:
                if listener.sock is sock:
                    self._forget_accept_reader(loop, listener.fd)
                    self.supervisor.poke(listener, f"accept() failed: {exc}")
                    return
        if self._previous_exception_handler is not None:
            self._previous_exception_handler(loop, context)
        else:
            loop.default_exception_handler(context)

    @staticmethod
    def _forget_accept_reader(loop: asyncio.AbstractEventLoop, fd: int) -> None:
        """Drop the loop's accept reader for ``fd`` (and only an accept reader: after the fd
        was closed underneath, its number may already belong to someone else)."""
        selector = getattr(loop, "_selector", None)
        if selector is None or fd < 0:
            return
        try:
            key = selector.get_key(fd)
        except (KeyError, ValueError, RuntimeError):
            return
        reader = key.data[0] if key.data else None
        if getattr(getattr(reader, "_callback", None), "__name__", "") == "_accept_connection":
            with contextlib.suppress(Exception):
                loop.remove_reader(fd)

    def _teardown_listener(self, supervised: Supervised) -> None:
        listener = supervised
        assert isinstance(listener, Listener)
        loop = asyncio.get_running_loop()
        ours = listener.fd_is_ours()
        self._forget_accept_reader(loop, listener.fd)
        if not ours:
            # The fd number is no longer this socket's: never close it through this object.
            with contextlib.suppress(OSError):
                listener.sock.detach()
        server = listener.server
        listener.server = None
        if server is not None and server.server is not None:
            with contextlib.suppress(Exception):
                server.server.close()  # stops accepting; existing connections live on
        if ours:
            with contextlib.suppress(OSError):
                listener.sock.close()

    async def _rebind_listener(self, supervised: Supervised) -> None:
        listener = supervised
        assert isinstance(listener, Listener)
        if self._stopping:
            raise RuntimeError("the server is stopping")
        if listener.kind == "tcp":
            host, port = listener.address[:2]
            sock = bind_tcp(host, port)
        else:
            sock = bind_unix(listener.address)
        try:
            listener.adopt(sock)
            await self._serve_listener(listener)
        except BaseException:
            listener.server = None
            with contextlib.suppress(OSError):
                sock.close()
            raise

    def _listener_gave_up(self, state: ListenerState) -> None:
        self.exit_code = 1
        self.request_stop(f"listener {state.listener} could not be restarted")

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
        return set(self.gate.connections)  # every listener's, restarted ones' included

    async def _close_when_idle(
        self, deadline: float, each_turn: Callable[[], None] | None = None
    ) -> None:
        """Close connections as they go idle until none is left or ``deadline`` passes."""
        while True:
            if each_turn is not None:
                each_turn()
            for conn in self._connections():
                conn.close_if_idle()
            if not self._connections() or time.monotonic() >= deadline:
                return
            await asyncio.sleep(0.02 if each_turn is not None else 0.05)

    async def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        await self.supervisor.stop()
        for listener in self.listeners:
            if listener.server is not None and listener.server.server is not None:
                with contextlib.suppress(Exception):
                    listener.server.server.close()
        await self._close_when_idle(time.monotonic() + self.config.server.shutdown_grace)
        if self._connections():
            # The grace period is over: what still runs ends the way any failure does
            # (an error event, [DONE] and the body's last chunk for a stream), then goes
            # idle and closes; only what cannot even do that in time is cut.
            error = server_stopping_error()
            await self._close_when_idle(
                time.monotonic() + FINAL_WRITE_SECONDS,
                each_turn=lambda: interrupt_requests(self.state, error),
            )
        for conn in self._connections():
            with contextlib.suppress(Exception):
                conn.close()
        for listener in self.listeners:
            owned = listener.kind == "unix" and listener.owns_path()
            if listener.fd_is_ours():
                with contextlib.suppress(Exception):
                    listener.sock.close()
            if owned:  # never remove a file that another server put there meanwhile
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(listener.address)
        if self._lifecycle is not None:
            with contextlib.suppress(Exception):
                await self._lifecycle.before_stop()
                await self._lifecycle.after_stop()
        await asyncio.to_thread(self.registry.close)
        if self._handler_installed:
            self._handler_installed = False
            asyncio.get_running_loop().set_exception_handler(self._previous_exception_handler)
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
