"""Starting and stopping the servers under test, one at a time, each on its own free port."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afmd.ports import free_ports
from bench import client

HOST = "127.0.0.1"


def rss_mb(pid: int) -> float | None:
    """VmRSS of a process, in MiB (None when it is gone or /proc is missing)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (all threads), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def afmd_config(port: int, *, default: str = "demo-32k", access_log: bool = False,
                max_concurrent: int = 16, extra_models: str = "") -> str:
    return f"""\
[server]
host = "{HOST}"
port = {port}
max_connections = 256

[queue]
max_concurrent_requests = {max_concurrent}
max_queued_requests = 256

[models]
default = "{default}"
{extra_models}
[log]
level = "info"
format = "json"
access_log = {"true" if access_log else "false"}
"""


@dataclass
class Server:
    """A server process with its log file; ``ready()`` waits for /health 200."""

    name: str
    cmd: list[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None  # None: this process's (another checkout's afmd runs from its own)
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_after: float | None = None

    def start(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.started_at = time.perf_counter()
        self.proc = subprocess.Popen(
            self.cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            cwd=self.cwd,
            start_new_session=True,
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    async def ready(self, timeout: float = 180.0, *, want_status: int = 200,
                    reason: str | None = None) -> float:
        """Seconds from start until /health answered ``want_status`` (and ``reason``)."""
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode if self.proc else '?'}:\n"
                    + self.log_tail()
                )
            with contextlib.suppress(OSError, client.HTTPError, asyncio.IncompleteReadError,
                                     TimeoutError):
                status, body = await client.request(HOST, self.port, "GET", "/health",
                                                    timeout=5.0)
                if status == want_status and (
                    reason is None or (isinstance(body, dict) and body.get("reason") == reason)
                ):
                    self.ready_after = time.perf_counter() - self.started_at
                    return self.ready_after
            await asyncio.sleep(0.01)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s:\n" + self.log_tail())

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()


def afmd_server(workdir: Path, name: str, *, cache_root: Path, binary: Path | None = None,
                **config: Any) -> Server:
    port = free_ports()
    cfg = workdir / f"{name}.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(afmd_config(port, **config))
    base = [str(binary)] if binary else [sys.executable, "-m", "afmd"]
    return Server(
        name=name,
        cmd=[*base, "serve", "--config", str(cfg), "--port", str(port)],
        port=port,
        log_path=workdir / f"{name}.log",
        env={"AFMD_CACHE_DIR": str(cache_root)},
    )


def afmd_process(workdir: Path, name: str, config: str, *, env: dict[str, str],
                 launcher: str | None = None, timeout: float = 120.0) -> Server:
    """``afmd serve`` from a config text on a free loopback port, started and ready.

    Blocking (it runs its own event loop to wait for /health): the standalone scripts
    (soak, slowloris) call it directly, the harness from a thread. ``launcher`` runs the
    server through another script (a probe that instruments it) instead of ``-m afmd``.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_ports()
    cfg = workdir / f"{name}.toml"
    cfg.write_text(config)
    entry = [launcher] if launcher else ["-m", "afmd"]
    server = Server(
        name=name,
        cmd=[sys.executable, *entry, "serve", "--config", str(cfg), "--port", str(port),
             "--log-format", "json"],
        port=port,
        log_path=workdir / "server.log",
        env=env,
    ).start()
    try:
        asyncio.run(server.ready(timeout))
    except BaseException:
        server.stop()
        raise
    return server


def mlx_server(workdir: Path, name: str, model_folder: Path) -> Server:
    port = free_ports()
    # Its /v1/models scans the Hugging Face cache and fails when there is none.
    hf_cache = workdir / "hf-cache"
    hf_cache.mkdir(parents=True, exist_ok=True)
    return Server(
        name=name,
        cmd=[sys.executable, "-m", "mlx_lm", "server", "--model", str(model_folder),
             "--host", HOST, "--port", str(port), "--log-level", "WARNING"],
        port=port,
        log_path=workdir / f"{name}.log",
        env={"HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1"},
    )
