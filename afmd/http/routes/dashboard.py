"""The dashboard: ``/ui/``, one page served from afmd's package data, and what it reads.

The page (``afmd/data/ui/``: hand-written HTML, CSS and JavaScript, nothing fetched from
anywhere else) is public, like ``/health``: it holds no secret, and a browser must load it
before it can ask for the key; so is ``/ui/auth``, which says whether a key is needed.
Everything it reads or does is under ``/ui/api/`` and screened as the API is (Host, Origin,
``server.api_key``), and the page sends the key the way the API takes it. The playground
uses the API itself (a streamed chat completion, the cancel endpoint for its request's
``X-Request-ID``); ``/ui/api/`` adds only what no endpoint says:

* ``GET /ui/api/status``: version, start, listeners, the config file in use;
* ``GET /ui/api/models``: every configured, built-in and downloaded model with its state,
  memory and requests, the memory budget, and the pulls;
* ``GET /ui/api/activity?since=SEQ&after=T``: running and queued requests, per model
  too, the access log's last lines after ``SEQ`` and the per-second series after Unix
  second ``T`` (:mod:`afmd.http.dashboard_state`), and the server's ``instance``, which
  tells a page that another server now answers on its address (``SEQ`` counts again);
* ``POST /ui/api/load``, ``/ui/api/unload`` and ``/ui/api/pull`` with ``{"model": ...}``:
  the actions. They change what the server holds, so beyond the gate's screening they are
  refused from any other origin, even one ``server.allowed_origins`` lets read the API.

A browser's ``GET /`` (one whose ``Accept`` prefers HTML) is sent to ``/ui/``
(:func:`browser_redirect`); other clients get the plain-text answer. ``[ui] enabled =
false`` registers none of this.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import orjson
from sanic import Request, Sanic
from sanic.response import HTTPResponse

from afmd import __version__
from afmd.dialects.fields.body import parse_json_body
from afmd.dialects.fields.checks import reject_unknown, required
from afmd.errors import ConflictError, InvalidRequestError
from afmd.http.app_state import AppState
from afmd.http.dashboard_state import ASSET_TYPES, Dashboard
from afmd.http.routes.model_detail import model_details
from afmd.http.routes.own_origin import refuse_other_origins
from afmd.http.sansio.screen import unknown_url
from afmd.hub.server_pulls import Pulls

PAGE_PATH = "/ui/"
#: The browser enforces what the page may load and call: its own origin, nothing else
#: (no CDN, no third party; no frame may hold it, so its buttons cannot be clickjacked).
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
BUILT_IN, CONFIGURED, DOWNLOADED = "built-in", "configured", "downloaded"
_HTML_TYPES = ("text/html", "application/xhtml+xml")
_ACTION_FIELDS = frozenset({"model"})


def add_routes(app: Sanic, state: AppState) -> None:
    """Register the page and ``/ui/api/``, unless ``[ui] enabled`` is false."""
    if not state.config.ui.enabled:
        return
    state.dashboard = Dashboard()
    app.add_route(_to_page, "/ui", methods=["GET"], name="ui_redirect", strict_slashes=True)
    app.add_route(_page, PAGE_PATH, methods=["GET"], name="ui", strict_slashes=True)
    app.add_route(_auth, "/ui/auth", methods=["GET"], name="ui_auth")
    app.add_route(_asset, "/ui/<name:str>", methods=["GET"], name="ui_asset",
                  unquote=True)
    app.add_route(_status, "/ui/api/status", methods=["GET"], name="ui_status")
    app.add_route(_models, "/ui/api/models", methods=["GET"], name="ui_models")
    app.add_route(_activity, "/ui/api/activity", methods=["GET"], name="ui_activity")
    app.add_route(_load, "/ui/api/load", methods=["POST"], name="ui_load")
    app.add_route(_unload, "/ui/api/unload", methods=["POST"], name="ui_unload")
    app.add_route(_pull, "/ui/api/pull", methods=["POST"], name="ui_pull")

    async def start_sampling(app: Sanic) -> None:
        state.activity.start(state.pipeline, state.running)

    async def stop_sampling(app: Sanic) -> None:
        state.activity.stop()

    app.register_listener(start_sampling, "before_server_start")
    app.register_listener(stop_sampling, "before_server_stop")


# ---------------------------------------------------------------------------- GET /


def prefers_html(accept: str | None) -> bool:
    """Whether an ``Accept`` header ranks HTML first: the media range with the highest
    ``q``, the earliest among equals, is HTML (a browser navigating; curl's ``*/*``, an
    SDK's ``application/json`` and no header at all are not)."""
    best: tuple[float, str] | None = None
    for part in (accept or "").split(","):
        media, *params = (p.strip() for p in part.split(";"))
        if not media:
            continue
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if q > 0 and (best is None or q > best[0]):
            best = (q, media.lower())
    return best is not None and best[1] in _HTML_TYPES


def browser_redirect(request: Request) -> HTTPResponse | None:
    """For ``GET /``: a browser is sent to the dashboard (None: answer as usual)."""
    if request.app.ctx.state.dashboard is None or not prefers_html(request.headers.get("accept")):
        return None
    return HTTPResponse(status=302, headers={"Location": PAGE_PATH, "Vary": "Accept"})


# ---------------------------------------------------------------------------- the page


async def _to_page(request: Request) -> HTTPResponse:
    return HTTPResponse(status=302, headers={"Location": PAGE_PATH})


async def _page(request: Request) -> HTTPResponse:
    return _file(request, "index.html")


async def _auth(request: Request) -> HTTPResponse:
    """Whether the page must ask for the key before it reads anything: public, so that a
    page without a key shows its key field at once instead of a refused request."""
    return _json({"api_key_required": bool(request.app.ctx.state.config.server.api_key)})


async def _asset(request: Request, name: str) -> HTTPResponse:
    return _file(request, name)


def _file(request: Request, name: str) -> HTTPResponse:
    body = request.app.ctx.state.dashboard.assets.get(name)
    if body is None:
        raise unknown_url(request.method, request.path)
    return HTTPResponse(body, headers=PAGE_HEADERS,
                        content_type=ASSET_TYPES[os.path.splitext(name)[1]])


# ---------------------------------------------------------------------------- reads


def _json(payload: Any, status: int = 200) -> HTTPResponse:
    return HTTPResponse(orjson.dumps(payload), status=status, content_type="application/json",
                        headers={"Cache-Control": "no-store"})


async def _status(request: Request) -> HTTPResponse:
    state = request.app.ctx.state
    config = state.config
    default = config.resolve_model(None)
    return _json({
        "version": __version__,
        "instance": state.dashboard.instance,
        "pid": os.getpid(),
        "started_at": state.started_at,
        "now": round(time.time(), 3),
        "uptime_s": max(0, int(time.time()) - state.started_at),
        "listeners": [{"address": address, "up": up}
                      for address, up in state.metrics.listener_up.items()],
        "config_file": config.source,
        "default_model": default.id if default is not None else None,
        "api_key_required": bool(config.server.api_key),
        "access_log": config.log.access_log,
    })


def _split_state(detail: str) -> tuple[str, str | None]:
    """``unavailable: reason`` (model_details' form) as a state and its reason."""
    state, _, reason = detail.partition(": ")
    return state, reason or None


async def _models(request: Request) -> HTTPResponse:
    state = request.app.ctx.state
    config = state.config
    registry = state.registry
    details = model_details(state)
    default = config.resolve_model(None)
    aliases: dict[str, list[str]] = {}
    for alias, target in config.models.aliases.items():
        aliases.setdefault(target, []).append(alias)
    rows: list[dict[str, Any]] = []
    for entry in config.models.model:
        detail = details[entry.id]
        model_state, reason = _split_state(detail["state"])
        rows.append({
            "id": entry.id,
            "path": entry.path,
            "source": BUILT_IN if entry.path.startswith("afmd:") else CONFIGURED,
            "kind": registry.kind_of(entry),
            "state": model_state,
            "reason": reason,
            "default": default is not None and entry.id == default.id,
            "aliases": aliases.get(entry.id, []),
            "keep_alive_s": config.models.keep_alive_of(entry),
            **{k: detail[k] for k in ("memory_bytes", "active", "queued", "idle_since",
                                      "expires_at")},
        })
    served = {entry.path for entry in config.models.model}
    for cached in await state.dashboard.downloads():
        if cached.repo in served:
            continue
        rows.append({
            "id": cached.repo, "path": cached.repo, "source": DOWNLOADED, "kind": None,
            "state": "unavailable",
            "reason": "downloaded, not configured: add it to [[models.model]] (or serve it "
                      "with --model) to load it",
            "default": False, "aliases": [], "keep_alive_s": None, "memory_bytes": None,
            "active": 0, "queued": 0, "idle_since": None, "expires_at": None,
            "size_bytes": cached.size_bytes,
        })
    residency = registry.residency
    return _json({
        "now": round(time.time(), 3),
        "models": rows,
        "memory": {"budget_bytes": residency.budget, "used_bytes": residency.used_bytes(),
                   "max_loaded": residency.max_loaded, "loaded": len(residency.loaded)},
        "pulls": state.dashboard.pulls.describe(),
    })


def _query_int(request: Request, name: str) -> int:
    value = request.args.get(name)
    if value is None:
        return 0
    if not value.isascii() or not value.isdigit() or len(value) > 18:
        raise InvalidRequestError(f"The query parameter '{name}' must be a non-negative "
                                  "integer.", code="invalid_value", param=name)
    return int(value)


async def _activity(request: Request) -> HTTPResponse:
    state = request.app.ctx.state
    scheduler = state.pipeline.scheduler
    details = model_details(state)
    return _json({
        "now": round(time.time(), 3),
        "instance": state.dashboard.instance,
        "active": scheduler.active,
        "queued": scheduler.queued,
        "models": {model_id: {"active": d["active"], "queued": d["queued"]}
                   for model_id, d in details.items()},
        **state.activity.snapshot(_query_int(request, "since"), _query_int(request, "after")),
    })


# ---------------------------------------------------------------------------- actions


def _same_origin_only(request: Request) -> None:
    """An action changes what the server holds: a page of another origin may not, even
    one the API answers (``server.allowed_origins``)."""
    refuse_other_origins(
        request, "The dashboard's actions (load, unload, pull) are accepted only from the "
                 "dashboard's own page, not from another origin.")


def _model_field(request: Request) -> str:
    body = parse_json_body(request.body)
    reject_unknown(body, _ACTION_FIELDS)
    model = required(body, "model", "model", str, "a string")
    if not model.strip():
        raise InvalidRequestError("'model' must not be empty.", code="invalid_value",
                                  param="model")
    return str(model)


async def _load(request: Request) -> HTTPResponse:
    """Load a configured model (an alias names its model); answered once it is loaded,
    with the load's own error if it fails."""
    _same_origin_only(request)
    state = request.app.ctx.state
    registry = state.registry
    entry = registry.resolve(_model_field(request))
    loaded = registry.loaded(entry.id)
    if loaded is not None:
        return _json({"id": entry.id, "state": "loaded", "memory_bytes": loaded.memory_bytes})
    task = registry.begin_load(entry)
    # The load goes on if this client leaves; its outcome is the registry's to report.
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    try:
        loaded = await asyncio.shield(task)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        stop = state.stop_error
        if stop is None or not task.cancelled() or (current is not None
                                                    and current.cancelling()):
            raise  # this client left
        # The shutdown dropped the load, which still waited for room: its error, as any
        # request waiting for a model gets (the cancel itself read as a 500).
        raise stop from None
    return _json({"id": entry.id, "state": "loaded", "memory_bytes": loaded.memory_bytes})


async def _unload(request: Request) -> HTTPResponse:
    """Unload an idle model now; 409 while requests hold it or when it is not loaded."""
    _same_origin_only(request)
    registry = request.app.ctx.state.registry
    entry = registry.resolve(_model_field(request))
    if not await registry.unload(entry.id, "unloaded from the dashboard"):
        raise ConflictError(f"The model '{entry.id}' is not loaded.", code="model_not_loaded",
                            param="model")
    return _json({"id": entry.id, "state": "available"})


async def _pull(request: Request) -> HTTPResponse:
    """Start pulling a repo (``OWNER/NAME[@REVISION]``) into the hub cache: 202 with the
    pull, whose progress ``/ui/api/models`` lists."""
    _same_origin_only(request)
    pulls: Pulls = request.app.ctx.state.dashboard.pulls
    pull = pulls.start(_model_field(request))
    return _json(pull.describe(), status=202)


__all__ = ["PAGE_HEADERS", "PAGE_PATH", "add_routes", "browser_redirect",
           "prefers_html"]
