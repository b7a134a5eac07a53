"""The API's handlers: HTTP framing around the pipeline, and nothing else.

A turn's route names its dialect (``ctx_dialect``, :mod:`afmd.dialects`): the handler
parses the body with it, prepares and runs the turn, and has it encode the run's events,
so one handler serves every dialect and the wire formats live in their adapters.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import orjson
from sanic import Request, Sanic
from sanic.response import HTTPResponse

from afmd.core.events import Event, Usage
from afmd.core.ids import new_request_id
from afmd.core.request import ChatRequest, CompletionRequest
from afmd.dialects.dialect import Dialect, OpensWithPrompt, ReplyEncoder, ReturnsTokens
from afmd.errors import (
    APIError,
    InvalidRequestError,
    NotFoundError,
    ServiceUnavailableError,
    request_timeout_error,
)
from afmd.http.access import log_access, note_error
from afmd.http.app_state import AppState
from afmd.http.routes.event_stream import STALL_GRACE, EventStream, Stalled
from afmd.http.routes.ignored import ignored_headers
from afmd.http.routes.large_bodies import answer_body, parse_body
from afmd.http.sansio.screen import REQUEST_ID
from afmd.service.chat_run import ChatRun, PreparedChat
from afmd.service.choices import ChoicesRun
from afmd.service.completion_prompts import PreparedCompletion
from afmd.service.completion_run import CompletionRun
from afmd.service.embedding_pipeline import EmbeddingService
from afmd.service.pipeline import ChatPipeline, NotStarted
from afmd.service.profiling import parse_profile_header

# The state routes live in afmd.http.routes.state_routes; app.py, the connection protocol and the
# tests find them here too.
__all__ = [
    "SSE_HEADERS",
    "cancel",
    "cancel_live",
    "dialect_of",
    "interrupt_requests",
    "json_response",
    "request_id_of",
    "server_stopping_error",
    "turn",
]

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def json_response(
    payload: Any, status: int = 200, headers: dict[str, str] | None = None
) -> HTTPResponse:
    return HTTPResponse(
        orjson.dumps(payload), status=status, headers=headers, content_type="application/json"
    )


def request_id_of(request: Request) -> str:
    """The client's X-Request-ID when it is a sane token; otherwise a fresh one."""
    rid = getattr(request.ctx, "request_id", None)
    if rid:
        return rid
    sent = request.headers.get("x-request-id") or None  # empty means absent
    if sent is not None and not REQUEST_ID.fullmatch(sent):
        raise InvalidRequestError(
            "X-Request-ID must be 1-128 characters among A-Z, a-z, 0-9, '.', '_', ':' and '-'.",
            code="invalid_value",
            param="X-Request-ID",
        )
    rid = sent or new_request_id()
    request.ctx.request_id = rid
    return rid


def answer_request_id(request: Request) -> str:
    """The id an answer names, whatever route gave it: the request's own once read
    (:func:`request_id_of`), else the client's X-Request-ID when it is a sane token, else a
    fresh one; never an error, as the answer is already made."""
    rid = getattr(request.ctx, "request_id", None)
    if not rid:
        sent = request.headers.get("x-request-id") or ""
        rid = sent if REQUEST_ID.fullmatch(sent) else new_request_id()
        request.ctx.request_id = rid
    return str(rid)


def dialect_of(request: Request | None) -> Dialect[Any] | None:
    """The dialect of the route ``request`` matched (None: not a turn's route), whichever
    kind of request it reads; or the one a route that two APIs share chose for this
    request (``request.ctx.dialect``: ``/v1/models/{id}`` for an Anthropic client)."""
    if request is None:
        return None
    chosen: Dialect[Any] | None = getattr(request.ctx, "dialect", None)
    if chosen is not None:
        return chosen
    route = getattr(request, "route", None)
    return getattr(route.ctx, "dialect", None) if route is not None else None


def response_headers(
    prepared: PreparedChat | PreparedCompletion, extra: dict[str, str]
) -> dict[str, str]:
    headers = {"X-Request-ID": prepared.request_id, "OpenAI-Request-ID": prepared.request_id,
               **extra}
    if prepared.plan.downgraded:
        headers["X-Grammar-Constraints"] = "downgraded"
    if prepared.trimmed:
        headers["X-AFM-Trimmed-Messages"] = str(prepared.trimmed)
    if isinstance(prepared, PreparedChat) and prepared.trimmed_prefix:
        headers["X-AFM-Trimmed-Context"] = str(prepared.trimmed_prefix)
    return headers


def server_stopping_error() -> ServiceUnavailableError:
    """What a request still running when the shutdown grace period ends is told, with
    the ``Retry-After`` every other 503 carries (a supervised daemon is back in moments;
    Anthropic's 529 said it already)."""
    return ServiceUnavailableError(
        "The server is stopping; the request was ended before it completed. Retry it "
        "when the server is back.",
        code="server_shutting_down",
        headers={"Retry-After": "1"},
    )


def interrupt_requests(state: AppState, error: APIError) -> None:
    """End every chat request still running with ``error`` (the server is stopping).

    Requests waiting for their model stop waiting (none is loaded for them), queued runs
    leave the queue and generations are cancelled; each handler then answers ``error`` as
    it answers any failure (a plain error before the 200, an error event and the stream's
    end after it) and its connection goes idle. Safe to call repeatedly: a run that
    started a new round meanwhile (server tools) is caught by the next call.
    """
    state.stop_error = error
    state.registry.loads.stop(error)  # nothing is loaded any more, for a turn or not
    state.pipeline.cancel_arriving()  # each answers the error, not a model loaded for it
    for request_id in list(state.running):
        run = state.pipeline.find(request_id)
        if run is None or run.finished:
            continue
        generation = run.generation
        if generation is None:
            run.ticket.cancel()  # still queued: start() returns it without a generation
        elif not generation.done:
            run.prepared.model.cancel(generation)
            generation.fail(error)  # wakes its consumer now, even mid-prefill


async def _next_batch(
    state: AppState, run: ChatRun | ChoicesRun | CompletionRun, batches: AsyncIterator[list[Event]]
) -> list[Event]:
    """The run's next batch of events; a run the shutdown cancelled fails with its error."""
    batch = await anext(batches)
    stop = state.stop_error
    if stop is not None and run.finished and run.finish_reason == "cancelled":
        raise stop
    return batch


def _note_end(request: Request, run: ChatRun | ChoicesRun | CompletionRun,
              reply: ReplyEncoder) -> None:
    """The run is over: what the access log and /metrics read, and the ids it ran for a
    reply that returns them (told before the last batch is encoded)."""
    request.ctx.usage = run.usage
    request.ctx.run = run  # its model and engine timings, for /metrics
    request.ctx.finish_reason = run.finish_reason
    if isinstance(reply, ReturnsTokens) and isinstance(run, ChatRun):
        tokens = run.token_ids
        if tokens is not None:
            reply.tokens_ran(tokens)


async def turn(request: Request, parsed: ChatRequest | CompletionRequest | None = None
               ) -> HTTPResponse | None:
    """One turn in the dialect of the route: parse, prepare, run, encode (``parsed``: the
    body as the dialect already read it, for a route that looked at it first)."""
    dialect = dialect_of(request)
    assert dialect is not None, "a turn's route names its dialect (ctx_dialect)"
    state = request.app.ctx.state
    pipeline: ChatPipeline = state.pipeline
    request_id = request_id_of(request)
    chat = parsed if parsed is not None else await parse_body(request, lambda raw: dialect.parse(
        raw, server_tools=pipeline.server_tools.names, strict=state.config.api.strict))
    request.ctx.model = chat.model
    extra = ignored_headers(chat.ignored_fields, request_id)
    try:
        prepared = await pipeline.prepare(
            chat,
            request_id,
            received_at=getattr(request.ctx, "started", None),
            profile=parse_profile_header(request.headers.get("x-afm-profile")),
        )
    except NotStarted as ended:
        if state.stop_error is not None:  # cancelled by the shutdown: its error
            raise state.stop_error from None
        return await _cancelled_before_start(request, dialect, ended, request_id, extra)
    request.ctx.model = prepared.model_name
    reply = dialect.reply(chat, model=prepared.model_name, fingerprint=prepared.fingerprint)
    if state.stop_error is not None:
        pipeline.discard(prepared)
        raise state.stop_error
    # From here until it is released, interrupt_requests() finds the run by this id
    # (start() registers it before it can wait in the queue).
    state.running[request_id] += 1
    try:
        if chat.stream:
            await _stream(request, prepared, reply, extra)
            return None
        run = await pipeline.start(prepared)
        request.ctx.run = run  # its engine timings for /metrics, however it ends
        try:
            async with aclosing(aiter(run)) as batches:
                return await _complete(request, run, batches, reply, extra)
        finally:
            pipeline.release(run)
    finally:
        state.running[request_id] -= 1
        if not state.running[request_id]:
            del state.running[request_id]


async def _cancelled_before_start(
    request: Request, dialect: Dialect[Any], ended: NotStarted, request_id: str,
    extra: dict[str, str],
) -> HTTPResponse | None:
    """A turn cancelled while its model loaded or was waited for: the answer a run
    cancelled in the queue gets (finish reason ``cancelled``), with no tokens counted."""
    reply = dialect.reply(ended.request, model=ended.model_name, fingerprint=ended.fingerprint)
    events = ended.events()
    request.ctx.model = ended.model_name
    request.ctx.usage = next(e for e in events if isinstance(e, Usage))
    request.ctx.finish_reason = "cancelled"
    headers = {"X-Request-ID": request_id, "OpenAI-Request-ID": request_id, **extra}
    if not ended.request.stream:
        return HTTPResponse(reply.body(events), headers=headers,
                            content_type="application/json")
    out = EventStream(request, reply, {**SSE_HEADERS, **headers})
    until = time.monotonic() + STALL_GRACE  # one small write, to a client just seen
    try:
        await out.write(reply.stream(events) + reply.stream_end(), last=True, until=until)
        await out.eof(until=until)
    except Stalled:
        out.cut()
        raise asyncio.CancelledError from None
    except asyncio.CancelledError:
        if out.opened:
            request.ctx.disconnected = True
        raise
    finally:
        out.stop()
        if out.opened:
            log_access(request, 200, out.sent)
    return None


async def _complete(
    request: Request, run: ChatRun | ChoicesRun | CompletionRun,
    batches: AsyncIterator[list[Event]], reply: ReplyEncoder, extra: dict[str, str],
) -> HTTPResponse:
    state = request.app.ctx.state
    events: list[Event] = []
    while not run.finished:
        events += await _next_batch(state, run, batches)
    _note_end(request, run, reply)
    return HTTPResponse(await answer_body(reply, events),
                        headers=response_headers(run.prepared, extra),
                        content_type="application/json")


async def _stream(
    request: Request, prepared: PreparedChat | PreparedCompletion, reply: ReplyEncoder,
    extra: dict[str, str],
) -> None:
    state = request.app.ctx.state
    if isinstance(reply, OpensWithPrompt) and isinstance(prepared, PreparedChat):
        reply.prompt_counted(len(prepared.prompt))
    out = EventStream(request, reply, {**SSE_HEADERS, **response_headers(prepared, extra)})
    # A client that stops reading gets until its deadline, and then a grace for the stream's
    # end, before its connection is cut: its writes are the only thing it can stall.
    late = prepared.deadline + STALL_GRACE
    try:
        try:
            await _stream_run(request, prepared, reply, out, late)
        except APIError as exc:
            if not out.opened:
                raise  # nothing was sent: a plain error
            request.ctx.stream_error = exc.code
            note_error(request, exc)
            await out.write(reply.stream_error(exc), until=late)
    except Stalled:
        # What is left cannot reach it: the connection goes, as one the client closed does.
        request.ctx.stream_error = getattr(request.ctx, "stream_error", None) or "timeout"
        out.cut()
        reply.stream_abandoned()
        raise asyncio.CancelledError from None
    except asyncio.CancelledError:
        # The connection went away under the stream: the 200 stays, the line says why.
        if out.opened:
            if state.stop_error is not None:  # closed by the shutdown, past its last chance
                request.ctx.stream_error = state.stop_error.code
            else:
                request.ctx.disconnected = True
            reply.stream_abandoned()
        raise
    finally:
        if out.opened:
            log_access(request, 200, out.sent)
    try:
        await out.eof(until=late)
    except Stalled:
        out.cut()
        raise asyncio.CancelledError from None


async def _stream_run(
    request: Request, prepared: PreparedChat | PreparedCompletion, reply: ReplyEncoder,
    out: EventStream, late: float,
) -> None:
    """Run the turn into ``out``; a write the client holds up past the deadline is the
    run's 504, as if the deadline had found it generating."""
    state = request.app.ctx.state
    pipeline: ChatPipeline = state.pipeline
    try:
        run = await pipeline.start(prepared)
        request.ctx.run = run  # its engine timings for /metrics, however it ends
        try:
            async with aclosing(aiter(run)) as batches:
                while True:
                    batch = await _next_batch(state, run, batches)
                    if run.finished:
                        _note_end(request, run, reply)
                        data = reply.stream(batch) + reply.stream_end()
                        break
                    data = reply.stream(batch)
                    try:
                        await out.write(data, until=prepared.deadline)
                    except Stalled:
                        raise request_timeout_error() from None
        finally:
            pipeline.release(run)
        # Written once the slot is free: a slow reader's last bytes keep only its connection.
        await out.write(data, last=True, until=late)
    finally:
        out.stop()


def cancel_live(app: Sanic, request_id: str) -> bool:
    """Cancel the turn or the embeddings request live under this ``X-Request-ID``; False:
    none is. An id names one live request across every route (a second is a 409), so
    every cancel route finds any of them: a client that cancels through its own dialect's
    route must not be told that nothing runs under an id that does."""
    state: AppState = app.ctx.state
    embeddings: EmbeddingService | None = getattr(app.ctx, "embeddings", None)
    return state.pipeline.cancel(request_id) or (
        embeddings is not None and embeddings.cancel(request_id))


async def cancel(request: Request, request_id: str) -> HTTPResponse:
    """Stop the turn, or the embeddings request, with this ``X-Request-ID``: Ollama's routes
    have no cancel route of their own, and are cancelled here (or through any other)."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.cancellation",
    }
    if not cancel_live(request.app, request_id):
        err = NotFoundError(
            f"No running request has the id '{request_id}'.", code="not_found", param=None
        )
        body["cancelled"] = False
        body.update(err.envelope())
        return json_response(body, status=404)
    body["cancelled"] = True
    return json_response(body)
