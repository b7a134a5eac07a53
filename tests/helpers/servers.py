"""``afmd serve`` as a child process on a free port: the real thing, with its signals, exit
code and JSON log (events to wait for). :mod:`helpers.inprocess` runs the server inside the
test process instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from helpers import zygote

ROOT = Path(__file__).resolve().parent.parent.parent

#: Servers whose exit code a test asserts dump every thread's stack if they abort.
DIAGNOSE = {"PYTHONFAULTHANDLER": "1"}


@dataclass
class ServerProcess:
    proc: subprocess.Popen[str] | zygote.ForkedServer
    events: list[dict[str, Any]] = field(default_factory=list)
    raw_lines: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def url(self) -> str:
        for address in self.addresses:
            if address.startswith("http://"):
                return address
        raise AssertionError(f"no TCP listener: {self.addresses}")

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def _reader(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cond:
                self.raw_lines.append(line)
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if isinstance(event, dict):
                        self.events.append(event)
                        if event.get("event") == "listening":
                            self.addresses = list(event.get("addresses", []))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_event(self, name: str, timeout: float = 30.0, **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for event in self.events:
                    if event.get("event") == name and all(
                        event.get(k) == v for k, v in match.items()
                    ):
                        return event
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.proc.poll() is not None and not self._alive_reader()):
                    raise AssertionError(
                        f"no '{name}' event; log:\n" + "".join(self.raw_lines[-50:])
                    )
                self._cond.wait(min(remaining, 0.2))

    def _alive_reader(self) -> bool:
        return self.proc.stderr is not None and not self.proc.stderr.closed

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("server exited:\n" + "".join(self.raw_lines[-50:]))
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.05)
        raise AssertionError("server never became healthy:\n" + "".join(self.raw_lines[-50:]))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_text(self) -> str:
        return "".join(self.raw_lines)


def afmd_command() -> list[str]:
    return [sys.executable, "-m", "afmd"]


def run_afmd(args: Sequence[str], *, env: dict[str, str], cwd: str | Path, timeout: float,
             input: str | None = None, stdin: int | None = None,
             ) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([*afmd_command(), *args], capture_output=True, text=True, ...)``
    for a short CLI command: forked from a warm interpreter (:func:`helpers.zygote.run`)
    where that is the same as a fresh start for what afmd does, plainly otherwise."""
    done = zygote.run(args, env=env, cwd=str(cwd), timeout=timeout, input=input, stdin=stdin)
    if done is not None:
        return done
    return subprocess.run([*afmd_command(), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(cwd), input=input, stdin=stdin)


def start_server(
    tmp_path: Path,
    *,
    config: str | None = None,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    ready: bool = True,
    port: bool = True,
    fork: bool = True,
) -> ServerProcess:
    """Start ``afmd serve`` on a free port; wait for its model unless ``ready=False``.

    The process is forked from a warm interpreter (:mod:`helpers.zygote`) where that is
    the same as a fresh start for what afmd does; ``fork=False`` execs a fresh interpreter
    always, for a test that reads the process's own command line."""
    cmd = [*afmd_command(), "serve", "--log-format", "json"]
    if config is not None:
        path = tmp_path / f"config-{time.monotonic_ns()}.toml"
        path.write_text(config)
        cmd += ["--config", str(path)]
    if port:
        cmd += ["--port", "0"]
    cmd += list(args)
    full_env = {**os.environ, **(env or {})}
    full_env.pop("AFMD_CONFIG", None)
    proc: Any = (zygote.spawn(cmd[len(afmd_command()):], full_env, str(tmp_path))
                 if fork else None)
    if proc is None:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
            cwd=str(tmp_path),
        )
    server = ServerProcess(proc)
    threading.Thread(target=server._reader, daemon=True).start()
    server.wait_event("listening", timeout=60)
    if ready:
        server.wait_ready()
    return server
