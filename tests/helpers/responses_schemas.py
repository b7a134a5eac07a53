"""Validation against OpenAI's published Responses API schemas
(tests/data/openai-responses-schemas.json): request bodies, response objects, stream
events, item lists and token counts."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import jsonschema

from helpers.openai_schemas import _allow_nullable

_PATH = Path(__file__).parent.parent / "data" / "openai-responses-schemas.json"


def _discriminated(node: Any) -> Any:
    """OpenAPI's ``oneOf`` with a ``discriminator`` picks its schema by the discriminating
    property; JSON Schema's ``oneOf`` instead wants exactly one match, which fails where
    the published variants overlap (an input message is both an ``EasyInputMessage`` and an
    ``Item``). Read such a ``oneOf`` as ``anyOf``."""
    if isinstance(node, list):
        return [_discriminated(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _discriminated(v) for k, v in node.items()}
    if "discriminator" in node and "oneOf" in node:
        node["anyOf"] = node.pop("oneOf")
    return node


@functools.cache
def _components() -> dict[str, Any]:
    doc = json.loads(_PATH.read_text())
    return _discriminated(_allow_nullable(copy.deepcopy(doc["components"])))


@functools.cache
def _validator(name: str) -> jsonschema.protocols.Validator:
    schema = {"$ref": f"#/components/schemas/{name}", "components": _components()}
    return jsonschema.Draft202012Validator(schema)


def validate(name: str, instance: Any) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``instance`` matches schema ``name``."""
    _validator(name).validate(instance)


def validate_request(body: Any) -> None:
    validate("CreateResponse", body)


def validate_response(body: Any) -> None:
    validate("Response", body)


@functools.cache
def _event_schemas() -> dict[str, tuple[str, ...]]:
    """The names of ``ResponseStreamEvent``'s variants, by the ``type`` values each admits
    (every variant has an ``enum`` of them)."""
    by_type: dict[str, list[str]] = {}
    for variant in _components()["schemas"]["ResponseStreamEvent"]["anyOf"]:
        name = variant["$ref"].rsplit("/", 1)[1]
        for value in _components()["schemas"][name]["properties"]["type"]["enum"]:
            by_type.setdefault(value, []).append(name)
    return {value: tuple(names) for value, names in by_type.items()}


def validate_event(event: Any) -> None:
    """A stream event; afmd's own profile events (``afm_profile…``) are not OpenAI's.

    ``ResponseStreamEvent`` is an ``anyOf`` of its variants, and a variant whose ``type``
    enum lacks the event's ``type`` cannot match it: the variants that admit that type
    are tried first, which is the same verdict without trying every other variant for
    each of a long stream's deltas. Where none matches, the whole schema is checked, for
    its own error."""
    kind = event.get("type")
    if str(kind or "").startswith("afm_profile"):
        return
    for name in _event_schemas().get(kind, ()) if isinstance(kind, str) else ():
        if _validator(name).is_valid(event):
            return
    validate("ResponseStreamEvent", event)


def validate_item_list(body: Any) -> None:
    validate("ResponseItemList", body)
