"""``afmd serve`` forked from a warm interpreter: the same ``afmd.cli.main.main`` in a process of
its own, without a fresh interpreter's start and imports each time.

Most of a test server's start is importing: Python, Sanic, afmd, then mlx-lm and
transformers when the model loads. The suite starts a hundred-odd servers on two cores, so
that import work was a large share of its whole CPU time. A zygote (one per test process,
started on first use) imports what ``afmd serve`` imports, then forks a child per server.
The child takes the stdio descriptors it is sent, the command line, the environment and the
working folder, and runs ``afmd.cli.main.main`` as ``python -m afmd`` would. Its signals, exit
code, log and sockets are its own: what the tests assert of a server process still holds.

What a fork does not give is what a fresh interpreter reads from the environment at import
time, so a server whose environment differs from the zygote's in anything but the
variables afmd reads at run time (``AFMD_*``, faulthandler's switch) is started plainly
(:func:`spawn` returns None). ``AFMD_TEST_NO_ZYGOTE=1`` starts every server plainly; the
zygote is Linux only (fork after importing MLX is not safe with Metal).

The zygote runs this file as a script; the test process uses :func:`spawn`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Any

#: Environment variables a child may have beyond (or unlike) the zygote's: afmd reads them
#: when it runs, not when it is imported.
RUNTIME_ENV_PREFIXES = ("AFMD_",)
#: Sanic reads ``SANIC_LOG_EXTRA`` at import, but sets it (and what it read) again when it
#: starts serving; a test process that ran a server in process has it set. MLX reads its
#: CUDA cache sizes when it first computes, and afmd sets them as a model loads
#: (afmd/engine/batch/backend.py), in process too.
RUNTIME_ENV = frozenset({"PYTHONFAULTHANDLER", "PYTEST_CURRENT_TEST", "SANIC_LOG_EXTRA",
                         "MLX_CUDA_GRAPH_CACHE_SIZE", "MLX_CUDA_SDPA_CACHE_SIZE"})
#: What ``afmd serve`` imports by the time its model answers (``-X importtime`` of a start).
PRELOAD = ("afmd.cli.main", "afmd.cli.model_commands", "afmd.server", "afmd.logs",
           "afmd.engine.models.model_registry",
           "afmd.engine.demo.builtin", "afmd.engine.batch.generation_thread", "mlx_lm",
           "mlx_lm.utils",
           "mlx_lm.tokenizer_utils", "transformers.models.auto.tokenization_auto",
           "transformers.tokenization_utils_fast")
OFF_ENV = "AFMD_TEST_NO_ZYGOTE"


# --- the zygote process ---------------------------------------------------------------

def _recv_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            raise ConnectionError("request cut short")
        data += more
    return json.loads(data), list(fds)


def _run_child(spec: dict[str, Any], fds: list[int], inherited: list[socket.socket]) -> None:
    """In the forked child: become ``python -m afmd <argv>``; never returns."""
    code = 1
    try:
        for sock in inherited:
            sock.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the zygote's own handler
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        os.chdir(spec["cwd"])
        os.environ.clear()
        os.environ.update(spec["env"])
        if os.environ.get("PYTHONFAULTHANDLER"):
            import faulthandler

            faulthandler.enable()
        # A fresh interpreter seeds MLX's default random state from the clock when it
        # imports MLX; every child of one zygote would share the zygote's.
        import mlx.core as mx

        mx.random.seed(int.from_bytes(os.urandom(4), "little"))
        sys.argv = ["afmd", *spec["argv"]]
        sys.path[0] = spec["cwd"]  # as `python -m` puts the working folder first
        from afmd.cli.main import main

        code = main(spec["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _returncode(status: int) -> int:
    """As subprocess.Popen reports it: the exit code, or minus the signal that ended it."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def serve_forks(path: str) -> None:
    """The zygote's loop: fork a child per request, report each child's exit to the
    connection that asked for it; stop (killing what is left) when the parent is gone."""
    parent = os.getppid()
    for name in PRELOAD:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    children: dict[int, socket.socket] = {}
    try:
        while os.getppid() == parent:
            readable, _, _ = select.select([listener], [], [], 0.1)
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                conn = children.pop(pid, None)
                if conn is not None:
                    with contextlib.suppress(OSError):
                        conn.sendall(f"{_returncode(status)}\n".encode())
                    conn.close()
            if not readable:
                continue
            conn, _ = listener.accept()
            try:
                spec, fds = _recv_request(conn)
            except (OSError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                _run_child(spec, fds, [listener, conn, *children.values()])
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            children[pid] = conn
    finally:
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


# --- the test process -----------------------------------------------------------------

class ForkedServer:
    """The part of :class:`subprocess.Popen` the tests use, for a zygote's child: its exit
    code comes from the zygote, the process's parent."""

    def __init__(self, pid: int, conn: socket.socket, stderr: IO[str]) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stderr = stderr
        self._conn = conn
        self._buffer = b""
        self._lock = threading.Lock()

    def _read_exit(self, timeout: float | None) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                return
            while not self._buffer.endswith(b"\n"):
                chunk = self._conn.recv(64)
                if not chunk:  # the zygote died: its child was killed with it
                    self._buffer = b"-9\n"
                    break
                self._buffer += chunk
            self.returncode = int(self._buffer)
            self._conn.close()

    def poll(self) -> int | None:
        self._read_exit(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read_exit(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"afmd (pid {self.pid})", timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped yet: the pid is still this process's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _as_serve_sets(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with what `afmd serve` sets before it imports mlx-lm."""
    from afmd.cli.main import QUIET_LIBRARIES

    return {**QUIET_LIBRARIES, **env}


class _Zygote:
    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="afmd-zygote-")
        self.path = os.path.join(self.folder, "fork.sock")
        self.env = _as_serve_sets(os.environ)
        self.env.pop("AFMD_CONFIG", None)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.path], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, text=True, env=self.env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line == "ready\n", f"the zygote did not start: {line!r}"
        atexit.register(self.close)

    def fits(self, env: dict[str, str]) -> bool:
        env = _as_serve_sets(env)
        keys = set(env) | set(self.env)
        return all(env.get(key) == self.env.get(key) for key in keys
                   if not key.startswith(RUNTIME_ENV_PREFIXES) and key not in RUNTIME_ENV)

    def fork(self, argv: Sequence[str], env: dict[str, str], cwd: str) -> ForkedServer:
        read_end, write_end = os.pipe()
        devnull = os.open(os.devnull, os.O_RDWR)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            message = json.dumps({"argv": list(argv), "env": env, "cwd": cwd}).encode() + b"\n"
            socket.send_fds(conn, [message], [devnull, devnull, write_end])
        finally:
            os.close(write_end)
            os.close(devnull)
        pid = b""
        while not pid.endswith(b"\n"):
            chunk = conn.recv(1)
            assert chunk, "the zygote closed the connection before forking"
            pid += chunk
        return ForkedServer(int(pid), conn, os.fdopen(read_end, "r"))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self.folder)


_ZYGOTE: _Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def spawn(argv: Sequence[str], env: dict[str, str], cwd: str) -> ForkedServer | None:
    """``afmd <argv>`` forked from this process's zygote, with stdin and stdout on
    /dev/null and stderr a pipe (``.stderr``, text); None where a fork would not be the
    same as a fresh start (see the module's docstring) or the zygote is off."""
    global _ZYGOTE
    if os.environ.get(OFF_ENV) == "1" or not sys.platform.startswith("linux"):
        return None
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None or _ZYGOTE.proc.poll() is not None:
            _ZYGOTE = _Zygote()
        zygote = _ZYGOTE
    if not zygote.fits(env):
        return None
    return zygote.fork(argv, env, cwd)


if __name__ == "__main__":
    # The zygote's own SIGTERM (from close) must not reach the loop as an exception that
    # skips killing its children: turn it into a normal exit through `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sys.path[0] = os.getcwd()  # as `python -m afmd` has it, not this file's folder
    serve_forks(sys.argv[1])
