"""What rank 0 does when its group loses a rank (see :mod:`afmd.distributed.lead`)."""

from __future__ import annotations

import asyncio
from typing import Any

from afmd.distributed.env import supervisor_gone, write_outcome
from afmd.distributed.lead import LOST_HOLD_S
from afmd.engine.models.residency import RETRY_AFTER_S
from afmd.errors import ServiceUnavailableError
from afmd.http.routes.handlers import interrupt_requests
from afmd.logs import get_logger

log = get_logger("afmd.distributed")

#: A collective that failed on the model's thread usually means a rank died; its closed
#: control connection names it within moments, so the generic loss waits that long.
_NAME_WAIT_S = 0.5


class GroupLoss:
    """Rank 0's handling of a loss, on the event loop; threads report through it."""

    def __init__(self, server: Any) -> None:
        """``server``: the afmd.server.Server of rank 0 (a higher layer, so not typed)."""
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._worker: Any = None

    def attach(self, loaded: Any) -> None:
        """The sharded model is loaded: watch its steps and hear of its failures."""
        group = self._server.group
        assert group is not None
        if loaded.shard is not None:
            group.shard = loaded.shard.describe()
            group.strategy = loaded.shard.strategy
        self._worker = loaded.worker
        if self._worker is not None:
            self._worker.on_fatal = self._fatal_from_thread

    def watch_supervisor(self) -> None:
        """Every second: if ``afmd launch`` is gone (killed), stop the group (exit 1) rather
        than serve on with nobody to stop it or report how it ended."""
        if supervisor_gone():
            log.error("afmd launch is gone: stopping the group")
            self._server.exit_code = 1
            self._server.request_stop("afmd launch is gone")
            return
        self._loop.call_later(1.0, self.watch_supervisor)

    def busy_since(self) -> float:
        worker = self._worker
        return float(worker.busy_since) if worker is not None else 0.0

    def from_thread(self, rank: int | None, detail: str) -> None:
        self._loop.call_soon_threadsafe(self.lose, rank, detail)

    def _fatal_from_thread(self, exc: BaseException) -> None:
        detail = f"a step failed: {exc}"
        self._loop.call_soon_threadsafe(self._loop.call_later, _NAME_WAIT_S, self.lose,
                                        None, detail)

    def lose(self, rank: int | None, detail: str) -> None:
        server = self._server
        group = server.group
        if group is None or not group.mark_lost(rank, detail):
            return
        lost = group.lost
        log.error("distributed group lost a rank", lost=lost, detail=detail)
        group.close()
        default = server.config.resolve_model(None)
        if default is not None:
            server.registry.loads.withdraw(default.id, str(lost))
        error = ServiceUnavailableError(
            f"The model is unavailable: {lost} ({detail}). The server is restarting; "
            "retry shortly.",
            code="model_unavailable",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
        interrupt_requests(server.state, error)
        server.exit_code = 1
        write_outcome(1, str(lost))
        self._loop.call_later(LOST_HOLD_S, server.request_stop, str(lost))
