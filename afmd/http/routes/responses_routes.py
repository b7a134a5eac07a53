"""The Responses API's routes: the turn itself, and the stored responses around it.

``POST /v1/responses`` is a turn like any other (:func:`afmd.http.routes.handlers.turn` with the
Responses adapter), or with ``background: true`` a run of its own
(:mod:`afmd.http.routes.background_runs`). The others read the adapter's store and the
background runs: retrieve (a background response while it runs, and a streamed one's
events again with ``?stream=true``), delete, list a response's input items; count an
input's tokens; cancel a background response by its ``resp_`` id, or any running response
by the ``X-Request-ID`` it was sent with. Every route is registered on the app, so the
gate screens them as all others (Host, Origin, key, media type, size), and every error is
in the adapter's envelope, OpenAI's.
"""

from __future__ import annotations

from typing import Any

from sanic import Request, Sanic
from sanic.response import HTTPResponse

from afmd.config.sections import Config
from afmd.dialects.fields.checks import quoted
from afmd.dialects.responses.conversation_store import ConversationStore
from afmd.dialects.responses.responses_api import OpenAIResponses
from afmd.dialects.responses.store import ResponseStore
from afmd.errors import InvalidRequestError, NotFoundError
from afmd.http.routes import background_runs
from afmd.http.routes import handlers as routes
from afmd.http.routes.handlers import json_response, request_id_of
from afmd.http.routes.ignored import ignored_headers
from afmd.http.routes.item_pages import check_include, list_page
from afmd.http.routes.large_bodies import on_loop, parse_body
from afmd.paths import cache_dir

#: Where ``[responses] persist`` keeps them.
STORE_FOLDER = "responses"
CONVERSATION_FOLDER = "conversations"


def _dialect(request: Request) -> OpenAIResponses:
    dialect = routes.dialect_of(request)
    assert isinstance(dialect, OpenAIResponses), "registered with ctx_dialect"
    return dialect


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(
        f"No stored response has the id {quoted(response_id)} (it was never stored, was deleted, "
        "or expired).", code="response_not_found", param="response_id")


async def stored_response(request: Request, response_id: str) -> HTTPResponse | None:
    """``GET`` or ``DELETE`` one stored response (one route for both methods, so that a
    405 lists both in ``Allow``)."""
    if request.method == "DELETE":
        return await delete(request, response_id)
    return await retrieve(request, response_id)


async def create(request: Request) -> HTTPResponse | None:
    """``POST /v1/responses``: a turn, or with ``background: true`` a background run."""
    dialect = _dialect(request)
    state = request.app.ctx.state
    routes.request_id_of(request)  # a bad X-Request-ID is refused before the body is read
    through = on_loop()
    chat = await parse_body(request, lambda raw: dialect.parse(
        raw, server_tools=state.pipeline.server_tools.names, strict=state.config.api.strict,
        through=through))
    if chat.echo.background:
        return await background_runs.create(request, dialect, chat)
    with dialect.conversations.holding(chat.echo.conversation):
        try:
            return await routes.turn(request, chat)
        finally:
            dialect.settled(chat)


async def retrieve(request: Request, response_id: str) -> HTTPResponse | None:
    """The response; one still running (background or not) as it stands. With
    ``?stream=true``, a streamed background response's events after ``starting_after``,
    followed live to its end if it still runs."""
    check_include(request)
    runs = request.app.ctx.state.background
    live = runs.running(response_id)
    stored = _dialect(request).store.get(response_id)
    turn = _dialect(request).running.get(response_id) if stored is None else None
    if turn is not None and request.args.get("stream") not in ("true", "1"):
        return json_response(turn.current("in_progress"))
    if live is None and stored is None:
        raise _not_found(response_id)
    if request.args.get("stream") not in ("true", "1"):
        if live is not None:
            return json_response(live.current())
        assert stored is not None
        return json_response(stored.response)
    after = background_runs.starting_after(request)
    headers = {"X-Request-ID": routes.request_id_of(request)}
    if live is not None and live.streamed:
        await background_runs.follow(request, live.follow(after), headers)
        return None
    events = runs.events(response_id)
    if events is None:
        raise InvalidRequestError(
            f"Response {quoted(response_id)} cannot be streamed: only a background response "
            "created with 'stream': true can, while it is stored and its events are kept "
            "(they are not kept across a restart, and the oldest go past "
            "max_stored_bytes); fetch it without 'stream'.", param="stream")
    await background_runs.follow(request, background_runs.replay(events, after), headers)
    return None


async def delete(request: Request, response_id: str) -> HTTPResponse:
    """Delete a stored response; a background response still running is cancelled first
    (deleted, it would have nowhere to end). One whose turn still runs otherwise runs on
    for the client reading it, and is not stored at its end."""
    turn = _dialect(request).running.pop(response_id, None)
    if turn is not None:
        turn.deleted()
        return json_response({"id": response_id, "object": "response.deleted",
                              "deleted": True})
    live = request.app.ctx.state.background.running(response_id)
    if live is not None:
        await background_runs.cancel(live, request.app.ctx.state.pipeline)
        # The cancel waits for the run's end only so long: one later must not store it
        # again once this delete has answered.
        live.reply.deleted()
    if not _dialect(request).store.delete(response_id):
        raise _not_found(response_id)
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def input_items(request: Request, response_id: str) -> HTTPResponse:
    """The response's input items (``ResponseItemList``), paged as OpenAI pages lists."""
    check_include(request)
    stored = _dialect(request).store.get(response_id)
    turn = _dialect(request).running.get(response_id) if stored is None else None
    if stored is None and turn is None:
        raise _not_found(response_id)
    items = stored.input_items if stored is not None else turn.input_items if turn else ()
    return json_response(list_page(request, items, f"input item of {quoted(response_id)}"))


async def input_tokens(request: Request) -> HTTPResponse:
    """How many tokens the input would take (``TokenCountsResource``)."""
    request_id = request_id_of(request)  # a bad X-Request-ID is refused here as everywhere
    state = request.app.ctx.state
    pipeline = state.pipeline
    dialect, through = _dialect(request), on_loop()
    parsed = await parse_body(request, lambda raw: dialect.parse_count(
        raw, server_tools=pipeline.server_tools.names, strict=state.config.api.strict,
        through=through))
    request.ctx.model = parsed.model
    count = await pipeline.count(parsed)
    return json_response({"object": "response.input_tokens", "input_tokens": count},
                         headers=ignored_headers(parsed.ignored_fields, request_id))


async def cancel(request: Request, request_id: str) -> HTTPResponse:
    """Cancel a background response by its ``resp_`` id (OpenAI's cancel: the response
    object, ``cancelled``; one already ended as it ended; a 400 for one that was not
    created in the background), or any running response by its ``X-Request-ID``: it ends
    with status ``cancelled``, streamed or not (as any live request the id names does)."""
    state = request.app.ctx.state
    live = state.background.running(request_id)
    if live is not None:
        return json_response(await background_runs.cancel(live, state.pipeline))
    stored = _dialect(request).store.get(request_id)
    if stored is not None or request_id in _dialect(request).running:
        if stored is not None and stored.response.get("background"):
            return json_response(stored.response)
        raise InvalidRequestError(
            f"Only background responses can be cancelled: {quoted(request_id)} was not "
            "created with 'background': true (cancel a running one by the X-Request-ID it "
            "was sent with).", code="invalid_value", param="response_id")
    body: dict[str, Any] = {"id": request_id, "object": "response.cancellation"}
    if not routes.cancel_live(request.app, request_id):
        error = NotFoundError(
            f"No running request has the id {quoted(request_id)} (cancel by the X-Request-ID the "
            "response was sent with; a stored response is already finished).",
            code="not_found", param=None)
        body["cancelled"] = False
        body.update(error.envelope())
        return json_response(body, status=404)
    body["cancelled"] = True
    return json_response(body)


async def compact(request: Request) -> HTTPResponse:
    """OpenAI's server-side compaction (the SDK's ``responses.compact``) returns an opaque,
    encrypted summary item only OpenAI's models read back. Unrouted, the path was read as
    a stored response's id, and the client was told POST is not allowed there."""
    raise NotFoundError(
        "POST /v1/responses/compact: afmd does not compact conversations on the server; "
        "send the conversation (or a summary the client made) as input.",
        code="not_served")


def add_routes(app: Sanic, config: Config) -> OpenAIResponses:
    """Register the routes on ``app``, over a store made from ``config``."""
    settings = config.responses
    folder = cache_dir() / STORE_FOLDER if settings.persist else None
    conversations = cache_dir() / CONVERSATION_FOLDER if settings.persist else None
    dialect = OpenAIResponses(ResponseStore(settings.max_stored, settings.ttl, folder,
                                            max_bytes=settings.max_stored_bytes),
                              ConversationStore(settings.max_conversations, settings.ttl,
                                                conversations,
                                                max_bytes=settings.max_conversations_bytes),
                              truncation="auto" if config.context.policy == "trim"
                              else "disabled")
    # A background stream's events leave with its response.
    runs = app.ctx.state.background
    runs.max_event_bytes = settings.max_stored_bytes
    dialect.store.on_remove = runs.forget
    for path, name in (("/v1/responses", "responses"), ("/responses", "responses_root")):
        app.add_route(create, path, methods=["POST"], name=name, ctx_dialect=dialect)
    app.add_route(input_tokens, "/v1/responses/input_tokens", methods=["POST"],
                  name="responses_input_tokens", ctx_dialect=dialect)
    app.add_route(compact, "/v1/responses/compact", methods=["POST"],
                  name="responses_compact", ctx_dialect=dialect)
    app.add_route(stored_response, "/v1/responses/<response_id:str>",
                  methods=["GET", "DELETE"], name="responses_stored", ctx_dialect=dialect,
                  unquote=True)
    app.add_route(input_items, "/v1/responses/<response_id:str>/input_items",
                  methods=["GET"], name="responses_input_items", ctx_dialect=dialect,
                  unquote=True)
    app.add_route(cancel, "/v1/responses/<request_id:str>/cancel", methods=["POST"],
                  name="responses_cancel", ctx_dialect=dialect,
                  unquote=True)
    return dialect
