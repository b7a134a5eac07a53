"""The API's handlers: HTTP framing around the pipeline, and nothing else.

A turn's route names its dialect (``ctx_dialect``, :mod:`afmd.dialects`): the handler
parses the body with it, prepares and runs the turn, and has it encode the run's events,
so one handler serves every dialect and the wire formats live in their adapters.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import orjson
from sanic import Request
from sanic.response import HTTPResponse

from afmd.core.events import Event
from afmd.core.ids import new_request_id
from afmd.dialects.base import Dialect, KeepsAlive, Reply
from afmd.errors import APIError, InvalidRequestError, NotFoundError, ServiceUnavailableError
from afmd.http.access import log_access
from afmd.http.ignored import ignored_headers
from afmd.http.model_detail import model_details
from afmd.pipeline import ChatPipeline, ChatRun, PreparedChat
from afmd.profiling import parse_profile_header

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

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
    if sent is not None and not _REQUEST_ID.fullmatch(sent):
        raise InvalidRequestError(
            "X-Request-ID must be 1-128 characters among A-Z, a-z, 0-9, '.', '_', ':' and '-'.",
            code="invalid_value",
            param="X-Request-ID",
        )
    rid = sent or new_request_id()
    request.ctx.request_id = rid
    return rid


def dialect_of(request: Request | None) -> Dialect | None:
    """The dialect of the route ``request`` matched (None: not a turn's route)."""
    route = getattr(request, "route", None) if request is not None else None
    return getattr(route.ctx, "dialect", None) if route is not None else None


def _response_headers(prepared: PreparedChat, extra: dict[str, str]) -> dict[str, str]:
    headers = {"X-Request-ID": prepared.request_id, "OpenAI-Request-ID": prepared.request_id,
               **extra}
    if prepared.plan.downgraded:
        headers["X-Grammar-Constraints"] = "downgraded"
    if prepared.trimmed:
        headers["X-AFM-Trimmed-Messages"] = str(prepared.trimmed)
    return headers


def server_stopping_error() -> ServiceUnavailableError:
    """What a request still running when the shutdown grace period ends is told."""
    return ServiceUnavailableError(
        "The server is stopping; the request was ended before it completed. Retry it "
        "when the server is back.",
        code="server_shutting_down",
    )


def interrupt_requests(state: Any, error: APIError) -> None:
    """End every chat request still running with ``error`` (the server is stopping).

    Queued runs leave the queue and generations are cancelled; each handler then answers
    ``error`` as it answers any failure (a plain error before the 200, an error event and
    the stream's end after it) and its connection goes idle. Safe to call repeatedly: a
    run that started a new round meanwhile (server tools) is caught by the next call.
    """
    state.stop_error = error
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
    state: Any, run: ChatRun, batches: AsyncIterator[list[Event]]
) -> list[Event]:
    """The run's next batch of events; a run the shutdown cancelled fails with its error."""
    batch = await anext(batches)
    stop = state.stop_error
    if stop is not None and run.finished and run.finish_reason == "cancelled":
        raise stop
    return batch


def _note_end(request: Request, run: ChatRun) -> None:
    request.ctx.usage = run.usage
    request.ctx.run = run  # its model and engine timings, for /metrics
    request.ctx.finish_reason = run.finish_reason


async def turn(request: Request) -> HTTPResponse | None:
    """One turn in the dialect of the route: parse, prepare, run, encode."""
    dialect = dialect_of(request)
    assert dialect is not None, "a turn's route names its dialect (ctx_dialect)"
    state = request.app.ctx.state
    pipeline: ChatPipeline = state.pipeline
    request_id = request_id_of(request)
    chat = dialect.parse(request.body, server_tools=pipeline.server_tools.names,
                         strict=state.config.api.strict)
    request.ctx.model = chat.model
    extra = ignored_headers(chat.ignored_fields, request_id)
    prepared = await pipeline.prepare(
        chat,
        request_id,
        received_at=getattr(request.ctx, "started", None),
        profile=parse_profile_header(request.headers.get("x-afm-profile")),
    )
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
        try:
            async with aclosing(aiter(run)) as batches:
                return await _complete(request, run, batches, reply, extra)
        finally:
            pipeline.release(run)
    finally:
        state.running[request_id] -= 1
        if not state.running[request_id]:
            del state.running[request_id]


async def _complete(
    request: Request, run: ChatRun, batches: AsyncIterator[list[Event]], reply: Reply,
    extra: dict[str, str],
) -> HTTPResponse:
    state = request.app.ctx.state
    events: list[Event] = []
    while not run.finished:
        events += await _next_batch(state, run, batches)
    _note_end(request, run)
    return HTTPResponse(reply.body(events), headers=_response_headers(run.prepared, extra),
                        content_type="application/json")


class _EventStream:
    """A turn's SSE response. Its status line waits for the first batch of events (until
    then any failure is a plain error), unless the dialect keeps quiet streams alive
    (:class:`~afmd.dialects.base.KeepsAlive`): then a wait past its interval (queued, a
    long prefill) opens the stream and sends its keep-alive, again after every quiet
    interval, and a later failure is an error event like any after the stream began."""

    __slots__ = ("_closed", "_first", "_headers", "_last", "_lock", "_pinger", "_request",
                 "_response", "sent")

    def __init__(self, request: Request, reply: Reply, headers: dict[str, str]) -> None:
        self._request = request
        self._first = reply.stream_start()  # before any batch is encoded, as replies expect
        self._headers = headers
        self._response: Any = None
        self._lock = asyncio.Lock()  # one write at a time: a batch, or a keep-alive
        self._last = time.monotonic()
        self._closed = False
        self._pinger: asyncio.Task[None] | None = None
        self.sent = 0
        if isinstance(reply, KeepsAlive):
            self._pinger = asyncio.create_task(
                self._keep_alive(reply.keepalive_interval, reply.keepalive()))

    @property
    def opened(self) -> bool:
        return self._response is not None

    async def write(self, data: bytes, *, last: bool = False) -> None:
        """Send ``data``; ``last``: nothing but this follows (no keep-alive after it)."""
        if last:
            self.stop()
        async with self._lock:
            await self._send(data)

    async def _send(self, data: bytes) -> None:
        if self._response is None:
            self._request.ctx.streamed = True
            self._response = await self._request.respond(
                status=200, headers=self._headers, content_type="text/event-stream")
            data = self._first + data
        self._last = time.monotonic()
        self.sent += len(data)
        await self._response.send(data)

    async def _keep_alive(self, interval: float, ping: bytes) -> None:
        """Send ``ping`` whenever ``interval`` seconds pass without a write."""
        try:
            while True:
                await asyncio.sleep(max(0.0, self._last + interval - time.monotonic()))
                async with self._lock:
                    if self._closed:
                        return
                    if time.monotonic() - self._last >= interval:
                        await self._send(ping)
        except Exception:  # the connection went away: the handler learns it itself
            return

    def stop(self) -> None:
        """No more keep-alives. A keep-alive being written is left to finish (cut short,
        the stream would be left mid-event); a waiting one ends at once."""
        self._closed = True
        if self._pinger is not None and not self._lock.locked():
            self._pinger.cancel()

    async def eof(self) -> None:
        await self._response.eof()


async def _stream(
    request: Request, prepared: PreparedChat, reply: Reply, extra: dict[str, str]
) -> None:
    state = request.app.ctx.state
    pipeline: ChatPipeline = state.pipeline
    out = _EventStream(request, reply, {**SSE_HEADERS, **_response_headers(prepared, extra)})
    try:
        try:
            run = await pipeline.start(prepared)
            try:
                async with aclosing(aiter(run)) as batches:
                    while True:
                        batch = await _next_batch(state, run, batches)
                        data = reply.stream(batch)
                        if run.finished:
                            _note_end(request, run)
                            data += reply.stream_end()
                        await out.write(data, last=run.finished)
                        if run.finished:
                            break
            finally:
                pipeline.release(run)
        finally:
            out.stop()
    except APIError as exc:
        if not out.opened:
            raise  # nothing was sent: a plain error
        request.ctx.stream_error = exc.code
        request.ctx.error = exc
        await out.write(reply.stream_error(exc))
    except asyncio.CancelledError:
        # The connection went away under the stream: the 200 stays, the line says why.
        if out.opened:
            if state.stop_error is not None:  # closed by the shutdown, past its last chance
                request.ctx.stream_error = state.stop_error.code
            else:
                request.ctx.disconnected = True
        raise
    finally:
        if out.opened:
            log_access(request, 200, out.sent)
    await out.eof()


@dataclass(frozen=True, slots=True)
class StateRoute:
    """A ``GET`` route whose answer is built from the server's state alone.

    Sanic serves it through :meth:`handler`; the connection protocol answers a plain,
    bodiless request for it itself (:class:`~afmd.http.gate.Direct`), because under a
    flood of health checks Sanic's per-request machinery costs several times what
    building the answer does. Both go through :meth:`answer`, so the two paths cannot
    disagree on status or body.
    """

    path: str
    name: str
    #: ``build(state)`` -> ``(status, JSON payload)``.
    build: Callable[[Any], tuple[int, Any]]

    def answer(self, state: Any) -> tuple[int, bytes]:
        """The status and the JSON body, as bytes."""
        status, payload = self.build(state)
        return status, orjson.dumps(payload)

    async def handler(self, request: Request) -> HTTPResponse:
        status, body = self.answer(request.app.ctx.state)
        return HTTPResponse(body, status=status, content_type="application/json")


def _models(state: Any) -> tuple[int, dict[str, Any]]:
    return 200, {"object": "list", "data": _model_objects(state)}


async def get_model(request: Request, model_id: str) -> HTTPResponse:
    state = request.app.ctx.state
    for obj in _model_objects(state):
        if obj["id"] == model_id:
            return json_response(obj)
    raise NotFoundError(
        f"The model '{model_id}' does not exist.", code="model_not_found", param="model"
    )


def _model_objects(state: Any) -> list[dict[str, Any]]:
    config = state.config
    created = state.started_at
    objects: list[dict[str, Any]] = []
    kinds: dict[str, str] = {}  # "chat" or "embedding": what each model serves
    for entry in config.models.model:
        kinds[entry.id] = state.registry.kind_of(entry)
        objects.append({"id": entry.id, "object": "model", "created": created,
                        "owned_by": "afmd", "kind": kinds[entry.id]})
    for alias, target in config.models.aliases.items():
        objects.append({"id": alias, "object": "model", "created": created,
                        "owned_by": "afmd", "parent": target, "kind": kinds.get(target)})
    return objects


def _health(state: Any) -> tuple[int, dict[str, Any]]:
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
    # Not ready while the default model's first load is due or under way, or failed; once
    # loaded it may be unloaded when idle, and then loads again on demand.
    if default is not None and not registry.is_ready(default.id) and (
        registry.failure(default.id) is not None
        or (state.config.models.preloads(default) and not registry.was_loaded(default.id))
    ):
        failure = registry.failure(default.id)
        body["status"] = "unavailable"
        body["reason"] = "model_load_failed" if failure and not registry.is_loading(
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


#: The routes that :class:`StateRoute` describes; ``create_app`` registers them.
STATE_ROUTES = (
    StateRoute("/v1/models", "models", _models),
    StateRoute("/health", "health", _health),
)


async def cancel(request: Request, request_id: str) -> HTTPResponse:
    state = request.app.ctx.state
    run = state.pipeline.find(request_id)
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.cancellation",
    }
    if run is None or run.finished:
        err = NotFoundError(
            f"No running request has the id '{request_id}'.", code="not_found", param=None
        )
        body["cancelled"] = False
        body.update(err.envelope())
        return json_response(body, status=404)
    run.cancel()
    body["cancelled"] = True
    return json_response(body)
