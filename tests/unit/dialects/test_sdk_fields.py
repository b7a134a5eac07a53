"""Every request field the installed ``openai`` SDK types is one afmd knows.

A field afmd does not know is listed in ``X-AFM-Ignored-Fields`` and, under ``[api] strict``,
refused as ``unknown_parameter``, which OpenAI never answers for its own fields: a client
passing a field its SDK offers (``prompt_cache_retention``) would break on a strict server.
When the SDK grows a field, this fails until the field is handled or knowingly ignored.
"""

from __future__ import annotations

from typing import Any

import pytest
from openai.types import completion_create_params, embedding_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import input_token_count_params, response_create_params

from afmd.dialects.openai import chat_body, completions_body, embeddings
from afmd.dialects.responses import responses_body

#: Fields afmd knows and refuses with a pointer to their replacement.
REFUSED = {"functions", "function_call"}


def typed_fields(params: Any) -> set[str]:
    return {key for base in params.__mro__ for key in getattr(base, "__annotations__", {})}


@pytest.mark.parametrize(("params", "known"), [
    (chat_create_params.CompletionCreateParamsBase, chat_body.KNOWN_FIELDS | REFUSED),
    (completion_create_params.CompletionCreateParamsBase, completions_body.KNOWN_FIELDS),
    (embedding_create_params.EmbeddingCreateParams, embeddings.KNOWN_FIELDS),
    (response_create_params.ResponseCreateParamsBase, responses_body.KNOWN_FIELDS),
    (input_token_count_params.InputTokenCountParams, responses_body.COUNT_FIELDS),
], ids=["chat", "completions", "embeddings", "responses", "input_tokens"])
def test_every_field_the_sdk_types_is_known(params: Any, known: frozenset[str]) -> None:
    fields = typed_fields(params)
    assert "model" in fields  # the SDK's layout is the one this reads
    assert fields - known == set()
