"""Ollama's native API through the official ``ollama`` Python client, on the real server and
the demo models: chat and generate (streamed and not) write what ``/v1/chat/completions``
and ``/v1/completions`` write for the same request, embeddings are ``/v1/embeddings``'
vectors, the model routes describe the real folders, ``options`` reach the sampler, and
errors, screening, cancel and ``[ollama] port`` hold as on every route.
"""

from __future__ import annotations

import base64
import http.server
import io
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import ollama
import pytest
from PIL import Image

from afmd.config.load import load_config
from afmd.core.events import Content, Finish, Reasoning, Timings, ToolCallEnd, Usage
from afmd.core.request import ToolCall
from afmd.dialects.ollama.ollama_api import OLLAMA_CHAT
from afmd.engine.demo import builtin as demo
from afmd.engine.models.model_registry import ModelRegistry
from afmd.errors import NotFoundError
from afmd.hub.cache import human_bytes
from afmd.hub.download import LISTING_CAP
from afmd.ports import free_ports

from conftest import ServerProcess, start_server
from helpers.format_models import FormatModels
from helpers.hub import FakeHub
from helpers.smoke import grown_mib_while

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture()
def client(server: ServerProcess) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=120)


def openai_chat(http: httpx.Client, **body: Any) -> dict[str, Any]:
    response = http.post("/v1/chat/completions", json={"model": "demo", **body})
    assert response.status_code == 200, response.text
    return response.json()


# -- the root, the version, the models ------------------------------------------------


def test_root_says_ollama_is_running(http: httpx.Client) -> None:
    got = http.get("/")
    assert got.status_code == 200
    assert got.headers["content-type"].startswith("text/plain")
    assert "Ollama is running" in got.text
    head = http.head("/")
    assert head.status_code == 200 and head.content == b""


def test_version_passes_clients_gates(http: httpx.Client) -> None:
    version = http.get("/api/version").json()["version"]
    assert tuple(int(p) for p in version.split(".")) >= (0, 6, 4)  # Copilot's minimum


def test_tags_list_every_model_with_details(client: ollama.Client) -> None:
    models = {m.model: m for m in client.list().models}
    for name in ("demo:latest", "demo-32k:latest", "demo-embedding:latest",
                 "demo-vision:latest", "gpt-4o-mini:latest"):
        assert name in models, sorted(models)
    demo_model = models["demo:latest"]
    folder = demo.materialize("demo")
    config = json.loads((folder / "config.json").read_text())
    assert demo_model.details.family == config["model_type"] == "qwen2"
    assert demo_model.details.format == "safetensors"
    assert demo_model.details.quantization_level == "F32"
    assert demo_model.details.parameter_size.endswith("K")
    assert demo_model.size == sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    assert len(demo_model.digest or "") == 64
    raw = httpx.get(str(client._client.base_url) + "/api/tags").json()["models"]
    assert all(m["name"] == m["model"] for m in raw)
    # Apple's on-device model has no folder: it is listed from what the framework says.
    assert models["system:latest"].details.family == "apple-foundation"
    shown = client.show("system")
    assert shown.capabilities == ["completion", "tools"]
    assert (shown.modelinfo or {})["apple-foundation.context_length"] == 4096


def test_ollamas_openai_routes_take_the_tag_too(http: httpx.Client) -> None:
    """Ollama's ``/v1/models/{model}`` takes a model by the name ``/api/tags`` lists, as
    every other route here does; afmd answered ``demo:latest`` 404."""
    for name, served in (("demo:latest", "demo"), ("gpt-4o-mini:latest", "gpt-4o-mini")):
        got = http.get(f"/v1/models/{name}")
        assert got.status_code == 200, got.text
        assert got.json()["id"] == served and got.json()["object"] == "model"
    assert http.get("/v1/models/nope:latest").status_code == 404


def test_show_describes_the_model(client: ollama.Client, http: httpx.Client) -> None:
    shown = client.show("demo")
    config = json.loads((demo.materialize("demo") / "config.json").read_text())
    info = shown.modelinfo or {}
    assert info["general.architecture"] == "qwen2"
    assert info["general.basename"] == "demo"
    assert info["qwen2.context_length"] == 131072
    assert info["qwen2.embedding_length"] == config["hidden_size"]
    assert info["qwen2.block_count"] == config["num_hidden_layers"]
    # The demo's tokenizer has tool-call and thinking markers and Qwen's FIM tokens.
    assert shown.capabilities == ["completion", "tools", "thinking", "insert"]
    assert "<|im_start|>" in (shown.template or "")
    assert client.show("demo-embedding:latest").capabilities == ["embedding"]
    assert "vision" in (client.show("demo-vision").capabilities or [])
    with pytest.raises(ollama.ResponseError) as caught:
        client.show("no-such-model")
    assert caught.value.status_code == 404
    assert caught.value.error == "model 'no-such-model' not found"


# -- chat --------------------------------------------------------------------------------


def test_greedy_chat_equals_chat_completions(client: ollama.Client, http: httpx.Client
                                            ) -> None:
    want = openai_chat(http, messages=MESSAGES, max_tokens=12, temperature=0)
    answer = client.chat(model="demo", messages=MESSAGES, options=GREEDY)
    assert answer.message.content == want["choices"][0]["message"]["content"]
    assert answer.model == "demo" and answer.done and answer.done_reason == "length"
    assert answer.prompt_eval_count == want["usage"]["prompt_tokens"]
    assert answer.eval_count == want["usage"]["completion_tokens"] == 12
    for field in ("total_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(getattr(answer, field), int) and getattr(answer, field) > 0, field
    assert answer.total_duration >= answer.eval_duration + answer.prompt_eval_duration
    assert answer.load_duration is not None and answer.load_duration >= 0

    parts = list(client.chat(model="demo:latest", messages=MESSAGES, options=GREEDY,
                             stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content or "" for p in parts) == answer.message.content
    assert parts[-1].model == "demo:latest" and parts[-1].eval_count == 12


def test_stream_is_ndjson_by_default(http: httpx.Client) -> None:
    response = http.post("/api/chat", json={"model": "demo", "messages": MESSAGES,
                                            "options": GREEDY})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert len(lines) >= 2 and lines[-1]["done"] is True
    assert all(line["done"] is False for line in lines[:-1])
    assert lines[-1]["created_at"].endswith("Z")
    profiled = http.post("/api/chat", json={"model": "demo", "messages": MESSAGES,
                                            "options": GREEDY},
                         headers={"X-AFM-Profile": "true"})
    last = json.loads(profiled.text.splitlines()[-1])
    assert last["done"] is True and last["afm_profile"]["completion_tokens"] == 12
    whole = http.post("/api/chat", json={"model": "demo", "messages": MESSAGES,
                                         "options": GREEDY, "stream": False})
    assert whole.headers["content-type"] == "application/json"
    assert whole.json()["message"]["content"] == "".join(
        line["message"]["content"] for line in lines)


def test_thinking_is_returned_apart(client: ollama.Client, http: httpx.Client) -> None:
    want = openai_chat(http, messages=MESSAGES, max_tokens=40, temperature=0,
                       reasoning_effort="medium")["choices"][0]["message"]
    answer = client.chat(model="demo", messages=MESSAGES, think=True,
                         options={"temperature": 0, "num_predict": 40})
    assert answer.message.content == want["content"]
    assert (answer.message.thinking or None) == want.get("reasoning_content")
    off = client.chat(model="demo", messages=MESSAGES, think=False, options=GREEDY)
    assert off.message.thinking is None


#: The call-format suite's models (helpers.format_models): one family whose model cannot
#: think (Qwen3-Coder's, Llama 3's JSON calls) and those that think by markup afmd reads
#: itself rather than mlx-lm (gpt-oss's analysis channel, Mistral's [THINK]).
FAMILY_MODELS = ("qwen3_coder", "llama3", "harmony", "mistral")


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    root = tmp_path_factory.mktemp("ollama-families")
    models = FormatModels(root / "models")
    config = "".join(f'[[models.model]]\nid = "{family}"\npath = "{models.folder(family)}"\n'
                     for family in FAMILY_MODELS)
    # A model that can think whose template does not unless asked to (a hybrid model's).
    quiet = root / "thinks-if-asked"
    shutil.copytree(models.folder("hermes"), quiet)
    settings = json.loads((quiet / "tokenizer_config.json").read_text())
    template = settings["chat_template"]
    assert "enable_thinking is defined and enable_thinking is false" in template
    settings["chat_template"] = template.replace(
        "enable_thinking is defined and enable_thinking is false",
        "not (enable_thinking is defined and enable_thinking)")
    (quiet / "tokenizer_config.json").write_text(json.dumps(settings))
    config += f'[[models.model]]\nid = "thinks-if-asked"\npath = "{quiet}"\n'
    server = start_server(root, config=config)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            yield http
    finally:
        server.stop()


def test_think_left_out_thinks_as_ollama_turns_it_on(families: httpx.Client) -> None:
    """Ollama's server sets ``think`` to true for a model that can think when a request
    leaves it out, whatever the template's own default: the prompt is the one ``think:
    true`` renders, not the template's default (which closes the thinking here). mlx-lm's
    tokenizer does the same (``enable_thinking`` is its ``has_thinking`` unless given):
    this holds it there."""
    def prompt_tokens(**think: Any) -> int:
        answer = families.post("/api/chat", json={
            "model": "thinks-if-asked", "stream": False, "options": {"num_predict": 1},
            "messages": [{"role": "user", "content": "Hello there."}], **think})
        assert answer.status_code == 200, answer.text
        return int(answer.json()["prompt_eval_count"])

    on, off = prompt_tokens(think=True), prompt_tokens(think=False)
    assert off > on  # the template closes the thinking when it is off
    assert prompt_tokens() == on


@pytest.mark.parametrize("family", FAMILY_MODELS)
def test_think_is_refused_where_show_lists_no_thinking(families: httpx.Client,
                                                       family: str) -> None:
    """As Ollama: ``think`` (true or a level) on a model without thinking is a 400
    ``"<model>" does not support thinking`` (the name as the request gave it), on chat,
    generate (raw too) and a load; ``think: false`` always passes. Whether a model thinks
    is what ``/api/show`` says, loaded or not: it said neither ``thinking`` nor ``tools``
    for gpt-oss, and no ``thinking`` for Mistral, whose markup afmd reads itself."""
    before = families.post("/api/show", json={"model": family}).json()["capabilities"]
    thinks = family in ("harmony", "mistral")
    assert ("thinking" in before) is thinks, before
    assert "tools" in before
    refusal = {"error": f'"{family}:latest" does not support thinking'}
    chat = {"model": f"{family}:latest", "messages": [{"role": "user", "content": "Hi"}],
            "options": {"num_predict": 2, "seed": 1}}
    for think in (True, "high", "max"):
        for stream in (False, True):
            got = families.post("/api/chat", json={**chat, "think": think, "stream": stream})
            if thinks:
                assert got.status_code == 200, got.text
            else:
                assert (got.status_code, got.json()) == (400, refusal), got.text
    generate = {"model": f"{family}:latest", "prompt": "Hi", "stream": False,
                "options": {"num_predict": 2}}
    for extra in ({}, {"raw": True}):
        got = families.post("/api/generate", json={**generate, **extra, "think": "low"})
        assert got.status_code == (200 if thinks else 400), got.text
        if not thinks:
            assert got.json() == refusal
    load = families.post("/api/chat", json={"model": family, "think": True})
    if thinks:
        assert load.json()["done_reason"] == "load"
    else:
        assert (load.status_code, load.json()["error"]) == (
            400, f'"{family}" does not support thinking')
    for body, route in ((chat, "/api/chat"), (generate, "/api/generate")):
        off = families.post(route, json={**body, "think": False, "stream": False})
        assert off.status_code == 200, off.text
    after = families.post("/api/show", json={"model": family}).json()["capabilities"]
    assert after == before  # the loaded model says what its folder said


def test_show_says_fill_in_the_middle_where_continue_looks_for_it(
        client: ollama.Client, families: httpx.Client) -> None:
    """Continue's Ollama provider fills in the middle through ``/api/generate``'s
    ``suffix`` only for a model whose ``/api/show`` ``template`` mentions Ollama's
    ``.Suffix``; otherwise it writes a FIM prompt of its own guessing, by the model's
    name, and sends it raw. A model with ``insert`` said so only in ``capabilities``, so
    Continue never used afmd's fill-in-the-middle. The template says it in a Jinja
    comment after the model's own template, which renders the same."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    shown = client.show("demo")
    assert "insert" in (shown.capabilities or [])
    own = json.loads((demo.materialize("demo") / "tokenizer_config.json").read_text(
        encoding="utf-8"))["chat_template"]
    template = shown.template or ""
    assert template.startswith(own) and ".Suffix" in template
    # Rendered as transformers renders a chat template: the same prompt.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    rendered = [env.from_string(t).render(messages=MESSAGES, add_generation_prompt=True)
                for t in (template, own)]
    assert rendered[0] == rendered[1]
    for family in FAMILY_MODELS:  # none of these has FIM tokens
        show = families.post("/api/show", json={"model": family}).json()
        assert "insert" not in show["capabilities"] and ".Suffix" not in show["template"]


def test_think_is_refused_before_the_model_loads(families: httpx.Client) -> None:
    """As Ollama: the refusal comes without loading the model (a load is seconds, and may
    unload another model, for an answer that is a 400 either way)."""
    def loaded() -> list[str]:
        return [m["name"] for m in families.get("/api/ps").json()["models"]]

    families.post("/api/generate", json={"model": "llama3", "keep_alive": 0})
    for _ in range(100):
        if "llama3:latest" not in loaded():
            break
        time.sleep(0.05)
    assert "llama3:latest" not in loaded()
    for route, body in (("/api/chat", {"messages": [{"role": "user", "content": "Hi"}]}),
                        ("/api/generate", {"prompt": "Hi"})):
        got = families.post(route, json={"model": "llama3", "think": True, "stream": False,
                                         **body})
        assert (got.status_code, got.json()) == (
            400, {"error": '"llama3" does not support thinking'}), got.text
        assert "llama3:latest" not in loaded()


def test_think_max_is_gpt_oss_high_as_in_ollama(families: httpx.Client) -> None:
    """gpt-oss's highest level is ``high``, which Ollama maps ``max`` to; afmd rendered
    ``Reasoning: medium``. The prompt is the measure: the level is written into it."""
    def prompt_tokens(think: Any) -> int:
        answer = families.post("/api/chat", json={
            "model": "harmony", "messages": [{"role": "user", "content": "Hi"}],
            "think": think, "stream": False, "options": {"num_predict": 1}}).json()
        return int(answer["prompt_eval_count"])

    assert prompt_tokens("high") != prompt_tokens("medium")  # the measure can tell them
    assert prompt_tokens("max") == prompt_tokens("high")


def test_format_schema_is_enforced(client: ollama.Client) -> None:
    schema = {"type": "object", "properties": {
        "colour": {"type": "string", "enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["colour", "count"], "additionalProperties": False}
    for seed in (1, 2, 3):
        answer = client.chat(model="demo", messages=MESSAGES, format=schema,
                             options={"seed": seed, "num_predict": 60})
        jsonschema.validate(json.loads(answer.message.content or ""), schema)


def test_a_line_separator_in_the_answer_does_not_split_a_streamed_line(
        client: ollama.Client) -> None:
    """The official client reads a stream with httpx's ``iter_lines``, which ends a line at
    U+2028, U+2029 and U+0085 as ``str.splitlines`` does: written raw, one in the answer
    cut its object in two and the client failed with a ``JSONDecodeError``. Ollama's Go
    encoder writes the first two escaped. Found by the schema-driven fuzzer."""
    separators = "\u2028\u2029\u0085"
    parts = list(client.chat(model="demo", messages=[{"role": "user", "content": "hi"}],
                             stream=True, think=False, format={"enum": [separators * 2]},
                             options={"temperature": 0, "num_predict": 20}))
    assert parts[-1].done
    text = "".join(part.message.content or "" for part in parts)
    assert json.loads(text) == separators * 2


def test_tool_history_in_ollamas_shape(client: ollama.Client) -> None:
    """A call whose arguments are an object, answered by a ``tool`` message naming it."""
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "11 degrees", "tool_name": "get_weather"},
    ]
    answer = client.chat(model="demo", messages=messages, tools=tools, options=GREEDY)
    assert answer.done and answer.prompt_eval_count and answer.prompt_eval_count > 30


def test_a_call_left_unanswered_is_history_as_in_ollama(http: httpx.Client) -> None:
    """A call with no tool message after it (the user declined it, or went on talking) is
    rendered as the model made it, as Ollama renders it: afmd refused it with a 400 (an
    OpenAI rule Ollama's API does not have), so an app's conversation that runs on
    Ollama failed here."""
    user = {"role": "user", "content": "Weather in Paris?"}
    called = {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"function": {"name": "get_time", "arguments": {"city": "Paris"}}}]}
    later = {"role": "user", "content": "Never mind, name three colours."}

    def prompt_tokens(messages: list[dict[str, Any]]) -> int:
        response = http.post("/api/chat", json={"model": "demo", "messages": messages,
                                                "stream": False, "options": GREEDY})
        assert response.status_code == 200, response.text
        return int(response.json()["prompt_eval_count"])

    without = prompt_tokens([user, later])
    assert prompt_tokens([user, called, later]) > without  # the calls are in the prompt
    answered = prompt_tokens(
        [user, called, {"role": "tool", "content": "18 C", "tool_name": "get_time"}, later])
    assert answered > prompt_tokens([user, called, later])
    assert prompt_tokens([user, called]) > prompt_tokens([user])


def test_a_tool_call_id_for_calls_sent_without_ids_answers_by_name(http: httpx.Client
                                                                   ) -> None:
    """Calls sent in Ollama's shape have no ids; a client that gives its tool messages
    ids of its own (``tool_call_id``, beside ``tool_name`` or alone) is answered as
    Ollama answers it: by the name, else in order. afmd matched the id to the ids it had
    made up for the calls and refused every such conversation with a 400."""
    user = {"role": "user", "content": "Weather in Paris?"}
    called = {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    result = {"role": "tool", "content": "18 C", "tool_name": "get_weather"}

    def answer(tool: dict[str, Any]) -> dict[str, Any]:
        response = http.post("/api/chat", json={
            "model": "demo", "messages": [user, called, tool], "stream": False,
            "options": GREEDY})
        assert response.status_code == 200, response.text
        return response.json()

    want = answer(result)
    for tool in ({**result, "tool_call_id": "toolu_01"},
                 {"role": "tool", "content": "18 C", "tool_call_id": "toolu_01"}):
        got = answer(tool)
        assert got["message"] == want["message"], tool
        assert got["prompt_eval_count"] == want["prompt_eval_count"], tool


@pytest.mark.parametrize(("sent", "read"), [
    # Ollama's Go ``api`` package: a tool without parameters, ``properties`` not omitempty.
    ({"type": "function", "function": {"name": "now", "parameters": {
        "type": "object", "properties": None}}},
     {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}),
    # Its zero value (no parameters set at all, nor the tool's type).
    ({"type": "", "function": {"name": "now", "parameters": {"type": "", "properties": None}}},
     {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}),
    # Before Ollama 0.12.11 ``required`` was not omitempty either; a pydantic model dumped
    # without ``exclude_none`` sends every unset keyword as null.
    ({"function": {"name": "weather", "parameters": {
        "type": "object", "required": None, "properties": {
            "city": {"type": "string", "description": None, "enum": None, "items": None}}}}},
     {"type": "function", "function": {"name": "weather", "parameters": {
         "type": "object", "properties": {"city": {"type": "string"}}}}}),
    # A null property is Go's zero value of one: a property of any value.
    ({"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": None}}}},
     {"type": "function", "function": {"name": "weather", "parameters": {
         "type": "object", "properties": {"city": {}}}}}),
])
def test_tools_as_go_clients_send_them(http: httpx.Client, sent: dict[str, Any],
                                       read: dict[str, Any]) -> None:
    """Nulls where Ollama's Go decoder reads a field left out, and Go's empty ``type``,
    are the tool they stand for (Ollama renders both alike). afmd refused them: "Invalid
    JSON schema: None is not of type 'object'", or "Missing required parameter:
    'tools[0].type'", for tools that Ollama serves."""
    def answer(tool: dict[str, Any]) -> dict[str, Any]:
        response = http.post("/api/chat", json={
            "model": "demo", "messages": MESSAGES, "tools": [tool], "stream": False,
            "options": GREEDY})
        assert response.status_code == 200, response.text
        return response.json()

    want, got = answer(read), answer(sent)
    assert got["message"] == want["message"]
    assert got["prompt_eval_count"] == want["prompt_eval_count"]


def lookup(key: int | str, unused: None = None) -> str:
    """Look a key up.

    Args:
      key: The key
      unused: Nothing
    """
    return str(key)


def test_a_function_with_a_union_argument_is_the_tool_it_stands_for(
    client: ollama.Client, http: httpx.Client
) -> None:
    """The official client builds a tool from a function's signature: a ``Union``
    argument's ``type`` it writes as its types joined (``"integer, string"``), one typed
    ``None`` as ``""``, and Ollama takes both. afmd refused the tool: "Invalid JSON
    schema: 'integer, string' is not valid under any of the given schemas"."""
    built = ollama._utils.convert_function_to_tool(lookup).model_dump(exclude_none=True)
    properties = built["function"]["parameters"]["properties"]
    joined = properties["key"]["type"]
    assert joined in ("integer, string", "string, integer")
    assert properties["unused"]["type"] == ""
    got = client.chat(model="demo", messages=MESSAGES, tools=[lookup], options=GREEDY)
    read = json.loads(json.dumps(built))
    read_properties = read["function"]["parameters"]["properties"]
    read_properties["key"]["type"] = joined.split(", ")
    del read_properties["unused"]["type"]
    want = http.post("/api/chat", json={"model": "demo", "messages": MESSAGES,
                                        "tools": [read], "stream": False, "options": GREEDY})
    assert want.status_code == 200, want.text
    assert got.message.model_dump(exclude_none=True) == {
        k: v for k, v in want.json()["message"].items() if v is not None}
    assert got.prompt_eval_count == want.json()["prompt_eval_count"]


def test_tool_calls_go_out_with_object_arguments() -> None:
    """The encoder: a finished call is one object, its arguments an object (Ollama's)."""
    request = OLLAMA_CHAT.parse(json.dumps({"model": "demo", "messages": MESSAGES}).encode())
    reply = OLLAMA_CHAT.reply(request, model="demo", fingerprint="fp")
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    events = [Content("Let me look."), ToolCallEnd(0, call), Timings(0.5, 0.0, 0.1, 0.3),
              Finish("tool_calls"), Usage(20, 9)]
    body = json.loads(reply.body(events))
    assert body["message"]["tool_calls"] == [
        {"id": "call_1", "function": {"index": 0, "name": "get_weather",
                                      "arguments": {"city": "Paris"}}}]
    assert body["done_reason"] == "stop"
    assert (body["total_duration"], body["eval_duration"]) == (500_000_000, 300_000_000)
    lines = reply.stream([Reasoning("hm")]) + reply.stream(events)
    objects = [json.loads(line) for line in lines.splitlines()]
    assert objects[0]["message"] == {"role": "assistant", "content": "", "thinking": "hm"}
    assert objects[1]["message"]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert objects[-1]["done"] is True and objects[-1]["eval_count"] == 9


def test_a_call_the_token_limit_cut_is_not_sent_as_a_call() -> None:
    """Ollama's arguments are an object and its parser returns whole calls only: a call
    cut by ``num_predict`` was sent with ``{}``, which a client would run with no
    arguments. ``done_reason: "length"`` says the turn was cut."""
    request = OLLAMA_CHAT.parse(json.dumps({"model": "demo", "messages": MESSAGES}).encode())
    reply = OLLAMA_CHAT.reply(request, model="demo", fingerprint="fp")
    whole = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    cut = ToolCall("call_2", "add", '{"a": 2, "b')
    events = [ToolCallEnd(0, whole), ToolCallEnd(1, cut), Timings(0.5, 0.0, 0.1, 0.3),
              Finish("length"), Usage(20, 9)]
    body = json.loads(reply.body(events))
    assert [c["function"]["name"] for c in body["message"]["tool_calls"]] == ["get_weather"]
    assert body["done_reason"] == "length"
    objects = [json.loads(line) for line in reply.stream(events).splitlines()]
    sent = [c for o in objects for c in o["message"].get("tool_calls", [])]
    assert [c["function"]["arguments"] for c in sent] == [{"city": "Paris"}]


def test_images_reach_a_vision_model(client: ollama.Client, http: httpx.Client) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, "PNG")
    data = base64.b64encode(buf.getvalue()).decode()
    want = openai_chat(http, model="demo-vision", max_tokens=10, temperature=0, messages=[
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
            {"type": "text", "text": "What is it?"}]}])
    answer = client.chat(model="demo-vision", options={"temperature": 0, "num_predict": 10},
                         messages=[{"role": "user", "content": "What is it?",
                                    "images": [data]}])
    assert answer.message.content == want["choices"][0]["message"]["content"]
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="demo", messages=[{"role": "user", "content": "x", "images": [data]}])
    assert caught.value.status_code == 400


NOT_AN_IMAGE = base64.b64encode(b"hello, world").decode()


@pytest.mark.parametrize(("route", "body", "field"), [
    ("/api/chat", {"messages": [MESSAGES[0], {"role": "user", "content": "x",
                                              "images": ["%"]}]}, "messages[1].images[0]"),
    ("/api/chat", {"messages": [MESSAGES[0], {"role": "user", "content": "x",
                                              "images": [NOT_AN_IMAGE]}]},
     "messages[1].images[0]"),
    ("/api/generate", {"prompt": "x", "images": ["%"]}, "images[0]"),
    ("/api/generate", {"prompt": "x", "system": "s", "images": [NOT_AN_IMAGE]}, "images[0]"),
], ids=["chat-not-base64", "chat-not-an-image", "generate-not-base64",
        "generate-not-an-image"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_bad_image_is_named_by_its_field(http: httpx.Client, route: str,
                                           body: dict[str, Any], field: str,
                                           stream: bool) -> None:
    """Ollama's error is one message: an image the vision model could not decode said
    only that "the image data is not a PNG, JPEG, WebP or GIF image", not which one."""
    got = http.post(route, json={"model": "demo-vision", "stream": stream, **body})
    assert got.status_code == 400, got.text
    assert set(got.json()) == {"error"}
    message = got.json()["error"]
    assert message.startswith(f"{field}: ") or message.startswith(f"'{field}'"), message


def test_images_for_a_model_that_cannot_see_name_the_images(http: httpx.Client) -> None:
    """The first image, as the body named it: a message's ``images[0]``, and a generate
    body's own ``images[0]``."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "PNG")
    image = base64.b64encode(buf.getvalue()).decode()
    chat = http.post("/api/chat", json={"model": "demo", "messages": [
        MESSAGES[0], {"role": "user", "content": "x", "images": [image]}]})
    assert chat.status_code == 400
    assert chat.json()["error"].startswith("messages[1].images[0]: ")
    generate = http.post("/api/generate", json={"model": "demo", "prompt": "x", "system": "s",
                                                "images": [image]})
    assert generate.status_code == 400
    assert generate.json()["error"].startswith("images[0]: ")


# -- generate ------------------------------------------------------------------------------


def test_generate_is_a_chat_turn_with_its_system(client: ollama.Client,
                                                 http: httpx.Client) -> None:
    want = openai_chat(http, messages=MESSAGES, max_tokens=12, temperature=0)
    answer = client.generate(model="demo", system=MESSAGES[0]["content"],
                             prompt=MESSAGES[1]["content"], options=GREEDY)
    assert answer.response == want["choices"][0]["message"]["content"]
    assert answer.done_reason == "length" and answer.eval_count == 12


def test_raw_and_fill_in_the_middle_are_completions(client: ollama.Client,
                                                    http: httpx.Client) -> None:
    prompt, suffix = "def area(r):\n    return", "\n\nprint(area(2))\n"
    for extra, ollama_extra in (({}, {"raw": True}), ({"suffix": suffix}, {"suffix": suffix})):
        want = http.post("/v1/completions", json={
            "model": "demo", "prompt": prompt, "max_tokens": 10, "temperature": 0,
            **extra}).json()["choices"][0]["text"]
        answer = client.generate(model="demo", prompt=prompt, options={
            "temperature": 0, "num_predict": 10}, **ollama_extra)
        assert answer.response == want
        streamed = "".join(p.response or "" for p in client.generate(
            model="demo", prompt=prompt, stream=True,
            options={"temperature": 0, "num_predict": 10}, **ollama_extra))
        assert streamed == want


def test_raw_takes_the_empty_fields_a_client_always_sends(http: httpx.Client) -> None:
    """Ollama refuses a raw prompt with a ``system``, ``template`` or ``context`` only
    where one is given (its check is ``!= ""``): a client that fills every field of the
    body, empty ones included, gets the raw completion. An empty ``system`` was a 400."""
    prompt = "def area(r):\n    return"
    want = http.post("/v1/completions", json={
        "model": "demo", "prompt": prompt, "max_tokens": 6,
        "temperature": 0}).json()["choices"][0]["text"]
    response = http.post("/api/generate", json={
        "model": "demo", "prompt": prompt, "raw": True, "stream": False, "system": "",
        "template": "", "context": [], "images": [], "format": "",
        "options": {"temperature": 0, "num_predict": 6}})
    assert response.status_code == 200, response.text
    assert response.json()["response"] == want
    refused = http.post("/api/generate", json={
        "model": "demo", "prompt": prompt, "raw": True, "system": "Be terse."})
    assert refused.status_code == 400 and "system" in refused.json()["error"]


def test_without_num_predict_the_context_bounds_the_answer(http: httpx.Client) -> None:
    body = {"model": "demo", "prompt": "Hello", "stream": False,
            "options": {"temperature": 0, "num_ctx": 40}}
    answer = http.post("/api/generate", json=body).json()
    assert answer["done_reason"] in ("length", "stop")
    assert answer["prompt_eval_count"] + answer["eval_count"] <= 40
    if answer["done_reason"] == "length":
        assert answer["prompt_eval_count"] + answer["eval_count"] == 40
    # A window larger than the model's is the model's.
    big = http.post("/api/generate", json={**body, "options": {
        "temperature": 0, "num_ctx": 10**7, "num_predict": 3}}).json()
    assert big["eval_count"] == 3


@pytest.mark.parametrize(("route", "body"), [
    ("/api/chat", {"messages": [{"role": "user", "content": "word " * 300}]}),
    ("/api/chat", {"messages": [{"role": "user", "content": "word " * 300}],
                   "truncate": False, "stream": True}),
    ("/api/generate", {"prompt": "word " * 300}),
    ("/api/generate", {"prompt": "word " * 300, "raw": True}),
], ids=["chat", "chat-untruncated", "generate", "raw"])
def test_a_prompt_too_long_for_num_ctx_names_it(http: httpx.Client, route: str,
                                                body: dict[str, Any]) -> None:
    """A prompt that does not fit the window ``options.num_ctx`` sets is a 400 that says
    so, as Ollama's MLX engine refuses it (its llama.cpp engine cuts the middle out of the
    prompt instead): the error said "This model's maximum context length is 20 tokens",
    blaming the model for the client's own setting."""
    got = http.post(route, json={"model": "demo", "options": {"num_ctx": 20}, **body})
    assert got.status_code == 400, got.text
    message = got.json()["error"]
    assert message.startswith("options.num_ctx: "), message
    assert "(20 tokens)" in message
    assert http.post(route, json={"model": "demo", "stream": False,
                                  "options": {"num_ctx": 2000, "num_predict": 2},
                                  **body}).status_code == 200


# -- options -------------------------------------------------------------------------------


def test_options_reach_the_sampler(client: ollama.Client, http: httpx.Client) -> None:
    options = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 11, "num_predict": 10,
               "presence_penalty": 0.5, "frequency_penalty": 0.3, "repeat_penalty": 1.2,
               "min_p": 0.01}
    want = openai_chat(http, messages=MESSAGES, max_tokens=10, temperature=0.9, top_p=0.95,
                       top_k=50, seed=11, presence_penalty=0.5, frequency_penalty=0.3,
                       repetition_penalty=1.2, min_p=0.01)
    answer = client.chat(model="demo", messages=MESSAGES, options=options)
    assert answer.message.content == want["choices"][0]["message"]["content"]
    assert client.chat(model="demo", messages=MESSAGES,
                       options=options).message.content == answer.message.content
    other = client.chat(model="demo", messages=MESSAGES, options={**options, "seed": 12})
    assert other.message.content != answer.message.content


def test_seed_minus_one_is_a_fresh_seed(client: ollama.Client) -> None:
    """-1 is Ollama's default seed and means "random" (llama.cpp's and Ollama's samplers
    read it so): afmd sampled with the fixed seed -1, the same answer every time. Any
    other seed, negative too, reproduces its answer."""
    def answer(seed: int) -> str:
        return client.chat(model="demo", messages=MESSAGES, think=False, options={
            "seed": seed, "temperature": 1.0, "num_predict": 16}).message.content or ""

    assert len({answer(-1) for _ in range(4)}) > 1
    assert answer(-5) == answer(-5)
    assert answer(7) == answer(7)


def test_a_temperature_above_two_samples_as_in_ollama(http: httpx.Client) -> None:
    """Ollama takes any temperature, and SillyTavern's text completion (a raw
    ``/api/generate`` with its sampler's options) offers up to 5: afmd refused anything
    above OpenAI's 2 with a 400 naming ``options.temperature``."""
    def answer(temperature: float) -> str:
        response = http.post("/api/generate", json={
            "model": "demo", "prompt": "Once upon a time", "raw": True, "stream": False,
            "options": {"temperature": temperature, "seed": 11, "num_predict": 16,
                        "top_k": 0, "top_p": 1, "typical_p": 1, "tfs_z": 1, "min_p": 0,
                        "repeat_penalty": 1.1, "repeat_last_n": 64}})
        assert response.status_code == 200, response.text
        return str(response.json()["response"])

    hot = answer(4.5)
    assert hot == answer(4.5) and hot != answer(0)  # sampled at that temperature, seeded
    negative = http.post("/api/generate", json={"model": "demo", "prompt": "x",
                                                "options": {"temperature": -1}})
    assert negative.status_code == 400 and "options.temperature" in negative.json()["error"]


def test_a_role_is_read_in_any_case(client: ollama.Client) -> None:
    """Ollama lowercases a role as it reads it: afmd answered 400 "Invalid role 'User'"."""
    upper = [{"role": "System", "content": MESSAGES[0]["content"]},
             {"role": "USER", "content": MESSAGES[1]["content"]}]
    want = client.chat(model="demo", messages=MESSAGES, options=GREEDY).message.content
    assert client.chat(model="demo", messages=upper, options=GREEDY).message.content == want


def test_a_window_longer_than_any_sequence_is_all_of_it(client: ollama.Client) -> None:
    """mlx slices the tokens by ``repeat_last_n``, and a slice past 32 bits failed the
    batch's step: this request and every other one generating beside it were 500s."""
    options = {**GREEDY, "num_predict": 12, "repeat_penalty": 1.3}
    whole = client.chat(model="demo", messages=MESSAGES, options={**options,
                                                                  "repeat_last_n": -1})
    beside: list[ollama.ChatResponse] = []
    neighbour = threading.Thread(target=lambda: beside.append(client.chat(
        model="demo", messages=MESSAGES, options={**GREEDY, "num_predict": 200})))
    neighbour.start()
    for window in (2**31 + 1, 10**11, 2**63 - 1):
        huge = client.chat(model="demo", messages=MESSAGES,
                           options={**options, "repeat_last_n": window})
        assert huge.message.content == whole.message.content, window
    neighbour.join(60)
    assert beside and beside[0].done_reason in ("stop", "length")


def test_stop_and_no_op_options(http: httpx.Client) -> None:
    plain = http.post("/api/chat", json={"model": "demo", "messages": MESSAGES,
                                         "stream": False, "options": GREEDY}).json()
    text = plain["message"]["content"]
    cut = text[3:6]
    assert cut and text.index(cut) == 3
    stopped = http.post("/api/chat", json={
        "model": "demo", "messages": MESSAGES, "stream": False,
        "options": {**GREEDY, "stop": [*(f"\x00{i}" for i in range(63)), cut],
                    "num_gpu": 99, "num_thread": 8, "mirostat": 2, "numa": False,
                    "use_mmap": True, "typical_p": 0.7}})
    assert stopped.status_code == 200, stopped.text
    assert stopped.json()["message"]["content"] == text[:3]
    assert stopped.json()["done_reason"] == "stop"
    # Ollama sets no limit; an editor's autocomplete adds its language's stop words to its
    # template's, so afmd takes 64, and names the list past that.
    many = http.post("/api/chat", json={
        "model": "demo", "messages": MESSAGES, "stream": False,
        "options": {**GREEDY, "stop": [f"s{i}" for i in range(65)]}})
    assert many.status_code == 400 and "options.stop" in many.json()["error"]
    assert "X-AFM-Ignored-Fields" not in stopped.headers  # Ollama's own options: accepted
    odd = http.post("/api/chat", json={"model": "demo", "messages": MESSAGES, "stream": False,
                                       "options": {**GREEDY, "warp_speed": 9}})
    assert odd.headers["X-AFM-Ignored-Fields"] == "options.warp_speed"


# -- embeddings ----------------------------------------------------------------------------


def test_embeddings_equal_v1_embeddings(client: ollama.Client, http: httpx.Client) -> None:
    texts = ["Why is the sky blue?", "Why is the grass green?"]
    want = http.post("/v1/embeddings", json={"model": "demo-embedding", "input": texts}).json()
    got = client.embed(model="demo-embedding", input=texts)
    assert got.model == "demo-embedding"
    for row, item in zip(got.embeddings, want["data"], strict=True):
        np.testing.assert_allclose(row, item["embedding"], rtol=0, atol=1e-6)
    assert got.prompt_eval_count == want["usage"]["prompt_tokens"]
    legacy = client.embeddings(model="demo-embedding:latest", prompt=texts[0])
    np.testing.assert_allclose(legacy.embedding, want["data"][0]["embedding"], atol=1e-6)
    long_text = "sky " * 2000  # past the model's context: cut, as Ollama's truncate says
    assert len(client.embed(model="demo-embedding", input=long_text).embeddings) == 1
    with pytest.raises(ollama.ResponseError) as caught:
        client.embed(model="demo-embedding", input=long_text, truncate=False)
    assert caught.value.status_code == 400
    # Options other than num_ctx change nothing here, but must be an object, as Ollama's
    # decoder says.
    assert len(client.embed(model="demo-embedding", input="x",
                            options={"num_ctx": 64}).embeddings) == 1
    for path, text in (("/api/embed", "input"), ("/api/embeddings", "prompt")):
        wrong = http.post(path, json={"model": "demo-embedding", text: "x", "options": "bad"})
        assert wrong.status_code == 400 and "options" in wrong.json()["error"], wrong.text


def test_a_truncated_input_keeps_the_token_its_pooling_reads(client: ollama.Client,
                                                              http: httpx.Client) -> None:
    """``truncate`` cuts an input to the context and still ends it in the
    ``<|endoftext|>`` the tokenizer appends, which last-token pooling reads, as Ollama's
    cut does (it cuts the text and encodes it again). The cut took that token off, and the
    vector was pooled at whatever token the cut fell on."""
    from tokenizers import Tokenizer

    folder = demo.materialize(demo.EMBEDDING_VARIANT)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    window = 512  # demo-embedding's context
    text = " ".join(f"w{i}" for i in range(400))
    ids = tokenizer.encode(text).ids
    assert len(ids) > window and ids[-1] == tokenizer.token_to_id("<|endoftext|>")
    want = http.post("/v1/embeddings", json={
        "model": "demo-embedding", "input": ids[: window - 1] + ids[-1:]}).json()
    got = client.embed(model="demo-embedding", input=text)
    np.testing.assert_allclose(got.embeddings[0], want["data"][0]["embedding"], rtol=0,
                               atol=1e-5)
    assert got.prompt_eval_count == window


def test_num_ctx_is_the_window_an_embedding_input_fits(client: ollama.Client,
                                                       http: httpx.Client) -> None:
    """``options.num_ctx`` (LangChain's ``OllamaEmbeddings(num_ctx=...)`` sends it) is the
    window Ollama loads the model with: an input past it is cut to it, or without
    ``truncate`` refused naming it. It was ignored: the whole input was embedded."""
    from tokenizers import Tokenizer

    folder = demo.materialize(demo.EMBEDDING_VARIANT)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = " ".join(f"w{i}" for i in range(40))
    ids = tokenizer.encode(text).ids
    window = 16
    assert len(ids) > window
    want = http.post("/v1/embeddings", json={
        "model": "demo-embedding", "input": ids[: window - 1] + ids[-1:]}).json()
    got = client.embed(model="demo-embedding", input=text, options={"num_ctx": window})
    np.testing.assert_allclose(got.embeddings[0], want["data"][0]["embedding"], rtol=0,
                               atol=1e-5)
    assert got.prompt_eval_count == window
    for path, body in (("/api/embed", {"input": text, "truncate": False}),
                       ("/api/embeddings", {"prompt": text})):
        refused = http.post(path, json={"model": "demo-embedding", **body,
                                        "options": {"num_ctx": window}})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"].startswith("options.num_ctx: the input length"), \
            refused.text
    wrong = http.post("/api/embed", json={"model": "demo-embedding", "input": "x",
                                          "options": {"num_ctx": "big"}})
    assert wrong.status_code == 400 and "options.num_ctx" in wrong.json()["error"], wrong.text


def test_an_embed_without_input_loads_with_its_keep_alive(client: ollama.Client,
                                                          http: httpx.Client) -> None:
    """Ollama's load form for embeddings: no texts (none, ``""``, ``[]``, an empty legacy
    prompt) loads the model with the request's keep_alive and answers no vectors;
    ``keep_alive: 0`` unloads it. The keep_alive was ignored (the model stayed five
    minutes), and ``input: ""`` or none was a 400."""
    def expires_in() -> float | None:
        running = {m.model: m for m in client.ps().models}
        entry = running.get("demo-embedding:latest")
        if entry is None:
            return None
        assert entry.expires_at is not None
        return entry.expires_at.timestamp() - time.time()

    def gone() -> None:
        deadline = time.monotonic() + 20
        while expires_in() is not None:
            assert time.monotonic() < deadline, "demo-embedding stayed loaded"
            time.sleep(0.1)

    for path, body in (("/api/embed", {"input": []}), ("/api/embed", {"input": ""}),
                       ("/api/embed", {}), ("/api/embeddings", {"prompt": ""}),
                       ("/api/embeddings", {})):
        loaded = http.post(path, json={"model": "demo-embedding", "keep_alive": "10s", **body})
        assert loaded.status_code == 200, (path, body, loaded.text)
        vectors = loaded.json()["embeddings" if path == "/api/embed" else "embedding"]
        assert vectors == [], (path, body)
        left = expires_in()
        assert left is not None and 5 < left <= 10.5, (path, body, left)
        unloaded = http.post(path, json={"model": "demo-embedding", "keep_alive": 0, **body})
        assert unloaded.status_code == 200, (path, body, unloaded.text)
        gone()
        # Not loaded: keep_alive 0 loads nothing only to unload it.
        assert http.post(path, json={"model": "demo-embedding", "keep_alive": 0,
                                     **body}).status_code == 200
        assert expires_in() is None
    empty = http.post("/api/embed", json={"model": "demo-embedding", "input": ["x", ""]})
    assert empty.status_code == 400  # one empty text among others is no load form


# -- loading, unloading, ps ----------------------------------------------------------------


def test_empty_prompts_load_and_unload(client: ollama.Client) -> None:
    loaded = client.generate(model="demo-32k", keep_alive="10m")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    running = {m.model: m for m in client.ps().models}
    assert "demo-32k:latest" in running
    entry = running["demo-32k:latest"]
    assert entry.context_length == 131072 and (entry.size or 0) > 0
    assert entry.expires_at is not None
    unloaded = client.chat(model="demo-32k", messages=[], keep_alive=0)
    assert unloaded.done_reason == "unload" and unloaded.message.content == ""
    deadline = time.monotonic() + 20
    while "demo-32k:latest" in {m.model for m in client.ps().models}:
        assert time.monotonic() < deadline, "demo-32k was never unloaded"
        time.sleep(0.1)
    again = client.chat(model="demo-32k", messages=[], keep_alive=0)  # not loaded: nothing
    assert again.done_reason == "unload"
    # A turn's own keep_alive 0: the model goes once the answer is over.
    answer = client.chat(model="demo-32k", messages=MESSAGES, options=GREEDY, keep_alive=0)
    assert answer.eval_count == 12
    deadline = time.monotonic() + 20
    while "demo-32k:latest" in {m.model for m in client.ps().models}:
        assert time.monotonic() < deadline, "demo-32k stayed loaded after keep_alive 0"
        time.sleep(0.1)


def test_an_unload_during_a_stream_unloads_when_it_ends(client: ollama.Client,
                                                       server: ServerProcess) -> None:
    """``ollama stop`` while a model answers: Ollama unloads it once the answer is over,
    since the latest request's keep_alive sets how long it stays. afmd said "unload" and
    then kept it for the running stream's five minutes, that request being the last out."""
    rid = "ollama-" + uuid.uuid4().hex
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", server.url + "/api/chat", timeout=60,
                          headers={"X-Request-ID": rid},
                          json={"model": "demo-32k", "messages": MESSAGES,
                                "options": {"num_predict": 4000}}) as response:
            for _ in response.iter_lines():
                started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        assert started.wait(30)
        unloaded = client.generate(model="demo-32k", keep_alive=0)
        assert unloaded.done_reason == "unload"
        assert "demo-32k:latest" in {m.model for m in client.ps().models}  # still answering
    finally:
        httpx.post(f"{server.url}/v1/chat/completions/{rid}/cancel")
        thread.join(30)
    deadline = time.monotonic() + 10
    while "demo-32k:latest" in {m.model for m in client.ps().models}:
        assert time.monotonic() < deadline, "demo-32k stayed loaded after its unload"
        time.sleep(0.1)


def test_a_load_is_for_a_chat_model_and_an_unload_for_any(http: httpx.Client) -> None:
    """Ollama refuses to load an embedding model for generate or chat; ``ollama stop``
    sends the unload form for every model."""
    for route, empty in (("generate", {}), ("chat", {"messages": []})):
        refused = http.post(f"/api/{route}", json={"model": "demo-embedding", **empty})
        assert refused.status_code == 400, refused.text
        assert refused.json() == {"error": f'"demo-embedding" does not support {route}'}
    http.post("/api/embed", json={"model": "demo-embedding", "input": "x"})
    stopped = http.post("/api/generate", json={"model": "demo-embedding", "keep_alive": 0})
    assert stopped.status_code == 200 and stopped.json()["done_reason"] == "unload"
    deadline = time.monotonic() + 20
    while "demo-embedding:latest" in {m["model"] for m in http.get("/api/ps").json()["models"]}:
        assert time.monotonic() < deadline, "demo-embedding stayed loaded"
        time.sleep(0.1)


def test_a_model_of_another_kind_is_refused_in_ollamas_words(client: ollama.Client) -> None:
    """Ollama names what was asked: ``"m" does not support chat`` (or ``generate``) for
    an embedding model, and its runner's 501 ``this model does not support embeddings``
    for a chat model, whose status clients read. afmd's own sentence (and 400) was
    another server's."""
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="demo-embedding", messages=MESSAGES)
    assert (caught.value.status_code, caught.value.error) == (
        400, '"demo-embedding" does not support chat')
    with pytest.raises(ollama.ResponseError) as caught:
        client.generate(model="demo-embedding", prompt="hi", stream=True).__next__()
    assert (caught.value.status_code, caught.value.error) == (
        400, '"demo-embedding" does not support generate')
    for call in (lambda: client.embed(model="demo", input="hi"),
                 lambda: client.embeddings(model="demo", prompt="hi")):
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert (caught.value.status_code, caught.value.error) == (
            501, "this model does not support embeddings")


@pytest.mark.parametrize("keep_alive", [-1, "-1m", "99999999999h", 1e20],
                         ids=["minus-one", "negative-duration", "huge-duration", "huge-number"])
def test_kept_for_good_shows_a_far_expiry(client: ollama.Client, http: httpx.Client,
                                          keep_alive: float | str) -> None:
    """Ollama shows a model kept loaded for good as expiring years ahead. A finite keep-alive
    too long for a date made ``/api/ps`` a 500, and ``-1`` showed the configured five
    minutes."""
    loaded = client.generate(model="demo-32k", keep_alive=keep_alive)
    assert loaded.done_reason == "load"
    try:
        running = {m.model: m for m in client.ps().models}
        expires = running["demo-32k:latest"].expires_at
        assert expires is not None
        assert expires.timestamp() > time.time() + 9 * 365 * 86400
        detail = http.get("/health").json()["model_details"]["demo-32k"]
        assert detail["state"] == "loaded" and detail["expires_at"] is None
    finally:
        client.chat(model="demo-32k", messages=[], keep_alive=0)


# -- errors, screening, cancel -------------------------------------------------------------


def test_errors_are_ollamas(client: ollama.Client, http: httpx.Client) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="nope", messages=MESSAGES)
    assert (caught.value.status_code, caught.value.error) == (404, "model 'nope' not found")
    bad = http.post("/api/chat", json={"model": "demo", "messages": "hi"})
    assert bad.status_code == 400 and set(bad.json()) == {"error"}
    assert "messages" in bad.json()["error"]
    options = http.post("/api/generate", json={"model": "demo", "prompt": "x",
                                               "options": {"temperature": "hot"}})
    assert options.status_code == 400 and "options.temperature" in options.json()["error"]
    builtin = http.request("DELETE", "/api/delete", json={"model": "demo"})
    assert builtin.status_code == 400 and "not a download" in builtin.json()["error"]
    refused = http.post("/api/chat", json={"model": "demo", "messages": MESSAGES},
                        headers={"Host": "evil.example"})
    assert refused.status_code == 421 and set(refused.json()) == {"error"}


NOT_A_SCHEMA = {"type": "object", "properties": {"a": {"type": "nope"}}}
PLAIN_TOOL = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("route", "body", "field"), [
    ("/api/chat", {"messages": MESSAGES, "format": NOT_A_SCHEMA}, "format"),
    ("/api/generate", {"prompt": "x", "format": {"enum": [-2**63 - 1]}}, "format.enum[0]"),
    ("/api/chat", {"messages": MESSAGES, "tools": [PLAIN_TOOL, {
        "type": "function", "function": {"name": "f", "parameters": NOT_A_SCHEMA}}]},
     "tools[1].function.parameters"),
], ids=["format", "generate-format-value", "second-tool"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_schema_error_names_its_field(http: httpx.Client, route: str, body: dict[str, Any],
                                        field: str, stream: bool) -> None:
    """Ollama's error is one message, so the message names the field, as Anthropic's
    does: a schema the grammar refused said only "Invalid JSON schema", not whether it
    was ``format`` or which of the tools."""
    response = http.post(route, json={"model": "demo", "stream": stream, **body})
    assert response.status_code == 400, response.text
    assert set(response.json()) == {"error"}
    assert response.json()["error"].startswith(f"{field}: "), response.text


def test_a_tool_result_answering_no_call_is_history_as_in_ollama(http: httpx.Client
                                                                   ) -> None:
    """A tool message that answers no call is rendered where it stands, as Ollama renders
    it: after an assistant's text whose calls the client did not send back (Continue's
    Ollama provider kept only the text), a result the client sent twice, or one naming a
    tool not called. afmd refused each with a 400, so these apps' tool loops broke on
    their second turn."""
    user = {"role": "user", "content": "Weather in Paris?"}
    said = {"role": "assistant", "content": "Let me look that up."}
    called = {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    result = {"role": "tool", "content": "18 C"}

    def prompt_tokens(messages: list[dict[str, Any]]) -> int:
        response = http.post("/api/chat", json={"model": "demo", "messages": messages,
                                                "stream": False, "options": GREEDY})
        assert response.status_code == 200, response.text
        return int(response.json()["prompt_eval_count"])

    assert prompt_tokens([user, said, result]) > prompt_tokens([user, said])
    assert prompt_tokens([user, result]) > prompt_tokens([user])
    once = prompt_tokens([user, called, result])
    assert prompt_tokens([user, called, result, result]) > once
    assert prompt_tokens([user, called, {**result, "tool_name": "get_time"}]) >= once


@pytest.mark.parametrize(("route", "field", "value"), [
    ("/api/chat", "messages", {}), ("/api/chat", "messages", 0),
    ("/api/chat", "messages", ""), ("/api/chat", "messages", False),
    ("/api/generate", "prompt", 0), ("/api/generate", "prompt", []),
    ("/api/generate", "prompt", {}), ("/api/generate", "suffix", 0),
])
def test_a_wrong_type_is_no_load_request(http: httpx.Client, route: str, field: str,
                                         value: Any) -> None:
    """Only a missing, null or empty ``messages`` (``prompt``) loads the model; Ollama
    refuses any other type. Anything falsy was taken for a load and answered 200."""
    response = http.post(route, json={"model": "demo", field: value})
    assert response.status_code == 400, response.text
    assert set(response.json()) == {"error"} and field in response.json()["error"]


def test_a_body_is_json_whatever_its_type_says_as_curl_sends_it(
        server: ServerProcess) -> None:
    """Ollama's docs (and ours) send ``curl -d '{…}'``: form-encoded by curl's default,
    or with no type at all from other tools. Ollama reads the body as JSON; so does afmd
    on its routes, for a client that is not a browser."""
    body = json.dumps({"model": "demo", "messages": MESSAGES, "stream": False,
                       "options": GREEDY}).encode()
    want = None
    for kind in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {} if kind is None else {"Content-Type": kind}
        got = httpx.post(server.url + "/api/chat", content=body, headers=headers,
                         timeout=60)
        assert got.status_code == 200, (kind, got.text)
        want = want or got.json()["message"]["content"]
        assert got.json()["message"]["content"] == want
    embed = httpx.post(server.url + "/api/embed", timeout=60, content=json.dumps(
        {"model": "demo-embedding", "input": "hi"}).encode(),
        headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert embed.status_code == 200 and len(embed.json()["embeddings"]) == 1
    # A browser's request (it names its origin, here the server's own) still needs JSON's
    # type: one it may send across origins without a preflight is refused.
    page = httpx.post(server.url + "/api/chat", content=body, timeout=60,
                      headers={"Content-Type": "text/plain", "Origin": server.url})
    assert page.status_code == 415 and set(page.json()) == {"error"}
    # The other APIs keep OpenAI's rule.
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, content=body,
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert chat.status_code == 415
    assert chat.json()["error"]["code"] == "unsupported_media_type"


#: What the official JavaScript SDKs send from a page besides ``Content-Type`` (the
#: ``ollama`` package's ``User-Agent`` where the browser lets it, OpenAI's and Anthropic's
#: ``x-stainless-*`` telemetry, Anthropic's opt-in to calls from a browser).
SDK_HEADERS = {
    "/api/chat": {"Accept": "application/json", "User-Agent": "ollama-js/0.6.4 (x64 linux)"},
    "/v1/chat/completions": {
        "Authorization": "Bearer unused", "x-stainless-lang": "js",
        "x-stainless-package-version": "7.60.0", "x-stainless-os": "Linux",
        "x-stainless-arch": "x64", "x-stainless-runtime": "browser:chrome",
        "x-stainless-runtime-version": "120", "x-stainless-retry-count": "0",
        "x-stainless-timeout": "600"},
    "/v1/messages": {
        "x-api-key": "unused", "anthropic-version": "2023-06-01",
        "anthropic-dangerous-direct-browser-access": "true", "x-stainless-lang": "js",
        "x-stainless-os": "Linux", "x-stainless-helper-method": "stream"},
}


class _AppPage(http.server.BaseHTTPRequestHandler):
    """An app's own page, at its own origin on this machine (Chromium refuses a page it
    takes for a public one access to a loopback address)."""

    def do_GET(self) -> None:
        body = b"<!doctype html><title>app</title>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


def test_a_page_may_send_what_the_official_sdks_send(tmp_path: Path) -> None:
    """A page of an allowed origin (an Electron app, a VS Code webview) calling through
    the official JavaScript SDKs sends their headers, so its preflight names them: Ollama
    allows them all (its OpenAI routes' ``x-stainless-*`` too). afmd's preflight left them
    out, and Chromium failed every such request before it was sent ("Failed to fetch")."""
    from helpers.browser import launched

    app = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AppPage)
    threading.Thread(target=app.serve_forever, daemon=True).start()
    origin = f"http://127.0.0.1:{app.server_address[1]}"
    server = start_server(tmp_path, config=f'[server]\nallowed_origins = ["{origin}"]\n')
    bodies = {
        "/api/chat": {"model": "demo", "messages": MESSAGES, "stream": False,
                      "options": GREEDY},
        "/v1/chat/completions": {"model": "demo", "messages": MESSAGES, "max_tokens": 2},
        "/v1/messages": {"model": "demo", "max_tokens": 2,
                         "messages": [{"role": "user", "content": "Hi"}]},
    }
    try:
        with launched() as browser:
            context = browser.new_context()
            page = context.new_page()
            page.goto(origin + "/")
            for path, headers in SDK_HEADERS.items():
                got = page.evaluate(
                    """async ([url, headers, body]) => {
                        try {
                            const r = await fetch(url, {method: "POST", body,
                                headers: {"Content-Type": "application/json", ...headers}});
                            return [r.status, await r.text()];
                        } catch (e) { return [0, String(e)]; }
                    }""",
                    [server.url + path, headers, json.dumps(bodies[path])])
                assert got[0] == 200, (path, got)
            context.close()
    finally:
        server.stop()
        app.shutdown()
        app.server_close()


def test_endpoints_afmd_does_not_serve_say_why_in_ollamas_envelope(
        client: ollama.Client, http: httpx.Client, tmp_path: Path) -> None:
    """Ollama's Modelfile and registry routes were an unknown URL in OpenAI's envelope
    ("check the URL for typos"): a client read a dict for its error string."""
    said = {}
    for name, call in [("create", lambda: client.create(model="mine", from_="demo")),
                       ("copy", lambda: client.copy("demo", "demo-copy")),
                       ("push", lambda: client.push("demo"))]:
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert caught.value.status_code == 404, name
        said[name] = caught.value.error
    assert said["create"].startswith("POST /api/create: afmd does not create models from "
                                     "Modelfiles")
    assert "[models.aliases]" in said["copy"] and "registry" in said["push"]
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"weights")
    with pytest.raises(ollama.ResponseError) as caught:
        client.create_blob(blob)
    assert caught.value.status_code == 404 and "keeps no Ollama blobs" in caught.value.error
    assert "demo-copy:latest" not in [m.model for m in client.list().models]
    # Any other path under /api is refused as its neighbours' errors read.
    unknown = http.post("/api/nonexistent", json={})
    assert unknown.status_code == 404 and set(unknown.json()) == {"error"}
    assert unknown.json()["error"].startswith("Unknown request URL: POST /api/nonexistent")
    assert http.get("/api/copy").status_code == 405
    assert set(http.get("/api/copy").json()) == {"error"}


def test_cancel_by_request_id_ends_the_stream(server: ServerProcess) -> None:
    rid = "ollama-" + uuid.uuid4().hex
    lines: list[dict[str, Any]] = []

    def stream() -> None:
        with httpx.stream("POST", server.url + "/api/chat", timeout=60,
                          headers={"X-Request-ID": rid},
                          json={"model": "demo", "messages": MESSAGES,
                                "options": {"num_predict": 4000}}) as response:
            lines.extend(json.loads(line) for line in response.iter_lines() if line)

    thread = threading.Thread(target=stream)
    thread.start()
    deadline = time.monotonic() + 30
    while True:
        cancelled = httpx.post(f"{server.url}/v1/chat/completions/{rid}/cancel")
        if cancelled.status_code == 200:
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    thread.join(30)
    assert lines[-1]["done"] is True and lines[-1]["done_reason"] == "cancelled"
    assert lines[-1]["eval_count"] < 4000


# -- pull and delete, against a stand-in hub ------------------------------------------------


REPO = "tiny-org/tiny-chat"


@pytest.fixture(scope="module")
def hub_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess,
                                                                           FakeHub]]:
    tmp = tmp_path_factory.mktemp("ollama-hub")
    with FakeHub() as hub:
        hub.add_folder(REPO, demo.materialize("demo"))
        # Telemetry as a user has it: not switched off (afmd switches it off itself).
        server = start_server(tmp, env={"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp / "hf")})
        yield server, hub
        server.stop()


def test_pull_reports_progress_then_the_model_serves(
        hub_server: tuple[ServerProcess, FakeHub]) -> None:
    server, hub = hub_server
    client = ollama.Client(host=server.url, timeout=120)
    progress = list(client.pull(REPO + ":latest", stream=True))
    statuses = [p.status for p in progress]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    files = [p for p in progress if (p.status or "").startswith("pulling ") and p.digest]
    assert files and all(p.total and p.completed is not None for p in files)
    weights = [p for p in files if p.digest.startswith("sha256:")]
    assert weights and weights[-1].completed == weights[-1].total
    # The hub was asked for the listing and the files, nothing else: with its telemetry on,
    # the hub client first fetched a registry of coding agents, read to its end.
    assert hub.log and all(r.path.startswith((f"/api/models/{REPO}/", f"/{REPO}/resolve/"))
                           for r in hub.log), [r.path for r in hub.log]
    names = {m.model for m in client.list().models}
    assert REPO + ":latest" in names
    pulled = len(hub.log)
    answer = client.chat(model=REPO, messages=MESSAGES, options=GREEDY)
    assert answer.eval_count == 12
    # The load read the pulled snapshot and asked the hub nothing (mlx-lm, given the id,
    # asked whether the revision had moved, and would have fetched what changed).
    assert hub.log[pulled:] == []
    reference = client.chat(model="demo", messages=MESSAGES, options=GREEDY)
    assert answer.message.content == reference.message.content  # the same weights
    with pytest.raises(ollama.ResponseError) as caught:
        client.delete(REPO)  # still loaded
    assert caught.value.status_code == 409
    client.generate(model=REPO, keep_alive=0)
    deadline = time.monotonic() + 20
    while REPO + ":latest" in {m.model for m in client.ps().models}:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert client.delete(REPO + ":latest").status == "success"
    assert REPO + ":latest" not in {m.model for m in client.list().models}
    with pytest.raises(ollama.ResponseError) as gone:
        client.delete(REPO)
    assert gone.value.status_code == 404
    # Deleted is gone, as Ollama has it: a request naming it is a 404. The server had
    # remembered the name, and the load fetched the repo again, unverified, behind the
    # client's back.
    asked = len(hub.log)
    for call in (lambda: client.chat(model=REPO, messages=MESSAGES, options=GREEDY),
                 lambda: client.show(REPO)):
        with pytest.raises(ollama.ResponseError) as unknown:
            call()
        assert unknown.value.status_code == 404, unknown.value.error
    assert hub.log[asked:] == []


def test_a_hub_repo_by_ollamas_name_for_it(hub_server: tuple[ServerProcess, FakeHub]
                                           ) -> None:
    """``hf.co/OWNER/NAME`` is how Ollama names a Hugging Face repo (``ollama pull
    hf.co/…``): it pulls, shows and deletes that repo here too. afmd answered the pull
    "'hf.co/…' is not a Hugging Face repo id", and every other route a 404."""
    server, hub = hub_server
    client = ollama.Client(host=server.url, timeout=120)
    for name in (f"hf.co/{REPO}", f"HF.co/{REPO}:latest", f"huggingface.co/{REPO}"):
        assert client.pull(name).status == "success", name
        assert client.show(name).capabilities == client.show("demo").capabilities, name
    assert REPO + ":latest" in {m.model for m in client.list().models}
    assert not [r.path for r in hub.log if ".co/" in r.path]  # the repo's own paths only
    assert client.delete(f"hf.co/{REPO}:latest").status == "success"
    assert REPO + ":latest" not in {m.model for m in client.list().models}


def test_a_pull_of_a_model_the_server_serves_by_its_name(tmp_path: Path) -> None:
    """Scripts and apps make sure of a model with ``pull`` before they use it, as Ollama
    answers a pull of a model it has: a built-in, a local folder or an alias is there
    already (nothing to download: ``success``), and a configured id whose path is a
    Hugging Face repo pulls that repo. Each was a 400 "'demo' is not a Hugging Face repo
    id", which stopped the script before its first request."""
    with FakeHub() as hub:
        hub.add_folder(REPO, demo.materialize("demo"))
        config = (f'[[models.model]]\nid = "mine"\npath = "{REPO}"\n'
                  f'[[models.model]]\nid = "local"\npath = "{demo.materialize("demo")}"\n'
                  '[models.aliases]\nbuddy = "demo"\n')
        server = start_server(tmp_path, config=config, env={
            "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")})
        try:
            client = ollama.Client(host=server.url, timeout=120)
            for name in ("demo", "demo:latest", "local", "buddy:latest"):
                assert client.pull(name).status == "success"
                statuses = [p.status for p in client.pull(name, stream=True)]
                assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
            assert hub.log == []  # nothing to fetch
            progress = list(client.pull("mine:latest", stream=True))
            assert progress[-1].status == "success"
            assert any((p.digest or "").startswith("sha256:") for p in progress)
            assert hub.log and all(r.path.startswith((f"/api/models/{REPO}/",
                                                      f"/{REPO}/resolve/"))
                                   for r in hub.log)
            answer = client.chat(model="mine", messages=MESSAGES, options=GREEDY)
            assert answer.eval_count == 12
            with pytest.raises(ollama.ResponseError) as caught:
                client.pull("nope")  # neither served nor a repo id: as before
            assert caught.value.status_code == 400
        finally:
            server.stop()


def test_a_failed_pull_says_why(hub_server: tuple[ServerProcess, FakeHub]) -> None:
    server, _ = hub_server
    client = ollama.Client(host=server.url, timeout=60)
    with pytest.raises(ollama.ResponseError) as caught:
        list(client.pull("tiny-org/missing", stream=True))
    assert "not found" in caught.value.error
    with pytest.raises(ollama.ResponseError) as whole:
        client.pull("tiny-org/missing")
    assert whole.value.status_code == 500  # as Ollama answers a failed pull not streamed
    assert "not found" in whole.value.error


ENDLESS = "tiny-org/endless-listing"


def test_a_listing_without_end_fails_the_pull_and_the_server_stays_up(
        hub_server: tuple[ServerProcess, FakeHub]) -> None:
    """A pull runs in the server's process, and the hub client read a listing to its end:
    a hub (or a proxy, or HF_ENDPOINT) that answered with JSON without end grew the server
    until it was killed. The listing's read stops at its cap, the pull is refused as other
    hub failures are, and the server's memory never rose by much more than the cap."""
    server, hub = hub_server
    hub.add_folder(ENDLESS, demo.materialize("demo"))
    hub.listing_without_end(ENDLESS)
    answer, grown_mib = grown_mib_while(server.proc.pid, lambda: httpx.post(
        server.url + "/api/pull", json={"model": ENDLESS, "stream": False}, timeout=60))
    assert grown_mib < LISTING_CAP / (1 << 20) * 3, grown_mib
    assert answer.status_code == 500, answer.text  # Ollama's status for a failed pull
    error = answer.json()["error"]
    assert f"sent a listing of {ENDLESS}@main longer than {human_bytes(LISTING_CAP)}" in error
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert not [r for r in hub.log if f"/{ENDLESS}/resolve/" in r.path]


SLOW = "tiny-org/slow-chat"


def test_a_pull_stops_when_its_client_leaves(hub_server: tuple[ServerProcess, FakeHub]
                                             ) -> None:
    """Ollama cancels a pull with its request. afmd's download thread went on to the last
    file after the client had gone (nothing could stop it), and the access log showed a
    plain 200; the files verified before it stopped are kept for the next pull."""
    server, hub = hub_server
    hub.add_folder(SLOW, demo.materialize("demo"))
    hub.throttle(SLOW, "model.safetensors", 400_000)  # seconds of weights, config.json last
    with httpx.Client(base_url=server.url, timeout=60) as http, http.stream(
            "POST", "/api/pull", json={"model": SLOW}) as response:
        for line in response.iter_lines():
            item = json.loads(line)
            if item.get("digest", "").startswith("sha1:") and item["completed"] == item["total"]:
                break  # a tokenizer file is in: the weights are on their way
    line = server.wait_event("request", path="/api/pull", model=SLOW)
    assert line["status"] == 200 and line.get("disconnected") is True, line
    server.wait_event("pull stopped", model=SLOW)
    time.sleep(0.5)  # a pull going on would fetch config.json within moments

    def fetched(name: str) -> int:
        return sum(1 for g in hub.log if g.method == "GET"
                   and g.path.startswith(f"/{SLOW}/resolve/") and g.path.endswith("/" + name))

    assert fetched("config.json") == 0, "the pull went on after its client left"
    hub.rates.clear()
    client = ollama.Client(host=server.url, timeout=120)
    assert list(client.pull(SLOW, stream=True))[-1].status == "success"
    assert fetched("tokenizer.json") == 1  # kept from the first pull, not fetched again
    assert SLOW + ":latest" in {m.model for m in client.list().models}
    assert client.delete(SLOW).status == "success"


AGAIN = "tiny-org/pulled-again"


def test_a_model_being_pulled_is_not_deleted(hub_server: tuple[ServerProcess, FakeHub]
                                            ) -> None:
    """A downloaded repo pulled again (a new commit upstream) while a client deletes it:
    the delete is a 409 ``model_in_use`` until the pull is over. Before, it was a 200,
    the files the pull had verified went from under it, and the pull failed on a blob
    gone missing ("FileNotFoundError"), leaving nothing."""
    server, hub = hub_server
    folder = demo.materialize("demo")
    hub.add_folder(AGAIN, folder)
    client = ollama.Client(host=server.url, timeout=120)
    assert client.pull(AGAIN).status == "success"
    files = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*")
             if p.is_file()}
    files["tokenizer_config.json"] += b"\n"  # a later commit
    commit = hub.add_repo(AGAIN, files)
    # Two seconds of that file (the delete below comes within moments of its first bytes),
    # which the pull fetches to its end even once its client left.
    hub.throttle(AGAIN, "tokenizer_config.json", 3000)
    body = json.dumps({"model": AGAIN}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as pulling:
        pulling.sendall(b"POST /api/pull HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        b"Content-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 30
        while not hub.gets(f"/{commit}/tokenizer_config.json"):
            assert time.monotonic() < deadline, "the pull never reached the slow file"
            time.sleep(0.02)
        refused = httpx.request("DELETE", server.url + "/api/delete", json={"model": AGAIN},
                                timeout=60)
    assert refused.status_code == 409, refused.text
    assert "being pulled" in refused.json()["error"]
    # Its client gone, the pull stops after that file; then the delete goes ahead.
    server.wait_event("pull stopped", model=AGAIN)
    assert client.delete(AGAIN).status == "success"
    # The same for the dashboard's pull, which runs on its own until it is done.
    hub.rates.clear()
    assert client.pull(AGAIN).status == "success"
    files["tokenizer_config.json"] += b"\n"
    commit = hub.add_repo(AGAIN, files)
    hub.throttle(AGAIN, "tokenizer_config.json", 3000)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.post("/ui/api/pull", json={"model": AGAIN}).status_code == 202
        deadline = time.monotonic() + 30
        while not hub.gets(f"/{commit}/tokenizer_config.json"):
            assert time.monotonic() < deadline, "the pull never reached the slow file"
            time.sleep(0.02)
        refused = http.request("DELETE", "/api/delete", json={"model": AGAIN})
        assert refused.status_code == 409, refused.text
        while (pull := next(p for p in http.get("/ui/api/models").json()["pulls"]
                            if p["repo"] == AGAIN))["state"] == "pulling":
            assert time.monotonic() < deadline + 30, pull
            time.sleep(0.05)
        assert pull["state"] == "done", pull
        assert http.request("DELETE", "/api/delete", json={"model": AGAIN}).status_code == 200


TWICE = "tiny-org/deleted-twice"


def test_deletes_at_once_delete_once(hub_server: tuple[ServerProcess, FakeHub]) -> None:
    """Several ``/api/delete``s of one model at once (a client retrying, two clients): one
    deletes it, the others find it gone (404). The second ``rmtree`` found the folder
    half gone under it and the request was a 500."""
    server, hub = hub_server
    hub.add_folder(TWICE, demo.materialize("demo"))
    client = ollama.Client(host=server.url, timeout=120)
    for _ in range(3):
        assert client.pull(TWICE).status == "success"
        statuses: list[int] = []
        go = threading.Barrier(8)

        def delete(statuses: list[int] = statuses, go: threading.Barrier = go) -> None:
            go.wait(30)
            statuses.append(httpx.request("DELETE", server.url + "/api/delete", timeout=60,
                                          json={"model": TWICE}).status_code)

        threads = [threading.Thread(target=delete) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert sorted(statuses) == [200] + [404] * 7, statuses
        assert TWICE + ":latest" not in {m.model for m in client.list().models}


LOADING = "tiny-org/loading-chat"


def test_a_model_loading_is_not_deleted(tmp_path: Path) -> None:
    """``/api/delete`` refused a loaded model but not one loading (or waiting for room to
    load, as here: one model at a time, the other busy): its files went from under the
    load, which failed with mlx-lm's confusing "Repo id must be in the form …" or loaded
    a model whose files were gone. It is a 409 until the load is over."""
    with FakeHub() as hub:
        hub.add_folder(LOADING, demo.materialize("demo"))
        server = start_server(tmp_path, config=(
            "[models]\nmax_loaded = 1\n[[models.model]]\nid = \"pulled\"\n"
            f"path = \"{LOADING}\"\n"), env={
            "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"),
            "HF_HUB_DISABLE_TELEMETRY": "1"})
        try:
            client = ollama.Client(host=server.url, timeout=120)
            assert client.pull(LOADING).status == "success"
            rid = "busy-" + uuid.uuid4().hex
            busy = threading.Event()
            answers: dict[str, httpx.Response] = {}

            def hold_demo() -> None:
                with httpx.stream("POST", server.url + "/api/chat", timeout=60,
                                  headers={"X-Request-ID": rid},
                                  json={"model": "demo", "messages": MESSAGES,
                                        "options": {"num_predict": 4000}}) as response:
                    for _ in response.iter_lines():
                        busy.set()

            def ask_pulled() -> None:
                answers["chat"] = httpx.post(server.url + "/api/chat", timeout=60, json={
                    "model": "pulled", "messages": MESSAGES, "stream": False,
                    "options": GREEDY})

            holder = threading.Thread(target=hold_demo)
            holder.start()
            assert busy.wait(30)
            asker = threading.Thread(target=ask_pulled)
            asker.start()
            deadline = time.monotonic() + 30
            while httpx.get(server.url + "/health").json()["model_details"]["pulled"][
                    "state"] != "loading":
                assert time.monotonic() < deadline, "the load never started"
                time.sleep(0.05)
            refused = httpx.request("DELETE", server.url + "/api/delete",
                                    json={"model": "pulled"})
            assert refused.status_code == 409, refused.text
            assert "loading" in refused.json()["error"]
            httpx.post(f"{server.url}/v1/chat/completions/{rid}/cancel")
            holder.join(30)
            asker.join(60)
            assert answers["chat"].status_code == 200, answers["chat"].text
            assert answers["chat"].json()["eval_count"] == 12
            # Loaded as "pulled", its files are as much in use named by their repo id: the
            # delete went ahead (it looked for a model loaded under the repo's id), and a
            # request naming the repo loaded a second copy of the same files beside it.
            by_repo = httpx.request("DELETE", server.url + "/api/delete",
                                    json={"model": LOADING})
            assert by_repo.status_code == 409, by_repo.text
            same = httpx.post(server.url + "/api/chat", timeout=60, json={
                "model": LOADING, "messages": MESSAGES, "stream": False, "options": GREEDY})
            assert same.status_code == 200, same.text
            assert same.json()["message"] == answers["chat"].json()["message"]
            loaded = [m["name"] for m in httpx.get(server.url + "/api/ps").json()["models"]]
            assert loaded == ["pulled:latest"], loaded
        finally:
            server.stop()


# -- [ollama] port --------------------------------------------------------------------------


def test_ollama_port_serves_and_a_taken_one_is_refused(tmp_path: Path) -> None:
    port = free_ports()
    first = start_server(tmp_path, config=f"[ollama]\nport = {port}\n")
    try:
        client = ollama.Client(host=f"http://127.0.0.1:{port}", timeout=60)
        assert client.chat(model="demo", messages=MESSAGES,
                           options=GREEDY).eval_count == 12
        assert httpx.get(f"http://localhost:{port}/v1/models").status_code == 200
        refused = httpx.get(f"http://127.0.0.1:{port}/api/tags",
                            headers={"Host": "evil.example"})
        assert refused.status_code == 421
        config = tmp_path / "taken.toml"
        config.write_text(f"[server]\nport = 0\n[ollama]\nport = {port}\n")
        result = subprocess.run([sys.executable, "-m", "afmd", "serve", "--config",
                                 str(config)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 1, result.stderr
        assert f"127.0.0.1:{port}" in result.stderr and "[ollama] port" in result.stderr
        assert f"pid {first.proc.pid}" in result.stderr  # who holds it, as doctor says
        assert "ollama serve" not in result.stderr  # a holder named needs no guess
    finally:
        first.stop()


def test_the_queue_refuses_in_ollamas_envelope(tmp_path: Path) -> None:
    """A full queue is a 429 with ``Retry-After`` here too, its body ``{"error": ...}``."""
    server = start_server(tmp_path, config="[queue]\nmax_concurrent_requests = 1\n"
                                           "max_queued_requests = 0\n")
    rid = "busy-" + uuid.uuid4().hex
    first: list[dict[str, Any]] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", server.url + "/api/chat", timeout=60,
                          headers={"X-Request-ID": rid},
                          json={"model": "demo", "messages": MESSAGES,
                                "options": {"num_predict": 4000}}) as response:
            for line in response.iter_lines():
                if line:
                    first.append(json.loads(line))
                    started.set()

    thread = threading.Thread(target=stream)
    try:
        thread.start()
        assert started.wait(30)
        refused = httpx.post(server.url + "/api/generate", timeout=30,
                             json={"model": "demo", "prompt": "hi", "stream": False})
        assert refused.status_code == 429, refused.text
        assert set(refused.json()) == {"error"} and refused.headers["Retry-After"]
        assert httpx.post(f"{server.url}/v1/chat/completions/{rid}/cancel").status_code == 200
        thread.join(30)
        assert first[-1]["done_reason"] == "cancelled"
    finally:
        server.stop()
        thread.join(5)


def test_truncate_drops_the_oldest_turns_to_fit_num_ctx(http: httpx.Client) -> None:
    turns: list[dict[str, str]] = []
    for i in range(12):
        turns += [{"role": "user", "content": f"Question number {i} about colours?"},
                  {"role": "assistant", "content": f"Answer number {i}: blue and red."}]
    messages = [{"role": "system", "content": "Be brief."}, *turns,
                {"role": "user", "content": "And the last one?"}]
    body = {"model": "demo", "messages": messages, "stream": False,
            "options": {"temperature": 0, "num_ctx": 120, "num_predict": 8}}
    full = openai_chat(http, messages=messages, max_tokens=1)["usage"]["prompt_tokens"]
    assert full > 120
    trimmed = http.post("/api/chat", json=body)
    assert trimmed.status_code == 200, trimmed.text
    assert int(trimmed.headers["X-AFM-Trimmed-Messages"]) > 0
    answer = trimmed.json()
    assert answer["prompt_eval_count"] + answer["eval_count"] <= 120
    refused = http.post("/api/chat", json={**body, "truncate": False})
    assert refused.status_code == 400 and "context length" in refused.json()["error"]


def test_sigterm_ends_pulls_with_the_shutdown_error(tmp_path: Path) -> None:
    """Pulls clients still wait on when the grace period ends are ended as the turns are:
    a streamed one with an ``{"error": ...}`` line and its body's end, one not streamed
    with the 503 ``server_shutting_down``. Before, the shutdown cut both connections:
    the stream's body ended without its last chunk (httpx: "incomplete chunked read"),
    the other had no answer at all."""
    with FakeHub() as hub:
        for repo in (SLOW, SLOW + "-2"):
            hub.add_folder(repo, demo.materialize("demo"))
            hub.throttle(repo, "model.safetensors", 20_000)  # a minute of weights
        server = start_server(tmp_path, config="[server]\nshutdown_grace = 0.5\n",
                              env={"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")})
        lines: list[dict[str, Any]] = []
        plain: dict[str, Any] = {}
        weights = threading.Event()

        def streamed() -> None:
            try:
                with httpx.stream("POST", server.url + "/api/pull", json={"model": SLOW},
                                  timeout=60) as response:
                    for line in response.iter_lines():
                        lines.append(json.loads(line))
                        if lines[-1].get("digest", "").startswith("sha256:"):
                            weights.set()
            except BaseException as exc:  # recorded for the test to report
                lines.append({"raised": repr(exc)})
            finally:
                weights.set()

        def not_streamed() -> None:
            try:
                r = httpx.post(server.url + "/api/pull", timeout=60,
                               json={"model": SLOW + "-2", "stream": False})
                plain["status"], plain["body"] = r.status_code, r.json()
            except BaseException as exc:
                plain["raised"] = repr(exc)

        threads = [threading.Thread(target=streamed, daemon=True),
                   threading.Thread(target=not_streamed, daemon=True)]
        try:
            for thread in threads:
                thread.start()
            assert weights.wait(60), lines
            deadline = time.monotonic() + 30
            while not hub.gets(f"/{SLOW}-2/resolve/" + hub.repos[SLOW + "-2"].commit
                               + "/model.safetensors"):
                assert time.monotonic() < deadline, "the second pull never fetched weights"
                time.sleep(0.02)
            server.proc.send_signal(signal.SIGTERM)
            for thread in threads:
                thread.join(30)
            code = server.proc.wait(30)
        finally:
            server.stop()
    assert code == 0
    assert "raised" not in lines[-1], lines[-1]
    assert set(lines[-1]) == {"error"} and "stopping" in lines[-1]["error"], lines[-1]
    assert plain.get("status") == 503, plain
    assert "stopping" in plain["body"]["error"], plain
    access = [e for e in server.events if e.get("event") == "request"
              and e.get("path") == "/api/pull"]
    assert {e.get("stream_error") or e.get("error_code") for e in access} \
        == {"server_shutting_down"}, access


def test_namespaced_tool_names_pass_where_openais_rule_refuses_them(
        http: httpx.Client) -> None:
    """MCP servers name tools ``calendar.read`` or ``docs/search``, and Ollama's clients
    pass them on (Ollama takes any name); OpenAI's dialect keeps OpenAI's rule, and a
    name no call reader could read back is refused naming the field."""
    def tool(name: str) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {}}}}

    messages = [{"role": "user", "content": "hi"}]
    ollama_answer = http.post("/api/chat", json={
        "model": "demo", "stream": False, "messages": messages,
        "options": {"num_predict": 2}, "tools": [tool("calendar.read"), tool("docs/search")]})
    assert ollama_answer.status_code == 200, ollama_answer.text
    refused = http.post("/api/chat", json={"model": "demo", "stream": False,
                                           "messages": messages, "tools": [tool("bad name!")]})
    assert refused.status_code == 400
    assert refused.json()["error"].startswith("tools[0].function.name: Invalid tool name")
    openai_answer = http.post("/v1/chat/completions", json={
        "model": "demo", "max_tokens": 2, "messages": messages,
        "tools": [tool("calendar.read")]})
    assert openai_answer.status_code == 400
    assert openai_answer.json()["error"]["param"] == "tools[0].function.name"


def test_a_model_named_in_another_case_is_that_model(http: httpx.Client,
                                                     client: ollama.Client,
                                                     tmp_path: Path) -> None:
    """Ollama compares names case-insensitively, and its clients lowercase the names they
    are given; a name two models share but for case is neither of them."""
    answer = client.chat(model="DEMO:latest", messages=MESSAGES, options={"num_predict": 2})
    assert answer.message.role == "assistant"
    assert http.post("/v1/chat/completions", json={
        "model": "GPT-4o-Mini", "max_tokens": 1,
        "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    config = tmp_path / "afmd.toml"
    config.write_text('[[models.model]]\nid = "Ab"\npath = "afmd:demo"\n'
                      '[[models.model]]\nid = "aB"\npath = "afmd:demo"\n'
                      '[[models.model]]\nid = "Coder-X"\npath = "afmd:demo"\n')
    registry = ModelRegistry(load_config(config, env={}))
    try:
        assert registry.resolve("coder-x").id == "Coder-X"
        assert registry.resolve("aB").id == "aB"
        with pytest.raises(NotFoundError):
            registry.resolve("ab")
    finally:
        registry.close()
