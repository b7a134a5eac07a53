"""The embeddings handlers: HTTP framing around :mod:`afmd.service.embedding_pipeline`, and nothing
else.

The gate has screened the request (Host, Origin, key, content type, size) as for every
route; the handler parses the body with its route's dialect, awaits the service and
has the dialect encode the vectors. ``X-AFM-Profile`` is for streams and is ignored here.
"""

from __future__ import annotations

from typing import Any

from sanic import Request, Sanic
from sanic.response import HTTPResponse

from afmd.core.events import Usage
from afmd.dialects.openai.embeddings import OPENAI_EMBEDDINGS, OpenAIEmbeddings
from afmd.errors import APIError, NotFoundError
from afmd.http.routes.handlers import cancel_live, json_response, request_id_of
from afmd.http.routes.ignored import ignored_headers
from afmd.http.routes.large_bodies import built_off_loop, parse_body
from afmd.service.embedding_pipeline import EmbeddingService


def service_of(app: Sanic) -> EmbeddingService:
    """The app's embedding service, made on first use from the state chat requests use."""
    service: EmbeddingService | None = getattr(app.ctx, "embeddings", None)
    if service is None:
        state = app.ctx.state
        pipeline = state.pipeline
        service = app.ctx.embeddings = EmbeddingService(
            registry=state.registry,
            scheduler=pipeline.scheduler,
            request_timeout=state.config.server.request_timeout,
            taken=pipeline.live,
        )
        embeddings = service
        pipeline.taken = lambda request_id: embeddings.find(request_id) is not None
    return service


def interrupt_embeddings(app: Sanic, error: APIError) -> None:
    """End every embeddings request still waiting or running with ``error`` (the server
    is stopping), as :func:`~afmd.http.routes.handlers.interrupt_requests` ends the turns."""
    service: EmbeddingService | None = getattr(app.ctx, "embeddings", None)
    if service is not None:
        service.interrupt(error)


def _dialect(request: Request) -> OpenAIEmbeddings:
    route = getattr(request, "route", None)
    dialect = getattr(route.ctx, "dialect", None) if route is not None else None
    return dialect if isinstance(dialect, OpenAIEmbeddings) else OPENAI_EMBEDDINGS


async def embeddings(request: Request) -> HTTPResponse:
    dialect = _dialect(request)
    request_id = request_id_of(request)
    strict = request.app.ctx.state.config.api.strict
    parsed = await parse_body(request, lambda raw: dialect.parse(raw, strict=strict))
    request.ctx.model = parsed.model
    extra = ignored_headers(parsed.ignored_fields, request_id)
    stop = request.app.ctx.state.stop_error
    if stop is not None:  # the shutdown's grace period is over, as for a turn
        raise stop
    result = await service_of(request.app).embed(parsed, request_id)
    request.ctx.model = result.model
    request.ctx.usage = Usage(result.prompt_tokens, 0)
    body = await built_off_loop(lambda: dialect.body(result, parsed),
                                weight=result.vectors.size)
    return HTTPResponse(
        body,
        headers={"X-Request-ID": request_id, "OpenAI-Request-ID": request_id, **extra},
        content_type="application/json",
    )


async def cancel(request: Request, request_id: str) -> HTTPResponse:
    """Stop the request with this ``X-Request-ID``, an embeddings request (which then
    answers 409) or a turn: every cancel route finds every live request by its id."""
    body: dict[str, Any] = {"id": request_id, "object": "embedding.cancellation"}
    if not cancel_live(request.app, request_id):
        error = NotFoundError(
            f"No running request has the id '{request_id}'.", code="not_found", param=None
        )
        body["cancelled"] = False
        body.update(error.envelope())
        return json_response(body, status=404)
    body["cancelled"] = True
    return json_response(body)
