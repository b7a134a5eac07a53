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

The short CLI commands (``afmd list``, ``show``, ``pull``, ``doctor``, ``check-config`` ...)
fork from a light zygote of their own (:func:`run`): one that imports only what every
``python -m afmd`` imports (the CLI, not MLX, transformers or huggingface_hub), so that what
those libraries read from the environment at import (``HF_*``) is read by the child, as in a
fresh start; the zygote checks that it imported none of them. There is one such zygote per
environment that matters at import (the variables it may not differ in), started on first
use; the child's stdin, stdout and stderr are what the caller gives or pipes, and it runs
the exit handlers and waits for the threads a fresh interpreter would before it exits.

The zygote runs this file as a script; the test process uses :func:`spawn` and :func:`run`.
"""

from __future__ import annotations

import atexit
import contextlib
import io
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
#: What every ``python -m afmd`` imports, and the commands' own modules (they import nothing
#: that reads the environment at import time): the CLI zygote's preload.
CLI_PRELOAD = ("afmd.cli.main", "afmd.cli.model_commands", "afmd.cli.doctor",
               "afmd.engine.models.describe")
#: What the CLI zygote must not have imported: the first three read ``HF_*`` at import
#: (:data:`CLI_RUNTIME_ENV_PREFIXES`), and a light command (the tests time some) must pay
#: for MLX and Sanic itself where it imports them, as a fresh start does.
CLI_NOT_PRELOADED = ("huggingface_hub", "transformers", "mlx_lm", "mlx", "sanic")
#: Beyond what a server child may differ in: variables afmd reads only when it runs
#: (afmd/paths.py, afmd/hub, afmd/config/load.py), and that only libraries the CLI
#: zygote does not import read at import.
CLI_RUNTIME_ENV_PREFIXES = (*RUNTIME_ENV_PREFIXES, "HF_", "HUGGINGFACE_")
CLI_RUNTIME_ENV = RUNTIME_ENV | {"HOMEBREW_PREFIX"}
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


def _reseed() -> None:
    """Seed what a fresh interpreter seeds from the OS when it imports it: every child of
    one zygote would share the zygote's random state."""
    seed = int.from_bytes(os.urandom(4), "little")
    if "random" in sys.modules:
        sys.modules["random"].seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    if "mlx.core" in sys.modules:
        sys.modules["mlx.core"].random.seed(seed)


def _exit_as_python_does() -> None:
    """What a fresh interpreter does after its ``__main__`` returns: wait for the threads
    that are not daemons, then run the exit handlers (logging's flush among them)."""
    threading._shutdown()  # type: ignore[attr-defined]  # as multiprocessing's children do
    atexit._run_exitfuncs()


def _run_child(spec: dict[str, Any], fds: list[int], inherited: list[socket.socket],
               cli: bool = False) -> None:
    """In the forked child: become ``python -m afmd <argv>``; never returns."""
    code = 1
    interrupted = False
    try:
        signal.set_wakeup_fd(-1)
        for sock in inherited:
            sock.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the zygote's own handlers
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
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
        # imports MLX (and Python's and NumPy's from the OS).
        _reseed()
        sys.argv = ["afmd", *spec["argv"]]
        sys.path[0] = spec["cwd"]  # as `python -m` puts the working folder first
        from afmd.cli.main import main

        try:
            code = main(spec["argv"])
        except SystemExit as exc:
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)  # as the interpreter reports sys.exit("...")
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:
        import traceback

        traceback.print_exc()
        code = 1
        interrupted = isinstance(exc, KeyboardInterrupt)
    finally:
        if cli:
            with contextlib.suppress(BaseException):
                _exit_as_python_does()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        if cli and interrupted:  # an interrupted interpreter ends by SIGINT (Popen: -2)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def _returncode(status: int) -> int:
    """As subprocess.Popen reports it: the exit code, or minus the signal that ended it."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def serve_forks(path: str, cli: bool = False) -> None:
    """The zygote's loop: fork a child per request, report each child's exit to the
    connection that asked for it; stop (killing what is left) when the parent is gone."""
    parent = os.getppid()
    for name in CLI_PRELOAD if cli else PRELOAD:
        __import__(name)
    if cli:
        loaded = [name for name in CLI_NOT_PRELOADED if name in sys.modules]
        assert not loaded, f"the CLI zygote imported {loaded} (see CLI_NOT_PRELOADED)"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    # A child's exit wakes the loop (and is reported at once), not the next poll.
    woken, wake = socket.socketpair()
    wake.setblocking(False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake.fileno(), warn_on_full_buffer=False)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    children: dict[int, socket.socket] = {}
    try:
        while os.getppid() == parent:
            readable, _, _ = select.select([listener, woken], [], [], 1.0)
            if woken in readable:
                with contextlib.suppress(BlockingIOError):
                    woken.recv(1 << 10, socket.MSG_DONTWAIT)
                readable.remove(woken)
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
                _run_child(spec, fds, [listener, conn, woken, wake, *children.values()], cli)
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

    def __init__(self, pid: int, conn: socket.socket, stderr: IO[str] | None) -> None:
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
    from afmd.cli.main import LIBRARY_ENVIRONMENT

    return {**LIBRARY_ENVIRONMENT, **env}


def _import_time_env(env: Mapping[str, str], cli: bool) -> dict[str, str]:
    """What of ``env`` a fresh interpreter may read at import: what a zygote's children
    must have as the zygote had it."""
    prefixes = CLI_RUNTIME_ENV_PREFIXES if cli else RUNTIME_ENV_PREFIXES
    names = CLI_RUNTIME_ENV if cli else RUNTIME_ENV
    return {key: value for key, value in env.items()
            if not key.startswith(prefixes) and key not in names}


class _Zygote:
    def __init__(self, env: Mapping[str, str] | None = None, cli: bool = False) -> None:
        self.cli = cli
        self.folder = tempfile.mkdtemp(prefix="afmd-zygote-")
        self.path = os.path.join(self.folder, "fork.sock")
        if cli:
            self.env = dict(os.environ if env is None else env)
        else:
            self.env = _as_serve_sets(os.environ)
            self.env.pop("AFMD_CONFIG", None)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.path, *(["cli"] if cli else [])],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=self.env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line == "ready\n", f"the zygote did not start: {line!r}"
        atexit.register(self.close)

    def fits(self, env: dict[str, str]) -> bool:
        if self.cli:
            return _import_time_env(env, True) == _import_time_env(self.env, True)
        return _import_time_env(_as_serve_sets(env), False) == _import_time_env(self.env, False)

    def _fork(self, argv: Sequence[str], env: dict[str, str], cwd: str,
              fds: Sequence[int]) -> tuple[int, socket.socket]:
        """Fork a child with ``fds`` as its stdin, stdout and stderr; its pid and the
        connection its exit code comes back on."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        message = json.dumps({"argv": list(argv), "env": env, "cwd": cwd}).encode() + b"\n"
        socket.send_fds(conn, [message], list(fds))
        pid = b""
        while not pid.endswith(b"\n"):
            chunk = conn.recv(1)
            assert chunk, "the zygote closed the connection before forking"
            pid += chunk
        return int(pid), conn

    def fork(self, argv: Sequence[str], env: dict[str, str], cwd: str) -> ForkedServer:
        read_end, write_end = os.pipe()
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            pid, conn = self._fork(argv, env, cwd, [devnull, devnull, write_end])
        finally:
            os.close(write_end)
            os.close(devnull)
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
#: The CLI zygotes, by the environment that matters at import (sorted items).
_CLI_ZYGOTES: dict[tuple[tuple[str, str], ...], _Zygote] = {}


def _enabled() -> bool:
    return os.environ.get(OFF_ENV) != "1" and sys.platform.startswith("linux")


def spawn(argv: Sequence[str], env: dict[str, str], cwd: str) -> ForkedServer | None:
    """``afmd <argv>`` forked from this process's zygote, with stdin and stdout on
    /dev/null and stderr a pipe (``.stderr``, text); None where a fork would not be the
    same as a fresh start (see the module's docstring) or the zygote is off."""
    global _ZYGOTE
    if not _enabled():
        return None
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None or _ZYGOTE.proc.poll() is not None:
            _ZYGOTE = _Zygote()
        zygote = _ZYGOTE
    if not zygote.fits(env):
        return None
    return zygote.fork(argv, env, cwd)


def _text(data: bytes) -> str:
    """As ``subprocess.run(..., text=True)`` decodes output: the locale's encoding,
    universal newlines."""
    encoding = io.TextIOWrapper(io.BytesIO()).encoding
    return data.decode(encoding).replace("\r\n", "\n").replace("\r", "\n")


def run(argv: Sequence[str], *, env: dict[str, str], cwd: str, timeout: float,
        input: str | None = None, stdin: int | None = None,
        ) -> subprocess.CompletedProcess[str] | None:
    """``subprocess.run([python, -m, afmd, *argv], capture_output=True, text=True, ...)``,
    forked from the CLI zygote for this environment: the same stdin (``input`` piped,
    ``stdin=subprocess.DEVNULL``, or this process's), stdout and stderr captured, the exit
    code (minus the signal that ended it) and TimeoutExpired after killing it. None where
    the zygote is off."""
    if not _enabled():
        return None
    assert stdin in (None, subprocess.DEVNULL) and (input is None or stdin is None)
    key = tuple(sorted(_import_time_env(env, True).items()))
    with _ZYGOTE_LOCK:
        zygote = _CLI_ZYGOTES.get(key)
        if zygote is None or zygote.proc.poll() is not None:
            zygote = _CLI_ZYGOTES[key] = _Zygote(env, cli=True)
    command = [sys.executable, "-m", "afmd", *argv]
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    in_read, in_write = os.pipe() if input is not None else (-1, -1)
    stdin_fd = (in_read if input is not None
                else os.open(os.devnull, os.O_RDONLY) if stdin == subprocess.DEVNULL else 0)
    try:
        pid, conn = zygote._fork(argv, env, cwd, [stdin_fd, out_write, err_write])
    finally:
        for fd in (out_write, err_write, *([stdin_fd] if stdin_fd != 0 else [])):
            os.close(fd)
    child = ForkedServer(pid, conn, None)
    captured: dict[int, bytes] = {}

    def drain(fd: int) -> None:
        with os.fdopen(fd, "rb") as stream:
            captured[fd] = stream.read()

    def feed() -> None:
        assert input is not None
        with contextlib.suppress(BrokenPipeError), os.fdopen(in_write, "wb") as stream:
            stream.write(input.encode(io.TextIOWrapper(io.BytesIO()).encoding))

    threads = [threading.Thread(target=drain, args=(fd,), daemon=True)
               for fd in (out_read, err_read)]
    if input is not None:
        threads.append(threading.Thread(target=feed, daemon=True))
    for thread in threads:
        thread.start()
    try:
        child.wait(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        for thread in threads:
            thread.join()
        raise subprocess.TimeoutExpired(command, timeout, _text(captured.get(out_read, b"")),
                                        _text(captured.get(err_read, b""))) from None
    for thread in threads:  # the outputs close when the child (and what it started) exits
        thread.join()
    assert child.returncode is not None
    return subprocess.CompletedProcess(command, child.returncode,
                                       _text(captured[out_read]), _text(captured[err_read]))


if __name__ == "__main__":
    # The zygote's own SIGTERM (from close) must not reach the loop as an exception that
    # skips killing its children: turn it into a normal exit through `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sys.path[0] = os.getcwd()  # as `python -m afmd` has it, not this file's folder
    serve_forks(sys.argv[1], cli=sys.argv[2:] == ["cli"])
