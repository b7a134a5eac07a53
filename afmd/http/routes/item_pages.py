"""Lists of items paged as OpenAI pages them (``limit``, ``order``, ``after``), for a
response's input items and a conversation's items alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sanic import Request

from afmd.dialects.fields.checks import quoted
from afmd.dialects.responses.options import parse_include
from afmd.errors import InvalidRequestError


def check_include(request: Request) -> None:
    """``include`` (the SDK sends ``include[]``) is checked against the Responses API's
    values and changes nothing: a stored response or item already holds all afmd keeps of
    it."""
    values = [*request.args.getlist("include", []), *request.args.getlist("include[]", [])]
    parse_include(values)


def _limit(request: Request) -> int:
    raw = request.args.get("limit")
    if raw is None:
        return 20
    # The length first: int() refuses a string of thousands of digits with a ValueError.
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 18) or not 1 <= int(raw) <= 100:
        raise InvalidRequestError(
            f"Invalid 'limit': '{raw[:20]}'; expected an integer from 1 to 100.", param="limit")
    return int(raw)


def list_page(request: Request, items: Sequence[dict[str, Any]], what: str) -> dict[str, Any]:
    """One page of ``items`` (oldest first) as the query asks, ``desc`` unless told
    otherwise; ``what`` names the items in the error of an ``after`` none of them has."""
    limit = _limit(request)
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequestError(
            f"Invalid 'order': '{order[:20]}'; supported values are 'asc' and 'desc'.",
            param="order")
    ordered = list(items if order == "asc" else reversed(items))
    after = request.args.get("after")
    if after is not None:
        index = next((i for i, item in enumerate(ordered) if item["id"] == after), None)
        if index is None:
            raise InvalidRequestError(
                f"Invalid 'after': no {what} has the id {quoted(after)}.", param="after")
        ordered = ordered[index + 1:]
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }
