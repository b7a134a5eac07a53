"""A request body decoded: one JSON object, nested no deeper than every later stage can
walk. The first check of every dialect, before any of its fields is looked at."""

from __future__ import annotations

from typing import Any

import orjson

from afmd.dialects.fields.checks import invalid, type_name
from afmd.dialects.fields.nesting import (
    MAX_NESTING,
    Segment,
    nesting_path,
    nesting_path_in_text,
    nests_deeper_than,
    param_of,
)
from afmd.errors import InvalidRequestError


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode the body; only a JSON object is a request, and only one nested at most
    ``MAX_NESTING`` levels deep (see :mod:`afmd.dialects.fields.nesting`)."""
    if not raw:
        raise InvalidRequestError(
            "The request body is empty; send a JSON object.", code="invalid_json"
        )
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        # orjson's own depth limit: the text before it parsed, so name what is too deep.
        path = nesting_path_in_text(raw) if "depth limit" in str(exc) else None
        if path is None:
            raise InvalidRequestError(
                f"The request body is not valid JSON: {exc}.", code="invalid_json"
            ) from None
        raise _too_deep(path) from None
    # A body with no more brackets than levels allowed cannot nest too deep (most chats).
    if raw.count(b"[") + raw.count(b"{") > MAX_NESTING and nests_deeper_than(body):
        raise _too_deep(nesting_path_in_text(raw) or nesting_path(body) or [])
    if not isinstance(body, dict):
        raise InvalidRequestError(
            f"The request body must be a JSON object, but got {type_name(body)}.",
            code="invalid_type",
        )
    return body


def _too_deep(path: list[Segment]) -> InvalidRequestError:
    return invalid(
        param_of(path) if path else None,
        f"The value is nested more than {MAX_NESTING} levels deep (arrays and objects, the "
        f"body counting as one); afmd accepts at most {MAX_NESTING} levels.",
    )
