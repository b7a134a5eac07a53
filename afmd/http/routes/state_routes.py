"""The routes answered from the server's state alone: ``/health``, ``/v1/models`` (and one
model's object by id).

``/v1/models`` is one path for two APIs, OpenAI's and Anthropic's, whose SDKs both call it
(``client.models.list()``): its objects carry both shapes' fields (OpenAI's ``object``,
``created``, ``owned_by``; Anthropic's ``type``, ``display_name``, ``created_at``,
``lifecycle`` (``active``: the SDK's model types require it), and the
list's ``has_more``, ``first_id``, ``last_id``), each SDK reading its own and passing the
other's by. The whole list is one page. A missing model's 404 is in the envelope of
the SDK that asked (``anthropic-version`` says Anthropic's).

They read the registry, the scheduler's counts and, on rank 0 of a launched group, the
group's health; no model is loaded and no slot is taken to answer them, so a client (or a
load balancer) may poll them as often as it likes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote

import orjson
from sanic import Request
from sanic.response import HTTPResponse

from afmd.dialects.anthropic.messages_api import ANTHROPIC_MESSAGES
from afmd.dialects.dialect import Dialect
from afmd.errors import NotFoundError
from afmd.http.app_state import AppState
from afmd.http.routes.model_detail import model_details
from afmd.http.sansio.screen import local_connection, reveals_machine

#: ``(header, dialect)``: a request to a route two APIs share (``/v1/models``) that carries
#: ``header`` comes from that API's SDK, and its errors go out in that dialect's envelope,
#: the one the SDK reads. Anthropic's SDKs send ``anthropic-version`` on every request and
#: OpenAI's never do. The gate's refusals on such paths follow the same table.
CLIENT_STYLES: tuple[tuple[str, Dialect[Any]], ...] = (("anthropic-version", ANTHROPIC_MESSAGES),)


@dataclass(frozen=True, slots=True)
class StateRoute:
    """A ``GET`` route whose answer is built from the server's state alone.

    Sanic serves it through :meth:`handler`; the connection protocol answers a plain,
    bodiless request for it itself (:class:`~afmd.http.sansio.gate.Direct`), because under a
    flood of health checks Sanic's per-request machinery costs several times what
    building the answer does. Both go through :meth:`answer`, so the two paths cannot
    disagree on status or body.
    """

    path: str
    name: str
    #: ``build(state)`` -> ``(status, JSON payload)``.
    build: Callable[[AppState], tuple[int, Any]]
    #: The route is open (no key needed): its answer to a stranger says less (see
    #: :func:`afmd.http.sansio.screen.reveals_machine`); ``limit(status, payload)`` -> payload.
    limit: Callable[[int, Any], Any] | None = None

    def answer(self, state: AppState, *, full: bool = True) -> tuple[int, bytes]:
        """The status and the JSON body, as bytes; ``full``: with the machine's details."""
        status, payload = self.build(state)
        if not full and self.limit is not None:
            payload = self.limit(status, payload)
        return status, orjson.dumps(payload)

    def full_for(self, state: AppState, sockname: object, key: bytes | None) -> bool:
        """Whether this request may see the machine's details in the answer."""
        if self.limit is None:
            return True
        return reveals_machine(state.config.server.api_key.encode(),
                               local_connection(sockname), key)

    async def handler(self, request: Request) -> HTTPResponse:
        state = request.app.ctx.state
        full = self.full_for(state, request.conn_info.sockname if request.conn_info else None,
                             _key_of(request))
        status, body = self.answer(state, full=full)
        return HTTPResponse(body, status=status, content_type="application/json")


def _key_of(request: Request) -> bytes | None:
    """The key a request carries, as the gate reads it (``x-api-key``, else Bearer)."""
    key = request.headers.get("x-api-key")
    if key is not None:
        return key.strip().encode("latin-1", "replace")
    scheme, _, rest = request.headers.get("authorization", "").partition(" ")
    return rest.strip().encode("latin-1", "replace") if scheme.lower() == "bearer" else None


def _models(state: AppState) -> tuple[int, dict[str, Any]]:
    data = _model_objects(state)
    return 200, {"object": "list", "data": data, "has_more": False,
                 "first_id": data[0]["id"] if data else None,
                 "last_id": data[-1]["id"] if data else None}


async def get_model(request: Request, model_id: str) -> HTTPResponse:
    # The route's ``unquote`` does not reach a ``path`` parameter (Sanic matches those by
    # a regular expression, and decodes only the ones its tree matches): decoded here.
    model_id = unquote(model_id)
    for header, dialect in CLIENT_STYLES:
        if header in request.headers:
            # Anthropic's 404 (``not_found_error``, with ``request-id``) is what its SDK's
            # error reads its ``type`` and ``requestID`` from.
            request.ctx.dialect = dialect
            break
    state = request.app.ctx.state
    # Ollama's default tag, as every other route reads it: a client of Ollama's OpenAI
    # routes names its models as ``/api/tags`` lists them (``demo:latest``).
    for name in dict.fromkeys((model_id, model_id.removesuffix(":latest"))):
        for obj in _model_objects(state):
            if obj["id"] == name:
                return HTTPResponse(orjson.dumps(obj), content_type="application/json")
    raise NotFoundError(
        f"The model '{model_id}' does not exist.", code="model_not_found", param="model"
    )


def _model_objects(state: AppState) -> list[dict[str, Any]]:
    config = state.config
    created = state.started_at
    # Anthropic's created_at: RFC 3339, in UTC.
    created_at = datetime.fromtimestamp(created, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def model(model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "afmd",
                "type": "model", "display_name": model_id, "created_at": created_at,
                "lifecycle": "active"}

    objects: list[dict[str, Any]] = []
    kinds: dict[str, str] = {}  # "chat" or "embedding": what each model serves
    for entry in config.models.model:
        kinds[entry.id] = state.registry.kind_of(entry)
        objects.append({**model(entry.id), "kind": kinds[entry.id]})
    for alias, target in config.models.aliases.items():
        objects.append({**model(alias), "parent": target, "kind": kinds.get(target)})
    return objects


def _health_limited(status: int, body: dict[str, Any]) -> dict[str, Any]:
    """``/health`` for a stranger on a keyed listener: whether the server is up (what a
    load balancer needs) and why not, nothing about the machine (model folders, pids, the
    hosts of a group). ``afmd doctor`` and ``afmd ps`` send the config's key."""
    return {key: body[key] for key in ("status", "reason") if key in body}


def _health(state: AppState) -> tuple[int, dict[str, Any]]:
    registry = state.registry
    default = state.config.resolve_model(None)
    body: dict[str, Any] = {
        "status": "ok",
        "models": registry.status(),
        "active_requests": state.pipeline.scheduler.active,
        "queued_requests": state.pipeline.scheduler.queued,
        "model_details": model_details(state),
    }
    status = 200
    # Apple's model as the default, where the framework cannot run it now: its reason.
    unavailable = registry.unavailable_reason(default.id) if default is not None else None
    if unavailable is not None:
        body["status"] = "unavailable"
        body["reason"] = unavailable
        status = 503
    # Not ready while the default model's first load is due or under way, or failed; once
    # loaded it may be unloaded when idle, and then loads again on demand.
    elif default is not None and not registry.is_ready(default.id) and (
        registry.failure(default.id) is not None
        or (state.config.models.preloads(default) and not registry.loads.was_loaded(default.id))
    ):
        failure = registry.failure(default.id)
        body["status"] = "unavailable"
        body["reason"] = "model_load_failed" if failure and not registry.loads.is_loading(
            default.id) else "model_not_ready"
        status = 503
    group = state.group
    if group is not None:  # rank 0 of a launched group: every rank, and a loss
        loaded = registry.loaded(default.id) if default is not None else None
        body["distributed"] = group.health(
            {"weights_bytes": loaded.weights_bytes} if loaded is not None else None
        )
        if group.lost is not None:
            body["status"] = "unavailable"
            body["reason"] = group.lost
            status = 503
    return status, body


#: The routes that :class:`StateRoute` describes; ``create_app`` registers them. The
#: listing is also at ``/models``, as chat, completions, embeddings and Responses are at
#: the root too: a client whose base URL leaves out ``/v1`` (the openai SDK's
#: ``models.list()`` on ``http://127.0.0.1:9999``) reached every route but this one.
STATE_ROUTES = (
    StateRoute("/v1/models", "models", _models),
    StateRoute("/models", "models_root", _models),
    StateRoute("/health", "health", _health, limit=_health_limited),
)
