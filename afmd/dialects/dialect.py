"""What a dialect adapter is: the seam every wire format plugs into.

The HTTP layer drives any :class:`Dialect` the same way: ``parse`` the body, prepare and
run the turn, then either ``body`` (all events at once) or ``stream_start``, ``stream``
per batch of events and ``stream_end``; an error is ``error_envelope`` before a stream's
head went out and ``stream_error`` after it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from afmd.core.events import Event
from afmd.core.ids import new_request_id
from afmd.core.request import ChatRequest, CompletionRequest
from afmd.errors import APIError


class ReplyEncoder(Protocol):
    """One response, encoded from one run's events."""

    def body(self, events: Sequence[Event]) -> bytes:
        """The whole (non-streamed) response body from every event of the run."""
        ...

    def stream_start(self) -> bytes:
        """What a stream sends before its first event (may be empty)."""
        ...

    def stream(self, events: Sequence[Event]) -> bytes:
        """One batch of events as the dialect's SSE; b"" when none of them shows."""
        ...

    def stream_end(self) -> bytes:
        """What follows the run's last event."""
        ...

    def stream_error(self, error: APIError) -> bytes:
        """An error that ends a stream already under way, and the stream's end."""
        ...

    def stream_abandoned(self) -> None:
        """The client left a stream under way (or stopped reading it): nothing can be
        sent; what the dialect keeps of the response is kept as cut short. Only a
        dialect whose responses outlive their request (Responses' store) keeps any."""
        ...


#: The kind of request a dialect reads: a chat turn, raw prompts (Completions), or either
#: (Ollama's generate).
RequestT = TypeVar("RequestT", bound="ChatRequest | CompletionRequest")


class Dialect(Protocol[RequestT]):
    name: str

    def parse(
        self, raw: bytes, *, server_tools: Collection[str] = (), strict: bool = False
    ) -> RequestT:
        """The body checked field by field into the internal request (400s name the field).

        An unknown top-level field is ignored and listed in the request's
        ``ignored_fields``; ``strict`` (``[api] strict``) refuses it instead."""
        ...

    def reply(self, request: RequestT, *, model: str, fingerprint: str) -> ReplyEncoder:
        """A response to ``request``; ``model`` is the name the client asked for."""
        ...

    def error_envelope(self, error: APIError) -> dict[str, Any]:
        """The JSON body of an error response in this dialect."""
        ...


class ErrorStyle(Protocol):
    """How one route's errors look: the part of a :class:`Dialect` the HTTP gate needs to
    answer a refusal (401, 404, 413, …) in the envelope of the route it was meant for."""

    def error_envelope(self, error: APIError) -> dict[str, Any]: ...


@runtime_checkable
class OwnStatuses(Protocol):
    """A dialect whose errors go out with statuses and headers of its own (Anthropic's
    529 ``overloaded_error`` for afmd's 503s); others keep the error's."""

    def error_status(self, error: APIError) -> tuple[int, Mapping[str, str]]: ...


@runtime_checkable
class NamesRequests(Protocol):
    """A dialect whose SDK reads a request's id from a header of its own (Anthropic's
    ``request-id``: ``message._request_id``, ``APIStatusError.request_id``), on every
    answer, refusals included."""

    request_id_header: str


@runtime_checkable
class NamesParams(Protocol):
    """A dialect whose fields are not chat's: the name it gives an error's ``param`` (the
    pipeline's errors name chat's fields), so the access log says what the client was
    told."""

    def error_param(self, error: APIError) -> str | None: ...


@runtime_checkable
class KeepsAlive(Protocol):
    """A reply whose stream shows it is alive while nothing else is sent (Anthropic's
    ``ping``): the handler opens the stream and sends :meth:`keepalive` whenever
    ``keepalive_interval`` seconds pass without a write (queued, a long prefill)."""

    keepalive_interval: float

    def keepalive(self) -> bytes: ...


@runtime_checkable
class BuiltApart(Protocol):
    """A reply whose whole body is built apart from anything the event loop reads of it
    (:meth:`build`, on any thread), then kept where it is kept (:meth:`built`, on the
    loop): Responses' answer, which a GET of the running response reads and the stores
    keep. ``body(events)`` is ``built(build(events))``."""

    def build(self, events: Sequence[Event]) -> Any: ...

    def built(self, parts: Any) -> bytes: ...


@runtime_checkable
class OpensWithPrompt(Protocol):
    """A reply whose stream's first event reports the prompt's size (Anthropic's
    ``message_start`` usage: many clients take ``input_tokens`` from it alone, and only
    ``output_tokens`` from ``message_delta``). The handler tells it the prompt's tokens
    before the stream starts."""

    def prompt_counted(self, tokens: int) -> None: ...


@runtime_checkable
class ReturnsTokens(Protocol):
    """A reply whose last object gives the client the token ids the model ran and wrote
    (Ollama's generate ``context``), to send back as the start of its next prompt. The
    handler tells it the ids once the run is over, before the last batch is encoded: the
    prompt is the handler's, the written ids the run's, and neither is an event every
    dialect would carry."""

    def tokens_ran(self, tokens: list[int]) -> None: ...


@runtime_checkable
class AnyBodyMediaType(Protocol):
    """A dialect whose reference server reads every request body as JSON, whatever its
    ``Content-Type`` says (Ollama's: its own docs' ``curl -d`` sends curl's default
    form encoding). The gate then takes such a body from a client that is not a browser
    (no ``Origin``); a browser's still needs JSON's type, which it cannot send across
    origins without a CORS preflight."""

    any_body_media_type: bool


@runtime_checkable
class OwnMediaType(Protocol):
    """A reply whose stream is not server-sent events (Ollama's NDJSON): its
    ``Content-Type``."""

    media_type: str


def error_response(
    style: ErrorStyle | None, error: APIError, request_id: str | None = None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """The status, JSON body and headers of ``error`` in ``style`` (OpenAI's when None);
    ``request_id`` is the request's, when it has one yet (a refusal before it did gets a
    fresh one where the style names requests)."""
    if style is None:
        return error.status, error.envelope(), dict(error.headers)
    if isinstance(style, OwnStatuses):
        status, own = style.error_status(error)
        headers = dict(own)
    else:
        status, headers = error.status, dict(error.headers)
    if isinstance(style, NamesRequests):
        headers[style.request_id_header] = request_id or new_request_id()
    return status, style.error_envelope(error), headers
