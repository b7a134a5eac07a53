"""The per-model detail ``/health`` adds for ``afmd ps`` and the loaded state of ``afmd
list`` and ``afmd rm``: ``model_details`` next to the ``models`` map, which keeps its shape.

Per configured model: ``state`` (``loaded``, ``loading``, ``available`` - loads on first
use -, or ``unavailable: <reason>``), ``path`` (what was configured: the CLI matches a repo
to the model serving it), ``memory_bytes`` (weights plus its KV caches, prefix cache and
running batch, measured; null when not loaded), ``active`` and ``queued`` requests (every
kind: chat, completions, responses, messages, embeddings; queued includes those waiting for
its load), ``idle_since`` (Unix time a request last got or released it; null while it has
work or is not loaded) and ``expires_at`` (Unix time its keep-alive unloads it; null while
it has work, when it is kept for good, or not loaded). Times are instants, not durations,
so that two answers with nothing changed in between are the same bytes (the connection's
direct answer and Sanic's must agree); ``afmd ps`` turns them into ``idle_s`` and
``expires_in_s``. ``kv_cache``: the bytes of the prefix KV cache's tiers,
``{"ram_bytes", "disk_bytes"}`` (null when not loaded or the model has no block cache),
and ``disk_writing``: whether its disk tier writes (false while paused by a full disk or
stopped, which only the log said; null without a disk tier).
"""

from __future__ import annotations

from typing import Any

from afmd.http.app_state import AppState


def model_details(state: AppState) -> dict[str, dict[str, Any]]:
    """Per configured model, and per download served under its repo id while it is loaded
    or loading, from the registry, which counts every request that holds or waits for a
    model (chat, completions, responses, messages, embeddings) and runs each model's
    keep-alive. Without the downloads, ``afmd ps`` did not show one a client had loaded
    by its repo id, and ``afmd rm`` deleted its files from under the server."""
    registry = state.registry
    details: dict[str, dict[str, Any]] = {}
    configured = state.config.models.model
    ids = {entry.id for entry in configured}
    for entry in [*configured, *(e for e in registry.downloads_in_use() if e.id not in ids)]:
        usage = registry.residency.usage(entry.id)
        failure = registry.failure(entry.id)
        loaded = registry.loaded(entry.id) if usage is not None else None
        tiers = loaded.kv_cache_bytes() if loaded is not None else None
        if usage is not None:
            model_state = "loaded"
        elif registry.loads.is_loading(entry.id):
            model_state = "loading"
        elif failure is not None:
            model_state = f"unavailable: {failure}"
        else:
            model_state = "available"
        details[entry.id] = {
            "state": model_state,
            "path": entry.path,
            "memory_bytes": usage.memory_bytes if usage else None,
            "active": usage.active if usage else 0,
            "queued": usage.queued if usage else registry.residency.waiting[entry.id],
            "idle_since": usage.idle_since if usage else None,
            "expires_at": usage.expires_at if usage else None,
            "kv_cache": ({"ram_bytes": tiers["ram"], "disk_bytes": tiers["disk"],
                          "disk_writing": loaded.kv_disk_writing() if loaded else None}
                         if tiers is not None else None),
        }
    return details
