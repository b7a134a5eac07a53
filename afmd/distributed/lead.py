"""Rank 0 of a launched group: the control channel, the watchdog, and what a loss means.

Rank 0 runs the whole HTTP server; this object is what it adds for the group. When a rank
is lost (its connection closed, its heartbeats stopped, or a step never ended) the group
cannot compute another token: the requests running fail at once with an error that says
so, new ones get 503 ``model_unavailable``, ``/health`` says which rank was lost, and a
moment later the process exits with code 1 so launchd (``brew services``) restarts the
group. Nothing waits on the lost rank.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

from afmd.config.sections import Config
from afmd.distributed.control import ControlServer, Watchdog
from afmd.distributed.env import leader_host

#: After a loss, how long rank 0 keeps answering (503s, /health) before it exits: long
#: enough for a probe or a client's retry to learn why.
LOST_HOLD_S = 2.0


class GroupLead:
    """Rank 0's view of the group."""

    def __init__(self, config: Config, group: Any) -> None:
        self.config = config
        self.group = group
        self.control = ControlServer(group.size, leader_host())
        self.control.start()
        # The other ranks learn where to report from the group itself.
        group.share(self.control.port.to_bytes(4, "little"))
        group.doorbell = self.control
        self.lost: str | None = None  # "rank N lost", once it happened
        self.lost_detail: str = ""
        self.shard: str = "loading"
        self.strategy: str = config.distributed.strategy
        self._watchdog: Watchdog | None = None
        self._started = time.time()

    @property
    def size(self) -> int:
        return int(self.group.size)

    def watch(
        self, busy_since: Callable[[], float], on_lost: Callable[[int | None, str], None]
    ) -> None:
        """Start watching the other ranks; ``on_lost`` runs once, on the watchdog's thread."""
        settings = self.config.distributed
        self._watchdog = Watchdog(
            self.control, on_lost, heartbeat_timeout=settings.heartbeat_timeout,
            step_timeout=settings.step_timeout, startup_timeout=settings.startup_timeout,
            busy_since=busy_since,
        )
        self._watchdog.start()

    def mark_lost(self, rank: int | None, detail: str) -> bool:
        """Record the loss (False if one was already recorded)."""
        if self.lost is not None:
            return False
        self.lost = f"rank {rank} lost" if rank is not None else "a rank was lost"
        self.lost_detail = detail
        return True

    def close(self) -> None:
        """The group is stopping: ranks leaving from now on are expected."""
        if self._watchdog is not None:
            self._watchdog.stop()
        self.control.close()

    def health(self, memory: dict[str, int] | None = None) -> dict[str, Any]:
        """``/health``'s ``distributed`` object: every rank, rank 0 first."""
        me = {"rank": 0, "host": socket.gethostname(), "pid": os.getpid(),
              "shard": self.shard, "memory": memory or {}, "connected": True}
        body: dict[str, Any] = {"ranks": [me, *self.control.reports()], "size": self.size,
                                "strategy": self.strategy}
        if self.lost is not None:
            body["lost"] = self.lost
            body["detail"] = self.lost_detail
        return body
