"""Background responses (``POST /v1/responses`` with ``background: true``): runs that go on
without the connection that started them.

The POST is prepared as any turn is (the same screening, model lease, prompt checks, each
refusal its own 4xx), then its run is handed to a task this module keeps, and the POST
answers at once: the response ``queued``, stored so, or (``stream``) its events, which the
client may stop reading at any time without ending the run. ``GET /v1/responses/{id}``
shows it ``queued`` / ``in_progress`` until it ends, then the stored final object;
``?stream=true&starting_after=N`` follows a streamed one's events after sequence number N,
live or replayed. The run waits in the same queue as every request: a full queue's 429
answers the POST itself. Its deadline is ``[responses] background_timeout`` instead of
``request_timeout``. A cancel by its ``resp_`` id (or its X-Request-ID) ends it
``cancelled``; the server's shutdown ends it ``failed`` with the shutdown's error.
The running responses and their events are kept by
:mod:`afmd.dialects.responses.background`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Iterable
from contextlib import aclosing
from typing import Any, cast

from sanic import Request
from sanic.response import HTTPResponse

from afmd.core.events import Usage
from afmd.dialects.responses.background import BackgroundRun, BackgroundRuns
from afmd.dialects.responses.responses_api import OpenAIResponses
from afmd.dialects.responses.responses_body import ResponsesRequest
from afmd.errors import APIError, GatewayTimeoutError, InvalidRequestError, ServerError
from afmd.http.access import log_access, log_request
from afmd.http.app_state import AppState
from afmd.http.routes.handlers import (
    SSE_HEADERS,
    json_response,
    request_id_of,
    response_headers,
    server_stopping_error,
)
from afmd.http.routes.ignored import ignored_headers
from afmd.logs import get_logger
from afmd.service.chat_run import ChatRun, PreparedChat
from afmd.service.choices import ChoicesRun
from afmd.service.completion_prompts import PreparedCompletion
from afmd.service.completion_run import CompletionRun
from afmd.service.pipeline import ChatPipeline, NotStarted
from afmd.service.profiling import parse_profile_header

__all__ = ["cancel", "create", "follow", "replay", "starting_after"]

log = get_logger("afmd.responses")

#: How long a follower's write may wait for its reader before its connection is cut (the
#: run goes on; the client resumes with ``starting_after``).
FOLLOW_STALL_SECONDS = 30.0
#: How long a cancel (or a delete) waits for the run to store its end before answering.
CANCEL_WAIT_SECONDS = 10.0

AnyRun = ChatRun | ChoicesRun | CompletionRun


async def _drive(state: AppState, bg: BackgroundRun, prepared: PreparedChat | PreparedCompletion,
                 path: str, received: float | None, release: Callable[[], None]) -> None:
    """Run the turn to its end and store it; nothing escapes (the task's failures are the
    response's, and logged). ``release`` lets its conversation go, at its end."""
    pipeline = state.pipeline
    run: AnyRun | None = None
    error: str | None = None
    try:
        try:
            run = await pipeline.start(prepared)
        except APIError as exc:
            if not bg.answered:  # refused before it could queue: the POST says so
                bg.refused = exc
                return
            raise
        try:
            async with aclosing(aiter(run)) as batches:
                while True:
                    batch = await anext(batches)
                    stop = state.stop_error
                    cancelled = run.finished and run.finish_reason == "cancelled"
                    if stop is not None and cancelled:
                        raise stop  # cancelled by the shutdown: failed with its error
                    if bg.status == "queued" and not cancelled:
                        # Its first events: it has left the queue (one cancelled while
                        # still waiting there goes from queued to its end).
                        bg.started()
                    bg.publish(bg.reply.stream_events(batch))
                    if run.finished:
                        break
            bg.finish(*bg.reply.end_events())
        finally:
            pipeline.release(run)
    except APIError as exc:
        if isinstance(exc, GatewayTimeoutError):
            exc = _past_deadline()
        error = exc.code
        bg.finish(*bg.reply.error_events(exc))
    except asyncio.CancelledError:
        # Cancelled as the event loop closes (a shutdown past its last chance).
        stop = state.stop_error or server_stopping_error()
        error = stop.code
        bg.finish(*bg.reply.error_events(stop))
        raise
    except Exception as exc:
        log.exception("background response failed", id=bg.id)
        failure = ServerError(f"The response failed: {type(exc).__name__}.")
        error = failure.code
        bg.finish(*bg.reply.error_events(failure))
    finally:
        release()
        state.running[bg.request_id] -= 1
        if not state.running[bg.request_id]:
            del state.running[bg.request_id]
        if bg.refused is None:
            _log_end(state, path, bg, run, received, error)
        bg.close()


def _past_deadline() -> GatewayTimeoutError:
    """The run's deadline passed, queued or generating: the pipeline's 504 names
    ``request_timeout``, which a background response is not held to."""
    return GatewayTimeoutError(
        "The background response did not complete within the server's background_timeout "
        "([responses] background_timeout).", code="timeout")


def _log_end(state: AppState, path: str, bg: BackgroundRun, run: AnyRun | None,
             received: float | None, error: str | None) -> None:
    """The access log's line for the run itself (the POST had its own when it answered):
    method ``BACKGROUND``, the response's path, its usage and how it ended; and the run's
    count in ``/metrics``, which the POST's could not hold: it ended before the run began.
    A run that failed told no usage (its response has none), as a stream cut off does."""
    usage: Usage | None = run.usage if run is not None else None
    if run is not None:
        state.metrics.generated(run.prepared.model.id, run, usage if error is None else None)
    log_request(state, "BACKGROUND", f"{path}/{bg.id}", 200, 0, started=received,
                request_id=bg.request_id, model=bg.current().get("model"), usage=usage,
                finish_reason=run.finish_reason if run is not None else None,
                stream_error=error, run=run)


async def cancel(bg: BackgroundRun, pipeline: ChatPipeline) -> dict[str, Any]:
    """Cancel the run (its slot is freed as it stops) and answer the response as it
    ended: ``cancelled``, or how it ended first if the cancel came too late."""
    pipeline.cancel(bg.request_id)
    if bg.task is not None:
        await asyncio.wait({bg.task}, timeout=CANCEL_WAIT_SECONDS)
    return bg.final if bg.final is not None else bg.reply.current("cancelled")


async def create(request: Request, dialect: OpenAIResponses, chat: ResponsesRequest
                 ) -> HTTPResponse | None:
    """The POST of a background response: prepared while the client waits (a refusal is
    its answer), then run by a task of its own, which holds its conversation to its end."""
    conversations, conversation = dialect.conversations, chat.echo.conversation
    conversations.hold(conversation)
    handed: list[BackgroundRun] = []  # the run whose task took the conversation over
    try:
        return await _create(request, dialect, chat,
                             lambda: conversations.release(conversation), handed)
    finally:
        if not handed:  # refused, or cancelled, before its task began
            conversations.release(conversation)


async def _create(request: Request, dialect: OpenAIResponses, chat: ResponsesRequest,
                  release: Callable[[], None], handed: list[BackgroundRun]
                  ) -> HTTPResponse | None:
    state = request.app.ctx.state
    runs: BackgroundRuns = state.background
    pipeline = state.pipeline
    request_id = request_id_of(request)
    request.ctx.model = chat.model
    extra = ignored_headers(chat.ignored_fields, request_id)
    try:
        prepared = await pipeline.prepare(
            chat, request_id, received_at=getattr(request.ctx, "started", None),
            profile=parse_profile_header(request.headers.get("x-afm-profile")),
            timeout=state.config.responses.background_timeout)
    except NotStarted as ended:
        if state.stop_error is not None:
            raise state.stop_error from None
        return await _cancelled_before_start(request, dialect, ended, request_id, extra)
    request.ctx.model = prepared.model_name
    if state.stop_error is not None:
        pipeline.discard(prepared)
        raise state.stop_error
    reply = dialect.reply(chat, model=prepared.model_name, fingerprint=prepared.fingerprint)
    queued, opening = reply.queued()
    bg = BackgroundRun(reply, request_id, opening, streamed=chat.stream)
    state.running[request_id] += 1  # interrupt_requests() finds it, as a turn's run
    runs.add(bg, _drive(state, bg, prepared, request.path,
                        getattr(request.ctx, "started", None), release),
             lambda rid: dialect.store.get(rid) is not None)
    handed.append(bg)
    # The task's first step runs before this handler resumes: by then the run holds a
    # slot, waits in the queue, or was refused (a full queue's 429) before it began.
    await asyncio.sleep(0)
    if bg.refused is not None:
        raise bg.refused
    bg.answered = True
    if bg.final is None:
        reply.keep(queued)  # GET finds it from now on (and a restart, persisted)
    headers = response_headers(prepared, extra)
    if not chat.stream:
        return json_response(bg.current(), headers=headers)
    await follow(request, bg.follow(-1), headers)
    return None


async def _cancelled_before_start(request: Request, dialect: OpenAIResponses,
                                  ended: NotStarted, request_id: str, extra: dict[str, str]
                                  ) -> HTTPResponse | None:
    """Cancelled (by its X-Request-ID) while its model loaded: stored ``cancelled``,
    answered whole or as one write of its stream."""
    assert isinstance(ended.request, ResponsesRequest), "parsed by the Responses adapter"
    reply = dialect.reply(ended.request, model=ended.model_name,
                          fingerprint=ended.fingerprint)
    request.ctx.finish_reason = "cancelled"
    headers = {"X-Request-ID": request_id, "OpenAI-Request-ID": request_id, **extra}
    if not ended.request.stream:
        return HTTPResponse(reply.body(ended.events()), headers=headers,
                            content_type="application/json")
    data = reply.stream_start() + reply.stream(ended.events()) + reply.stream_end()
    await follow(request, _once([data]), headers)
    return None


async def _once(chunks: Iterable[bytes]) -> AsyncGenerator[bytes, None]:
    for chunk in chunks:
        yield chunk


def replay(events: list[bytes], after: int) -> AsyncGenerator[bytes, None]:
    """A finished response's kept events after sequence number ``after``."""
    return _once([b"".join(events[max(after + 1, 0):])])


async def follow(request: Request, source: AsyncGenerator[bytes, None],
                 headers: dict[str, str]) -> None:
    """Write ``source`` as an SSE stream. A reader that leaves, or stops reading, loses
    its connection and nothing else: the run is not this stream's."""
    request.ctx.streamed = True
    sent = 0
    try:
        response = await request.respond(status=200, headers={**SSE_HEADERS, **headers},
                                         content_type="text/event-stream")
        async with aclosing(source) as chunks:
            async for chunk in chunks:
                if not chunk:
                    continue
                async with asyncio.timeout(FOLLOW_STALL_SECONDS):
                    await response.send(chunk)
                sent += len(chunk)
        async with asyncio.timeout(FOLLOW_STALL_SECONDS):
            await response.eof()
    except TimeoutError:
        request.ctx.stream_error = "timeout"
        transport = cast("asyncio.Transport | None", request.transport)
        if transport is not None and not transport.is_closing():
            transport.abort()
    except asyncio.CancelledError:
        request.ctx.disconnected = True
        raise
    finally:
        log_access(request, 200, sent)


def starting_after(request: Request) -> int:
    """``?starting_after=N``: the sequence number after which to resume (-1: from the
    first event)."""
    raw = request.args.get("starting_after")
    if raw is None or raw == "":
        return -1
    # ASCII digits only: int() would also take "+1", " 1", "1_0" and other scripts' digits,
    # and refuse thousands of digits with an error of its own.
    digits = raw.removeprefix("-")
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 18) or int(raw) < -1:
        raise InvalidRequestError(
            "Invalid 'starting_after': expected a sequence number (an integer, 0 or more).",
            code="invalid_value", param="starting_after")
    return int(raw)

