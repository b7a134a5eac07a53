"""What a running server's routes share: its config, models and pipeline, the requests it
handles, and what ``/metrics``, ``/health`` and the dashboard read.

One object per server, made by :mod:`afmd.server` and handed to the Sanic application
(``app.ctx.state``), so the routes, the connections' own answers (``/health``) and the
access log all read the same state. Kept apart from the application (:mod:`afmd.http.app`),
which imports every route, so that the routes can name its type.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from afmd.config.sections import Config
from afmd.dialects.responses.background import BackgroundRuns
from afmd.engine.models.model_registry import ModelRegistry
from afmd.errors import APIError
from afmd.http.dashboard_state import Activity, Dashboard
from afmd.http.routes.metrics import Metrics
from afmd.service.pipeline import ChatPipeline


class GroupHealth(Protocol):
    """Rank 0's side of a launched group as ``/health`` reads it
    (:class:`afmd.distributed.lead.GroupLead`, a layer above HTTP)."""

    #: "rank N lost", once a rank was lost; None while the group is whole.
    lost: str | None

    def health(self, memory: dict[str, int] | None = None) -> dict[str, Any]: ...


@dataclass
class AppState:
    """One server's shared state (module doc)."""

    config: Config
    registry: ModelRegistry
    pipeline: ChatPipeline
    started_at: int = field(default_factory=lambda: int(time.time()))
    #: Request ids of the chat requests being handled (a count: ids may be sent twice).
    running: Counter[str] = field(default_factory=Counter)
    #: Set once the shutdown ends the requests still running: what they are told.
    stop_error: APIError | None = None
    #: The pulls clients wait on (``/api/pull``): what ends each with an error (no turn of
    #: the pipeline, so the shutdown's end of the turns does not reach them), and its repo.
    pulls: dict[Callable[[APIError], None], str] = field(default_factory=dict)
    #: What ``GET /metrics`` reports: this server's own, never a process-wide registry.
    metrics: Metrics = field(default_factory=Metrics)
    #: Rank 0's side of a launched group, else None.
    group: GroupHealth | None = None
    #: The last requests and the per-second series the dashboard shows.
    activity: Activity = field(default_factory=Activity)
    #: The dashboard's own state: None while it is off.
    dashboard: Dashboard | None = None
    #: The Responses API's background responses (``background: true``).
    background: BackgroundRuns = field(default_factory=BackgroundRuns)


__all__ = ["AppState", "GroupHealth"]
