"""Anthropic's Messages API on the wire: the SSE events in order, the error envelope and
statuses (the gate's refusals included), x-api-key, CORS, queue, ping, cancel, profile,
shutdown; and the pieces under them (the error mapping, the gate's per-route envelope,
the stop sequence the output chain reports, the thinking budget's grammar)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import anthropic
import httpx
import httpx2
import jsonschema
import pytest
from PIL import Image

from afmd.config.load import load_config
from afmd.config.sections import ServerConfig
from afmd.core.request import ChatRequest, Message
from afmd.dialects.anthropic.messages_api import ANTHROPIC_MESSAGES
from afmd.dialects.anthropic.messages_body import parse_count_request
from afmd.dialects.dialect import error_response
from afmd.engine.demo.template import CHAT_TEMPLATE
from afmd.engine.models.loaded_model import LoadedModel
from afmd.engine.models.model_registry import ModelRegistry
from afmd.errors import (
    APIError,
    AuthenticationError,
    GatewayTimeoutError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitError,
    ServerError,
    ServiceUnavailableError,
    UnsupportedMediaTypeError,
)
from afmd.grammar.compiler import llg_tokenizer
from afmd.http.sansio.gate import Gate, Reply
from afmd.http.sansio.screen import GatePolicy, RouteVerdict
from afmd.output.processor import OutputProcessor
from afmd.service.chat_template import folded_system_turns, template_messages
from afmd.service.output_plan import plan_output

from conftest import ServerProcess, start_server
from helpers.anthropic_cases import ADD as ADD_SCHEMA
from helpers.anthropic_cases import (
    MESSAGES,
    SCHEMAS,
    STORY,
    STORY_CHAT,
    THINKS,
    TOOLS,
    error_of,
    parse_events,
    validate_message,
)

PATH = "/v1/messages"
KEY = "sk-anthropic-test"
ORIGIN = "http://good.example"
BODY_LIMIT = 4096
LONG = 8000  # tokens: far longer than any test waits


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "demo", "max_tokens": 8, "messages": MESSAGES, **fields}


def story(**fields: Any) -> dict[str, Any]:
    """A stream that lasts far longer than any test waits."""
    return body(**{**STORY, "max_tokens": LONG, "stream": True, **fields})


def blocks_of(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The content blocks a stream built, checked event by event: each block starts,
    takes deltas of its own kind and stops before the next starts, indexes 0, 1, …"""
    kinds = {"text": "text_delta", "thinking": "thinking_delta",
             "tool_use": "input_json_delta"}
    built: list[dict[str, Any]] = []
    open_block: dict[str, Any] | None = None
    for name, data in events:
        if name == "content_block_start":
            assert open_block is None and data["index"] == len(built)
            open_block = dict(data["content_block"], _json="")
        elif name == "content_block_delta":
            assert open_block is not None and data["index"] == len(built)
            delta = data["delta"]
            assert delta["type"] == kinds[open_block["type"]]
            key = {"text_delta": "text", "thinking_delta": "thinking"}.get(delta["type"])
            if key:
                open_block[key] += delta[key]
            else:
                open_block["_json"] += delta["partial_json"]
        elif name == "content_block_stop":
            assert open_block is not None and data["index"] == len(built)
            built.append(open_block)
            open_block = None
    assert open_block is None
    return built


# --------------------------------------------------------------------------- the stream


@pytest.mark.parametrize("seed", THINKS[:1])
def test_stream_event_order_with_thinking_and_tool_use(http: httpx.Client, seed: int) -> None:
    response = http.post(PATH, json=body(max_tokens=300, tools=TOOLS, stream=True, seed=seed,
                                         tool_choice={"type": "any"}))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [e for e in parse_events(response.text) if e[0] != "ping"]
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert set(names[1:-2]) == {"content_block_start", "content_block_delta",
                                "content_block_stop"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["id"].startswith("msg_") and start["model"] == "demo"
    built = blocks_of(events)
    assert built[0]["type"] == "thinking" and built[0]["thinking"]
    assert built[0]["signature"] == ""
    calls = built[1:]
    assert calls and all(b["type"] == "tool_use" for b in calls)
    for block in calls:
        assert block["id"].startswith("toolu_") and block["input"] == {}
        jsonschema.validate(json.loads(block["_json"]), SCHEMAS[block["name"]])
    fragments = [d for n, d in events if n == "content_block_delta"
                 and d["delta"]["type"] == "input_json_delta"]
    assert len(fragments) > len(calls)
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    usage = delta["usage"]
    assert usage["output_tokens"] > 0 and usage["input_tokens"] > 0
    assert usage["output_tokens_details"]["thinking_tokens"] > 0
    assert usage["cache_creation_input_tokens"] == 0


def test_stream_of_text_ends_with_max_tokens(http: httpx.Client) -> None:
    response = http.post(PATH, json=body(max_tokens=6, stream=True, temperature=0))
    events = [e for e in parse_events(response.text) if e[0] != "ping"]
    built = blocks_of(events)
    assert [b["type"] for b in built] == ["text"]
    whole = http.post(PATH, json=body(max_tokens=6, temperature=0)).json()
    validate_message(whole)
    assert whole["content"] == [{"type": "text", "text": built[0]["text"]}]
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    assert events[-2][1]["usage"]["output_tokens"] == 6
    assert whole["usage"]["output_tokens"] == 6


def test_profile_event_before_message_stop(server: ServerProcess, http: httpx.Client) -> None:
    # Greedy: a sampled token could be the end of the text before max_tokens.
    response = http.post(PATH, json=body(stream=True, temperature=0),
                         headers={"X-AFM-Profile": "true"})
    names = [name for name, _ in parse_events(response.text)]
    assert names[-3:] == ["message_delta", "afm_profile", "message_stop"]
    profile = parse_events(response.text)[-2][1]["afm_profile"]
    assert profile["completion_tokens"] == 8
    # The official client steps over the event.
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    with claude.messages.stream(model="demo", max_tokens=8, messages=MESSAGES,
                                extra_body={"temperature": 0},
                                extra_headers={"X-AFM-Profile": "true"}) as stream:
        message = stream.get_final_message()
    assert message.usage.output_tokens == 8


def test_cancel_by_request_id(server: ServerProcess, http: httpx.Client) -> None:
    rid = f"anthropic-{uuid.uuid4().hex[:8]}"
    text: list[str] = []
    started = threading.Event()

    def read() -> None:
        with httpx.stream("POST", server.url + PATH, json=story(),
                          headers={"X-Request-ID": rid}, timeout=60) as response:
            for chunk in response.iter_text():
                text.append(chunk)
                if "content_block_delta" in chunk:
                    started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert started.wait(30)
    cancelled = http.post(f"{PATH}/{rid}/cancel")
    assert cancelled.status_code == 200
    assert cancelled.json() == {"id": rid, "type": "message_cancellation", "cancelled": True}
    reader.join(30)
    events = parse_events("".join(text))
    assert events[-2][1]["delta"]["stop_reason"] == "cancelled"
    assert events[-1][0] == "message_stop"
    missing = http.post(f"{PATH}/{rid}/cancel")
    assert missing.status_code == 404
    assert error_of(missing)[0] == "not_found_error"


# --------------------------------------------------------------------------- errors


def test_request_errors_are_anthropic_errors(http: httpx.Client) -> None:
    cases = [
        ({"model": "demo", "messages": MESSAGES}, "max_tokens: "),
        (body(max_tokens=-1), "max_tokens: "),
        # 0 fills the prompt cache and answers nothing: no stream of it.
        (body(max_tokens=0, stream=True), "stream: "),
        (body(max_tokens=0, output_config={"format": {"type": "json_schema", "schema": {
            "type": "object"}}}), "output_config.format: "),
        (body(messages=[]), "messages: "),
        (body(messages=[{"role": "system", "content": "x"}]), "messages: "),
        # A prefill (tests/server/test_prefill.py) may not end in whitespace.
        (body(messages=[*MESSAGES, {"role": "assistant", "content": "Sure "}]),
         "messages[1].content: final assistant content cannot end with trailing whitespace"),
        (body(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
         "tools[0].type: "),
        (body(tools=[{"name": "f"}]), "tools[0].input_schema: "),
        # A call's input is an object: a schema of a string or of anything has none.
        (body(tools=[{"name": "f", "input_schema": {"type": "string", "enum": ["abc"]}}]),
         "tools[0].input_schema.type: Input should be 'object'"),
        (body(tools=[{"name": "f", "input_schema": {"properties": {}}}]),
         "tools[0].input_schema.type: "),
        (body(tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), "tool_choice.name: "),
        (body(tool_choice={"type": "any"}), "tool_choice.type: "),
        (body(tools=[{"name": "f", "input_schema": {"type": "object", "properties": 3}}]),
         "tools[0].input_schema: "),
        (body(stop_sequences="x"), "stop_sequences: "),
        (body(thinking={"type": "sometimes"}), "thinking.type: "),
        (body(output_config={"effort": "extreme"}), "output_config.effort: "),
        (body(stream="yes"), "stream: "),
        # Fields afmd does not act on still have Anthropic's types (they were taken as
        # anything, so a client's bug surfaced only against Anthropic).
        (body(metadata="u-1"), "metadata: "),
        (body(metadata={"user_id": 7}), "metadata.user_id: "),
        (body(service_tier=["auto"]), "service_tier: "),
        (body(speed=1), "speed: "),
        (body(inference_geo={"region": "us"}), "inference_geo: "),
        (body(container=3), "container: "),
        (body(cache_control="ephemeral"), "cache_control: "),
        (body(context_management=[]), "context_management: "),
        (body(mcp_servers={"type": "url"}), "mcp_servers: "),
        (body(mcp_servers=["https://mcp.example"]), "mcp_servers[0]: "),
    ]
    for payload, prefix in cases:
        response = http.post(PATH, json=payload)
        assert response.status_code == 400, (payload, response.text)
        kind, message = error_of(response)
        assert kind == "invalid_request_error"
        assert message.startswith(prefix), (prefix, message)
    broken = http.post(PATH, content=b"{", headers={"Content-Type": "application/json"})
    assert broken.status_code == 400 and error_of(broken)[0] == "invalid_request_error"


def test_the_gates_refusals_use_the_routes_envelope(http: httpx.Client) -> None:
    unknown = http.post(f"{PATH}/nope", json={})
    assert unknown.status_code == 404 and error_of(unknown)[0] == "not_found_error"
    method = http.get(PATH)
    assert method.status_code == 405 and error_of(method)[0] == "invalid_request_error"
    assert method.headers["allow"] == "POST"
    media = http.post(PATH, content=b"{}", headers={"Content-Type": "text/plain"})
    assert media.status_code == 415 and error_of(media)[0] == "invalid_request_error"
    count = http.post(f"{PATH}/count_tokens", json={"messages": MESSAGES})
    assert count.status_code == 400
    assert error_of(count) == ("invalid_request_error",
                               "model: Missing required parameter: 'model'.")
    # Other routes keep OpenAI's envelope.
    chat = http.post("/v1/nope", json={})
    assert chat.status_code == 404 and chat.json()["error"]["code"] == "unknown_url"


def test_a_missing_model_is_anthropics_404_to_anthropics_sdk(server: ServerProcess,
                                                              http: httpx.Client) -> None:
    """``/v1/models/{id}`` serves both SDKs: a request with ``anthropic-version`` (which
    Anthropic's SDKs send on every request, OpenAI's never) is told a missing model in
    Anthropic's envelope with ``request-id``, where the SDK's error reads its type and id
    (it was OpenAI's ``invalid_request_error`` and no id); without it, OpenAI's."""
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    assert claude.models.retrieve("demo").id == "demo"
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.models.retrieve("nope")
    assert missing.value.body == {"type": "error", "error": {
        "type": "not_found_error", "message": "model: The model 'nope' does not exist."}}
    assert missing.value.request_id and missing.value.request_id.startswith("req_")
    openai_style = http.get("/v1/models/nope")
    assert openai_style.status_code == 404 and "request-id" not in openai_style.headers
    assert openai_style.json()["error"]["code"] == "model_not_found"


def test_every_answer_names_its_request_id_where_the_sdk_reads_it(
        server: ServerProcess, http: httpx.Client) -> None:
    """Anthropic's SDK reads ``request-id`` (``_request_id``, ``APIStatusError.request_id``):
    it is the request's X-Request-ID on answers, streams, count_tokens and every error,
    and a fresh id on the gate's refusals."""
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    raw = claude.messages.with_raw_response.create(**body(max_tokens=1))
    assert raw.request_id and raw.request_id == raw.headers["x-request-id"]
    assert raw.parse()._request_id == raw.request_id
    with claude.messages.stream(**body(max_tokens=1)) as stream:
        assert stream.request_id
        assert stream.request_id == stream.response.headers["x-request-id"]
        stream.until_done()
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(**body(max_tokens=-1))
    assert refused.value.request_id
    assert refused.value.request_id == refused.value.response.headers["x-request-id"]
    with pytest.raises(anthropic.NotFoundError) as unknown:
        claude.messages.create(**body(model="nope"))
    assert unknown.value.request_id
    counted = claude.messages.with_raw_response.count_tokens(model="demo", messages=MESSAGES)
    assert counted.request_id and counted.request_id == counted.headers["x-request-id"]
    sent = http.post(PATH, json=body(max_tokens=1), headers={"X-Request-ID": "mine-1"})
    assert sent.headers["request-id"] == "mine-1"
    bad = http.post(PATH, json=body(max_tokens=1), headers={"X-Request-ID": "bad id!"})
    assert bad.status_code == 400  # the field named once, at the start, as Anthropic does
    assert bad.json()["error"]["message"].startswith("X-Request-ID must be "), bad.text
    negative = http.post(PATH, json=body(max_tokens=-1)).json()["error"]["message"]
    assert negative.startswith("max_tokens: "), negative
    media = http.post(PATH, content=b"{}", headers={"Content-Type": "text/plain"})
    assert media.status_code == 415 and media.headers["request-id"].startswith("req_")
    # OpenAI's routes keep their own headers only.
    assert "request-id" not in http.post("/v1/chat/completions", json={}).headers


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("guarded"), config=f"""
[server]
api_key = "{KEY}"
allowed_origins = ["{ORIGIN}"]
max_request_body_bytes = {BODY_LIMIT}
""")
    yield proc
    proc.stop()


def test_api_key_in_x_api_key_or_bearer(guarded: ServerProcess) -> None:
    url = guarded.url + PATH
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"},
                    {"x-api-key": KEY, "anthropic-version": "2023-06-01",
                     "anthropic-beta": "prompt-caching-2024-07-31"},
                    # An SDK given an empty key and a bearer token sends both.
                    {"x-api-key": "", "Authorization": f"Bearer {KEY}"}):
        assert httpx.post(url, json=body(max_tokens=1), headers=headers).status_code == 200
    for headers in ({}, {"x-api-key": "sk-wrong"}, {"x-api-key": ""},
                    {"x-api-key": "sk-wrong", "Authorization": f"Bearer {KEY}"}):
        refused = httpx.post(url, json=body(max_tokens=1), headers=headers)
        assert refused.status_code == 401, headers
        assert error_of(refused)[0] == "authentication_error"
    # Any route takes the key either way; other routes answer in OpenAI's envelope.
    chat = guarded.url + "/v1/chat/completions"
    payload = {"messages": MESSAGES, "max_tokens": 1}
    assert httpx.post(chat, json=payload, headers={"x-api-key": KEY}).status_code == 200
    assert httpx.post(chat, json=payload).json()["error"]["code"] == "invalid_api_key"
    # Listing models with a wrong key: each SDK reads the 401 in its own envelope.
    with pytest.raises(anthropic.AuthenticationError) as listed:
        anthropic.Anthropic(base_url=guarded.url, api_key="sk-wrong", max_retries=0
                            ).models.list()
    assert listed.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": "Incorrect API key provided."}}
    assert listed.value.request_id and listed.value.request_id.startswith("req_")
    refused = httpx.get(guarded.url + "/v1/models", headers={"x-api-key": "sk-wrong"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    # The official client sends x-api-key.
    claude = anthropic.Anthropic(base_url=guarded.url, api_key=KEY, max_retries=0)
    greedy = body(max_tokens=1, extra_body={"temperature": 0})
    assert claude.messages.create(**greedy).usage.output_tokens == 1
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=guarded.url, api_key="sk-wrong",
                            max_retries=0).messages.create(**body(max_tokens=1))


def test_guarded_refusals(guarded: ServerProcess) -> None:
    url = guarded.url + PATH
    large = httpx.post(url, json=body(system="x" * BODY_LIMIT), headers={"x-api-key": KEY})
    assert large.status_code == 413 and error_of(large)[0] == "request_too_large"
    foreign = httpx.post(url, json=body(), headers={"x-api-key": KEY,
                                                    "Origin": "http://evil.example"})
    assert foreign.status_code == 403 and error_of(foreign)[0] == "permission_error"
    preflight = httpx.options(url, headers={"Origin": ORIGIN,
                                            "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 204
    allowed = {h.strip().lower()
               for h in preflight.headers["access-control-allow-headers"].split(",")}
    assert {"x-api-key", "anthropic-version", "anthropic-beta", "content-type"} <= allowed
    allowed_origin = httpx.post(url, json=body(max_tokens=1),
                                headers={"x-api-key": KEY, "Origin": ORIGIN})
    assert allowed_origin.headers["access-control-allow-origin"] == ORIGIN


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One slot, one place in the queue, and a short request_timeout."""
    proc = start_server(tmp_path_factory.mktemp("tight"), config="""
[queue]
max_concurrent_requests = 1
max_queued_requests = 1
[server]
request_timeout = 9
[[models.model]]
id = "tiny-ctx"
path = "afmd:demo"
context_length = 64
""")
    yield proc
    proc.stop()


@pytest.mark.slow
def test_queued_stream_pings_then_fails_with_an_error_event(tight: ServerProcess) -> None:
    """A stream waiting in the queue opens and pings; its request_timeout passing later
    (queued or generating) is an error event; a third request is refused with 429."""
    url = tight.url
    hog_started = threading.Event()

    def hog() -> None:
        payload = {**STORY_CHAT, "max_tokens": LONG, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=payload,
                          timeout=60) as response:
            for _ in response.iter_bytes():
                hog_started.set()

    threading.Thread(target=hog, daemon=True).start()
    assert hog_started.wait(30)
    waited: list[tuple[float, str]] = []
    sent = time.monotonic()
    queued_open = threading.Event()

    def queued() -> None:
        with httpx.stream("POST", url + PATH, json=story(), timeout=60) as response:
            assert response.status_code == 200
            queued_open.set()
            for line in response.iter_lines():
                waited.append((time.monotonic() - sent, line))

    reader = threading.Thread(target=queued, daemon=True)
    reader.start()
    assert queued_open.wait(15), "the queued stream did not open"
    refused = httpx.post(url + PATH, json=body())
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    assert error_of(refused)[0] == "rate_limit_error"
    reader.join(60)
    events = parse_events("".join(line + "\n" for _, line in waited))
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"]
    ping_at = next(t for t, line in waited if line == "event: ping")
    assert 4.0 < ping_at < 8.0, ping_at
    assert names[-1] == "error" and "message_stop" not in names
    assert events[-1][1]["error"]["type"] == "timeout_error"


def test_max_tokens_is_a_cap_the_context_window_lowers(tight: ServerProcess) -> None:
    """Claude Code asks for max_tokens far beyond a small local context: the answer runs
    until the window is full and says so (chat still refuses it, as OpenAI does)."""
    response = httpx.post(tight.url + PATH, json=body(model="tiny-ctx", max_tokens=32000,
                                                      **STORY), timeout=60)
    assert response.status_code == 200, response.text
    message = response.json()
    validate_message(message)
    assert message["stop_reason"] == "model_context_window_exceeded"
    usage = message["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage[
        "output_tokens"] == 64
    capped = httpx.post(tight.url + PATH, json=body(model="tiny-ctx", max_tokens=3, **STORY),
                        timeout=60).json()
    assert capped["stop_reason"] == "max_tokens" and capped["usage"]["output_tokens"] == 3
    chat = httpx.post(tight.url + "/v1/chat/completions", timeout=60, json={
        **STORY_CHAT, "model": "tiny-ctx", "max_tokens": 32000})
    assert chat.status_code == 400
    assert chat.json()["error"]["code"] == "context_length_exceeded"
    too_long = httpx.post(tight.url + PATH, timeout=60, json=body(
        model="tiny-ctx", messages=[{"role": "user", "content": "word " * 200}]))
    assert too_long.status_code == 400
    kind, message = error_of(too_long)
    match = re.fullmatch(r"prompt is too long: (\d+) tokens > 64 maximum", message)
    assert kind == "invalid_request_error" and match and int(match[1]) >= 64, message


@pytest.mark.slow
def test_shutdown_is_overloaded_with_retry_after(tmp_path: Path) -> None:
    proc = start_server(tmp_path, config="[server]\nshutdown_grace = 1\n")
    results: dict[str, Any] = {}
    generating = threading.Event()

    def plain() -> None:
        results["plain"] = httpx.post(proc.url + PATH, json=story(stream=False), timeout=60)

    def streamed() -> None:
        with httpx.stream("POST", proc.url + PATH, json=story(), timeout=60) as response:
            text = ""
            for chunk in response.iter_text():
                text += chunk
                if "content_block_delta" in text:
                    generating.set()
            results["stream"] = text

    threads = [threading.Thread(target=f, daemon=True) for f in (plain, streamed)]
    for thread in threads:
        thread.start()
    try:
        assert generating.wait(30)
        time.sleep(0.3)
        proc.proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(30)
    finally:
        assert proc.stop() == 0
    plain_response = results["plain"]
    assert plain_response.status_code == 529
    assert plain_response.headers["retry-after"] == "1"
    assert error_of(plain_response)[0] == "overloaded_error"
    last = parse_events(results["stream"])[-1]
    assert last[0] == "error" and last[1]["error"]["type"] == "overloaded_error"


# --------------------------------------------------------------------------- the pieces


@pytest.mark.parametrize(("error", "status", "kind"), [
    (InvalidRequestError("x"), 400, "invalid_request_error"),
    (AuthenticationError("x"), 401, "authentication_error"),
    (PermissionDeniedError("x"), 403, "permission_error"),
    (NotFoundError("x"), 404, "not_found_error"),
    (PayloadTooLargeError("x"), 413, "request_too_large"),
    (UnsupportedMediaTypeError("x"), 415, "invalid_request_error"),
    (RateLimitError("x", headers={"Retry-After": "3"}), 429, "rate_limit_error"),
    (ServerError("x"), 500, "api_error"),
    (ServiceUnavailableError("x", code="busy"), 529, "overloaded_error"),
    (GatewayTimeoutError("x"), 504, "timeout_error"),
])
def test_error_mapping(error: APIError, status: int, kind: str) -> None:
    got_status, envelope, headers = error_response(ANTHROPIC_MESSAGES, error)
    assert got_status == status
    assert envelope == {"type": "error", "error": {"type": kind, "message": "x"}}
    if status in (429, 529):
        assert headers["Retry-After"] == ("3" if status == 429 else "1")
    # Without a style, the error is OpenAI's, as before.
    assert error_response(None, error) == (error.status, error.envelope(),
                                           dict(error.headers))


def test_params_are_named_in_anthropics_terms() -> None:
    def message(error: APIError) -> str:
        return ANTHROPIC_MESSAGES.error_envelope(error)["error"]["message"]

    assert message(InvalidRequestError("bad", param="tools[2].function.parameters")) == (
        "tools[2].input_schema: bad")
    assert message(InvalidRequestError("bad", param="response_format.json_schema.schema")) == (
        "output_config.format.schema: bad")
    assert message(InvalidRequestError(  # the pipeline names the image as the body did
        "bad", param="messages[3].content[0].content[1].source",
        code="image_input_not_supported")) == "messages[3].content[0].content[1].source: bad"
    assert message(InvalidRequestError("bad", param="max_tokens")) == "max_tokens: bad"


def test_the_gate_answers_in_the_style_its_route_names() -> None:
    def route(method: str, path: str) -> RouteVerdict | tuple[int, tuple[str, ...]]:
        if path == PATH:
            return RouteVerdict(200 if method == "POST" else 405, ("POST",),
                                ANTHROPIC_MESSAGES)
        return 404, ()  # a check written before styles: OpenAI's envelope

    policy = GatePolicy(route=route, api_key=KEY.encode())
    for path, status, kind in ((PATH, 401, "authentication_error"), ("/v1/x", 404, None)):
        out = Gate(policy).feed(f"POST {path} HTTP/1.1\r\nHost: localhost\r\n"
                                "Content-Length: 0\r\n\r\n".encode())
        assert isinstance(out[0], Reply) and out[0].rejection is not None
        assert out[0].rejection.status == status
        payload = json.loads(out[0].data.split(b"\r\n\r\n", 1)[1])
        if kind is None:
            assert payload["error"]["code"] == "unknown_url"
        else:
            assert payload["error"]["type"] == kind
    accepted = Gate(policy).feed(f"POST {PATH} HTTP/1.1\r\nHost: localhost\r\nx-api-key: "
                                 f"{KEY}\r\nContent-Length: 0\r\n\r\n".encode())
    assert not isinstance(accepted[0], Reply)


def test_a_refusal_on_a_shared_path_reads_as_the_sdk_that_sent_it() -> None:
    """``/v1/models`` belongs to no dialect (OpenAI's and Anthropic's SDKs both list models
    there): the gate refuses a request carrying ``anthropic-version`` in Anthropic's
    envelope, with ``request-id``, and any other in OpenAI's."""
    def route(method: str, path: str) -> RouteVerdict:
        return RouteVerdict(200) if path == "/v1/models" else RouteVerdict(404)

    policy = GatePolicy.from_config(
        ServerConfig(api_key=KEY), route, check_host=True,
        client_styles=(("Anthropic-Version", ANTHROPIC_MESSAGES),))
    for path, status in (("/v1/models", 401), ("/v1/nope", 404)):
        for version, kind in (("anthropic-VERSION: 2023-06-01\r\n", "error"), ("", None)):
            out = Gate(policy).feed(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n{version}"
                                    "x-api-key: sk-wrong\r\n\r\n".encode())
            assert isinstance(out[0], Reply) and out[0].rejection is not None
            assert out[0].rejection.status == status
            head, _, raw = out[0].data.partition(b"\r\n\r\n")
            payload = json.loads(raw)
            assert payload.get("type") == kind, (path, version, payload)
            assert (b"\r\nrequest-id: req_" in head.lower()) == (kind is not None)


def test_a_conversation_in_afmds_terms() -> None:
    """Blocks become afmd's messages: system blocks joined, a user turn's results as tool
    messages in the order of the calls then its text, thinking as the turn's reasoning,
    consecutive turns of one role as one, the choice and sampling fields mapped."""
    raw = json.dumps({
        "model": "claude-x", "max_tokens": 50, "stop_sequences": ["END"],
        "system": [{"type": "text", "text": "Be brief."},
                   {"type": "text", "text": "Be right.", "cache_control": {"type": "x"}}],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "user", "content": [{"type": "text", "text": "And a sum."}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Two calls.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Calling."},
                {"type": "tool_use", "id": "toolu_a", "name": "get_weather",
                 "input": {"city": "Paris", "unit": "celsius"}},
                {"type": "tool_use", "id": "toolu_b", "name": "add", "input": {"a": 2, "b": 3}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_b", "content": "5"},
                {"type": "tool_result", "tool_use_id": "toolu_a", "is_error": True,
                 "content": [{"type": "text", "text": "down"}]},
                {"type": "text", "text": "Go on."},
            ]},
        ],
        "tools": TOOLS, "tool_choice": {"type": "tool", "name": "add",
                                        "disable_parallel_tool_use": True},
        "output_config": {"effort": "max"}, "top_k": 5, "unknown_field": [1],
    }).encode()
    chat = ANTHROPIC_MESSAGES.parse(raw)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief.\n\nBe right."), ("user", "Weather?\n\nAnd a sum."),
        ("assistant", "Calling."), ("tool", "Error: down"), ("tool", "5"), ("user", "Go on.")]
    assistant = chat.messages[2]
    assert assistant.reasoning == "Two calls."
    assert [(c.id, c.name, json.loads(c.arguments)) for c in assistant.tool_calls] == [
        ("toolu_a", "get_weather", {"city": "Paris", "unit": "celsius"}),
        ("toolu_b", "add", {"a": 2, "b": 3})]
    assert [m.tool_call_id for m in chat.messages[3:5]] == ["toolu_a", "toolu_b"]
    assert chat.tool_choice.mode == "required" and chat.tool_choice.allowed == ("add",)
    assert not chat.parallel_tool_calls
    assert (chat.model, chat.max_tokens, chat.stop, chat.top_k) == ("claude-x", 50, ("END",), 5)
    assert (chat.reasoning_effort, chat.thinking_budget) == ("xhigh", None)
    # Thinking on takes a choice that forces no call; its budget is the grammar's.
    thinking = ANTHROPIC_MESSAGES.parse(json.dumps(body(
        max_tokens=50, tools=TOOLS, tool_choice={"type": "auto"},
        thinking={"type": "enabled", "budget_tokens": 20})).encode())
    assert (thinking.reasoning_effort, thinking.thinking_budget) == ("medium", 20)
    assert [t.parameters for t in chat.tools] == [t["input_schema"] for t in TOOLS]
    assert chat.ignored_fields == ("unknown_field",)  # named in X-AFM-Ignored-Fields


def test_claude_codes_blank_text_blocks_are_read_as_nothing() -> None:
    """Claude Code sends empty and whitespace-only text blocks beside real content (which
    Anthropic refuses): afmd answers, and they leave no empty paragraph, nor a user turn
    of spaces after the tool's answer."""
    raw = json.dumps(body(max_tokens=5, tools=TOOLS, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                     {"type": "text", "text": ""}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": ""},
            {"type": "tool_use", "id": "toolu_a", "name": "add", "input": {"a": 1, "b": 2}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_a",
             "content": [{"type": "text", "text": " "}, {"type": "text", "text": "3"}]},
            {"type": "text", "text": " \n"}]},
    ])).encode()
    chat = ANTHROPIC_MESSAGES.parse(raw)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("user", "Hi"), ("assistant", None), ("tool", "3")]


def _offered(**fields: Any) -> tuple[str, ...]:
    return tuple(t.name for t in ANTHROPIC_MESSAGES.parse(json.dumps(body(**fields)).encode())
                 .tools)


def test_tools_offered_follow_deferral_references_and_changes() -> None:
    """As Anthropic: a ``defer_loading`` tool is offered once a ``tool_reference`` in a
    result loads it (Claude Code's ToolSearch), and system messages add tools (by name, or
    defined by value) and withdraw them from their point on. Before, a tool_reference or a
    tool_addition was a 400, and deferred tools were offered from the start."""
    search = {"name": "ToolSearch", "input_schema": {"type": "object"}}
    db = {"name": "mcp__db__query", "input_schema": ADD_SCHEMA, "defer_loading": True}
    tools = [search, db, TOOLS[0]]
    asked = [{"role": "user", "content": "Query the db."},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_s",
                                                "name": "ToolSearch", "input": {}}]}]

    def answered(*parts: dict[str, Any]) -> list[dict[str, Any]]:
        return [*asked, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_s", "content": list(parts)}]}]

    assert _offered(tools=tools) == ("ToolSearch", "get_weather")
    loaded = answered({"type": "text", "text": "Found:"},
                      {"type": "tool_reference", "tool_name": "mcp__db__query"})
    assert _offered(tools=tools, messages=loaded) == (
        "ToolSearch", "mcp__db__query", "get_weather")
    chat = ANTHROPIC_MESSAGES.parse(json.dumps(body(tools=tools, messages=loaded)).encode())
    assert chat.messages[-1].content == "Found:\n\nTool loaded: mcp__db__query"
    # A reference to a tool the client no longer sends is the text it is.
    gone = answered({"type": "tool_reference", "tool_name": "mcp__gone"})
    assert _offered(tools=tools, messages=gone) == ("ToolSearch", "get_weather")
    # Mid-conversation changes, in order: add by name, define by value, withdraw.
    changes = [{"role": "user", "content": "Hi."}, {"role": "system", "content": [
        {"type": "text", "text": "Tools changed."},
        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "mcp__db__query"}},
        {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": TOOLS[1]}},
        {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "get_weather"}},
    ]}, {"role": "user", "content": "Go on."}]
    assert _offered(tools=tools, messages=changes) == ("ToolSearch", "mcp__db__query", "add")
    chat = ANTHROPIC_MESSAGES.parse(json.dumps(body(tools=tools, messages=changes)).encode())
    assert ("system", "Tools changed.") in [(m.role, m.content) for m in chat.messages]
    for change, param, message in (
        ({"type": "tool_removal", "tool": {"type": "tool_reference", "name": "nope"}},
         "messages[1].content[0].tool.name", "'nope' names no tool"),
        ({"type": "tool_addition", "tool": {"type": "tool_definition", "definition": {
            "name": "bad name", "input_schema": {"type": "object"}}}},
         "messages[1].content[0].tool.definition.name", "Invalid tool name"),
        ({"type": "tool_removal", "tool": {"type": "tool_definition", "definition": {}}},
         "messages[1].content[0].tool.type", "Invalid value"),
    ):
        with pytest.raises(InvalidRequestError) as refused:
            ANTHROPIC_MESSAGES.parse(json.dumps(body(tools=tools, messages=[
                MESSAGES[0], {"role": "system", "content": [change]}])).encode())
        assert refused.value.param == param and message in refused.value.message
    # A search result reads as text, in a user turn and in a tool's result alike.
    result = {"type": "search_result", "source": "https://x.example/a", "title": "A",
              "content": [{"type": "text", "text": "alpha"}, {"type": "text", "text": "beta"}]}
    text = "Search result: A\nSource: https://x.example/a\n\nalpha\n\nbeta"
    chat = ANTHROPIC_MESSAGES.parse(json.dumps(body(messages=[
        {"role": "user", "content": [result, {"type": "text", "text": "Sum up."}]}])).encode())
    assert chat.messages[-1].content == text + "\n\nSum up."
    chat = ANTHROPIC_MESSAGES.parse(json.dumps(body(tools=tools,
                                                    messages=answered(result))).encode())
    assert chat.messages[-1].content == text


def test_a_turn_scoped_system_message_is_shown_until_a_user_message_follows() -> None:
    """``clear_at: "next_user_message"`` (Claude Code's turn-scoped reminders) shows a
    system message's text only until a user message follows it, its tool changes
    holding; ``never`` always; on another role it is Anthropic's 400, whose words Claude
    Code reads. Before, the text stayed in every later prompt."""
    def texts(*messages: dict[str, Any]) -> list[tuple[str, str | None]]:
        chat = ANTHROPIC_MESSAGES.parse(json.dumps(body(messages=list(messages),
                                                        tools=TOOLS)).encode())
        return [(m.role, m.content) for m in chat.messages]

    reminder = {"role": "system", "content": "Remember.", "clear_at": "next_user_message"}
    kept = {"role": "system", "content": "Always.", "clear_at": "never"}
    assert texts(MESSAGES[0], reminder) == [("user", MESSAGES[0]["content"]),
                                            ("system", "Remember.")]
    later = texts(MESSAGES[0], reminder, kept, {"role": "assistant", "content": "Ok."},
                  {"role": "user", "content": "Next."})
    assert ("system", "Always.") in later and ("system", "Remember.") not in later
    removal = {"role": "system", "clear_at": "next_user_message", "content": [
        {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "add"}}]}
    assert _offered(tools=TOOLS, messages=[MESSAGES[0], removal, {
        "role": "user", "content": "Next."}]) == ("get_weather",)
    with pytest.raises(InvalidRequestError) as refused:
        texts({**MESSAGES[0], "clear_at": "never"})
    assert refused.value.param == "messages[0].clear_at"
    assert ANTHROPIC_MESSAGES.error_envelope(refused.value)["error"]["message"] == (
        'messages[0].clear_at: clear_at is only permitted on role: "system" messages.')
    with pytest.raises(InvalidRequestError) as refused:
        texts(MESSAGES[0], {**reminder, "clear_at": "soon"})
    assert refused.value.param == "messages[1].clear_at"


def test_a_system_message_sets_the_effort_from_there_on(server: ServerProcess) -> None:
    """Claude Code changes effort mid-conversation with a system message of no content and
    ``output_config.effort``, the top-level ``output_config`` (and its cached prefix) left
    as it was: the last such message sets the answer's effort. Before, its empty content
    was a 400 (Claude Code then retried without it)."""
    def effort(*messages: dict[str, Any], **fields: Any) -> str | None:
        raw = json.dumps(body(messages=list(messages), **fields)).encode()
        return ANTHROPIC_MESSAGES.parse(raw).reasoning_effort

    low = {"role": "system", "content": [], "output_config": {"effort": "low"}}
    top = {"output_config": {"effort": "high"}}
    for level, ours in (("low", "low"), ("medium", "medium"), ("high", "high"),
                        ("xhigh", "xhigh"), ("max", "xhigh")):  # the SDK's levels
        assert effort(MESSAGES[0], {**low, "output_config": {"effort": level}}) == ours
    assert effort(MESSAGES[0], **top) == "high"
    assert effort(MESSAGES[0], low, **top) == "low"
    assert effort(MESSAGES[0], low, {"role": "assistant", "content": "Ok."},
                  {"role": "user", "content": "More."},
                  {"role": "system", "output_config": {"effort": "max"}}, **top) == "xhigh"
    assert effort(MESSAGES[0], low, thinking={"type": "disabled"}) == "none"
    for message, param in (
        ({"role": "system", "content": []}, "messages[1].content"),
        ({"role": "system", "content": [], "output_config": {"effort": "huge"}},
         "messages[1].output_config.effort"),
        ({"role": "system", "content": [], "output_config": {"format": {}}},
         "messages[1].output_config.format"),
        ({"role": "system", "output_config": "low"}, "messages[1].output_config"),
    ):
        with pytest.raises(InvalidRequestError) as refused:
            effort(MESSAGES[0], message)
        assert refused.value.param == param
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    reply = claude.beta.messages.create(model="demo", max_tokens=2, messages=[MESSAGES[0], low],
                                        output_config={"effort": "high"},
                                        betas=["mid-conversation-system-2026-04-07"])
    assert reply.usage.output_tokens > 0


def test_claude_codes_tool_search_through_the_sdk(server: ServerProcess) -> None:
    """The round Claude Code's ToolSearch makes, through the official client: the deferred
    tool is not offered (nor counted) until its reference comes back in a result, and is
    then called."""
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    search = {"name": "ToolSearch", "input_schema": {"type": "object"}}
    db = {"name": "mcp__db__query", "description": "Run a query.", "input_schema": ADD_SCHEMA,
          "defer_loading": True}
    asked = [{"role": "user", "content": "Query the db."},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_s",
                                                "name": "ToolSearch", "input": {}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_s",
                                           "content": [{"type": "text", "text": "none"}]}]}]
    loaded = [*asked[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_s",
         "content": [{"type": "tool_reference", "tool_name": "mcp__db__query"}]}]}]
    forced = {"type": "tool", "name": "mcp__db__query", "disable_parallel_tool_use": True}
    with pytest.raises(anthropic.BadRequestError, match=r"tool_choice\.name: .* deferred"):
        claude.beta.messages.create(model="demo", max_tokens=64, tools=[search, db],
                                    messages=asked, tool_choice=forced)
    reply = claude.beta.messages.create(model="demo", max_tokens=64, tools=[search, db],
                                        messages=loaded, tool_choice=forced,
                                        thinking={"type": "disabled"},
                                        betas=["advanced-tool-use-2025-11-20"])
    assert [(b.type, getattr(b, "name", None)) for b in reply.content] == [
        ("tool_use", "mcp__db__query")]
    assert reply.stop_reason == "tool_use"
    counted = [claude.beta.messages.count_tokens(model="demo", tools=[search, tool],
                                                 messages=asked).input_tokens
               for tool in (db, {**db, "defer_loading": False})]
    assert counted[0] < counted[1]


def test_the_sdks_tool_runner_drops_threads_and_changes_tools(server: ServerProcess,
                                                               http: httpx.Client) -> None:
    """The official tool runner threads by default (``thread``: the server holds the
    conversation, a ``continue`` sends only the new turn), which afmd cannot: Anthropic's
    ``thread_unsupported_request`` refusal makes it resend the whole conversation without
    one (before, ``thread`` was ignored and a continuation answered out of context); and
    its ``add_tools``/``remove_tools`` arrive as system messages' tool changes, after which
    only the added tool can be called."""
    refused = http.post(PATH, json=body(thread={"type": "continue",
                                                "previous_message_id": "msg_x"}))
    assert refused.status_code == 400
    assert refused.json()["error"]["details"] == {"error_code": "thread_unsupported_request"}
    assert error_of(refused)[1].startswith("thread: ")
    assert http.post(PATH, json=body(max_tokens=1, thread=None)).status_code == 200
    sent: list[dict[str, Any]] = []

    def record(request: httpx2.Request) -> None:
        if request.url.path == PATH:
            sent.append(json.loads(request.content))

    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                                 http_client=httpx2.Client(event_hooks={"request": [record]}))

    @anthropic.beta_tool
    def pick(unit: Literal["c", "f"]) -> str:
        """Pick a unit."""
        return unit

    @anthropic.beta_tool
    def flip(side: Literal["heads", "tails"]) -> str:
        """Flip a coin."""
        return side

    runner = claude.beta.messages.tool_runner(
        model="demo", max_tokens=40, tools=[pick], messages=[{"role": "user", "content": "Go."}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        thinking={"type": "disabled"}, max_iterations=2, betas=["inline-tools-2026-09-15"])
    called = []
    for message in runner:
        called += [b.name for b in message.content if b.type == "tool_use"]
        if len(called) == 1:
            assert runner.generate_tool_call_response() is not None  # pick's, run now
            runner.add_tools(flip)
            runner.remove_tools("pick")
    assert called == ["pick", "flip"]
    assert [("thread" in b, len(b["messages"])) for b in sent] == [(True, 1), (False, 1),
                                                                    (False, 4)]
    assert [b["type"] for b in sent[-1]["messages"][-1]["content"]] == ["tool_addition",
                                                                       "tool_removal"]


def test_thinking_refuses_a_forced_tool_choice() -> None:
    """Thinking on (``enabled``, ``adaptive``) with a ``tool_choice`` that forces a call
    (``any``, ``tool``) is Anthropic's 400 naming the choice, in a turn and in a count
    alike; ``auto`` and ``none`` think freely, and a forced call without thinking (off
    or left to the model's default) is answered."""
    forcing = ({"type": "any"}, {"type": "tool", "name": "add"})
    thinking_on = ({"type": "enabled", "budget_tokens": 4}, {"type": "adaptive"})
    for choice in forcing:
        for thinking in thinking_on:
            fields = {"tools": TOOLS, "tool_choice": choice, "thinking": thinking}
            for parse in (ANTHROPIC_MESSAGES.parse, parse_count_request):
                with pytest.raises(InvalidRequestError) as info:
                    parse(json.dumps(body(**fields)).encode())
                assert info.value.param == "tool_choice.type"
                assert info.value.message == ("Thinking may not be enabled when tool_choice "
                                              "forces tool use.")
        for thinking in ({"type": "disabled"}, None):
            fields = {"tools": TOOLS, "tool_choice": choice, "thinking": thinking}
            assert ANTHROPIC_MESSAGES.parse(json.dumps(body(**fields)).encode()
                                            ).tool_choice.mode == "required"
    for choice in ({"type": "auto"}, {"type": "none"}):
        for thinking in thinking_on:
            chat = ANTHROPIC_MESSAGES.parse(json.dumps(body(
                tools=TOOLS, tool_choice=choice, thinking=thinking)).encode())
            assert chat.tool_choice.mode == choice["type"]


def test_system_messages_stay_where_they_stand() -> None:
    """Claude Code's ``role: "system"`` messages inside ``messages`` (a string or text
    blocks) stay in place: one before the first turn joins the system prompt, one between
    a call and its results follows the results; the fields it sends that mean nothing
    locally are accepted, even under strict, and named."""
    raw = json.dumps({
        "model": "demo", "max_tokens": 32000, "system": "Top.",
        "messages": [
            {"role": "system", "content": "Early."},
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_a", "name": "add", "input": {"a": 1}}]},
            {"role": "system", "content": [{"type": "text", "text": "Mid."},
                                           {"type": "text", "text": "Still mid."}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_a", "content": "2"},
                {"type": "text", "text": "Go on."}]},
            {"role": "system", "content": "Late."},
        ],
        "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
        "metadata": {"user_id": "u"},
    }).encode()
    for strict in (False, True):
        chat = ANTHROPIC_MESSAGES.parse(raw, strict=strict)
        assert [(m.role, m.content, m.in_place) for m in chat.messages] == [
            ("system", "Top.", False), ("system", "Early.", True), ("user", "Hi.", False),
            ("assistant", None, False), ("tool", "2", False),
            ("system", "Mid.\n\nStill mid.", True), ("user", "Go on.", False),
            ("system", "Late.", True)]
        assert chat.ignored_fields == ("context_management", "metadata")
        assert chat.reasoning_effort == "high" and chat.max_tokens_shrinks
    assert [(m["role"], m["content"]) for m in template_messages(chat.messages)] == [
        ("system", "Top.\n\nEarly."), ("user", "Hi."), ("assistant", ""), ("tool", "2"),
        ("system", "Mid.\n\nStill mid."), ("user", "Go on."), ("system", "Late.")]
    for bad, param in (({"role": "system", "content": [{"type": "image"}]},
                        "messages[0].content[0].type"),
                       ({"role": "tool", "content": "x"}, "messages[0].role")):
        with pytest.raises(InvalidRequestError) as info:
            ANTHROPIC_MESSAGES.parse(json.dumps(body(messages=[bad, *MESSAGES])).encode())
        assert info.value.param == param
    for role, article in (("assistant", "an"), ("user", "a")):
        with pytest.raises(InvalidRequestError) as info:
            ANTHROPIC_MESSAGES.parse(json.dumps(body(messages=[
                *MESSAGES, {"role": role, "content": [{"type": "bogus"}]}])).encode())
        assert f"is not supported in {article} {role} message" in info.value.message
    with pytest.raises(InvalidRequestError) as info:  # a system message is no user turn
        ANTHROPIC_MESSAGES.parse(json.dumps(body(messages=[
            {"role": "system", "content": "Only this."}])).encode())
    assert info.value.code == "missing_user_message"
    # Nor does one between two assistant turns answer the first one's call.
    with pytest.raises(InvalidRequestError) as info:
        ANTHROPIC_MESSAGES.parse(json.dumps(body(messages=[
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {}}]},
            {"role": "system", "content": "note"},
            {"role": "assistant", "content": "more"},
            {"role": "user", "content": "next"}])).encode())
    assert (info.value.code, info.value.param) == ("missing_tool_output", "messages[1].content")


def test_plain_text_documents_are_read_and_others_refused_by_name() -> None:
    """A document block (the SDK's ``DocumentBlockParam``) in a user turn or a tool result:
    its text reaches the model, titled; a PDF or a URL is a 400 naming its source."""
    text = {"type": "document", "title": "Notes", "context": "From the meeting.",
            "citations": {"enabled": True},
            "source": {"type": "text", "media_type": "text/plain", "data": "Ship on Friday."}}
    blocks = {"type": "document", "source": {"type": "content", "content": [
        {"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}]}}
    chat = ANTHROPIC_MESSAGES.parse(json.dumps(body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Summarise:"}, text, blocks]}])).encode())
    assert chat.messages[-1].content == (
        "Summarise:\n\nDocument: Notes\nFrom the meeting.\n\nShip on Friday.\n\n"
        "Document:\n\nPart one.\n\nPart two.")
    call = {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [text]}
    chat = ANTHROPIC_MESSAGES.parse(json.dumps(body(messages=[
        {"role": "user", "content": "Read it."}, {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result]}])).encode())
    assert chat.messages[-1].role == "tool"
    assert chat.messages[-1].content.endswith("Ship on Friday.")
    pdf = {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}
    for source, param, code in (
            (pdf, "messages[0].content[0].source.type", "unsupported_document"),
            ({"type": "url", "url": "https://example.com/a.pdf"},
             "messages[0].content[0].source.type", "unsupported_document"),
            ({"type": "text", "media_type": "text/html", "data": "<p>"},
             "messages[0].content[0].source.media_type", "invalid_value"),
            ({"type": "content", "content": [{"type": "image"}]},
             "messages[0].content[0].source.content[0].type", "invalid_value")):
        with pytest.raises(InvalidRequestError) as info:
            ANTHROPIC_MESSAGES.parse(json.dumps(body(messages=[{"role": "user", "content": [
                {"type": "document", "source": source}]}])).encode())
        assert (info.value.param, info.value.code) == (param, code)


def _picture(fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (2, 2), (200, 30, 30)).save(buf, fmt)
    return buf.getvalue()


def test_an_image_is_of_its_declared_media_type() -> None:
    """Bytes of one of the four formats declared as another are Anthropic's 400 naming
    the block's media type, in a user turn and in a tool result alike; bytes of none of
    them are left for the decoder to name (a vision model's 400, a text model's refusal
    of images). The format is the one the bytes' signature names, as Pillow picks its
    decoder: a file with a PNG's signature and nothing readable after it is a PNG
    declared as a JPEG, not left to the decoder."""
    types = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif",
             "WEBP": "image/webp"}

    def parse(data: bytes, media: str, *, in_result: bool = False) -> ChatRequest:
        image = {"type": "image", "source": {"type": "base64", "media_type": media,
                                             "data": base64.b64encode(data).decode()}}
        if not in_result:
            messages = [{"role": "user", "content": [{"type": "text", "text": "What?"},
                                                     image]}]
        else:
            call = {"type": "tool_use", "id": "toolu_1", "name": "look", "input": {}}
            messages = [{"role": "user", "content": "Look."},
                        {"role": "assistant", "content": [call]},
                        {"role": "user", "content": [{"type": "tool_result",
                                                      "tool_use_id": "toolu_1",
                                                      "content": [image]}]}]
        return ANTHROPIC_MESSAGES.parse(json.dumps(body(messages=messages)).encode())

    for fmt, actual in types.items():
        data = _picture(fmt)
        assert parse(data, actual).messages[-1].images[0].data == data
        for declared in types.values():
            if declared == actual:
                continue
            with pytest.raises(InvalidRequestError) as info:
                parse(data, declared)
            assert info.value.param == "messages[0].content[1].source.media_type"
            assert info.value.message == (
                f"The image was specified using the {declared} media type, but the image "
                f"appears to be a {actual} image.")
    with pytest.raises(InvalidRequestError) as info:
        parse(_picture("PNG"), "image/jpeg", in_result=True)
    assert info.value.param == "messages[2].content[0].content[0].source.media_type"
    for unknown in (b"BM" + bytes(60), b"GIF90a" + bytes(40), b""):
        assert parse(unknown, "image/jpeg").messages[-1].images[0].data == unknown
    with pytest.raises(InvalidRequestError) as info:
        parse(b"\x89PNG\r\n\x1a\n" + bytes(40), "image/jpeg")
    assert info.value.param == "messages[0].content[1].source.media_type"


#: The demo's template, made to refuse a system turn anywhere but first (as many do).
_FIRST_SYSTEM_ONLY = (
    "{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}"
    "{{- raise_exception('System message must be at the beginning.') }}"
    "{%- endif %}{%- endfor %}" + CHAT_TEMPLATE)


class _FirstSystemOnly:
    """The demo's tokenizer rendering through :data:`_FIRST_SYSTEM_ONLY`."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> Any:
        return self._tokenizer.apply_chat_template(messages, chat_template=_FIRST_SYSTEM_ONLY,
                                                   **kwargs)

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return list(self._tokenizer.encode(text, **kwargs))


def test_late_system_turns_rendered_in_place_or_folded(demo_model: LoadedModel) -> None:
    """The demo's template renders a system turn where it stands; one that refuses it
    gets the text folded into the next user turn (the one before, at the end)."""
    messages = [{"role": "system", "content": "Top."}, {"role": "user", "content": "Hi."},
                {"role": "system", "content": "Mid."}, {"role": "user", "content": "Go."},
                {"role": "system", "content": "Late."}]
    decode = demo_model.tokenizer.decode
    text = decode(demo_model.render_prompt(messages))
    assert ("<|im_start|>user\nHi.<|im_end|>\n<|im_start|>system\nMid.<|im_end|>\n"
            "<|im_start|>user\nGo.<|im_end|>\n<|im_start|>system\nLate.<|im_end|>") in text
    strict = dataclasses.replace(demo_model, tokenizer=_FirstSystemOnly(demo_model.tokenizer))
    folded = decode(strict.render_prompt(messages))
    assert "<|im_start|>system" not in folded.split("<|im_end|>", 1)[1]
    assert "<|im_start|>user\nMid.\n\nGo.\n\nLate.<|im_end|>" in folded
    assert folded_system_turns(messages[:2]) is None


def test_claude_codes_fields_and_overflow_on_the_wire(http: httpx.Client,
                                                      tight: ServerProcess) -> None:
    """A body as Claude Code sends it is answered, the unused fields named; count_tokens
    counts a system message inside ``messages``; a prompt over the window is Anthropic's
    ``prompt is too long`` on both routes."""
    claude = body(max_tokens=32000, thinking={"type": "adaptive"},
                  output_config={"effort": "medium"}, metadata={"user_id": "u"},
                  context_management={"edits": []},
                  messages=[{"role": "system", "content": "Be terse."}, *MESSAGES,
                            {"role": "system", "content": [{"type": "text", "text": "Now."}]}])
    beta = {"anthropic-beta": "claude-code-20250219,mid-conversation-system-2026-04-07"}
    response = http.post(PATH + "?beta=true", json={**claude, "max_tokens": 4}, headers=beta)
    assert response.status_code == 200, response.text
    assert response.headers["x-afm-ignored-fields"] == "metadata, context_management"
    validate_message(response.json())
    count = PATH + "/count_tokens?beta=true"
    plain = {k: claude[k] for k in ("model", "messages")}
    with_system = http.post(count, json=plain, headers=beta).json()["input_tokens"]
    without = http.post(count, json={**plain, "messages": MESSAGES}).json()["input_tokens"]
    assert with_system > without + 4
    long = [{"role": "user", "content": "word " * 200}]
    for path, extra in ((PATH, {"max_tokens": 32000}), (PATH + "/count_tokens", {})):
        refused = httpx.post(tight.url + path, timeout=60,
                             json={"model": "tiny-ctx", "messages": long, **extra})
        assert refused.status_code == 400, refused.text
        kind, message = error_of(refused)
        match = re.fullmatch(r"prompt is too long: (\d+) tokens > 64 maximum", message)
        assert kind == "invalid_request_error" and match and int(match[1]) > 200, message


def test_output_chain_names_the_stop_that_matched() -> None:
    output = OutputProcessor(stops=("END", "</answer>"))
    assert output.stop_sequence is None
    pieces = output.feed("some text </ans") + output.feed("wer> more")
    assert output.stopped_by_sequence and output.stop_sequence == "</answer>"
    assert "".join(p.text for p in pieces) == "some text"


@pytest.fixture(scope="module")
def demo_model() -> Iterator[LoadedModel]:
    registry = ModelRegistry(load_config(None, env={}))

    async def load() -> LoadedModel:
        return await registry.begin_load(registry.resolve("demo"))

    yield asyncio.run(load())
    registry.close()


def test_thinking_budget_closes_the_block_in_free_text(demo_model: LoadedModel) -> None:
    """With no tools and no format the budget still binds: a grammar ends the thinking
    block at the budget (and a request without a budget keeps the grammar-free path)."""
    request = ChatRequest(messages=(Message("user", "Hi"),), thinking_budget=3)
    prompt = demo_model.render_prompt([{"role": "user", "content": "Hi"}])
    assert plan_output(ChatRequest(messages=request.messages), demo_model, prompt,
                     64).grammar is None
    grammar = plan_output(request, demo_model, prompt, 64).grammar
    assert grammar is not None
    tokenizer = llg_tokenizer(demo_model.tokenizer, demo_model.vocab_size, demo_model.eos_ids)
    start, end = (tokenizer.tokenize_str(m) for m in ("<think>", "</think>"))
    words = tokenizer.tokenize_str(" one two three four")
    assert len(words) >= 4
    matcher = grammar.matcher()
    assert matcher.consume_tokens(start + words[:3])
    assert matcher.validate_tokens(words[3:4]) == 0, "a fourth thinking token"
    assert matcher.validate_tokens(end) == len(end)
    free = grammar.matcher()
    assert free.consume_tokens(words), "an answer without thinking is free text"


def test_message_start_counts_the_prompt(http: httpx.Client) -> None:
    """Many clients take a stream's input tokens from ``message_start`` alone (and only
    ``output_tokens`` from ``message_delta``): it said 0. It counts the whole prompt; the
    end's usage splits it into what the prefix cache held and what it did not."""
    messages = [{"role": "user", "content": f"Count me {uuid.uuid4().hex}."}]
    for turn in range(2):  # the second finds the first's prompt in the prefix cache
        response = http.post(PATH, json={"model": "demo", "max_tokens": 4, "stream": True,
                                         "messages": messages})
        assert response.status_code == 200, response.text
        events = parse_events(response.text)
        start = events[0][1]["message"]["usage"]
        end = next(data for name, data in events if name == "message_delta")["usage"]
        prompt = end["input_tokens"] + end["cache_read_input_tokens"]
        assert prompt > 0 and start["input_tokens"] == prompt, (start, end)
        assert start["output_tokens"] == 0 and end["output_tokens"] > 0
        if turn:
            assert end["cache_read_input_tokens"] > 0, end


def test_a_whitespace_stop_sequence_is_anthropics_400_under_strict() -> None:
    """Anthropic refuses a stop sequence of whitespace only ("stop_sequences: each stop
    sequence must contain non-whitespace"), which clients written for other APIs send
    (``"\\n"``): a strict server refuses it as Anthropic does, where it was taken, so the
    client's bug surfaced only against Anthropic. Without ``[api] strict`` it still acts."""
    stops = ["END", "\n", " \t"]
    raw = json.dumps(body(stop_sequences=stops)).encode()
    assert ANTHROPIC_MESSAGES.parse(raw).stop == tuple(stops)
    with pytest.raises(InvalidRequestError) as info:
        ANTHROPIC_MESSAGES.parse(raw, strict=True)
    assert info.value.param == "stop_sequences[1]"
    assert info.value.message == "each stop sequence must contain non-whitespace"
    raw = json.dumps(body(stop_sequences=["END", "x y"])).encode()
    assert ANTHROPIC_MESSAGES.parse(raw, strict=True).stop == ("END", "x y")
