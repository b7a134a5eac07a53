"""The per-model detail ``/health`` adds for ``afmd ps`` and the loaded state of ``afmd
list`` and ``afmd rm``: ``model_details`` next to the ``models`` map, which keeps its shape.

Per configured model: ``state`` (``loaded``, ``loading``, ``available`` - loads on first
use -, or ``unavailable: <reason>``), ``path`` (what was configured: the CLI matches a repo
to the model serving it), ``memory_bytes`` (weights plus the prefix cache's KV state, both
measured; null when not loaded), ``active`` and ``queued`` requests (chat and completions),
``idle_since`` (Unix time a request last got or released it; null while it has work or is
not loaded) and ``expires_at`` (Unix time it unloads; null: it stays until the server
stops). Times are instants, not durations, so that two answers with nothing changed in
between are the same bytes (the connection's direct answer and Sanic's must agree);
``afmd ps`` turns them into ``idle_s`` and ``expires_in_s``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any


def _requests(state: Any) -> tuple[Counter[str], Counter[str]]:
    """(active, queued) chat and completions requests per model id."""
    active: Counter[str] = Counter()
    queued: Counter[str] = Counter()
    for request_id in list(state.running):
        run = state.pipeline.find(request_id)
        if run is None or run.finished:
            continue
        model_id = run.prepared.model.id
        if run.ticket.holds_slot:
            active[model_id] += 1
        elif not run.ticket.cancelled:
            queued[model_id] += 1
    return active, queued


def model_details(state: Any) -> dict[str, dict[str, Any]]:
    registry = state.registry
    active, queued = _requests(state)
    details: dict[str, dict[str, Any]] = {}
    for entry in state.config.models.model:
        loaded = registry.loaded(entry.id)
        failure = registry.failure(entry.id)
        memory: int | None = None
        idle_since: float | None = None
        if loaded is not None:
            model_state = "loaded"
            worker = loaded.worker
            memory = loaded.weights_bytes + (worker.cache_bytes if worker is not None else 0)
            if not (active[entry.id] or queued[entry.id]):
                idle_since = round(loaded.last_used, 3)
        elif registry.is_loading(entry.id):
            model_state = "loading"
        elif failure is not None:
            model_state = f"unavailable: {failure}"
        else:
            model_state = "available"
        details[entry.id] = {
            "state": model_state,
            "path": entry.path,
            "memory_bytes": memory,
            "active": active[entry.id],
            "queued": queued[entry.id],
            "idle_since": idle_since,
            "expires_at": None,
        }
    return details
