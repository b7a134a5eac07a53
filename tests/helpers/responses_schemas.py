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


def validate_event(event: Any) -> None:
    """A stream event; afmd's own profile events (``afm_profile…``) are not OpenAI's."""
    if not str(event.get("type", "")).startswith("afm_profile"):
        validate("ResponseStreamEvent", event)


def validate_item_list(body: Any) -> None:
    validate("ResponseItemList", body)
