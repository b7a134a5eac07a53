"""OpenAI's request fields that afmd accepts without acting on them, held to OpenAI's types.

A billing tier, a cache's retention, stored completions, tags for OpenAI's dashboard: none
changes what a local model could answer, so none is refused. But a value OpenAI refuses (a
number as a metadata value, a string for ``store``, a verbosity it has no level for) is a
400 here too, naming it: taken silently, the client's bug would surface only against OpenAI.
Tiers, retentions and modalities are held to their type alone, since OpenAI adds values to
them; chat's option objects (``audio``, ``web_search_options``, ``prompt_cache_options``,
``moderation``) to being objects, their keys unread.
"""

from __future__ import annotations

from typing import Any

from afmd.dialects.fields.checks import Scalar, invalid, missing, wrong_type
from afmd.errors import InvalidRequestError

STORE = Scalar("store", "boolean")
SERVICE_TIER = Scalar("service_tier", "string")
PROMPT_CACHE_RETENTION = Scalar("prompt_cache_retention", "string")
VERBOSITY = Scalar("verbosity", "string", choices=("low", "medium", "high"))
#: OpenAI's bound on a ``safety_identifier``'s characters.
MAX_SAFETY_IDENTIFIER = 64


def _short_identifier(value: str, param: str) -> None:
    if len(value) > MAX_SAFETY_IDENTIFIER:
        raise invalid(param, f"Invalid '{param}': a string of at most "
                             f"{MAX_SAFETY_IDENTIFIER} characters is expected, got "
                             f"{len(value)}.")


SAFETY_IDENTIFIER = Scalar("safety_identifier", "string", rule=_short_identifier)
#: OpenAI's bounds on ``metadata``: pairs, a key's and a value's characters.
MAX_METADATA = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


def metadata_of(value: Any) -> dict[str, str]:
    """``metadata``: up to 16 string pairs, keys of at most 64 characters and values of at
    most 512."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise wrong_type("metadata", "an object", value)
    if len(value) > MAX_METADATA:
        raise invalid("metadata", f"'metadata' holds at most {MAX_METADATA} pairs, "
                      f"got {len(value)}.")
    for key, text in value.items():
        if len(key) > MAX_METADATA_KEY:
            raise invalid(f"metadata.{key[:MAX_METADATA_KEY]}",
                          f"A metadata key is at most {MAX_METADATA_KEY} characters.")
        if not isinstance(text, str):
            raise wrong_type(f"metadata.{key}", "a string", text)
        if len(text) > MAX_METADATA_VALUE:
            raise invalid(f"metadata.{key}",
                          f"A metadata value is at most {MAX_METADATA_VALUE} characters.")
    return dict(value)


#: Chat's option objects afmd ignores: what each is for has no meaning for a local model.
OPTION_OBJECTS = ("audio", "web_search_options", "prompt_cache_options", "moderation")


def check_modalities(value: Any) -> None:
    """``modalities``: null or an array of strings (the answer is text whatever it asks)."""
    if value is None:
        return
    if not isinstance(value, list):
        raise wrong_type("modalities", "an array of strings", value)
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise wrong_type(f"modalities[{i}]", "a string", item)


#: The Responses API's option objects afmd ignores (its ``moderation`` and
#: ``prompt_cache_options`` as chat's; a background run's completion window, an access
#: program, image compression), each an object in OpenAI's SDK.
RESPONSES_OPTION_OBJECTS = ("prompt_cache_options", "moderation", "background_options",
                            "access_programs", "image")


def check_option_objects(body: dict[str, Any],
                         keys: tuple[str, ...] = OPTION_OBJECTS) -> None:
    """Each of ``keys`` the body holds: null or an object."""
    for key in keys:
        value = body.get(key)
        if value is not None and not isinstance(value, dict):
            raise wrong_type(key, "an object", value)


def check_context_management(value: Any) -> None:
    """The Responses API's ``context_management`` (OpenAI's server-side compaction, which
    afmd does not do): null or a non-empty array of entries, each an object with a string
    ``type``, as OpenAI's schema has it."""
    if value is None:
        return
    if not isinstance(value, list):
        raise wrong_type("context_management", "an array", value)
    if not value:
        raise InvalidRequestError(
            "Invalid 'context_management': empty array. Expected an array with minimum "
            "length 1, but got an empty array instead.", code="empty_array",
            param="context_management")
    for i, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise wrong_type(f"context_management[{i}]", "an object", entry)
        kind = entry.get("type")
        if kind is None:
            raise missing(f"context_management[{i}].type")
        if not isinstance(kind, str):
            raise wrong_type(f"context_management[{i}].type", "a string", kind)
