"""Ollama's native routes on afmd's endpoint (and on ``[ollama] port``'s listener).

``/api/chat`` and ``/api/generate`` are turns like chat's (:func:`afmd.http.routes.handlers.turn`,
in :mod:`afmd.dialects.ollama.ollama_api`), after one look at the body: one without messages (or
without a prompt) only loads its model, or with ``keep_alive: 0`` unloads it, as Ollama's
clients use it. Embeddings go through the same service as ``/v1/embeddings``; the model
routes read :mod:`afmd.http.routes.ollama_models`; ``/api/pull`` downloads through ``afmd pull``'s
own code, its progress as Ollama's objects. Every route names an Ollama dialect, so each
error, the gate's refusals included, is ``{"error": "..."}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import orjson
from sanic import Request, Sanic
from sanic.response import HTTPResponse

from afmd.core.events import Usage
from afmd.core.request import ChatRequest, CompletionRequest
from afmd.dialects.fields.body import parse_json_body
from afmd.dialects.fields.checks import Scalar, read_scalars, unknown_keys
from afmd.dialects.fields.keep_alive import keep_alive_of
from afmd.dialects.ollama.embed_body import (
    embed_body,
    embed_request,
    embeddings_body,
    embeddings_request,
)
from afmd.dialects.ollama.ollama_api import (
    MEDIA_TYPE,
    OLLAMA,
    OLLAMA_CHAT,
    OLLAMA_GENERATE,
    error_body,
    load_answer,
    ndjson,
)
from afmd.dialects.ollama.ollama_body import (
    CHAT_FIELDS,
    GENERATE_FIELDS,
    chat_request,
    generate_request,
    is_load_request,
    wants_thinking,
)
from afmd.engine.models.kinds import CHAT, EMBEDDING
from afmd.errors import (
    APIError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    ServerError,
)
from afmd.http.access import log_access
from afmd.http.app_state import AppState
from afmd.http.routes import handlers as routes
from afmd.http.routes import ollama_models
from afmd.http.routes.embedding_routes import service_of
from afmd.http.routes.ignored import ignored_headers
from afmd.http.routes.large_bodies import built_off_loop, parse_body
from afmd.hub import cache as hubcache
from afmd.hub.server_pulls import PULLING
from afmd.logs import get_logger
from afmd.service.pipeline import thinking_not_supported

if TYPE_CHECKING:  # imported where a pull runs: the hub client is heavy
    from afmd.hub.download import RemoteFile

__all__ = ["ROOT_TEXT", "VERSION", "add_routes"]

#: What ``/api/version`` reports: the Ollama API afmd speaks (clients gate features on it,
#: GitHub Copilot's Ollama provider on 0.6.4 or later).
VERSION = "0.12.0"
#: ``GET /``'s answer to a client that is not a browser: Ollama's clients probe for it.
ROOT_TEXT = "Ollama is running"

#: Ollama's routes for building and sharing its own model files, which afmd does not serve
#: (its models are MLX folders and Hugging Face repos), and what a client calling one is
#: told instead of an unknown URL's "check the URL for typos".
NOT_SERVED: dict[str, tuple[tuple[str, ...], str]] = {
    "/api/create": (("POST",), "afmd does not create models from Modelfiles: configure an "
                    "MLX model folder or Hugging Face repo in [[models.model]], or pull one "
                    "with /api/pull."),
    "/api/copy": (("POST",), "afmd does not copy models: give a model a second name with "
                  "[models.aliases] in its config."),
    "/api/push": (("POST",), "afmd does not push models to a registry: its models are MLX "
                  "folders and Hugging Face repos."),
    "/api/blobs/<digest:str>": (("HEAD", "POST"), "afmd keeps no Ollama blobs: its models "
                                "are MLX folders and Hugging Face repos, pulled with /api/pull."),
}

_log = get_logger("afmd.hub")

_MODEL = (Scalar("model", "string", required=True),)
_PULL = (Scalar("model", "string", required=True), Scalar("stream", "boolean", default=True))
#: The fields of Ollama's model requests (its api/types.go), ``name`` its older spelling of
#: ``model``: the rest are refused under ``[api] strict`` and named otherwise, as a turn's.
SHOW_FIELDS = frozenset({"model", "name", "verbose", "system", "template", "options"})
DELETE_FIELDS = frozenset({"model", "name"})
PULL_FIELDS = frozenset({"model", "name", "stream", "insecure", "username", "password"})


def _model_request_headers(request: Request, body: dict[str, Any],
                           known: frozenset[str]) -> dict[str, str]:
    """The unknown fields of a model request, refused under ``[api] strict`` (a misspelt
    ``model`` beside ``name`` would act on another model) and named in the header
    otherwise."""
    strict = request.app.ctx.state.config.api.strict
    return ignored_headers(unknown_keys(body, known, strict=strict),
                           routes.request_id_of(request))


def add_routes(app: Sanic) -> None:
    app.add_route(chat, "/api/chat", methods=["POST"], name="ollama_chat",
                  ctx_dialect=OLLAMA_CHAT)
    app.add_route(generate, "/api/generate", methods=["POST"], name="ollama_generate",
                  ctx_dialect=OLLAMA_GENERATE)
    for handler, path, method in (
        (embed, "/api/embed", "POST"), (embeddings, "/api/embeddings", "POST"),
        (tags, "/api/tags", "GET"), (show, "/api/show", "POST"), (ps, "/api/ps", "GET"),
        (pull, "/api/pull", "POST"), (delete, "/api/delete", "DELETE"),
        (version, "/api/version", "GET"),
    ):
        methods = [method, "HEAD"] if method == "GET" else [method]
        app.add_route(handler, path, methods=methods,
                      name="ollama_" + path.rsplit("/", 1)[1], ctx_dialect=OLLAMA)
    for path, (verbs, _) in NOT_SERVED.items():
        app.add_route(not_served, path, methods=list(verbs),
                      name="ollama_not_served_" + path.split("/")[2], ctx_dialect=OLLAMA,
                      unquote=True)


async def not_served(request: Request, **_: str) -> HTTPResponse:
    uri = request.route.uri if request.route is not None else request.path
    raise NotFoundError(f"{request.method} {request.path}: {NOT_SERVED[uri][1]}",
                        code="not_served")


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None
          ) -> HTTPResponse:
    return HTTPResponse(orjson.dumps(payload), status=status, headers=headers,
                        content_type="application/json")


# ---------------------------------------------------------------------------- turns


async def chat(request: Request) -> HTTPResponse | None:
    state = request.app.ctx.state

    def parse(raw: bytes) -> tuple[dict[str, Any], ChatRequest | None]:
        body = parse_json_body(raw)
        if is_load_request(body, chat=True):
            return body, None
        return body, chat_request(body, server_tools=state.pipeline.server_tools.names,
                                  strict=state.config.api.strict)

    body, parsed = await parse_body(request, parse)
    if parsed is None:
        return await _load(request, body, chat=True)
    await _refuse_thinking_unloaded(state, parsed)
    return await routes.turn(request, parsed)


async def generate(request: Request) -> HTTPResponse | None:
    state = request.app.ctx.state

    def parse(raw: bytes) -> tuple[dict[str, Any], ChatRequest | CompletionRequest | None]:
        body = parse_json_body(raw)
        if is_load_request(body, chat=False):
            return body, None
        return body, generate_request(body, strict=state.config.api.strict)

    body, parsed = await parse_body(request, parse)
    if parsed is None:
        return await _load(request, body, chat=False)
    await _refuse_thinking_unloaded(state, parsed)
    return await routes.turn(request, parsed)


async def _refuse_thinking_unloaded(state: AppState,
                                    parsed: ChatRequest | CompletionRequest) -> None:
    """``think`` for a model that cannot think, refused before the model loads, as Ollama
    refuses it: the load would be seconds (and another model's unload) for a 400. A
    loaded model is checked by the pipeline, which knows it for certain."""
    if not parsed.require_thinking:
        return
    entry = state.registry.resolve(parsed.model)
    if state.registry.loaded(entry.id) is not None:
        return
    if not await asyncio.to_thread(ollama_models.thinks, state, entry):
        raise thinking_not_supported(parsed.model or entry.id)


async def _load(request: Request, body: dict[str, Any], *, chat: bool) -> HTTPResponse:
    """Load the model (its keep-alive from the request), or with ``keep_alive`` 0 unload
    it once idle: nothing is generated. A load is for a model that chats, as the request
    would be (Ollama refuses an embedding model's); an unload is for any model, as
    ``ollama stop`` sends it. Its unknown fields are a turn's: a misspelt ``keep_alive``
    would load where the client meant to unload, so ``[api] strict`` refuses them too."""
    state = request.app.ctx.state
    registry = state.registry
    ignored = unknown_keys(body, CHAT_FIELDS if chat else GENERATE_FIELDS,
                           strict=state.config.api.strict)
    headers = ignored_headers(ignored, routes.request_id_of(request))
    name = read_scalars(body, _MODEL)["model"]
    keep_alive = keep_alive_of(body)
    thinking = wants_thinking(body.get("think"))
    request.ctx.model = name
    entry = registry.resolve(name)
    reason = "load"
    if keep_alive == 0:
        reason = "unload"
        await registry.unload_when_idle(entry)  # (a model loading: once that is done)
    else:
        if thinking and not await asyncio.to_thread(ollama_models.thinks, state, entry):
            raise thinking_not_supported(name)  # as Ollama refuses it before loading
        lease = await registry.lease(entry, CHAT, keep_alive=keep_alive)
        lease.release()
    return HTTPResponse(load_answer(name, chat=chat, reason=reason), headers=headers,
                        content_type="application/json")


# ---------------------------------------------------------------------------- embeddings


async def embed(request: Request) -> HTTPResponse:
    return await _embed(request, legacy=False)


async def embeddings(request: Request) -> HTTPResponse:
    return await _embed(request, legacy=True)


async def _embed(request: Request, *, legacy: bool) -> HTTPResponse:
    state = request.app.ctx.state
    started = time.perf_counter()
    request_id = routes.request_id_of(request)
    strict = state.config.api.strict
    read = embeddings_request if legacy else embed_request
    parsed = await parse_body(request, lambda raw: read(parse_json_body(raw), strict=strict))
    request.ctx.model = parsed.model
    extra = ignored_headers(parsed.ignored_fields, request_id)
    if state.stop_error is not None:
        raise state.stop_error
    # A body without texts is how Ollama's clients load or unload the model: held with
    # its keep_alive, timed (Ollama reports the load apart). With texts the service gets
    # the model, findable by the request's id (a cancel while it loads ends it) and timed.
    registry = state.registry
    entry = service_of(request.app).entry_for(parsed.model)
    load = 0.0
    if parsed.inputs:
        result = await service_of(request.app).embed(parsed, request_id)
        load = result.load_seconds
    else:
        result = None
        if parsed.keep_alive == 0:
            await registry.unload_when_idle(entry)  # (a model loading: once that is done)
        else:
            lease = await registry.lease(entry, EMBEDDING, keep_alive=parsed.keep_alive)
            lease.release()
            load = time.perf_counter() - started
    request.ctx.usage = Usage(result.prompt_tokens if result else 0, 0)
    headers = {"X-Request-ID": request_id, **extra}
    if legacy:
        return HTTPResponse(embeddings_body(result), headers=headers,
                            content_type="application/json")
    total = time.perf_counter() - started
    body = await built_off_loop(
        lambda: embed_body(result, parsed.model or entry.id, total=total, load=load),
        weight=result.vectors.size if result is not None else 0)
    return HTTPResponse(body, headers=headers, content_type="application/json")


# ---------------------------------------------------------------------------- models


async def tags(request: Request) -> HTTPResponse:
    state = request.app.ctx.state
    listed = ollama_models.listed(state)

    def build() -> list[dict[str, Any]]:
        return [ollama_models.tag_object(state, name, entry) for name, entry in listed]

    return _json({"models": await asyncio.to_thread(build)})


async def show(request: Request) -> HTTPResponse:
    state = request.app.ctx.state
    body = parse_json_body(request.body)
    headers = _model_request_headers(request, body, SHOW_FIELDS)
    if "model" not in body and isinstance(body.get("name"), str):
        body["model"] = body["name"]  # Ollama's older spelling
    name = read_scalars(body, _MODEL)["model"]
    request.ctx.model = name
    entry = state.registry.resolve(name)
    return _json(await asyncio.to_thread(ollama_models.show, state, name, entry),
                 headers=headers)


async def ps(request: Request) -> HTTPResponse:
    return _json({"models": ollama_models.loaded_models(request.app.ctx.state)})


async def version(request: Request) -> HTTPResponse:
    return _json({"version": VERSION})


async def delete(request: Request) -> HTTPResponse:
    """Delete a downloaded model from the Hugging Face cache (not one the server has
    loaded, and never a configured folder: only what ``afmd rm`` deletes)."""
    state = request.app.ctx.state
    body = parse_json_body(request.body)
    headers = _model_request_headers(request, body, DELETE_FIELDS)
    if "model" not in body and isinstance(body.get("name"), str):
        body["model"] = body["name"]
    name = read_scalars(body, _MODEL)["model"]
    request.ctx.model = name
    entry = state.registry.resolve(name)
    repo = entry.path
    if not hubcache.REPO_ID.match(repo):
        raise InvalidRequestError(f"model '{name}' is not a download ({repo}): only models in "
                                  "the Hugging Face cache can be deleted; take a configured "
                                  "one out of the configuration instead", param="model")
    cached = hubcache.inspect(repo)
    if cached is None:
        raise NotFoundError(f"model '{name}' not found: only models downloaded into the "
                            "Hugging Face cache can be deleted", code="model_not_found",
                            param="model")
    # Whatever id serves these files (a configured one of this path, the repo id itself).
    for model_id in state.registry.sharing_files(repo):
        as_id = "" if model_id in (name, entry.id) else f" (as '{model_id}')"
        if state.registry.loaded(model_id) is not None:
            raise ConflictError(f"model '{name}' is loaded{as_id}; unload it first (a "
                                "request with keep_alive 0) or wait for its keep-alive to "
                                "end", code="model_in_use", param="model")
        if state.registry.loads.is_loading(model_id):  # the files would go from under it
            raise ConflictError(f"model '{name}' is loading{as_id} for a request; delete it "
                                "once that is answered and the model unloaded",
                                code="model_in_use", param="model")
    if _pulling(state, repo):  # its files would go from under the download
        raise ConflictError(f"model '{name}' is being pulled; delete it once the pull is "
                            "over", code="model_in_use", param="model")
    # Out of the cache's view in the same step as the checks above: a load that starts
    # after them finds no files, rather than files about to go.
    taken = hubcache.take_out(repo)
    if taken is None:  # a delete beside it won
        raise NotFoundError(f"model '{name}' not found: it was deleted meanwhile",
                            code="model_not_found", param="model")
    await asyncio.to_thread(taken.delete)
    return HTTPResponse(status=200, headers=headers)


def _pulling(state: AppState, repo: str) -> bool:
    """Whether the server is pulling ``repo`` (``/api/pull``, its download thread still
    running; the dashboard): a delete then took the files the pull had verified from under
    it, and the pull failed on a file gone missing ("FileNotFoundError: ... blobs/...")
    after its client was told the delete succeeded."""
    if repo in state.pulls.values():
        return True
    page = state.dashboard.pulls.get(repo) if state.dashboard is not None else None
    return page is not None and page.state == PULLING


# ---------------------------------------------------------------------------- pull


def _digest(remote: RemoteFile) -> str:
    return f"sha256:{remote.sha256}" if remote.sha256 else f"sha1:{remote.blob_id}"


async def pull(request: Request) -> HTTPResponse | None:
    """Download a model (a Hugging Face repo id, ``:latest`` allowed) with ``afmd pull``'s
    checks, reporting Ollama's progress objects: ``pulling manifest``, per file ``pulling
    <digest>`` with ``total`` and ``completed`` bytes, ``verifying sha256 digest``,
    ``writing manifest``, ``success``. A name the server serves already is pulled as
    Ollama pulls a model it has (:func:`_served`; a configured repo: that repo).

    The pull is the request's, as Ollama's is its request context's: a client that goes
    away (or a server that stops) stops the download thread, which nothing else would,
    and the next pull fetches only the files not yet verified."""
    from afmd.hub.download import PullError, PullStopped, parse_ref
    from afmd.hub.download import pull as pull_model

    body = parse_json_body(request.body)
    headers = _model_request_headers(request, body, PULL_FIELDS)
    if "model" not in body and isinstance(body.get("name"), str):
        body["model"] = body["name"]
    values = read_scalars(body, _PULL)
    name = values["model"]
    request.ctx.model = name
    state: AppState = request.app.ctx.state
    source = hubcache.plain_name(name)
    configured = state.config.resolve_model(source)
    if configured is not None and not _from_hub(configured.path):
        if state.stop_error is not None:
            raise state.stop_error
        return await _served(request, values["stream"], headers)
    if configured is not None:  # a configured id (or alias) of a repo: that repo
        source = configured.path
    try:
        repo = parse_ref(source)[0]
    except PullError as exc:
        raise InvalidRequestError(str(exc), param="model") from None
    if state.stop_error is not None:  # the shutdown's grace period is over, as for a turn
        raise state.stop_error
    loop = asyncio.get_running_loop()
    # Progress objects, then None; or the shutdown's error (see interrupt_pulls).
    queue: asyncio.Queue[dict[str, Any] | APIError | None] = asyncio.Queue()
    stop = threading.Event()

    def interrupt(error: APIError) -> None:
        stop.set()
        queue.put_nowait(error)

    def put(item: dict[str, Any] | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: the server stopped
            loop.call_soon_threadsafe(queue.put_nowait, item)

    last_sent: dict[str, float] = {}

    def report(remote: RemoteFile, done: int, total: int | None) -> None:
        digest = _digest(remote)
        now = time.monotonic()
        total = total or remote.size
        if now - last_sent.get(digest, -1.0) >= 0.2 or done >= total:  # a few a second
            last_sent[digest] = now
            put({"status": f"pulling {digest.split(':', 1)[1][:12]}", "digest": digest,
                 "total": total, "completed": done})

    def ended(stopped: bool) -> None:
        """On the loop, once the download thread is over: the repo is being pulled until
        then, which may be after its client left (a file under way is fetched to its end
        before the flag is seen)."""
        state.pulls.pop(interrupt, None)
        if stopped:  # nobody is left to tell but the log
            _log.info("pull stopped", model=name, reason="the request ended before the pull")

    def work() -> None:
        stopped = False
        try:
            pull_model(source, out=_Discard(), terminal=False, report=report, stop=stop)
        except PullStopped:
            stopped = True
        except PullError as exc:
            put({"error": str(exc)})
        except Exception as exc:  # the hub client's own failure, named as it is
            put({"error": f"{type(exc).__name__}: {exc}"})
        else:
            for status in ("verifying sha256 digest", "writing manifest", "success"):
                put({"status": status})
        finally:
            put(None)
            with contextlib.suppress(RuntimeError):  # the loop is gone: the server stopped
                loop.call_soon_threadsafe(ended, stopped)

    put({"status": "pulling manifest"})
    # A daemon thread, not the loop's executor: a server stopping mid-file must not wait
    # for the hub client's next progress step to notice the flag.
    state.pulls[interrupt] = repo
    threading.Thread(target=work, name=f"afmd-ollama-pull-{name}", daemon=True).start()
    try:
        if not values["stream"]:
            last: dict[str, Any] = {}
            while (item := await queue.get()) is not None:
                if isinstance(item, APIError):
                    raise item
                last = item
            if "error" in last:  # the hub's failure (or its files'): Ollama's 500
                raise ServerError(last["error"], code="pull_failed", param="model")
            return _json({"status": "success"}, headers=headers)
        await _stream_pull(request, queue, headers)
        return None
    finally:
        stop.set()  # cancelled (the client left, the server stops) or over: harmless then


def _from_hub(path: str) -> bool:
    """Whether a configured model's files come from the hub: a repo id that names no
    folder here (``models/qwen`` may be either, and a folder wins, as a load reads it)."""
    return hubcache.REPO_ID.match(path) is not None and not os.path.isdir(
        os.path.expanduser(path))


#: What a pull of a model already here reports: Ollama's steps around the files, none of
#: which needs fetching.
_SERVED_STEPS = ("pulling manifest", "verifying sha256 digest", "writing manifest", "success")


async def _served(request: Request, stream: bool, headers: dict[str, str]
                  ) -> HTTPResponse | None:
    """A pull of a model the server serves from no repo (a built-in, a local folder, an
    alias of one): nothing to download, so ``success``, as Ollama answers a pull of a
    model it has. Scripts and apps pull a model to make sure of it before using it."""
    if not stream:
        return _json({"status": "success"}, headers=headers)
    steps: asyncio.Queue[dict[str, Any] | APIError | None] = asyncio.Queue()
    for status in _SERVED_STEPS:
        steps.put_nowait({"status": status})
    steps.put_nowait(None)
    await _stream_pull(request, steps, headers)
    return None


def interrupt_pulls(state: AppState, error: APIError) -> None:
    """End every pull a client still waits on with ``error`` (the server is stopping), as
    :func:`~afmd.http.routes.handlers.interrupt_requests` ends the turns: a stream with
    an error line and its end, one not streamed with the error itself, the download
    stopped. Before, the shutdown cut their connections: a streamed pull's body ended
    without its last chunk (a broken connection to the client), a plain one unanswered."""
    for interrupt in list(state.pulls):
        interrupt(error)
    state.pulls.clear()


async def _stream_pull(request: Request,
                       queue: asyncio.Queue[dict[str, Any] | APIError | None],
                       headers: dict[str, str]) -> None:
    request.ctx.streamed = True
    response = await request.respond(status=200, headers=headers, content_type=MEDIA_TYPE)
    sent = 0
    try:
        while (item := await queue.get()) is not None:
            if isinstance(item, APIError):
                request.ctx.stream_error = item.code
                line = ndjson(error_body(item))
                sent += len(line)
                await response.send(line)
                break
            if "error" in item:
                request.ctx.stream_error = "pull_failed"
            line = ndjson(item)
            sent += len(line)
            await response.send(line)
        await response.eof()
    except asyncio.CancelledError:
        # The 200 went out: the access line says why the stream ended early.
        stop_error = request.app.ctx.state.stop_error
        if stop_error is not None:
            request.ctx.stream_error = stop_error.code
        else:
            request.ctx.disconnected = True
        raise
    finally:
        log_access(request, 200, sent)


class _Discard(io.StringIO):
    """Where ``afmd pull``'s text goes when its progress is reported as objects (a text
    stream, as the progress bars expect, that keeps nothing; not a terminal)."""

    def write(self, text: str) -> int:
        return len(text)

