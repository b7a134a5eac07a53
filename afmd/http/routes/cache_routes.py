"""``POST /afmd/cache/clear``: empty the prefix KV cache's tiers, what ``afmd cache clear``
asks a running server to do.

The body is optional: ``{}`` (or none) clears every model's blocks in RAM and every block
file under ``[cache] disk_dir``; ``{"model": ID}`` (an alias names its model) only that
model's. A loaded model's tiers are cleared through its cache, so its index forgets what
was deleted; a model not loaded has only files, deleted by its folder. The answer says
what was freed: ``{"cleared": [{"model", "ram_bytes", "disk_bytes"}], "disk_dir",
"disk_bytes"}`` (``disk_bytes`` at top level: every file deleted, other models' too).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from sanic import Request, Sanic
from sanic.response import HTTPResponse

from afmd.dialects.fields.body import parse_json_body
from afmd.dialects.fields.checks import reject_unknown
from afmd.engine.kvcache import folder as kv_folder
from afmd.errors import InvalidRequestError
from afmd.http.app_state import AppState
from afmd.http.routes.own_origin import refuse_other_origins

PATH = kv_folder.CLEAR_PATH
_FIELDS = frozenset({"model"})


def add_routes(app: Sanic) -> None:
    app.add_route(_clear, PATH, methods=["POST"], name="cache_clear")


def _model_field(request: Request) -> str | None:
    if not request.body or not request.body.strip():
        return None
    body = parse_json_body(request.body)
    reject_unknown(body, _FIELDS)
    model = body.get("model")
    if model is None:
        return None
    if not isinstance(model, str) or not model.strip():
        raise InvalidRequestError("'model' must be a non-empty string.", code="invalid_value",
                                  param="model")
    return model


def clear_sync(state: AppState, model: str | None) -> dict[str, Any]:
    """Clear the tiers (blocking file deletes: run off the event loop)."""
    registry = state.registry
    root = kv_folder.resolve(state.config.cache.disk_dir)
    ids = ([registry.resolve(model).id] if model is not None
           else [entry.id for entry in state.config.models.model])
    cleared = []
    disk_total = 0
    for model_id in ids:
        loaded = registry.loaded(model_id)
        cache = loaded.kv_cache if loaded is not None else None
        ram = disk = 0
        if cache is not None:
            ram, disk = cache.clear()
        _, freed = kv_folder.clear(root, model_id)  # files another process wrote
        disk += freed
        disk_total += disk
        cleared.append({"model": model_id, "ram_bytes": ram, "disk_bytes": disk})
    if model is None:  # models no longer configured left files too
        disk_total += kv_folder.clear(root)[1]
    return {"cleared": cleared, "disk_dir": str(root), "disk_bytes": disk_total}


async def _clear(request: Request) -> HTTPResponse:
    # It deletes what every client's conversations had cached, files included: not for
    # a page of another origin, even one server.allowed_origins lets use the API.
    refuse_other_origins(request, "Clearing the KV cache is accepted only from afmd itself "
                                  "(`afmd cache clear`), not from a web page.")
    model = _model_field(request)
    state = request.app.ctx.state
    result = await asyncio.to_thread(clear_sync, state, model)
    return HTTPResponse(orjson.dumps(result), content_type="application/json",
                        headers={"Cache-Control": "no-store"})
