"""The grammar compile worker: every new grammar is compiled first in a separate process.

A grammar compile runs llguidance's native code on a client's schema. Some inputs make it
recurse without end (a stack overflow, SIGSEGV: the process dies with every request in
flight, and no log line) and some could make it run far too long; a thread cannot be
stopped in either case, and a bigger thread stack does not end an endless recursion. So
the server never compiles a grammar text it has not seen compile elsewhere: a spawned
worker validates each new text (with the model's tokenizer, which special-token
references in a grammar need) under a time bound. If the worker dies or overruns, that
request gets a 400 naming its field, the worker is killed and started afresh for the
next compile, and the server is untouched. Only a text the worker accepted is then built
into a matcher in the server, where llguidance, being deterministic, does the same work
again without fault.

The worker receives a tokenizer's serialized form once per model (llguidance rebuilds
it: the worker imports neither transformers nor MLX), and answers ``(is_error,
messages)`` as ``LLMatcher.validate_grammar_with_warnings`` does, having also built the
matcher (where the lexer's automata are made: the costly part). One compile at a
time: compiles take milliseconds and results are cached by text
(:mod:`afmd.grammar.compiler`). A large schema's can take seconds, and requests bringing
new ones wait for each other; one waits no longer than its deadline
(:data:`COMPILE_DEADLINE`), so a request answered 504 meanwhile never keeps the worker
busy after it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from afmd.logs import get_logger

log = get_logger("afmd.grammar")

#: Set in the worker's environment to the socket it serves; afmd's CLI entry checks it
#: first, so the frozen binary (which has no ``-c``) can be its own worker.
WORKER_ENV = "AFMD_GRAMMAR_WORKER_FD"

#: Longest a single compile may run in the worker before the request is refused.
COMPILE_TIMEOUT_S = 10.0
#: Longest the worker may take to build a model's tokenizer (a 151k vocabulary's is the
#: slow case) or to start.
SETUP_TIMEOUT_S = 120.0


#: The deadline (``time.monotonic()``) of the request a thread compiles for, if any. The
#: compile is reached deep inside a round's build, on the thread the build runs on, which
#: runs in the request's context (afmd.service.round_builder sets it there).
COMPILE_DEADLINE: ContextVar[float | None] = ContextVar("afmd_compile_deadline",
                                                        default=None)


class CompileAbandoned(Exception):
    """The request's deadline passed while its compile waited for the worker: it was not
    compiled (and has no verdict)."""


class CompileFailed(Exception):
    """The worker died or overran on a grammar: the input is refused, the server lives."""


@dataclass(frozen=True, slots=True)
class TokenizerSource:
    """What the worker needs to build the same llguidance tokenizer the server has."""

    serialized: str  # the Hugging Face ``tokenizer.json`` text
    n_vocab: int
    eos_ids: tuple[int, ...]


def serve_from_env() -> None:
    """The worker process's entry: serve the socket :data:`WORKER_ENV` names."""
    _serve(Connection(int(os.environ[WORKER_ENV])))


def _command() -> tuple[list[str], dict[str, str]]:
    """The worker's command line and the environment additions it needs."""
    if getattr(sys, "frozen", False):
        return [sys.executable], {}
    # A fresh interpreter running this module alone: not multiprocessing's spawn, which
    # re-runs the parent's main script in the child unless it is guarded. It finds afmd
    # where this process did, whatever its working directory.
    here = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    return ([sys.executable, "-c",
             "from afmd.grammar.sandbox import serve_from_env; serve_from_env()"],
            {"PYTHONPATH": path})


def _serve(conn: Connection) -> None:
    """The worker's loop: tokenizers by key, then grammars to validate."""
    from llguidance import LLMatcher, LLTokenizer

    tokenizers: dict[int, Any] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the server is gone: so is the worker
            return
        kind = message[0]
        # A Python-level error (a grammar llguidance's reader refuses by raising) is an
        # answer like any other; only a fault or an overrun costs the worker.
        if kind == "tokenizer":
            _, key, source = message
            try:
                tokenizers[key] = LLTokenizer(source.serialized, n_vocab=source.n_vocab,
                                              eos_token=list(source.eos_ids))
                conn.send(("ok",))
            except Exception as exc:  # sent back, raised there
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
        elif kind == "forget":  # the server freed that tokenizer's model: no answer
            tokenizers.pop(message[1], None)
        elif kind == "validate":
            _, key, grammar = message
            tokenizer = tokenizers.get(key) if key is not None else None
            try:
                is_error, messages = LLMatcher.validate_grammar_with_warnings(
                    grammar, tokenizer)
                if not is_error and tokenizer is not None:
                    # Validating does not build the lexer's automata; building the
                    # matcher does, and that is where a schema can cost seconds and
                    # gigabytes: it happens here first, under the time bound.
                    matcher = LLMatcher(tokenizer, grammar, log_level=0)
                    if matcher.is_error():
                        is_error, messages = True, [matcher.get_error()]
            except Exception as exc:  # the grammar's error: a verdict
                is_error, messages = True, [str(exc) or type(exc).__name__]
            conn.send((bool(is_error), list(messages)))
        elif kind == "crash":  # tests: a worker death on demand
            os.abort()


class CompileWorker:
    """The server's handle on its compile worker: started on first use, restarted after
    a death or an overrun, one exchange at a time (callers are request threads)."""

    def __init__(self, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._process: Any = None
        self._conn: Connection | None = None
        self._known: set[int] = set()
        # Keys of tokenizers the server freed, for the worker to drop at the next exchange.
        self._forgotten: list[int] = []
        self.restarts = 0  # worker deaths and overruns so far, for tests and metrics

    def validate(self, grammar: str, key: int | None,
                 source: TokenizerSource | None) -> tuple[bool, tuple[str, ...]]:
        """``validate_grammar_with_warnings`` in the worker; :class:`CompileFailed` if the
        worker dies or overruns on it, :class:`CompileAbandoned` if the request's deadline
        (:data:`COMPILE_DEADLINE`) passes while it waits for the worker. A compile that
        began runs to its end, past the deadline too: its verdict is kept for the text."""
        deadline = COMPILE_DEADLINE.get()
        wait = -1.0 if deadline is None else max(deadline - time.monotonic(), 0.0)
        if not self._lock.acquire(timeout=wait):
            raise CompileAbandoned("the request's deadline passed while it waited for the "
                                   "grammar compiler")
        try:
            conn = self._connection()
            self._send_forgotten(conn)
            if key is not None and key not in self._known:
                if source is None:
                    raise ValueError("a tokenizer the worker does not know needs its source")
                answer = self._exchange(conn, ("tokenizer", key, source), SETUP_TIMEOUT_S,
                                        "setting up the tokenizer")
                if answer[0] != "ok":
                    raise RuntimeError(f"the compile worker cannot build the tokenizer: "
                                       f"{answer[1]}")
                self._known.add(key)
            reply = self._exchange(conn, ("validate", key, grammar), self.timeout_s,
                                   "compiling the grammar")
            is_error, messages = reply
            return bool(is_error), tuple(messages)
        finally:
            self._lock.release()

    def forget(self, key: int) -> None:
        """The server freed the tokenizer known by ``key``: the worker drops its copy at the
        next exchange. Called from a finalizer (any thread, perhaps one inside
        :meth:`validate`), so it only notes the key: a list's ``append`` is atomic."""
        self._forgotten.append(key)

    @property
    def tokenizers(self) -> int:
        """How many tokenizers the worker holds (tests)."""
        with self._lock:
            if self._conn is not None:
                self._send_forgotten(self._conn)
            return len(self._known)

    def crash(self) -> None:
        """Make the worker die as a compiler fault would (tests and the benchmark)."""
        with self._lock:
            conn = self._connection()
            conn.send(("crash",))
            self._exchange(conn, None, SETUP_TIMEOUT_S, "crashing on purpose",
                           expect_death=True)

    def start(self) -> None:
        """Start the worker now rather than on the first compile."""
        with self._lock:
            self._connection()

    def close(self) -> None:
        with self._lock:
            self._stop()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    # -- under the lock --
    def _send_forgotten(self, conn: Connection) -> None:
        while self._forgotten:
            key = self._forgotten.pop()
            if key in self._known:
                self._known.discard(key)
                with contextlib.suppress(OSError):  # a dead worker is found by the exchange
                    conn.send(("forget", key))

    def _connection(self) -> Connection:
        if self._conn is None or self._process is None or self._process.poll() is not None:
            self._stop()
            ours, theirs = socket.socketpair()
            fd = theirs.fileno()
            command, extra = _command()
            env = {**os.environ, **extra, WORKER_ENV: str(fd)}
            try:
                process = subprocess.Popen(command, env=env, pass_fds=(fd,),
                                           stdin=subprocess.DEVNULL, close_fds=True)
            finally:
                theirs.close()
            self._process, self._conn = process, Connection(ours.detach())
            self._known = set()
        return self._conn

    def _exchange(self, conn: Connection, message: Any, timeout_s: float, what: str,
                  *, expect_death: bool = False) -> Any:
        try:
            if message is not None:
                conn.send(message)
            if conn.poll(timeout_s):
                return conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            code = self._stop()
            self.restarts += 1
            if expect_death:
                return None
            log.warning("grammar compile worker died; the request is refused and the "
                        "worker restarted", exit_code=code, task=what)
            raise CompileFailed(f"the grammar compiler crashed while {what}") from None
        self._stop()
        self.restarts += 1
        log.warning("grammar compile worker overran; the request is refused and the worker "
                    "restarted", timeout_s=timeout_s, task=what)
        raise CompileFailed(
            f"the grammar compiler took longer than {timeout_s:g} s while {what}")

    def _stop(self) -> int | None:
        """Close and reap the worker; its exit status (negative: the signal), if known."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        process, self._process = self._process, None
        if process is None:
            return None
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=0.2)  # a worker that died has already exited
        if process.poll() is None:
            process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
        return process.returncode


_worker = CompileWorker()


def compile_worker() -> CompileWorker:
    """The process's compile worker (one per server)."""
    return _worker


__all__ = ["COMPILE_DEADLINE", "COMPILE_TIMEOUT_S", "CompileAbandoned", "CompileFailed",
           "CompileWorker", "TokenizerSource", "compile_worker"]
