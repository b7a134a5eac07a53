"""Ids afmd makes up: random alphanumerics, in the shapes OpenAI clients know."""

from __future__ import annotations

import secrets
import string

_ALPHANUM = string.ascii_letters + string.digits


def alphanumerics(n: int) -> str:
    # One getrandom() for the whole id, not one per character (secrets.choice).
    return "".join(_ALPHANUM[b % 62] for b in secrets.token_bytes(n))


def new_request_id() -> str:
    return "req_" + secrets.token_hex(16)


def new_tool_call_id() -> str:
    return "call_" + alphanumerics(24)
