"""Validation of afmd's output against OpenAI's published schemas (tests/data)."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import jsonschema

_PATH = Path(__file__).parent.parent / "data" / "openai-chat-schemas.json"


def _allow_nullable(node: Any) -> Any:
    """OpenAPI 3.0's ``nullable: true`` means null is allowed too."""
    if isinstance(node, list):
        return [_allow_nullable(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _allow_nullable(v) for k, v in node.items()}
    if node.pop("nullable", False):
        if "enum" in node and None not in node["enum"]:
            node["enum"] = [*node["enum"], None]
        kind = node.get("type")
        if isinstance(kind, str):
            node["type"] = [kind, "null"]
        elif isinstance(kind, list):
            node["type"] = [*kind, "null"]
        else:
            node = {"anyOf": [node, {"type": "null"}]}
    return node


@functools.cache
def _components() -> dict[str, Any]:
    doc = json.loads(_PATH.read_text())
    return _allow_nullable(copy.deepcopy(doc["components"]))


@functools.cache
def _validator(name: str) -> jsonschema.protocols.Validator:
    schema = {"$ref": f"#/components/schemas/{name}", "components": _components()}
    return jsonschema.Draft202012Validator(schema)


def validate(name: str, instance: Any) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``instance`` matches schema ``name``."""
    _validator(name).validate(instance)


def validate_response(body: Any) -> None:
    validate("CreateChatCompletionResponse", body)


def validate_chunk(chunk: Any) -> None:
    validate("CreateChatCompletionStreamResponse", chunk)


def validate_error(body: Any) -> None:
    validate("ErrorResponse", body)


def validate_models(body: Any) -> None:
    validate("ListModelsResponse", body)
