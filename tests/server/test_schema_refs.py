"""Schemas with ``$ref`` (pydantic's nested models) wherever a client's schema is embedded.

A tool's parameters sit under ``properties.arguments`` of the call's grammar, so
``#/$defs/X`` used to point at nothing and any such tool was refused (400
``invalid_schema``), even with ``tool_choice: "auto"``. End to end against the real server
and the demo model, sampled: pydantic-shaped schemas with ``$defs`` and with
``definitions`` as tool parameters (auto, required, named, allowed_tools, several tools
with same-named definitions, beside a ``response_format``) and as a server tool's
parameters. Every call's arguments are checked with ``jsonschema`` against the schema as
sent, which resolves its references against that schema's own root.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from conftest import ServerProcess, start_server
from helpers.openai_schemas import validate_response
from helpers.paths import TESTS_DIR

TOOLS_DIR = TESTS_DIR / "tools"
MESSAGES = [{"role": "user", "content": "Register a person and a node."}]
SEEDS = range(6)


class Address(BaseModel):
    street: str = Field(max_length=8)
    number: int = Field(ge=1, le=99)


class Tag(BaseModel):
    label: Literal["red", "blue"]


class Node(BaseModel):
    name: str = Field(max_length=4)
    kids: list[Node] = Field(default=[], max_length=1)


class Person(BaseModel):
    name: str = Field(max_length=8)
    home: Address = Field(description="where they live")
    tags: list[Tag] = Field(max_length=2)
    work: Address | None = None


class Tree(BaseModel):
    root: Node


def draft7(schema: dict[str, Any]) -> dict[str, Any]:
    """The same schema as older generators write it: ``definitions``, draft-07 pointers."""
    text = json.dumps(schema).replace('"$defs"', '"definitions"')
    return json.loads(text.replace("#/$defs/", "#/definitions/"))


PERSON = Person.model_json_schema()
TREE = Tree.model_json_schema()
FLAVOURS = {"$defs": (PERSON, TREE), "definitions": (draft7(PERSON), draft7(TREE))}


def tools(person: dict[str, Any], tree: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {"name": "register", "parameters": person}},
        {"type": "function", "function": {"name": "plant", "parameters": tree}},
    ]


def ask(http: httpx.Client, **body: Any) -> dict[str, Any]:
    response = http.post("/v1/chat/completions", json={
        "model": "demo", "messages": MESSAGES, "max_tokens": 400, "temperature": 1.0,
        "reasoning_effort": "none", "parallel_tool_calls": False, **body})
    assert response.status_code == 200, response.text
    completion = response.json()
    validate_response(completion)
    return completion


def calls_of(completion: dict[str, Any]) -> list[tuple[str, Any]]:
    calls = completion["choices"][0]["message"].get("tool_calls") or []
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def check_forced(completion: dict[str, Any], schemas: dict[str, dict[str, Any]]) -> None:
    assert completion["choices"][0]["finish_reason"] == "tool_calls", completion
    calls = calls_of(completion)
    assert len(calls) == 1
    name, arguments = calls[0]
    assert name in schemas
    jsonschema.validate(arguments, schemas[name])


def in_parallel(fn: Any, items: Any) -> list[Any]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(fn, items))


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize(
    ("choice", "names"),
    [("required", ("register", "plant")),
     ({"type": "function", "function": {"name": "register"}}, ("register",)),
     ({"type": "function", "function": {"name": "plant"}}, ("plant",)),
     ({"type": "allowed_tools", "allowed_tools": {
         "mode": "required", "tools": [{"type": "function", "function": {"name": "plant"}}]}},
      ("plant",))],
    ids=["required", "named-register", "named-plant", "allowed_tools"],
)
def test_forced_calls_with_referenced_models(
    http: httpx.Client, flavour: str, choice: Any, names: tuple[str, ...]
) -> None:
    person, tree = FLAVOURS[flavour]
    schemas = {n: s for n, s in (("register", person), ("plant", tree)) if n in names}
    completions = in_parallel(
        lambda seed: ask(http, tools=tools(person, tree), tool_choice=choice, seed=seed), SEEDS)
    for completion in completions:
        check_forced(completion, schemas)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_auto_with_referenced_models_is_accepted(http: httpx.Client, flavour: str) -> None:
    person, tree = FLAVOURS[flavour]
    schemas = {"register": person, "plant": tree}
    for seed in SEEDS[:3]:
        completion = ask(http, tools=tools(person, tree), tool_choice="auto", seed=seed,
                         max_tokens=60)
        for name, arguments in calls_of(completion):
            jsonschema.validate(arguments, schemas[name])


def test_same_named_definitions_of_two_tools_stay_apart(http: httpx.Client) -> None:
    def with_item(item: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}},
                "required": ["item"], "$defs": {"Item": item}}

    number = with_item({"type": "integer", "minimum": 0, "maximum": 9})
    word = with_item({"enum": ["kumquat", "rutabaga"]})
    both = [{"type": "function", "function": {"name": "count", "parameters": number}},
            {"type": "function", "function": {"name": "say", "parameters": word}}]
    for name, schema in (("count", number), ("say", word)):
        named = {"type": "function", "function": {"name": name}}
        completions = in_parallel(
            lambda seed, named=named: ask(http, tools=both, tool_choice=named, seed=seed),
            SEEDS)
        for completion in completions:
            check_forced(completion, {name: schema})  # by its own tool's definitions


def test_response_format_with_references_beside_tools(http: httpx.Client) -> None:
    answer_format = {"type": "json_schema", "json_schema": {
        "name": "person", "strict": True, "schema": PERSON}}
    for seed in SEEDS:
        completion = ask(http, tools=tools(PERSON, TREE), tool_choice="auto", seed=seed,
                         response_format=answer_format)
        choice = completion["choices"][0]
        calls = calls_of(completion)
        if calls:
            check_forced(completion, {"register": PERSON, "plant": TREE})
        else:
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


# ------------------------------------------------------------------------- server tools


def toml_value(value: Any) -> str:
    """A JSON value as a TOML inline value (keys quoted, so ``$ref`` is fine)."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(v)}"
                                for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if value is None:
        raise ValueError("TOML has no null")
    return json.dumps(value)


# pydantic's shape without nulls (TOML has none): a nested model by reference, twice.
LOOKUP = {
    "type": "object",
    "properties": {"home": {"$ref": "#/$defs/Address", "description": "where"},
                   "others": {"type": "array", "items": {"$ref": "#/$defs/Address"},
                              "maxItems": 1}},
    "required": ["home", "others"],
    "$defs": {"Address": Address.model_json_schema()},
}


@pytest.fixture(scope="module")
def referencing_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[
        ServerProcess, Path]]:
    tmp = tmp_path_factory.mktemp("server-tool-refs")
    mark = tmp / "lookup.jsonl"
    config = (
        "[[tools.server]]\n"
        'name = "zz_lookup"\n'
        f"parameters = {toml_value(LOOKUP)}\n"
        f"command = [{json.dumps(sys.executable)}, {json.dumps(str(TOOLS_DIR / 'echo_tool.py'))}]\n"
        f'env = {{ MARK_FILE = {json.dumps(str(mark))}, TOOL_NONCE = "n" }}\n'
    )
    proc = start_server(tmp, config=config)
    yield proc, mark
    proc.stop()


def test_server_tool_with_referenced_models(
    referencing_server: tuple[ServerProcess, Path]
) -> None:
    proc, mark = referencing_server
    for seed in SEEDS[:4]:
        response = httpx.post(proc.url + "/v1/chat/completions", timeout=60, json={
            "messages": MESSAGES, "max_tokens": 300, "temperature": 1.0, "seed": seed,
            "reasoning_effort": "none", "parallel_tool_calls": False,
            "tool_choice": {"type": "function", "function": {"name": "zz_lookup"}}})
        assert response.status_code == 200, response.text
        assert "tool_calls" not in response.json()["choices"][0]["message"]
    runs = [json.loads(line) for line in mark.read_text().splitlines()]
    assert len(runs) >= 4  # the tool ran (afmd checked its arguments before running it)
    for run in runs:
        jsonschema.validate(run["args"], LOOKUP)
    events = [e for e in proc.events if e.get("event") == "server tool"]
    assert events and all(e["ok"] is True for e in events)


# ------------------------------------------------------------------- a schema of nothing

#: Schemas that only refer to themselves: they compile, and admit no value at all.
SELF_REFERENCING = [{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
                    {"$ref": "#"},
                    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                     "$ref": "#/$defs/a"}]


@pytest.mark.parametrize("schema", SELF_REFERENCING, ids=["loop", "root", "two-step"])
def test_a_schema_admitting_nothing_is_the_clients_error_in_every_dialect(
        http: httpx.Client, schema: dict[str, Any]) -> None:
    """Without thinking first, the grammar's very first mask allows only the end: the row
    ended at once with no token, and the empty answer was a 500 ``invalid_json_output``."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for stream in (False, True):
        got = http.post("/v1/chat/completions", json={
            "model": "demo", "messages": MESSAGES, "max_tokens": 8, "stream": stream,
            "reasoning_effort": "none", "response_format": fmt})
        assert got.status_code == 400, got.text
        error = got.json()["error"]
        assert (error["code"], error["param"]) == (
            "invalid_schema", "response_format.json_schema.schema"), error
    responses = http.post("/v1/responses", json={
        "model": "demo", "input": "x", "max_output_tokens": 16,
        "reasoning": {"effort": "none"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}})
    assert responses.status_code == 400, responses.text
    assert responses.json()["error"]["code"] == "invalid_schema"
    assert responses.json()["error"]["param"] == "text.format.schema"
    messages = http.post("/v1/messages", json={
        "model": "demo", "max_tokens": 8, "messages": MESSAGES,
        "thinking": {"type": "disabled"},
        "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert messages.status_code == 400, messages.text
    assert messages.json()["error"]["type"] == "invalid_request_error"
    assert messages.json()["error"]["message"].startswith("output_config.format.schema: ")
    ollama = http.post("/api/chat", json={"model": "demo", "messages": MESSAGES,
                                          "stream": False, "think": False, "format": schema})
    assert ollama.status_code == 400, ollama.text
    assert "JSON schema cannot be used" in ollama.json()["error"]
    # The server is unharmed: the same request with a schema that admits a value works.
    fine = ask(http, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                "required": ["a"], "additionalProperties": False}}})
    json.loads(fine["choices"][0]["message"]["content"])


@pytest.mark.parametrize("index", ["5", "\u00b2", "\u2460", "\uff11"],
                         ids=["past-end", "superscript", "circled", "fullwidth"])
def test_a_reference_into_a_list_needs_an_ascii_index_in_range(
        http: httpx.Client, index: str) -> None:
    """``str.isdigit`` holds for "²" but ``int`` refuses it: such a pointer was a 500."""
    schema = {"type": "object", "properties": {
        "a": {"anyOf": [{"type": "integer"}]}, "b": {"$ref": f"#/properties/a/anyOf/{index}"}}}
    chat = http.post("/v1/chat/completions", json={
        "model": "demo", "messages": MESSAGES, "max_tokens": 8, "reasoning_effort": "none",
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["code"] == "invalid_schema"
    tools = http.post("/v1/messages", json={
        "model": "demo", "max_tokens": 8, "messages": MESSAGES,
        "tools": [{"name": "f", "input_schema": schema}]})
    assert tools.status_code == 400, tools.text
    assert tools.json()["error"]["type"] == "invalid_request_error"
