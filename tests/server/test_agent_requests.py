"""The requests the coding agents send, replayed through the real server in seconds: their
shapes as tests/server/test_agents.py's run captured them (tests/data/agents/*.json, prose
replaced by short strings, the model named MODEL), so a change that breaks an agent fails
here without npm. Only the output budget is lowered (a random model writes until it is
cut), and ids the agent took from earlier answers are this replay's own.

Zed is a GUI editor the suite cannot run: its requests (zed.json) are written from its
source, field for field, and so is Continue's IDE autocomplete (the CLI the suite runs
has none); each such request names the source it was read from."""

from __future__ import annotations

import json
import uuid
from typing import Any
from urllib.parse import unquote

import httpx
import pytest

from conftest import parse_sse
from helpers.anthropic_cases import parse_events
from helpers.paths import TESTS_DIR

DATA = TESTS_DIR / "data" / "agents"


def requests_of(agent: str) -> list[dict[str, Any]]:
    data = json.loads((DATA / f"{agent}.json").read_text())
    out = []
    for request in data["requests"]:
        body = json.loads(json.dumps(request["body"]).replace('"MODEL"', '"demo"'))
        out.append({**request, "body": body})
    return out


def ignored(response: httpx.Response) -> list[str]:
    value = response.headers.get("X-AFM-Ignored-Fields", "")
    return [unquote(name) for name in value.split(", ") if name]


def test_head_and_get_root_answer_200(http: httpx.Client) -> None:
    """Claude Code's preconnect is ``HEAD /``; Ollama's clients probe ``GET /``."""
    for method in ("HEAD", "GET"):
        response = http.request(method, "/")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
    assert http.get("/").text == "Ollama is running"


@pytest.mark.parametrize("index", [0, 1, 2], ids=["json", "stream-json", "continued"])
def test_claude_code(http: httpx.Client, index: int) -> None:
    request = requests_of("claude_code")[index]
    body = {**request["body"], "max_tokens": 8}
    # It continues a turn cut at its cap with the cap raised, past what the demo's window
    # leaves after the prompt: a cap the window lowers, not a refusal.
    asked = 128000 if index == 2 else 32000
    assert request["body"]["max_tokens"] == asked and body["thinking"]["type"] == "adaptive"
    if index == 2:
        body = {**request["body"], "stop_sequences": ["e"]}  # ends the random text soon
    assert [m["role"] for m in body["messages"]][:2] == ["user", "system"]
    response = http.post(request["path"], json=body, headers=request["headers"])
    assert response.status_code == 200, response.text
    assert {"metadata", "context_management"} <= set(ignored(response))
    events = parse_events(response.text)
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    delta = next(data for name, data in events if name == "message_delta")
    assert delta["delta"]["stop_reason"] in ("max_tokens", "end_turn", "stop_sequence")
    # count_tokens counts the system message inside messages.
    count = {k: body[k] for k in ("model", "messages", "system", "tools")}
    counted = http.post("/v1/messages/count_tokens?beta=true", json=count,
                        headers=request["headers"])
    assert counted.status_code == 200, counted.text
    without = {**count, "messages": [m for m in body["messages"] if m["role"] != "system"]}
    fewer = http.post("/v1/messages/count_tokens", json=without).json()["input_tokens"]
    assert counted.json()["input_tokens"] > fewer


def test_claude_code_billing_header_keeps_the_prefix_cache(http: httpx.Client) -> None:
    """Claude Code opens its system prompt with an attribution block, ``x-anthropic-
    billing-header: cc_version=<version>.<3 hex>; ...``, whose hex is a hash of its
    conversation's first user message (and a sub-agent adds ``cc_is_subagent=true;``).
    Rendered, it made every other session and every sub-agent miss the whole prefix
    cache after its first few tokens: the system prompt and the tools behind it, most of
    the prompt, prefilled again. Anthropic reads the block as attribution, not prompt;
    afmd leaves it out, so two sessions share their prefix."""
    request = requests_of("claude_code")[0]
    unique = f"run {uuid.uuid4().hex}: " + "Follow the repository's conventions. " * 40
    usages = []
    for header in ("cc_version=2.1.337.ef8; cc_entrypoint=sdk-cli;",
                   "cc_version=2.1.337.f13; cc_entrypoint=sdk-cli; cc_is_subagent=true;"):
        system = [{"type": "text", "text": f"x-anthropic-billing-header: {header}"},
                  *request["body"]["system"][1:]]
        system[1] = {**system[1], "text": unique}
        body = {**request["body"], "system": system, "max_tokens": 8, "stream": False}
        response = http.post(request["path"], json=body, headers=request["headers"])
        assert response.status_code == 200, response.text
        usages.append(response.json()["usage"])
    first, second = usages
    whole = first["input_tokens"] + first["cache_read_input_tokens"]
    assert second["input_tokens"] + second["cache_read_input_tokens"] == whole
    # Everything up to the first user message's own text, at least: the system prompt.
    assert second["cache_read_input_tokens"] > whole - 60, (first, second)


def test_codex(http: httpx.Client) -> None:
    (request,) = requests_of("codex")
    body = request["body"]
    kinds = [tool["type"] for tool in body["tools"]]
    assert "namespace" in kinds and "web_search" in kinds and body["store"] is False
    assert "max_output_tokens" not in body  # Codex never sends it: the window is the cap
    body = {**body, "max_output_tokens": 16}
    response = http.post(request["path"], json=body, headers=request["headers"])
    assert response.status_code == 200, response.text
    assert ignored(response) == [f"tools[{kinds.index('web_search')}]"]
    events = [json.loads(line[len("data: "):]) for line in response.text.splitlines()
              if line.startswith("data: ")]
    assert events[-1]["type"] == "response.incomplete"
    echoed = events[-1]["response"]["tools"]
    assert [t["type"] for t in echoed] == [k for k in kinds if k != "web_search"]
    # A call of a namespace's function names the namespace; it goes back in input.
    namespace = next(tool for tool in body["tools"] if tool["type"] == "namespace")
    forced = {**body, "stream": False, "parallel_tool_calls": False, "max_output_tokens": 200,
              "reasoning": {"effort": "none"}, "temperature": 0,
              "tool_choice": {"type": "function", "name": "wait_agent"}}
    answer = http.post(request["path"], json=forced)
    assert answer.status_code == 200, answer.text
    (call,) = [item for item in answer.json()["output"] if item["type"] == "function_call"]
    assert (call["namespace"], call["name"]) == (namespace["name"], "wait_agent")
    again = {**body, "input": [*body["input"], call, {
        "type": "function_call_output", "call_id": call["call_id"], "output": "done"}]}
    assert http.post(request["path"], json=again).status_code == 200


@pytest.mark.parametrize("index", [0, 1], ids=["title", "turn"])
def test_opencode(http: httpx.Client, index: int) -> None:
    request = requests_of("opencode")[index]
    assert request["body"]["max_tokens"] == 32000  # fits the 131,072-token window
    body = {**request["body"]}
    if index == 1:
        assert body["tools"] and body["tool_choice"] == "auto"
    response = http.post(request["path"], json={**body, "max_tokens": 32000, "stop": ["e"]})
    assert response.status_code == 200, response.text
    chunks = parse_sse(response.text)
    assert chunks[-1] == "[DONE]" and chunks[-2]["usage"]["completion_tokens"] >= 0


def test_ai_sdk_two_steps(http: httpx.Client) -> None:
    first, second = requests_of("ai_sdk")
    assert first["body"]["tool_choice"] == "required" and "store" not in first["body"]
    step = http.post(first["path"], json={**first["body"], "temperature": 0})
    assert step.status_code == 200, step.text
    output = step.json()["output"]
    call = next(item for item in output if item["type"] == "function_call")
    # The second step as the SDK builds it: earlier items by reference, the call, its output.
    sent = second["body"]["input"]
    assert [item.get("type", "message") for item in sent] == [
        "message", "item_reference", "function_call", "function_call_output"]
    references = [{"type": "item_reference", "id": item["id"]} for item in output
                  if item["type"] != "function_call"]
    replay = {**second["body"], "input": [
        sent[0], *references,
        {**sent[2], "call_id": call["call_id"], "name": call["name"],
         "arguments": call["arguments"]},
        {**sent[3], "call_id": call["call_id"]}]}
    answer = http.post(second["path"], json=replay)
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] in ("completed", "incomplete")
    assert all(item["type"] != "function_call" for item in answer.json()["output"])


def _budget(body: dict[str, Any], field: str, tokens: int = 16) -> dict[str, Any]:
    """The body with its output capped: a greedy random model may never end its turn."""
    return {**body, field: tokens}


def _streamed_chat(response: httpx.Response) -> list[Any]:
    assert response.status_code == 200, response.text
    chunks = parse_sse(response.text)
    assert chunks[-1] == "[DONE]"
    assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks[:-1]), chunks
    return chunks


@pytest.mark.parametrize("index", [0, 1], ids=["whole", "diff"])
def test_aider(http: httpx.Client, index: int) -> None:
    """aider (through litellm's OpenAI client): streamed, greedy, no output cap."""
    request = requests_of("aider")[index]
    body = request["body"]
    assert body["temperature"] == 0 and body["stream"] is True
    assert "max_tokens" not in body and "stream_options" not in body and "tools" not in body
    assert body["messages"][0]["role"] == "system"
    _streamed_chat(http.post(request["path"], json=_budget(body, "max_tokens")))


def test_continue_cli(http: httpx.Client) -> None:
    """Continue's CLI: its tools (function tools only), usage asked in the stream."""
    request = requests_of("continue")[0]
    body = request["body"]
    assert body["stream_options"] == {"include_usage": True} and "tool_choice" not in body
    assert {tool["type"] for tool in body["tools"]} == {"function"}
    chunks = _streamed_chat(http.post(request["path"], json=_budget(body, "max_tokens")))
    assert chunks[-2]["usage"]["prompt_tokens"] > 0


def test_continue_autocomplete(http: httpx.Client) -> None:
    """Continue's IDE autocomplete with ``provider: openai``: the FIM prompt rendered by the
    client, sent to the legacy completions endpoint, streamed."""
    request = requests_of("continue")[1]
    assert request["path"] == "/v1/completions" and "suffix" not in request["body"]
    response = http.post(request["path"], json=request["body"])
    assert response.status_code == 200, response.text
    chunks = parse_sse(response.text)
    assert chunks[-1] == "[DONE]" and chunks[-2]["choices"][0]["finish_reason"] is not None


def _zed(kind: str) -> list[dict[str, Any]]:
    return [r for r in requests_of("zed") if r["name"].startswith(kind)]


@pytest.mark.parametrize("index", [0, 1, 2], ids=["turn", "tool-result", "title"])
def test_zed_openai_compatible(http: httpx.Client, index: int) -> None:
    """Zed's openai_compatible provider (Chat Completions, its default): temperature 1
    always, ``max_completion_tokens`` from the model's settings, an assistant tool call
    with ``content: null``, a user turn of several text parts."""
    request = _zed("openai_compatible")[index]
    body = request["body"]
    assert body["temperature"] == 1.0 and body["stream_options"] == {"include_usage": True}
    assert "tool_choice" not in body and "parallel_tool_calls" not in body
    replay = _budget(body, "max_completion_tokens")
    chunks = _streamed_chat(http.post(request["path"], json=replay))
    assert chunks[-2]["usage"]["completion_tokens"] <= 16


def test_zed_ollama(http: httpx.Client) -> None:
    """Zed's ollama provider: the model list, each model's capabilities and context (what
    it sends as ``num_ctx``), then streamed chats with tools, ``think``, null options and
    a tool message naming its tool."""
    tags, show, turn, result = _zed("ollama")
    listed = http.get(tags["path"])
    assert listed.status_code == 200
    assert "demo:latest" in [m["name"] for m in listed.json()["models"]]
    shown = http.post(show["path"], json=show["body"])
    assert shown.status_code == 200, shown.text
    assert {"tools", "thinking"} <= set(shown.json()["capabilities"])
    info = shown.json()["model_info"]
    assert info[f"{info['general.architecture']}.context_length"] == 131072
    for request in (turn, result):
        body = request["body"]
        assert body["options"]["num_predict"] is None and body["think"] is True
        replay = {**body, "options": {**body["options"], "num_predict": 16}}
        response = http.post(request["path"], json=replay)
        assert response.status_code == 200, response.text
        lines = [json.loads(line) for line in response.text.splitlines() if line]
        assert lines[-1]["done"] is True and lines[-1]["eval_count"] <= 16
        assert not ignored(response), ignored(response)
