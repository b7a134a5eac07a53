"""OpenAI's fields that afmd accepts and does not act on (``store``, ``metadata``,
``service_tier``, ``prompt_cache_retention``, chat's ``verbosity``, ``modalities``,
``audio``, ``web_search_options``, ``prompt_cache_options`` and ``moderation``) are still held to
OpenAI's types: a value OpenAI refuses is a 400 naming it in chat as in Responses. Chat
took any value of them."""

from __future__ import annotations

from typing import Any

import pytest

from afmd.dialects.openai.chat_body import parse_chat_request
from afmd.dialects.responses.responses_body import parse_responses_request
from afmd.errors import InvalidRequestError


def chat(**fields: Any) -> Any:
    return parse_chat_request({"messages": [{"role": "user", "content": "a"}], **fields})


def responses(**fields: Any) -> Any:
    return parse_responses_request({"input": "a", **fields}, lookup=lambda _: None)


@pytest.mark.parametrize(("fields", "code", "param"), [
    ({"store": "yes"}, "invalid_type", "store"),
    ({"metadata": "x"}, "invalid_type", "metadata"),
    ({"metadata": {"k": 1}}, "invalid_type", "metadata.k"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "invalid_value", "metadata"),
    ({"metadata": {"k": "v" * 513}}, "invalid_value", "metadata.k"),
    ({"verbosity": "extreme"}, "invalid_value", "verbosity"),
    ({"service_tier": 1}, "invalid_type", "service_tier"),
    ({"prompt_cache_retention": 24}, "invalid_type", "prompt_cache_retention"),
    ({"modalities": "text"}, "invalid_type", "modalities"),
    ({"modalities": ["text", 1]}, "invalid_type", "modalities[1]"),
    ({"audio": "alloy"}, "invalid_type", "audio"),
    ({"web_search_options": True}, "invalid_type", "web_search_options"),
    ({"prompt_cache_options": "explicit"}, "invalid_type", "prompt_cache_options"),
    ({"moderation": "block"}, "invalid_type", "moderation"),
    ({"safety_identifier": "u" * 65}, "invalid_value", "safety_identifier"),
], ids=["store", "metadata", "metadata-value", "metadata-pairs", "metadata-long",
        "verbosity", "service-tier", "cache-retention", "modalities", "modality",
        "audio", "web-search-options", "cache-options", "moderation", "safety-identifier"])
def test_chat_holds_them_to_openais_types(fields: dict[str, Any], code: str,
                                          param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        chat(**fields)
    assert (caught.value.code, caught.value.param) == (code, param)


@pytest.mark.parametrize(("fields", "param"), [
    ({"service_tier": 1}, "service_tier"),
    ({"prompt_cache_retention": ["24h"]}, "prompt_cache_retention"),
    ({"prompt_cache_options": "explicit"}, "prompt_cache_options"),
    ({"moderation": "block"}, "moderation"),
    ({"background_options": "2h"}, "background_options"),
    ({"access_programs": ["standard"]}, "access_programs"),
    ({"image": "auto"}, "image"),
    ({"context_management": {"type": "compaction"}}, "context_management"),
    ({"context_management": ["compaction"]}, "context_management[0]"),
    ({"context_management": [{"type": 1}]}, "context_management[0].type"),
], ids=["service-tier", "cache-retention", "cache-options", "moderation",
        "background-options", "access-programs", "image", "context-management",
        "context-management-entry", "context-management-type"])
def test_responses_holds_them_to_openais_types(fields: dict[str, Any], param: str) -> None:
    """Responses' option objects and ``context_management`` took any value, where chat
    refuses its own option objects of another type."""
    with pytest.raises(InvalidRequestError) as caught:
        responses(**fields)
    assert (caught.value.code, caught.value.param) == ("invalid_type", param)


def test_responses_context_management_is_a_non_empty_array_of_typed_entries() -> None:
    """As OpenAI's schema has it: at least one entry, each with its ``type``."""
    for value, code, param in (([], "empty_array", "context_management"),
                               ([{}], "missing_required_parameter",
                                "context_management[0].type")):
        with pytest.raises(InvalidRequestError) as caught:
            responses(context_management=value)
        assert (caught.value.code, caught.value.param) == (code, param)
    responses(context_management=[{"type": "compaction", "compact_threshold": 1000}])


def test_a_safety_identifier_is_at_most_64_characters() -> None:
    """OpenAI's bound on it, in Responses as in chat; one of 64 passes."""
    for parse in (chat, responses):
        with pytest.raises(InvalidRequestError) as caught:
            parse(safety_identifier="u" * 65)
        assert (caught.value.code, caught.value.param) == ("invalid_value",
                                                           "safety_identifier")
        parse(safety_identifier="u" * 64)


def test_their_values_pass_new_tiers_too() -> None:
    """OpenAI adds tiers and retentions: any string of them passes, as does null."""
    fields = {"store": True, "metadata": {"k": "v"}, "verbosity": "low",
              "service_tier": "ultrafast", "prompt_cache_retention": "7d"}
    chat(**fields)
    # Chat's own: the answer is text whatever they ask, and OpenAI adds modalities.
    chat(modalities=["text", "audio", "image"], audio={"voice": "alloy", "format": "wav"},
         web_search_options={}, prompt_cache_options={"mode": "implicit"},
         moderation={"model": "omni-moderation-latest"})
    chat(**dict.fromkeys(("modalities", "audio", "web_search_options",
                          "prompt_cache_options", "moderation")))
    responses(**{k: v for k, v in fields.items() if k != "verbosity"})
    responses(prompt_cache_options={"mode": "implicit"}, moderation={"model": "m"},
              background_options={"completion_window": "2h"},
              access_programs={"cyber": "standard"}, image={"context_compression": "auto"})
    chat(**dict.fromkeys(fields))
    responses(**dict.fromkeys(fields))
    responses(**dict.fromkeys(("prompt_cache_options", "moderation", "background_options",
                               "access_programs", "image", "context_management")))
