"""OpenAI's Responses API on the wire (``POST /v1/responses``): the adapter.

The body is checked into the internal request (:mod:`afmd.dialects.responses.responses_body`;
items in :mod:`afmd.dialects.responses.items`, tools, ``text`` and the rest in
:mod:`afmd.dialects.responses.options`), the run's events become a response object
or its stream of semantic events (:mod:`afmd.dialects.responses.output_items`), and a response
with ``store`` (the API's default) is kept in the bounded store
(:mod:`afmd.dialects.responses.store`) that ``previous_response_id`` and the
``/v1/responses/{id}`` routes read; a response with ``conversation`` continues that
conversation and, once it has ended, adds its input and output to it
(:mod:`afmd.dialects.responses.conversation_store`). Errors are OpenAI's envelope, their
``param`` named as this API names it (the pipeline names chat's: ``messages``,
``response_format``, …).
"""

from __future__ import annotations

import re
import time
from collections.abc import Collection, Sequence
from typing import Any

import orjson

from afmd.core.events import Event, profile_payload
from afmd.core.request import ChatRequest
from afmd.dialects.fields.body import parse_json_body
from afmd.dialects.fields.checks import quoted
from afmd.dialects.responses.conversation_store import ConversationStore
from afmd.dialects.responses.items import Item
from afmd.dialects.responses.output_items import UNDER_WAY, ResponseBuilder
from afmd.dialects.responses.responses_body import (
    ResponsesRequest,
    Through,
    direct,
    parse_responses_request,
)
from afmd.dialects.responses.store import ResponseStore, Stored
from afmd.errors import APIError, ContextLengthError, InvalidRequestError

_CHAT_TOOL = re.compile(r"tools\[(\d+)\]\.function\.(.+)")


def rename_param(param: str | None) -> str | None:
    """A param as chat names it (the pipeline's errors), as the Responses API names it."""
    if param is None:
        return None
    if param.startswith("messages"):
        return "input"  # the message's index is not the item's: name the input as a whole
    if param.startswith("response_format.json_schema.schema"):
        return "text.format.schema" + param.removeprefix("response_format.json_schema.schema")
    if param.startswith("response_format"):
        return "text.format"
    if param == "max_tokens":
        return "max_output_tokens"
    if param == "logprobs":
        return "include"  # message.output_text.logprobs asks for them here
    match = _CHAT_TOOL.fullmatch(param)
    if match is not None:
        return f"tools[{match.group(1)}].{match.group(2)}"
    return param


def as_responses(error: APIError) -> APIError:
    """The error as this API words it: a prompt over the context window is OpenAI's
    Responses sentence (its clients and agents show it as such), with the numbers after
    it; any other is as it is."""
    if not isinstance(error, ContextLengthError):
        return error
    reworded = ContextLengthError(
        "Your input exceeds the context window of this model. Please adjust your input and "
        f"try again. ({error.message})", prompt_tokens=error.prompt_tokens, limit=error.limit,
        param=error.param)
    reworded.code = error.code
    return reworded


def param_of(error: APIError) -> str | None:
    """The error's param as this API names it; a field the client sent that this API does
    not know keeps its own name."""
    return error.param if error.code == "unknown_parameter" else rename_param(error.param)


#: The statuses whose turn joins its conversation: one that ended by itself (cut at
#: ``max_output_tokens`` included). A failed or cancelled turn adds nothing, so that the
#: conversation never holds an input without its answer or half an answer.
_TURN_ENDED = frozenset({"completed", "incomplete"})


class ResponsesReply:
    """One response, whole or streamed; stored at its end when the request says so."""

    __slots__ = ("_builder", "_conversations", "_deleted", "_request", "_saved", "_store")

    def __init__(self, request: ResponsesRequest, *, model: str, store: ResponseStore,
                 conversations: ConversationStore) -> None:
        self._request = request
        self._store = store
        self._conversations = conversations
        self._builder = ResponseBuilder(request.echo, model=model, stream=request.stream)
        self._saved = False  # the response reached its end (or its failure) here
        self._deleted = False  # deleted while it ran: whatever comes later is not stored

    @property
    def id(self) -> str:
        return self._builder.id

    def body(self, events: Sequence[Event]) -> bytes:
        return self.built(self.build(events))

    def build(self, events: Sequence[Event]) -> tuple[ResponseBuilder, dict[str, Any], bytes]:
        """The whole answer, built in a builder of its own (any thread: a GET reads this
        reply's meanwhile, and finds it ``in_progress`` until :meth:`built`)."""
        builder = self._builder.fork()
        builder.feed(list(events))
        response = builder.finish()
        # The profile is the request's, not the response's: on the wire, never stored.
        return builder, response, orjson.dumps({**response, **profile_payload(events)})

    def built(self, parts: tuple[ResponseBuilder, dict[str, Any], bytes]) -> bytes:
        """The answer :meth:`build` made, now this reply's, and stored (on the loop)."""
        self._builder, response, body = parts
        self._save(response)
        return body

    def stream_start(self) -> bytes:
        return self._builder.start()

    def stream(self, events: Sequence[Event]) -> bytes:
        self._builder.feed(list(events))
        return self._builder.take()

    def stream_end(self) -> bytes:
        self._save(self._builder.finish())
        return self._builder.take()

    def stream_error(self, error: APIError) -> bytes:
        error = as_responses(error)
        self._save(self._builder.fail(error, param_of(error)))
        return self._builder.take()

    # -- a background response (afmd.http.routes.background_runs runs it) --

    @property
    def background(self) -> bool:
        return self._request.echo.background

    @property
    def input_items(self) -> tuple[Item, ...]:
        return self._request.echo.input_items

    def queued(self) -> tuple[dict[str, Any], list[bytes]]:
        """The response as its POST answers it, ``queued``, and, streamed, the events that
        open its stream: ``response.created`` and ``response.queued``."""
        response = self._builder.response("queued")
        return response, self._builder.start_events() if self._request.stream else []

    def began(self) -> list[bytes]:
        """Its run has begun: ``response.in_progress``, streamed (none otherwise)."""
        return self._builder.began() if self._request.stream else []

    def keep(self, response: dict[str, Any]) -> None:
        """Store the response as it stands (a background one, ``queued``, once its POST
        was let in): ``GET /v1/responses/{id}`` finds it while it runs, and a restart
        finds it unfinished. Its end replaces it."""
        self._put(response)

    def current(self, status: str) -> dict[str, Any]:
        """The response as it stands while its run goes on (``queued``, ``in_progress``)."""
        return self._builder.response(status)

    def stream_events(self, events: Sequence[Event]) -> list[bytes]:
        """:meth:`stream`, one SSE event apiece (a background stream is resumed after any
        of them by its ``sequence_number``, which is its index)."""
        self._builder.feed(list(events))
        return self._builder.take_events()

    def end_events(self) -> tuple[dict[str, Any], list[bytes]]:
        response = self._save(self._builder.finish())
        return response, self._builder.take_events()

    def error_events(self, error: APIError) -> tuple[dict[str, Any], list[bytes]]:
        error = as_responses(error)
        response = self._save(self._builder.fail(error, param_of(error)))
        return response, self._builder.take_events()

    def deleted(self) -> None:
        """The response was deleted while its run went on: an end that comes after the
        delete answered must not store it again."""
        self._deleted = True

    def stream_abandoned(self) -> None:
        """Stored as ``cancelled`` with what it had written: the client was told its id in
        ``response.created``, and fetching it, or continuing from it, must find it (its run
        is cancelled with the connection). One that had reached its end stays as it was."""
        if not self._saved:
            self._save(self._builder.abandon())

    def _save(self, response: dict[str, Any]) -> dict[str, Any]:
        self._saved = True
        echo = self._request.echo
        if echo.conversation is not None and response["status"] in _TURN_ENDED:
            self._conversations.append_turn(echo.conversation,
                                            (*echo.input_items, *self._builder.output))
        self._put(response)
        return response

    def _put(self, response: dict[str, Any]) -> None:
        echo = self._request.echo
        if echo.store and not self._deleted:
            conversation = (*echo.history, *echo.input_items, *self._builder.output)
            self._store.put(response["id"], Stored(response, echo.input_items, conversation,
                                                   time.time()))


class OpenAIResponses:
    """The ``/v1/responses`` adapter, over one server's store of responses."""

    name = "openai_responses"

    def __init__(self, store: ResponseStore, conversations: ConversationStore, *,
                 truncation: str = "disabled") -> None:
        self.store = store
        self.conversations = conversations
        self.truncation = truncation  # a body's that names none: the server's policy
        #: The responses to be stored whose turn still runs (a background one is stored
        #: from its POST on), by id: ``GET`` shows one ``in_progress``, and a ``DELETE``
        #: keeps it from being stored at its end, where it found nothing and the response
        #: was stored after all. Each leaves at its turn's end (:meth:`settled`).
        self.running: dict[str, ResponsesReply] = {}
        self._of_request: dict[int, ResponsesReply] = {}

    def parse(self, raw: bytes, *, server_tools: Collection[str] = (),
              strict: bool = False, through: Through = direct) -> ResponsesRequest:
        """The body checked into a request; the stores are read ``through`` (a parse on
        another thread than theirs hands its lookups over)."""
        return parse_responses_request(
            parse_json_body(raw), lookup=through(self._history),
            conversations=through(self.conversations.items),
            find_item=through(self.find_item), server_tools=server_tools, strict=strict,
            truncation=self.truncation)

    def parse_count(
        self, raw: bytes, *, server_tools: Collection[str] = (), strict: bool = False,
        through: Through = direct,
    ) -> ResponsesRequest:
        """An ``input_tokens`` body (the fields that shape the prompt, nothing else)."""
        return parse_responses_request(
            parse_json_body(raw), lookup=through(self._history),
            conversations=through(self.conversations.items),
            find_item=through(self.find_item), server_tools=server_tools, counting=True,
            strict=strict)

    def find_item(self, item_id: str) -> Item | None:
        """An ``item_reference``'s item: one a stored response holds, or a conversation."""
        found = self.store.item(item_id)
        return found if found is not None else self.conversations.item(item_id)

    def _history(self, response_id: str) -> Sequence[Item] | None:
        """What ``previous_response_id`` continues: a background response still running
        has no answer yet to continue from."""
        stored = self.store.get(response_id)
        if stored is None:
            if response_id in self.running:
                raise InvalidRequestError(
                    f"Previous response {quoted(response_id)} is still in_progress: continue "
                    "from it once it has ended.", code="invalid_value",
                    param="previous_response_id")
            return None
        status = stored.response.get("status")
        if status in UNDER_WAY:
            raise InvalidRequestError(
                f"Previous response {quoted(response_id)} is still {status} (a background "
                "response): continue from it once it has ended.", code="invalid_value",
                param="previous_response_id")
        return stored.conversation

    def reply(self, request: ChatRequest, *, model: str, fingerprint: str) -> ResponsesReply:
        assert isinstance(request, ResponsesRequest), "parse() made it"
        reply = ResponsesReply(request, model=model, store=self.store,
                               conversations=self.conversations)
        if request.echo.store and not request.echo.background:
            self.running[reply.id] = reply
            self._of_request[id(request)] = reply
        return reply

    def settled(self, request: ResponsesRequest) -> None:
        """The turn of ``request`` is over, its response stored or its failure answered:
        it runs no more."""
        reply = self._of_request.pop(id(request), None)
        if reply is not None:
            self.running.pop(reply.id, None)

    def error_envelope(self, error: APIError) -> dict[str, Any]:
        error = as_responses(error)
        envelope = error.envelope()
        envelope["error"]["param"] = param_of(error)
        return envelope

    def error_param(self, error: APIError) -> str | None:
        return param_of(error)
