"""The access log: one structured event per request, streamed or not."""

from __future__ import annotations

import time
from typing import Any

from sanic import Request

from afmd.logs import get_logger

_log = get_logger("afmd.access")


def log_access(request: Request, status: int, nbytes: int) -> None:
    state = request.app.ctx.state
    if not state.config.log.access_log:
        return
    ctx = request.ctx
    started = getattr(ctx, "started", None)
    fields: dict[str, Any] = {
        "method": request.method,
        "path": request.path,
        "status": status,
        "duration_ms": round((time.perf_counter() - started) * 1000, 2) if started else None,
        "request_id": getattr(ctx, "request_id", None),
        "bytes": nbytes,
    }
    model = getattr(ctx, "model", None)
    if model:
        fields["model"] = model
    usage = getattr(ctx, "usage", None)
    if usage is not None:
        fields["prompt_tokens"] = usage.prompt_tokens
        fields["completion_tokens"] = usage.completion_tokens
        fields["cached_tokens"] = usage.cached_tokens
    for extra in ("finish_reason", "stream_error"):
        value = getattr(ctx, extra, None)
        if value:
            fields[extra] = value
    _log.info("request", **fields)
