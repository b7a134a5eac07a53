"""The Sanic application: routes, error envelopes and the access log.

Sanic is configured to stay out of the way (no banner, no access log of its own, no
touch-up, which fails in a frozen binary) and every error, whether raised by afmd or by
Sanic's own routing and parsing, leaves as OpenAI's error envelope.
"""

from __future__ import annotations

import itertools
import time

from sanic import Request, Sanic
from sanic.exceptions import (
    BadRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RequestCancelled,
    SanicException,
)
from sanic.handlers import ErrorHandler
from sanic.response import HTTPResponse

from afmd.dialects.dialect import error_response
from afmd.dialects.openai.chat import OPENAI_CHAT
from afmd.dialects.openai.completions import OPENAI_COMPLETIONS
from afmd.dialects.openai.embeddings import OPENAI_EMBEDDINGS
from afmd.errors import APIError, InvalidRequestError, PayloadTooLargeError, ServerError
from afmd.http.access import CLIENT_CLOSED, log_access, note_error
from afmd.http.app_state import AppState
from afmd.http.routes import anthropic_routes as messages
from afmd.http.routes import cache_routes, conversation_routes, dashboard
from afmd.http.routes import embedding_routes as embeddings
from afmd.http.routes import handlers as routes
from afmd.http.routes import ollama_routes as ollama
from afmd.http.routes import responses_routes as responses
from afmd.http.routes.metrics import metrics
from afmd.http.routes.state_routes import STATE_ROUTES, get_model
from afmd.http.sansio.screen import Cors, method_not_allowed, unknown_url
from afmd.logs import get_logger

_app_counter = itertools.count()


class _EnvelopeErrorHandler(ErrorHandler):
    """Every error as OpenAI's envelope, whichever layer raised it."""

    def default(self, request: Request, exception: Exception) -> HTTPResponse:
        if isinstance(exception, RequestCancelled) and request is not None:
            stop = request.app.ctx.state.stop_error
            if stop is None:
                # The client went away (queued, or before its answer): its doing, not a
                # server error. Nothing reaches it; the status is for the access log only.
                request.ctx.disconnected = True
                return HTTPResponse(status=CLIENT_CLOSED)
            exception = stop  # the shutdown closed the connection
        error = to_api_error(exception, request)
        if isinstance(error, ServerError) and not isinstance(exception, APIError):
            get_logger("afmd").error(
                "unhandled error", path=request.path, exc_info=exception
            )
        if request is not None:
            note_error(request, error)  # the access log names its code and param
        # In the envelope (and with the status) of the route's dialect.
        rid = getattr(request.ctx, "request_id", None) if request else None
        status, envelope, headers = error_response(routes.dialect_of(request), error, rid)
        if rid:
            headers.setdefault("X-Request-ID", rid)
            headers.setdefault("OpenAI-Request-ID", rid)
        return routes.json_response(envelope, status=status, headers=headers)


def to_api_error(exception: BaseException, request: Request | None = None) -> APIError:
    if isinstance(exception, APIError):
        return exception
    # The gate refuses unknown URLs and methods first, with the same errors.
    if isinstance(exception, MethodNotAllowed):
        allowed = sorted(getattr(exception, "allowed_methods", None) or [])
        if request is None:
            return method_not_allowed("this method", "this URL", allowed)
        return method_not_allowed(request.method, request.path, allowed)
    if isinstance(exception, NotFound):
        if request is None:
            return unknown_url("", "")
        return unknown_url(request.method, request.path)
    if isinstance(exception, PayloadTooLarge):
        # Sanic raises the same exception for an oversized request line + headers
        # ("Request header exceeds the size limit"); that is not the body's fault.
        if "header" in str(exception).lower():
            return InvalidRequestError(
                "The request line and headers are larger than max_header_bytes; shorten the "
                "URL or the headers.",
                code="malformed_request",
                status=431,
            )
        return PayloadTooLargeError("The request body is larger than max_request_body_bytes.")
    if isinstance(exception, BadRequest):
        return InvalidRequestError(
            f"Malformed request: {exception}", code="malformed_request"
        )
    if isinstance(exception, SanicException):
        status = int(getattr(exception, "status_code", 500) or 500)
        if status < 500:
            return InvalidRequestError(str(exception), code="malformed_request", status=status)
    return ServerError("The server had an error while processing your request.")


async def _root(request: Request) -> HTTPResponse:
    """What Ollama's clients probe for, and a plain "it runs" for anyone else."""
    redirect = dashboard.browser_redirect(request)  # a browser: to the dashboard
    if redirect is not None:
        return redirect
    return HTTPResponse(ollama.ROOT_TEXT, content_type="text/plain; charset=utf-8")


def create_app(state: AppState, name: str | None = None) -> Sanic:
    server = state.config.server
    app = Sanic(
        name or f"afmd_{next(_app_counter)}",
        configure_logging=False,
        error_handler=_EnvelopeErrorHandler(),
    )
    app.config.update(
        {
            "MOTD": False,
            "ACCESS_LOG": False,
            "TOUCHUP": False,
            "NOISY_EXCEPTIONS": False,
            "FALLBACK_ERROR_FORMAT": "json",
            "REQUEST_MAX_SIZE": server.max_request_body_bytes,
            "REQUEST_MAX_HEADER_SIZE": server.max_header_bytes,
            # Sanic stops reading a connection once it holds this many bytes, until it
            # asks for more; a request the gate hands over whole never makes it ask, so
            # past 64 KiB (its default) a client's close went unseen and its generation
            # ran on. The gate bounds what Sanic holds (max_buffered_request_bytes, all
            # connections together), so the pause can be left to it: one past that bound.
            "REQUEST_BUFFER_SIZE": server.max_buffered_request_bytes + 1,
            "REQUEST_TIMEOUT": server.idle_timeout,
            "KEEP_ALIVE_TIMEOUT": server.idle_timeout,
            # Our own request_timeout governs generations; Sanic's inactivity timer must
            # never cut a stream during a long prefill.
            "RESPONSE_TIMEOUT": server.request_timeout + 60.0,
            "GRACEFUL_SHUTDOWN_TIMEOUT": server.shutdown_grace,
            "REAL_IP_HEADER": None,
        }
    )
    app.ctx.state = state

    # A turn's route names its dialect: the adapter that parses its bodies, encodes its
    # answers and renders its errors. Every route with a parameter in its path is
    # registered with ``unquote``: Sanic hands a parameter over still percent-encoded, and
    # the SDKs encode the ids they put in a path (a model's ``org/name`` came as
    # ``org%2Fname``, and was not found).
    app.add_route(routes.turn, "/v1/chat/completions", methods=["POST"],
                  name="chat_completions", ctx_dialect=OPENAI_CHAT)
    app.add_route(routes.turn, "/chat/completions", methods=["POST"],
                  name="chat_completions_root", ctx_dialect=OPENAI_CHAT)
    app.add_route(routes.cancel, "/v1/chat/completions/<request_id:str>/cancel",
                  methods=["POST"], name="cancel", unquote=True)
    app.add_route(routes.turn, "/v1/completions", methods=["POST"],
                  name="completions", ctx_dialect=OPENAI_COMPLETIONS)
    app.add_route(routes.turn, "/completions", methods=["POST"],
                  name="completions_root", ctx_dialect=OPENAI_COMPLETIONS)
    app.add_route(routes.cancel, "/v1/completions/<request_id:str>/cancel",
                  methods=["POST"], name="completions_cancel", unquote=True)
    app.add_route(embeddings.embeddings, "/v1/embeddings", methods=["POST"],
                  name="embeddings", ctx_dialect=OPENAI_EMBEDDINGS)
    app.add_route(embeddings.embeddings, "/embeddings", methods=["POST"],
                  name="embeddings_root", ctx_dialect=OPENAI_EMBEDDINGS)
    app.add_route(embeddings.cancel, "/v1/embeddings/<request_id:str>/cancel",
                  methods=["POST"], name="embeddings_cancel", unquote=True)
    conversation_routes.add_routes(app, responses.add_routes(app, state.config))
    messages.add_routes(app)
    ollama.add_routes(app)
    for route in STATE_ROUTES:
        app.add_route(route.handler, route.path, methods=["GET"], name=route.name)
    app.add_route(get_model, "/v1/models/<model_id:path>", methods=["GET"],
                  name="model", unquote=True)
    app.add_route(get_model, "/models/<model_id:path>", methods=["GET"],
                  name="model_root", unquote=True)
    app.add_route(metrics, "/metrics", methods=["GET"], name="metrics")
    cache_routes.add_routes(app)
    app.add_route(_root, "/", methods=["GET", "HEAD"], name="root")
    dashboard.add_routes(app, state)

    @app.on_request
    async def _mark_start(request: Request) -> None:
        request.ctx.started = time.perf_counter()

    cors = Cors.from_origins(server.allowed_origins)  # the gate's, from the same config

    @app.on_response
    async def _cors(request: Request, response: HTTPResponse) -> None:
        # The gate already refused disallowed origins with 403; streamed responses pass
        # here too (request.respond() runs response middleware before the head is sent).
        cors.apply(request.headers.get("origin"), response.headers)

    @app.on_response
    async def _request_id(request: Request, response: HTTPResponse) -> None:
        # Every answer names its request, as OpenAI's API does (its SDKs read the id of
        # any answer, a model listing's too), and under the header the route's SDK reads
        # it from as well (Anthropic's ``request-id``); streams pass here before their head.
        rid = response.headers.get("X-Request-ID") or routes.answer_request_id(request)
        if "X-Request-ID" not in response.headers:
            response.headers["X-Request-ID"] = rid
        name = getattr(routes.dialect_of(request), "request_id_header", None)
        if name and name not in response.headers:
            response.headers[name] = rid

    @app.on_response
    async def _access_log(request: Request, response: HTTPResponse) -> None:
        if getattr(request.ctx, "streamed", False):
            return  # logged when the stream ends
        # Sanic runs response middleware last registered first: _request_id has not named
        # the answer yet, and the line must name the id it will carry.
        request.ctx.request_id = (response.headers.get("X-Request-ID")
                                  or routes.answer_request_id(request))
        body = getattr(response, "body", None)
        log_access(request, response.status, len(body) if body else 0)

    return app


