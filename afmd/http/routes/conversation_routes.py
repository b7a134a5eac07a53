"""OpenAI's Conversations API: a conversation and its items, over the Responses adapter's
store of conversations (the one a response's ``conversation`` reads and grows).

Every route is registered with the Responses adapter as its dialect, so the gate screens
them as all others and every error is in OpenAI's envelope. A conversation or item id
from the path is only looked up in memory.
"""

from __future__ import annotations

from sanic import Request, Sanic
from sanic.response import HTTPResponse

from afmd.dialects.fields.body import parse_json_body
from afmd.dialects.fields.checks import quoted
from afmd.dialects.responses.conversation_store import Conversation
from afmd.dialects.responses.conversations import parse_add, parse_create, parse_update
from afmd.dialects.responses.responses_api import OpenAIResponses
from afmd.errors import NotFoundError
from afmd.http.routes import handlers as routes
from afmd.http.routes.handlers import json_response
from afmd.http.routes.item_pages import check_include, list_page


def _dialect(request: Request) -> OpenAIResponses:
    dialect = routes.dialect_of(request)
    assert isinstance(dialect, OpenAIResponses), "registered with ctx_dialect"
    return dialect


def _strict(request: Request) -> bool:
    return bool(request.app.ctx.state.config.api.strict)


def _conversation(request: Request, conversation_id: str) -> Conversation:
    found = _dialect(request).conversations.get(conversation_id)
    if found is None:
        raise NotFoundError(
            f"Conversation with id {quoted(conversation_id)} not found (it was never made, "
            "was deleted, or expired).", code="conversation_not_found",
            param="conversation_id")
    return found


def _item_index(conversation: Conversation, item_id: str) -> int:
    index = conversation.find(item_id)
    if index is None:
        raise NotFoundError(
            f"Item with id {quoted(item_id)} not found in conversation "
            f"{quoted(conversation.id)}.", code="item_not_found", param="item_id")
    return index


async def create(request: Request) -> HTTPResponse:
    dialect = _dialect(request)
    body = parse_json_body(request.body) if request.body else {}
    metadata, items = parse_create(body, find_item=dialect.find_item,
                                   strict=_strict(request))
    return json_response(dialect.conversations.create(metadata, items).object())


async def conversation(request: Request, conversation_id: str) -> HTTPResponse:
    """``GET`` (retrieve), ``POST`` (update its metadata) or ``DELETE`` one conversation
    (one route for the three, so that a 405 lists them all in ``Allow``)."""
    found = _conversation(request, conversation_id)
    store = _dialect(request).conversations
    if request.method == "DELETE":
        store.delete(found.id)
        return json_response({"id": found.id, "object": "conversation.deleted",
                              "deleted": True})
    if request.method == "POST":
        store.set_metadata(found, parse_update(parse_json_body(request.body)))
    return json_response(found.object())


async def items(request: Request, conversation_id: str) -> HTTPResponse:
    """``GET`` lists the items (``ConversationItemList``, paged), ``POST`` appends up to
    20 and lists those."""
    found = _conversation(request, conversation_id)
    check_include(request)
    if request.method == "GET":
        return json_response(list_page(request, found.items,
                                       f"item of {quoted(found.id)}"))
    dialect = _dialect(request)
    added = parse_add(parse_json_body(request.body), find_item=dialect.find_item,
                      strict=_strict(request))
    dialect.conversations.add(found, added)
    return json_response({
        "object": "list",
        "data": added,
        "first_id": added[0]["id"] if added else None,
        "last_id": added[-1]["id"] if added else None,
        "has_more": False,
    })


async def item(request: Request, conversation_id: str, item_id: str) -> HTTPResponse:
    """``GET`` one item, or ``DELETE`` it (answered with the conversation, as OpenAI's)."""
    found = _conversation(request, conversation_id)
    index = _item_index(found, item_id)
    if request.method == "DELETE":
        _dialect(request).conversations.delete_item(found, index)
        return json_response(found.object())
    check_include(request)
    return json_response(found.items[index])


def add_routes(app: Sanic, dialect: OpenAIResponses) -> None:
    """Register the routes on ``app``, over ``dialect``'s conversations."""
    app.add_route(create, "/v1/conversations", methods=["POST"],
                  name="conversations", ctx_dialect=dialect)
    app.add_route(conversation, "/v1/conversations/<conversation_id:str>",
                  methods=["GET", "POST", "DELETE"], name="conversation",
                  ctx_dialect=dialect, unquote=True)
    app.add_route(items, "/v1/conversations/<conversation_id:str>/items",
                  methods=["GET", "POST"], name="conversation_items", ctx_dialect=dialect,
                  unquote=True)
    app.add_route(item, "/v1/conversations/<conversation_id:str>/items/<item_id:str>",
                  methods=["GET", "DELETE"], name="conversation_item", ctx_dialect=dialect,
                  unquote=True)
