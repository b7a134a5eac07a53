"""Anthropic's Messages routes: ``POST /v1/messages`` is a turn like chat's
(:func:`afmd.http.routes.handlers.turn`, in the :mod:`~afmd.dialects.anthropic.messages_api`
dialect); counting a prompt's tokens and cancelling a run by its ``X-Request-ID`` are
here. Every route names the dialect, so each error, the gate's refusals included, is in
Anthropic's envelope.
"""

from __future__ import annotations

from sanic import Request, Sanic
from sanic.response import HTTPResponse

from afmd.dialects.anthropic.messages_api import ANTHROPIC_MESSAGES
from afmd.errors import NotFoundError
from afmd.http.routes import handlers as routes
from afmd.http.routes.ignored import ignored_headers
from afmd.http.routes.large_bodies import parse_body


def add_routes(app: Sanic) -> None:
    app.add_route(routes.turn, "/v1/messages", methods=["POST"], name="messages",
                  ctx_dialect=ANTHROPIC_MESSAGES)
    app.add_route(count_tokens, "/v1/messages/count_tokens", methods=["POST"],
                  name="messages_count_tokens", ctx_dialect=ANTHROPIC_MESSAGES)
    app.add_route(cancel, "/v1/messages/<request_id:str>/cancel", methods=["POST"],
                  name="messages_cancel", ctx_dialect=ANTHROPIC_MESSAGES,
                  unquote=True)


async def count_tokens(request: Request) -> HTTPResponse:
    """The prompt's tokens as ``/v1/messages`` would render it (tools and system
    included); nothing is queued or generated."""
    state = request.app.ctx.state
    pipeline = state.pipeline
    request_id = routes.request_id_of(request)
    chat = await parse_body(request, lambda raw: ANTHROPIC_MESSAGES.parse_count(
        raw, server_tools=pipeline.server_tools.names, strict=state.config.api.strict))
    request.ctx.model = chat.model
    tokens = await pipeline.count(chat, must_fit=True)
    return routes.json_response(
        {"input_tokens": tokens},
        headers={"X-Request-ID": request_id, "OpenAI-Request-ID": request_id,
                 **ignored_headers(chat.ignored_fields, request_id)})


async def cancel(request: Request, request_id: str) -> HTTPResponse:
    """Stop the run with this ``X-Request-ID``: its stream ends with ``stop_reason``
    ``cancelled`` (every cancel route finds every live request by its id)."""
    if not routes.cancel_live(request.app, request_id):
        raise NotFoundError(f"No running request has the id '{request_id}'.",
                            code="not_found")
    return routes.json_response({"id": request_id, "type": "message_cancellation",
                                 "cancelled": True})
