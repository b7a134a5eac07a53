"""Listening sockets afmd binds itself, served by Sanic, rebuilt when they break.

Sanic's runner would fork workers, install its own signal handlers and bind Unix sockets
world-writable; afmd instead binds each listener itself (TCP and/or a 0600 Unix socket)
and hands the socket to Sanic's ``create_server``. :class:`Listeners` owns them for the
server's whole life: binding, serving, the loop exception handler that notices a broken
accept(), tearing down and rebinding for the :class:`~afmd.http.transport.supervisor.
ListenerSupervisor`, and closing (a socket file is removed only while it is still ours).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import os
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sanic import Sanic

from afmd.cli.port_owners import holder_text
from afmd.http.compat import accept_failure, forget_accept_reader
from afmd.http.transport.connection import AfmdProtocol
from afmd.http.transport.supervisor import ListenerState, ListenerSupervisor, Supervised
from afmd.ports import host_port

#: What ``loop.set_exception_handler`` takes (and ``get_exception_handler`` gives back).
_ExceptionHandler = Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object]


class StartupError(Exception):
    """A problem that stops the server before it serves (exit code 1)."""


_SO_ACCEPTCONN = getattr(socket, "SO_ACCEPTCONN", None)


@dataclass
class Listener:
    kind: str  # "tcp" | "unix"
    address: Any  # (host, port) as bound (the real port, also when port 0 was asked) or path
    sock: socket.socket
    protocol: type[AfmdProtocol] | None = None  # this listener's own protocol class
    # Sanic's AsyncioServer; Any, because Sanic declares its ``server`` attribute (the
    # asyncio server, closed to stop accepting) as always None.
    server: Any = None
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
        return f"http://{host_port(host, port)}"

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


def is_loopback(host: str) -> bool:
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
            raise StartupError(f"cannot listen on {host_port(host, port)}: the port is "
                               f"already in use {holder_text(port)}") from None
        raise StartupError(f"cannot listen on {host_port(host, port)}: {exc.strerror}") from None
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


class Listeners:
    """The server's listeners, from binding to closing, supervised while they serve."""

    def __init__(self, app: Sanic, on_gave_up: Callable[[ListenerState], None]) -> None:
        self.app = app
        self.items: list[Listener] = []
        self.supervisor = ListenerSupervisor(
            teardown=self._teardown, rebind=self._rebind, on_exhausted=on_gave_up)
        #: The first listener's Sanic server: it runs the app's start and stop events.
        #: (A Sanic AsyncioServer: Any, as sanic.server is not among the Sanic modules afmd
        #: imports, tests/meta/test_compat.py.)
        self.lifecycle: Any = None
        self.stopping = False
        self._previous_handler: _ExceptionHandler | None = None
        self._handler_installed = False

    def add(
        self, kind: str, address: Any, sock: socket.socket, protocol: type[AfmdProtocol]
    ) -> None:
        self.items.append(Listener(kind, address, sock, protocol))

    async def start(self, bind: Callable[[], None]) -> None:
        """Bind (``bind`` calls :meth:`add`) and serve every listener, then watch them; on
        failure nothing is left bound."""
        try:
            bind()
            for listener in self.items:
                await self._serve(listener)
        except BaseException:
            self.close()
            raise
        loop = asyncio.get_running_loop()
        self._previous_handler = loop.get_exception_handler()
        loop.set_exception_handler(self._loop_exception)
        self._handler_installed = True
        self.supervisor.listeners = list(self.items)
        self.supervisor.start()

    async def _serve(self, listener: Listener) -> None:
        server = await self.app.create_server(
            sock=listener.sock,
            protocol=listener.protocol,
            return_asyncio_server=True,
            asyncio_server_kwargs={"start_serving": False},
        )
        assert server is not None  # None only without return_asyncio_server
        listener.server = server
        if self.lifecycle is None:
            await server.startup()
            await server.before_start()
            self.lifecycle = server
        await server.start_serving()

    async def stop_accepting(self) -> None:
        """No more connections (existing ones live on), and no more rebuilding."""
        self.stopping = True
        await self.supervisor.stop()
        for listener in self.items:
            if listener.server is not None and listener.server.server is not None:
                with contextlib.suppress(Exception):
                    listener.server.server.close()

    def close(self) -> None:
        """Close every socket that is still ours and remove our socket files."""
        for listener in self.items:
            owned = listener.kind == "unix" and listener.owns_path()
            if listener.fd_is_ours():
                with contextlib.suppress(Exception):
                    listener.sock.close()
            if owned:  # never remove a file that another server put there meanwhile
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(listener.address)

    def restore_exception_handler(self) -> None:
        if self._handler_installed:
            self._handler_installed = False
            asyncio.get_running_loop().set_exception_handler(self._previous_handler)

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """An accept() that raises (a listener shut down underneath makes plain asyncio
        retry and log on every loop turn): stop the storm and have the listener rebuilt."""
        sock = accept_failure(context)
        for listener in self.items:
            if sock is not None and listener.sock is sock:
                forget_accept_reader(loop, listener.fd)
                self.supervisor.poke(listener, f"accept() failed: {context.get('exception')}")
                return
        if self._previous_handler is not None:
            self._previous_handler(loop, context)
        else:
            loop.default_exception_handler(context)

    def _teardown(self, supervised: Supervised) -> None:
        listener = supervised
        assert isinstance(listener, Listener)
        ours = listener.fd_is_ours()
        forget_accept_reader(asyncio.get_running_loop(), listener.fd)
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

    async def _rebind(self, supervised: Supervised) -> None:
        listener = supervised
        assert isinstance(listener, Listener)
        if self.stopping:
            raise RuntimeError("the server is stopping")
        if listener.kind == "tcp":
            host, port = listener.address[:2]
            sock = bind_tcp(host, port)
        else:
            sock = bind_unix(listener.address)
        try:
            listener.adopt(sock)
            await self._serve(listener)
        except BaseException:
            listener.server = None
            with contextlib.suppress(OSError):
                sock.close()
            raise
