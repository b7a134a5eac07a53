"""Objects that do not say ``additionalProperties`` are generated closed.

JSON Schema leaves such an object open, and a grammar that follows it lets a sampled model
invent keys until ``max_tokens``: the arguments or the answer never close. The grammar's
copy closes them (every closed output is valid against the schema as given); the final
check still uses the schema as sent. End to end on the real server and the demo model,
sampled over many seeds: forced tool arguments and ``json_schema`` answers carry no key
outside their ``properties``, and finish. Then, on the real grammar and tokenizer: an
object left open on purpose (``additionalProperties: true``, or no ``properties``) still
accepts extra keys.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import pytest

from afmd.config.load import load_config
from afmd.engine.models.loaded_model import LoadedModel
from afmd.engine.models.model_registry import ModelRegistry
from afmd.grammar.compiler import ToolSchema, json_schema_grammar, llg_tokenizer, tool_grammar

from helpers.openai_schemas import validate_response

SEEDS = range(12)
MESSAGES = [{"role": "user", "content": "Plan a trip as JSON."}]

# Objects that never say additionalProperties, nested through every kind of place.
OPEN = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "when": {"type": "object",
                 "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31}},
                 "required": ["day"]},
        "stops": {"type": "array", "maxItems": 2,
                  "items": {"type": "object", "properties": {"n": {"enum": [1, 2]}}}},
        "hotel": {"anyOf": [{"$ref": "#/$defs/Hotel"}, {"type": "null"}]},
    },
    "required": ["city", "when", "stops", "hotel"],
    "$defs": {"Hotel": {"type": "object",
                        "properties": {"stars": {"type": "integer", "minimum": 1,
                                                 "maximum": 5}},
                        "required": ["stars"]}},
}


def resolve(schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = OPEN["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def assert_only_listed_keys(value: Any, schema: dict[str, Any]) -> None:
    """Every object in ``value`` uses only the keys its (sub)schema lists."""
    schema = resolve(schema)
    if isinstance(value, dict):
        if "anyOf" in schema:
            schema = resolve(next(s for s in schema["anyOf"] if s.get("type") != "null"))
        assert set(value) <= set(schema["properties"]), (value, schema)
        for key, item in value.items():
            assert_only_listed_keys(item, schema["properties"][key])
    elif isinstance(value, list):
        for item in value:
            assert_only_listed_keys(item, schema["items"])


def ask(http: httpx.Client, seed: int, **body: Any) -> dict[str, Any]:
    response = http.post("/v1/chat/completions", json={
        "model": "demo", "messages": MESSAGES, "max_tokens": 300, "temperature": 1.0,
        "reasoning_effort": "none", "seed": seed, **body})
    assert response.status_code == 200, response.text
    completion = response.json()
    validate_response(completion)
    return completion


def in_parallel(fn: Any) -> list[Any]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(fn, SEEDS))


def test_forced_arguments_of_open_objects_carry_only_listed_keys(http: httpx.Client) -> None:
    tools = [{"type": "function", "function": {"name": "trip", "parameters": OPEN}}]
    completions = in_parallel(lambda seed: ask(
        http, seed, tools=tools, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "trip"}}))
    for completion in completions:
        choice = completion["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        arguments = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
        jsonschema.validate(arguments, OPEN)
        assert_only_listed_keys(arguments, OPEN)


def test_json_schema_answers_of_open_objects_carry_only_listed_keys(
    http: httpx.Client
) -> None:
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "trip", "schema": OPEN}}
    completions = in_parallel(lambda seed: ask(http, seed, response_format=response_format))
    for completion in completions:
        choice = completion["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        answer = json.loads(choice["message"]["content"])
        jsonschema.validate(answer, OPEN)
        assert_only_listed_keys(answer, OPEN)


# ------------------------------------------------------------- the grammar, token by token


@pytest.fixture(scope="module")
def demo_model() -> Iterator[LoadedModel]:
    config = load_config(None, env={})
    registry = ModelRegistry(config)
    entry = registry.resolve("demo")

    async def load() -> LoadedModel:
        return await registry.begin_load(entry)

    yield asyncio.run(load())
    registry.close()


def accepts(grammar: Any, text: str) -> bool:
    matcher = grammar.matcher()
    tokens = grammar.tokenizer.tokenize_str(text)
    return matcher.validate_tokens(tokens) == len(tokens) and (
        matcher.consume_tokens(tokens) and matcher.is_accepting())


@pytest.mark.parametrize(
    ("schema", "text", "accepted"),
    [
        (OPEN, '{"city":"x","when":{"day":1},"stops":[],"hotel":null}', True),
        (OPEN, '{"city":"x","when":{"day":1},"stops":[],"hotel":null,"z":1}', False),
        (OPEN, '{"city":"x","when":{"day":1,"z":1},"stops":[],"hotel":null}', False),
        (OPEN, '{"city":"x","when":{"day":1},"stops":[{"z":1}],"hotel":null}', False),
        (OPEN, '{"city":"x","when":{"day":1},"stops":[],"hotel":{"stars":1,"z":1}}', False),
        ({**OPEN, "additionalProperties": True},
         '{"city":"x","when":{"day":1},"stops":[],"hotel":null,"z":1}', True),
        ({"type": "object"}, '{"z":1}', True),
        ({"type": "object", "properties": {"o": {"type": "object"}}}, '{"o":{"z":1}}', True),
        ({"type": "object", "properties": {"a": {"type": "integer"}},
          "patternProperties": {"^x": {"type": "integer"}}}, '{"a":1,"x1":2}', True),
    ],
    ids=["listed", "extra-top", "extra-nested", "extra-in-items", "extra-in-ref",
         "explicitly-open", "no-properties", "nested-no-properties", "pattern"],
)
def test_grammar_closes_only_what_lists_its_keys(
    demo_model: LoadedModel, schema: dict[str, Any], text: str, accepted: bool
) -> None:
    tokenizer = llg_tokenizer(demo_model.tokenizer, demo_model.vocab_size, demo_model.eos_ids)
    before = json.dumps(schema)
    answer = json_schema_grammar(tokenizer, schema, thinking=None, param="p")
    assert accepts(answer, text) is accepted
    call = tool_grammar(tokenizer, [ToolSchema("f", schema, "tools[0]")], start="<tool_call>",
                        end="</tool_call>", required=True, parallel=False, thinking=None)
    wrapped = f'<tool_call>\n{{"name":"f","arguments":{text}}}\n</tool_call>'
    assert accepts(call, wrapped) is accepted
    assert json.dumps(schema) == before  # the client's schema is left as it was sent
