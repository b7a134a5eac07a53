"""The API's handlers: HTTP framing around the pipeline, and nothing else."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from sanic import Request
from sanic.response import HTTPResponse

from afmd.errors import APIError, InvalidRequestError, NotFoundError, ServiceUnavailableError
from afmd.http.access import log_access
from afmd.output.pieces import Content, Reasoning, ToolCallArguments, ToolCallStart
from afmd.pipeline import ChatPipeline, ChatRun, Done, Output, PreparedChat
from afmd.profiling import parse_profile_header
from afmd.protocol.request import parse_chat_request, parse_json_body
from afmd.protocol.response import (
    DONE,
    ChunkEncoder,
    assistant_message,
    completion_object,
    error_event,
    new_request_id,
    sse,
)

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


def _response_headers(prepared: PreparedChat) -> dict[str, str]:
    headers = {"X-Request-ID": prepared.request_id, "OpenAI-Request-ID": prepared.request_id}
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
    ``[DONE]`` after it) and its connection goes idle. Safe to call repeatedly: a run that
    started a new round meanwhile (server tools) is caught by the next call.
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


async def _next_outputs(state: Any, run: ChatRun) -> list[Output]:
    """The run's next batch; a run the shutdown cancelled fails with the stop error."""
    batch = await run.next_outputs()
    stop = state.stop_error
    if stop is not None and batch and isinstance(done := batch[-1], Done) and (
        done.finish_reason == "cancelled"
    ):
        raise stop
    return batch


async def chat_completions(request: Request) -> HTTPResponse | None:
    state = request.app.ctx.state
    pipeline: ChatPipeline = state.pipeline
    request_id = request_id_of(request)
    chat = parse_chat_request(
        parse_json_body(request.body), server_tools=pipeline.server_tools.names
    )
    request.ctx.model = chat.model
    prepared = await pipeline.prepare(
        chat,
        request_id,
        received_at=getattr(request.ctx, "started", None),
        profile=parse_profile_header(request.headers.get("x-afm-profile")),
    )
    request.ctx.model = prepared.model_name
    if state.stop_error is not None:
        raise state.stop_error
    # From here until it is released, interrupt_requests() finds the run by this id
    # (start() registers it before it can wait in the queue).
    state.running[request_id] += 1
    try:
        run = await pipeline.start(prepared)
        try:
            if chat.stream:
                await _stream(request, run)
                return None
            return await _complete(request, run)
        finally:
            pipeline.release(run)
    finally:
        state.running[request_id] -= 1
        if not state.running[request_id]:
            del state.running[request_id]


async def _complete(request: Request, run: ChatRun) -> HTTPResponse:
    state = request.app.ctx.state
    content: list[str] = []
    reasoning: list[str] = []
    done: Done | None = None
    while done is None:
        for out in await _next_outputs(state, run):
            if isinstance(out, Content):
                content.append(out.text)
            elif isinstance(out, Reasoning):
                reasoning.append(out.text)
            elif isinstance(out, Done):
                done = out
    p = run.prepared
    request.ctx.usage = done.usage
    request.ctx.finish_reason = done.finish_reason
    text = "".join(content)
    calls = [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in done.tool_calls
    ]
    body = completion_object(
        completion_id=p.completion_id,
        created=p.created,
        model=p.model_name,
        fingerprint=p.fingerprint,
        message=assistant_message(
            text if text or not calls else None,
            reasoning="".join(reasoning) or None,
            tool_calls=calls or None,
        ),
        finish_reason=done.finish_reason,
        usage=done.usage,
    )
    return json_response(body, headers=_response_headers(p))


async def _stream(request: Request, run: ChatRun) -> None:
    state = request.app.ctx.state
    p = run.prepared
    # The status line waits for the first token: until then any failure is a plain error.
    batch = await _next_outputs(state, run)
    request.ctx.streamed = True
    response = await request.respond(
        status=200,
        headers={**SSE_HEADERS, **_response_headers(p)},
        content_type="text/event-stream",
    )
    encoder = ChunkEncoder(p.completion_id, p.created, p.model_name, p.fingerprint)
    out_buf = [encoder.role()]
    sent = 0
    try:
        while True:
            for out in batch:
                if isinstance(out, Content):
                    out_buf.append(encoder.content(out.text))
                elif isinstance(out, Reasoning):
                    out_buf.append(encoder.delta({"reasoning_content": out.text}))
                elif isinstance(out, ToolCallStart):
                    out_buf.append(encoder.delta({"tool_calls": [{
                        "index": out.index,
                        "id": out.id,
                        "type": "function",
                        "function": {"name": out.name, "arguments": out.arguments},
                    }]}))
                elif isinstance(out, ToolCallArguments):
                    out_buf.append(encoder.delta({"tool_calls": [{
                        "index": out.index, "function": {"arguments": out.fragment},
                    }]}))
                else:
                    request.ctx.usage = out.usage
                    request.ctx.finish_reason = out.finish_reason
                    out_buf.append(encoder.finish(out.finish_reason))
                    if p.request.include_usage:
                        out_buf.append(encoder.usage(out.usage))
                    if out.profile is not None:
                        out_buf.append(sse(out.profile))
                    out_buf.append(DONE)
            data = b"".join(out_buf)
            out_buf.clear()
            sent += len(data)
            await response.send(data)
            if run.finished:
                break
            batch = await _next_outputs(state, run)
    except APIError as exc:
        data = error_event(exc.envelope()) + DONE
        sent += len(data)
        request.ctx.stream_error = exc.code
        request.ctx.error = exc
        await response.send(data)
    except asyncio.CancelledError:
        # The connection went away under the stream: the 200 stays, the line says why.
        if state.stop_error is not None:  # closed by the shutdown, past its last chance
            request.ctx.stream_error = state.stop_error.code
        else:
            request.ctx.disconnected = True
        raise
    finally:
        log_access(request, 200, sent)
    await response.eof()


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
    for entry in config.models.model:
        objects.append({"id": entry.id, "object": "model", "created": created,
                        "owned_by": "afmd"})
    for alias, target in config.models.aliases.items():
        objects.append({"id": alias, "object": "model", "created": created,
                        "owned_by": "afmd", "parent": target})
    return objects


def _health(state: Any) -> tuple[int, dict[str, Any]]:
    registry = state.registry
    default = state.config.resolve_model(None)
    body: dict[str, Any] = {
        "status": "ok",
        "models": registry.status(),
        "active_requests": state.pipeline.scheduler.active,
        "queued_requests": state.pipeline.scheduler.queued,
    }
    status = 200
    if default is not None and not registry.is_ready(default.id):
        failure = registry.failure(default.id)
        body["status"] = "unavailable"
        body["reason"] = "model_load_failed" if failure and not registry.is_loading(
            default.id) else "model_not_ready"
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
