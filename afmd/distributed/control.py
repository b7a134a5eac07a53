"""The control channel: each rank's heartbeat and report to rank 0, over plain TCP.

The model's own collectives cannot say which rank is gone, and a rank that hangs (stopped,
deadlocked, its machine asleep) leaves the others blocked in a collective forever. So every
other rank keeps one TCP connection to rank 0 and writes a line on it twice a second
(its host, pid, shard and memory), from a thread of its own: rank 0 learns that rank N
died the moment its connection closes, and that it hangs when its lines stop. The same
lines are what ``/health`` and ``afmd doctor`` report of every rank.

Lines are JSON objects; the first of a connection names the rank.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

BEAT_INTERVAL_S = 0.5
#: What rank 0 writes to wake the others (the only thing it ever writes to them).
DOORBELL = b"\x01"
#: A rank's shard until it has loaded it.
LOADING = "loading"
_MAX_LINE = 1 << 16


@dataclass(slots=True)
class RankStatus:
    """What rank 0 knows of one rank."""

    rank: int
    host: str = ""
    pid: int = 0
    shard: str = ""
    memory: dict[str, int] = field(default_factory=dict)
    last_seen: float = 0.0  # monotonic; 0.0: never heard from
    closed: bool = False

    def report(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "pid": self.pid, "shard": self.shard,
                "memory": dict(self.memory), "connected": self.last_seen > 0 and not self.closed}


class ControlServer:
    """Rank 0's end: accepts the other ranks' connections and watches their heartbeats."""

    def __init__(self, size: int, host: str) -> None:
        self.size = size
        self.ranks: dict[int, RankStatus] = {r: RankStatus(r) for r in range(1, size)}
        self._sock = socket.create_server((host, 0))
        self._closing = False
        self._lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    def start(self) -> None:
        threading.Thread(target=self._accept, name="afmd-control", daemon=True).start()

    def close(self) -> None:
        """Stop watching (the group is stopping: ranks leaving now are expected)."""
        self._closing = True
        with contextlib.suppress(OSError):
            self._sock.close()

    def reports(self) -> list[dict[str, Any]]:
        with self._lock:
            return [status.report() for status in self.ranks.values()]

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        status: RankStatus | None = None
        with conn, conn.makefile("rb") as lines:
            for line in lines:
                if len(line) > _MAX_LINE:
                    break
                try:
                    msg = orjson.loads(line)
                    rank = int(msg["rank"])
                except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                    break
                with self._lock:
                    status = self.ranks.get(rank)
                    if status is None:
                        break
                    self._conns[rank] = conn
                    status.host = str(msg.get("host", status.host))
                    status.pid = int(msg.get("pid", status.pid))
                    status.shard = str(msg.get("shard", status.shard))
                    status.memory = {k: int(v) for k, v in msg.get("memory", {}).items()}
                    status.last_seen = time.monotonic()
                    status.closed = False
        if status is not None:
            with self._lock:
                status.closed = True

    def ring(self) -> None:
        """Wake every other rank out of its idle wait (the doorbell of a plan)."""
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            with contextlib.suppress(OSError):  # a rank gone: the watchdog says so
                conn.sendall(DOORBELL)

    def wait(self) -> None:  # rank 0 rings, never waits
        raise NotImplementedError

    def lost(
        self, *, heartbeat_timeout: float, startup_deadline: float, now: float | None = None
    ) -> tuple[int, str] | None:
        """The first rank found lost and why, or None while all are well."""
        if self._closing:
            return None
        now = time.monotonic() if now is None else now
        with self._lock:
            for status in self.ranks.values():
                if status.closed:
                    return status.rank, "its connection closed"
                if status.shard in ("", LOADING):
                    # Loading a shard may hold a rank's interpreter for seconds at a
                    # time (imports, tokenizer, weights): only the startup bound applies.
                    if now > startup_deadline:
                        return status.rank, "never finished loading its shard"
                elif now - status.last_seen > heartbeat_timeout:
                    return status.rank, f"no heartbeat for {heartbeat_timeout:g}s"
        return None


class Watchdog:
    """Rank 0's thread that turns a lost rank or a step that never ends into one call."""

    def __init__(
        self,
        control: ControlServer,
        on_lost: Callable[[int | None, str], None],
        *,
        heartbeat_timeout: float,
        step_timeout: float,
        startup_timeout: float,
        busy_since: Callable[[], float],
    ) -> None:
        self._control = control
        self._on_lost = on_lost
        self._heartbeat_timeout = heartbeat_timeout
        self._step_timeout = step_timeout
        self._startup_deadline = time.monotonic() + startup_timeout
        self._busy_since = busy_since
        self._stopped = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._watch, name="afmd-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(0.1):
            lost: tuple[int | None, str] | None = self._control.lost(
                heartbeat_timeout=self._heartbeat_timeout, startup_deadline=self._startup_deadline)
            if lost is None:
                since = self._busy_since()
                if since and time.monotonic() - since > self._step_timeout:
                    lost = (None, f"a step took over {self._step_timeout:g}s")
            if lost is not None and not self._stopped.is_set():
                self._stopped.set()
                self._on_lost(*lost)
                return


class Heartbeat:
    """A follower's end: connects to rank 0 and reports until the process ends; if rank
    0 goes away, ``on_leader_lost`` runs (the follower has nothing left to serve)."""

    def __init__(
        self,
        rank: int,
        address: tuple[str, int],
        describe: Callable[[], dict[str, Any]],
        on_leader_lost: Callable[[], None],
    ) -> None:
        self._rank = rank
        self._sock = socket.create_connection(address, timeout=30)
        self._sock.settimeout(None)
        self._describe = describe
        self._on_leader_lost = on_leader_lost
        self._stopped = threading.Event()
        self._wake = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._beat, name="afmd-heartbeat", daemon=True).start()

    def ring(self) -> None:  # only rank 0 rings
        raise NotImplementedError

    def wait(self) -> None:
        """Block until rank 0 rings (its next plan follows); ConnectionError if it is gone."""
        if not self._sock.recv(1):
            raise ConnectionError("rank 0 closed the control connection")

    def nudge(self) -> None:
        """Report now (the shard just loaded), not at the next beat."""
        self._wake.set()

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        with contextlib.suppress(OSError):
            self._sock.close()

    def _beat(self) -> None:
        while not self._stopped.is_set():
            msg = {"rank": self._rank, "host": socket.gethostname(), "pid": os.getpid()}
            with contextlib.suppress(Exception):
                msg.update(self._describe())
            try:
                self._sock.sendall(orjson.dumps(msg) + b"\n")
            except OSError:
                if not self._stopped.is_set():
                    self._on_leader_lost()
                return
            self._wake.wait(BEAT_INTERVAL_S)
            self._wake.clear()
