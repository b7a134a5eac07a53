"""The Conversations API's request bodies (``/v1/conversations`` and its items), checked.

Items are the Responses API's input items, checked by the same checker
(:func:`afmd.dialects.responses.items.canonical_items`) into the form the API returns
them in, with ids; a conversation's items are the history a response with
``conversation`` continues from, so an item this API accepted is one ``input`` accepts.
Unlike ``/v1/responses``, an unknown top-level field is always refused: no other server
has these routes, so no client sends them another server's fields.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from afmd.dialects.fields.checks import missing, reject_unknown, wrong_type
from afmd.dialects.fields.unused import metadata_of
from afmd.dialects.responses.items import Item, canonical_items, check_unique_ids
from afmd.errors import InvalidRequestError

#: How many items one request may add (OpenAI's bound).
MAX_ITEMS = 20

# ``safety_identifier`` is accepted and unused, as on /v1/responses.
_CREATE_FIELDS = frozenset({"items", "metadata", "safety_identifier"})
_UPDATE_FIELDS = frozenset({"metadata"})
_ADD_FIELDS = frozenset({"items"})


def _items(value: Any, find_item: Callable[[str], Item | None], strict: bool) -> list[Item]:
    if not isinstance(value, list):
        raise wrong_type("items", "an array of items", value)
    if len(value) > MAX_ITEMS:
        raise InvalidRequestError(
            f"Invalid 'items': array too long. Expected an array with maximum length "
            f"{MAX_ITEMS}, but got an array with length {len(value)} instead.",
            code="array_above_max_length", param="items")
    items = canonical_items(value, "items", find_item=find_item, strict=strict)
    check_unique_ids(value, items, "items")
    return items


def parse_create(body: dict[str, Any], *, find_item: Callable[[str], Item | None],
                 strict: bool) -> tuple[dict[str, str], list[Item]]:
    """``POST /v1/conversations``: its metadata and first items (both optional)."""
    reject_unknown(body, _CREATE_FIELDS)
    identifier = body.get("safety_identifier")
    if identifier is not None and not isinstance(identifier, str):
        raise wrong_type("safety_identifier", "a string", identifier)
    items = [] if body.get("items") is None else _items(body["items"], find_item, strict)
    return metadata_of(body.get("metadata")), items


def parse_update(body: dict[str, Any]) -> dict[str, str]:
    """``POST /v1/conversations/{id}``: the metadata that replaces the old (null: none)."""
    reject_unknown(body, _UPDATE_FIELDS)
    if "metadata" not in body:
        raise missing("metadata")
    return metadata_of(body["metadata"])


def parse_add(body: dict[str, Any], *, find_item: Callable[[str], Item | None],
              strict: bool) -> list[Item]:
    """``POST /v1/conversations/{id}/items``: the items to append."""
    reject_unknown(body, _ADD_FIELDS)
    if body.get("items") is None:
        raise missing("items")
    return _items(body["items"], find_item, strict)
