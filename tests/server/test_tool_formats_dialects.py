"""The families' reasoning and calls through every dialect, over a real server.

gpt-oss's ``analysis`` channel and Mistral's ``[THINK]`` block are reasoning whatever
the wire: Chat Completions' ``reasoning_content``, a Responses ``reasoning`` item, an
Anthropic ``thinking`` block — before the call, never mixed with the answer, and no
markup in any text. Bodies and events are validated against each API's schemas.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import ServerProcess, parse_sse, start_server
from helpers.anthropic_cases import parse_events, validate_event, validate_message
from helpers.format_models import FormatModels
from helpers.formats import SPECS
from helpers.openai_schemas import validate_chunk, validate_response
from helpers.responses_schemas import validate_event as validate_responses_event
from helpers.responses_schemas import validate_response as validate_responses_response

ADD = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99},
    "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"],
    "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
FAMILIES = ("harmony", "mistral")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("dialects")
    models = FormatModels(root / "models")
    config = "".join(f'[[models.model]]\nid = "{family}"\npath = "{models.folder(family)}"\n'
                     for family in FAMILIES)
    proc = start_server(root, config=config)
    yield proc
    proc.stop()


@pytest.fixture()
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def no_markup(family: str, *texts: str) -> None:
    for text in texts:
        for token in SPECS[family].tokens:
            assert token not in text, (token, text)


def chat(http: httpx.Client, family: str, seed: int) -> tuple[str, str, list[dict[str, Any]]]:
    response = http.post("/v1/chat/completions", json={
        "model": family, "messages": [{"role": "user", "content": "Add 1 and 2."}],
        "tools": CHAT_TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
        "max_tokens": 160, "temperature": 1.0, "seed": seed, "stream": True})
    assert response.status_code == 200, response.text
    reasoning, content, calls, order = "", "", {}, []
    for chunk in parse_sse(response.text)[:-1]:
        validate_chunk(chunk)
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                reasoning += delta["reasoning_content"]
                order.append("reasoning")
            if delta.get("content"):
                content += delta["content"]
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                entry["name"] += call.get("function", {}).get("name") or ""
                entry["arguments"] += call.get("function", {}).get("arguments") or ""
                order.append("call")
    assert "reasoning" not in order[order.index("call"):] if "call" in order else True
    return reasoning, content, list(calls.values())


def thinking_seed(http: httpx.Client, family: str) -> int:
    """A seed whose turn thinks first (gpt-oss always does; Magistral-style models may)."""
    for seed in range(8):
        reasoning, content, calls = chat(http, family, seed)
        no_markup(family, reasoning, content)
        assert [c["name"] for c in calls] == ["add"]
        assert set(json.loads(calls[0]["arguments"])) == {"a", "b"}
        if reasoning:
            return seed
    raise AssertionError("no seed thought")


@pytest.mark.parametrize("family", FAMILIES)
def test_reasoning_in_every_dialect(http: httpx.Client, family: str) -> None:
    seed = thinking_seed(http, family)
    if family == "harmony":
        assert seed == 0  # gpt-oss reasons before every answer

    # Responses: a reasoning item, then the function call.
    body = {"model": family, "input": "Add 1 and 2.", "tool_choice": "required",
            "parallel_tool_calls": False, "max_output_tokens": 160, "temperature": 1.0,
            "seed": seed, "tools": [{"type": "function", "name": "add", "parameters": ADD}]}
    whole = http.post("/v1/responses", json=body)
    assert whole.status_code == 200, whole.text
    response = whole.json()
    validate_responses_response(response)
    kinds = [item["type"] for item in response["output"]]
    assert kinds == ["reasoning", "function_call"], kinds
    text = response["output"][0]["content"][0]["text"]
    assert text
    no_markup(family, text, response["output"][1]["arguments"])
    streamed = http.post("/v1/responses", json={**body, "stream": True})
    events = [json.loads(block.split("data: ", 1)[1])
              for block in streamed.text.split("\n\n") if "data: " in block]
    for event in events:
        validate_responses_event(event)
    assert "response.reasoning_text.delta" in [e["type"] for e in events]

    # Anthropic: a thinking block first, then tool_use; streamed as thinking deltas.
    claude = {"model": family, "max_tokens": 160, "temperature": 1.0, "seed": seed,
              "messages": [{"role": "user", "content": "Add 1 and 2."}],
              "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
              "tools": [{"name": "add", "input_schema": ADD}]}
    message = http.post("/v1/messages", json=claude)
    assert message.status_code == 200, message.text
    validate_message(message.json())
    blocks = message.json()["content"]
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"], blocks
    no_markup(family, blocks[0]["thinking"])
    stream = http.post("/v1/messages", json={**claude, "stream": True})
    parsed = parse_events(stream.text)
    for name, data in parsed:
        validate_event(name, data)
    deltas = [d["delta"]["type"] for n, d in parsed if n == "content_block_delta"]
    assert "thinking_delta" in deltas and "input_json_delta" in deltas


def test_harmony_answers_on_its_final_channel(http: httpx.Client) -> None:
    """A free answer: the final channel's text is the content, reasoning apart."""
    response = http.post("/v1/chat/completions", json={
        "model": "harmony", "messages": [{"role": "user", "content": "Hi."}],
        "max_tokens": 60, "seed": 3, "reasoning_effort": "low",
        "response_format": {"type": "json_object"}})
    assert response.status_code == 200, response.text
    body = response.json()
    validate_response(body)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"]
    no_markup("harmony", message["content"], message["reasoning_content"])
    assert isinstance(json.loads(message["content"]), dict)


def test_thinking_sent_back_renders_alike_in_every_dialect(http: httpx.Client) -> None:
    """A turn's thinking sent back is rendered into the prompt whichever API carries it:
    chat's ``reasoning_content`` (what afmd's own answer had), a Responses reasoning item,
    an Anthropic thinking block, Ollama's ``thinking``. Chat dropped it: the prompt was not
    what the model wrote, and not what the same conversation made through the others."""
    thought, answer = "Two and two make four.", "Four."
    asked, again = {"role": "user", "content": "2+2?"}, {"role": "user", "content": "3+3?"}

    def chat(reasoning: str | None) -> int:
        said: dict[str, Any] = {"role": "assistant", "content": answer}
        if reasoning is not None:
            said["reasoning_content"] = reasoning
        response = http.post("/v1/chat/completions", json={
            "model": "mistral", "messages": [asked, said, again], "max_tokens": 1})
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["prompt_tokens"])

    responses = http.post("/v1/responses", json={
        "model": "mistral", "max_output_tokens": 16, "store": False, "input": [
            asked, {"type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": thought}]},
            {"role": "assistant", "content": answer}, again]})
    messages = http.post("/v1/messages", json={
        "model": "mistral", "max_tokens": 1, "messages": [
            asked, {"role": "assistant", "content": [
                {"type": "thinking", "thinking": thought, "signature": ""},
                {"type": "text", "text": answer}]}, again]})
    ollama = http.post("/api/chat", json={
        "model": "mistral", "stream": False, "options": {"num_predict": 1}, "messages": [
            asked, {"role": "assistant", "content": answer, "thinking": thought}, again]})
    for response in (responses, messages, ollama):
        assert response.status_code == 200, response.text
    usage = messages.json()["usage"]
    counts = {"chat": chat(thought), "responses": responses.json()["usage"]["input_tokens"],
              "messages": usage["input_tokens"] + usage["cache_read_input_tokens"],
              "ollama": ollama.json()["prompt_eval_count"]}
    assert len(set(counts.values())) == 1, counts
    assert counts["chat"] > chat(None)  # the template renders it: it is in the prompt
    wrong = http.post("/v1/chat/completions", json={
        "model": "mistral", "max_tokens": 1, "messages": [
            asked, {"role": "assistant", "content": answer, "reasoning_content": 4}, again]})
    assert wrong.status_code == 400
    assert wrong.json()["error"]["param"] == "messages[1].reasoning_content"


def test_config_paths_are_the_built_models(tmp_path: Path) -> None:
    """The families' folders are what the server loads (sanity of the fixture)."""
    models = FormatModels(tmp_path)
    assert (models.folder("harmony") / "tokenizer.json").exists()


def test_harmony_stops_match_its_final_channel_only(http: httpx.Client) -> None:
    """A stop sequence ends gpt-oss's answer only where the final channel's text has it:
    not in the analysis, not in the channel markup; usage counts the tokens through the
    one that completed it, and log-probabilities cover those whose text came before it."""
    schema = {"type": "object", "properties": {"t": {"type": "string", "minLength": 6,
                                                     "maxLength": 8}},
              "required": ["t"], "additionalProperties": False}
    body = {"model": "harmony", "messages": [{"role": "user", "content": "Hi."}],
            "max_tokens": 80, "seed": 3, "reasoning_effort": "low", "logprobs": True,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "t", "schema": schema}}}

    def ask(stop: list[str] | None) -> dict[str, Any]:
        response = http.post("/v1/chat/completions", json={**body, "stop": stop})
        assert response.status_code == 200, response.text
        validate_response(response.json())
        return response.json()

    free = ask(None)
    message = free["choices"][0]["message"]
    reasoning, content = message["reasoning_content"], message["content"]
    assert reasoning and json.loads(content)["t"]
    # Where each token's text ends in the model's text (a token holding part of a
    # character makes none until the character is whole).
    entries = free["choices"][0]["logprobs"]["content"]
    written = list(itertools.accumulate(bytes(e["bytes"]) for e in entries))
    ends = [len(b.decode("utf-8", "ignore")) for b in written]
    raw = written[-1].decode()
    assert raw.count("<|channel|>final<|message|>") == 1, raw

    markup = ask(["<|channel|>", "<|message|>", "analysis", "final", reasoning[:3]])
    assert markup["choices"][0]["message"] == message
    assert markup["choices"][0]["finish_reason"] == free["choices"][0]["finish_reason"]
    assert markup["usage"]["completion_tokens"] == free["usage"]["completion_tokens"]

    # Inside the answer (the analysis may have it too): the answer ends there.
    stop = '"t"'
    cut = ask([stop])
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["message"]["content"] == content[:content.index(stop)]
    assert cut["choices"][0]["message"]["reasoning_content"] == reasoning
    start = raw.index(content, raw.index("<|channel|>final<|message|>")) + content.index(stop)
    assert cut["usage"]["completion_tokens"] == next(
        i for i, end in enumerate(ends) if end >= start + len(stop)) + 1
    assert cut["choices"][0]["logprobs"]["content"] == [
        e for e, end in zip(entries, ends, strict=True) if end <= start]
