"""The access log: one structured event per request, streamed or not, whoever answered it."""

from __future__ import annotations

import time
from typing import Any

from sanic import Request

from afmd.core.events import Usage
from afmd.dialects.dialect import NamesParams
from afmd.errors import APIError
from afmd.http.app_state import AppState
from afmd.http.routes.metrics import AnyRun, first_token_seconds
from afmd.logs import get_logger

_log = get_logger("afmd.access")

#: The status logged for a request whose client went away before its answer was sent
#: (nginx's "client closed request"); it never goes on the wire.
CLIENT_CLOSED = 499

#: Characters of a client's own text (the model it named, the path it sent) that one
#: line repeats: far more than any model id or route, while a request naming a model of
#: megabytes still makes a line of ordinary size, in the log and in the dashboard's ring.
MAX_ECHOED_CHARS = 512


def bounded(text: str | None) -> str | None:
    """``text`` cut to :data:`MAX_ECHOED_CHARS`, its full length noted. The model field is
    the client's until it resolves (an unknown one is logged as sent), and the ring keeps
    its last requests' lines for the life of the server: unbounded, each request could
    leave a whole body's worth of model name there, and write as much to the log."""
    if text is None or len(text) <= MAX_ECHOED_CHARS:
        return text
    return f"{text[:MAX_ECHOED_CHARS]}… ({len(text)} characters)"


def note_error(request: Request, error: APIError) -> None:
    """Note the request's error for its access log line (its code, and its param as the
    route's dialect names it), letting go of its traceback and of what it was raised
    from: the request would refer to the error and the traceback's frames to the request,
    so all of it waited for the garbage collector, with whatever the frames held: the
    pictures of a vision request that failed after decoding some (hundreds of megabytes
    each, left for several requests before a collection came)."""
    error.__traceback__ = None
    error.__context__ = error.__cause__ = None
    request.ctx.error = error


def log_access(request: Request, status: int, nbytes: int) -> None:
    """Log a request Sanic handled, with what its handler noted on ``request.ctx``, and
    count it in ``/metrics`` (whether or not the access log is on)."""
    request.app.ctx.state.metrics.answered(request, status)
    ctx = request.ctx
    error = getattr(ctx, "error", None)
    run = getattr(ctx, "run", None)
    ttft = first_token_seconds(run) if run is not None else None
    log_request(
        request.app.ctx.state, request.method, request.path, status, nbytes,
        started=getattr(ctx, "started", None),
        request_id=getattr(ctx, "request_id", None),
        model=getattr(ctx, "model", None),
        usage=getattr(ctx, "usage", None),
        finish_reason=getattr(ctx, "finish_reason", None),
        stream_error=getattr(ctx, "stream_error", None),
        error_code=getattr(error, "code", None),
        error_param=_param_told(request, error),
        disconnected=getattr(ctx, "disconnected", False),
        ttft_ms=round(ttft * 1000, 2) if ttft is not None else None,
        run=run,
    )


def _param_told(request: Request, error: APIError | None) -> str | None:
    """The error's param as the route's dialect named it to the client."""
    if error is None:
        return None
    route = getattr(request, "route", None)
    dialect = getattr(route.ctx, "dialect", None) if route is not None else None
    return dialect.error_param(error) if isinstance(dialect, NamesParams) else error.param


def log_request(
    state: AppState,
    method: str,
    path: str,
    status: int,
    nbytes: int,
    *,
    started: float | None = None,
    request_id: str | None = None,
    model: str | None = None,
    usage: Usage | None = None,
    finish_reason: str | None = None,
    stream_error: str | None = None,
    error_code: str | None = None,
    error_param: str | None = None,
    disconnected: bool = False,
    ttft_ms: float | None = None,
    run: AnyRun | None = None,
) -> None:
    """The ``request`` event, when ``log.access_log`` is on; ``started`` is a
    :func:`time.perf_counter` reading. Requests the protocol answers without Sanic are
    logged here directly, so both kinds of line have the same fields.

    ``error_code`` and ``error_param`` are the envelope the client got (or, for a stream,
    the error event that ended it): without them a refused request's line says only "400".
    ``disconnected`` marks a client that went away before its answer was complete;
    ``ttft_ms`` is a generating request's time to its first token.

    The dashboard's ring of recent requests (:mod:`afmd.http.dashboard_state`) gets every line,
    whether or not the log is on.
    """
    duration_ms = round((time.perf_counter() - started) * 1000, 2) if started else None
    path, model, error_param = bounded(path) or "", bounded(model), bounded(error_param)
    state.activity.record(method, path, status, duration_ms=duration_ms,
                          request_id=request_id, model=model, usage=usage, ttft_ms=ttft_ms,
                          finish_reason=finish_reason, error_code=error_code or stream_error,
                          run=run)
    if not state.config.log.access_log:
        return
    fields: dict[str, Any] = {
        "method": method,
        "path": path,
        "status": status,
        "duration_ms": duration_ms,
        "request_id": request_id,
        "bytes": nbytes,
    }
    if model:
        fields["model"] = model
    if usage is not None:
        fields["prompt_tokens"] = usage.prompt_tokens
        fields["completion_tokens"] = usage.completion_tokens
        fields["cached_tokens"] = usage.cached_tokens
    if ttft_ms is not None:
        fields["ttft_ms"] = ttft_ms
    if finish_reason:
        fields["finish_reason"] = finish_reason
    if stream_error:
        fields["stream_error"] = stream_error
    if error_code:
        fields["error_code"] = error_code
    if error_param:
        fields["error_param"] = error_param
    if disconnected:
        fields["disconnected"] = True
    _log.info("request", **fields)
