"""Every bad request against the real server: OpenAI's error envelope with a precise param."""

from __future__ import annotations

import time
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import httpx
import pytest

from afmd.dialects.fields.nesting import MAX_NESTING, param_of
from afmd.errors import MAX_MESSAGE_CHARS, MAX_PARAM_CHARS, InvalidRequestError, ServerError

from conftest import ServerProcess, start_server
from helpers.openai_schemas import validate_error, validate_response

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "Say something."}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
DEMO_CONTEXT = 131072


def check_error(
    response: httpx.Response,
    status: int,
    code: str,
    param: str | None,
    error_type: str = "invalid_request_error",
) -> dict[str, Any]:
    """Assert ``response`` is exactly the envelope described; return its ``error``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].split(";")[0].strip() == "application/json"
    body = response.json()
    validate_error(body)
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code, error
    assert error["param"] == param, error
    assert error["type"] == error_type, error
    message = error["message"]
    assert isinstance(message, str) and len(message) >= 10 and " " in message.strip()
    assert message[0].isupper() or message[0] == "'", message
    for leak in ("Traceback", 'File "', "object at 0x", "Error(", "\n"):
        assert leak not in message, message
    return error


def _body(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"messages": list(messages) or [USER], **fields}


def _deep_part_type(levels: int) -> bytes:
    """A content part whose ``type`` is an array nested ``levels`` deep, as JSON text."""
    return (b'{"messages": [{"role": "user", "content": [{"type": '
            + b"[" * levels + b"]" * levels + b"}]}]}")


def _deep_schema(levels: int) -> bytes:
    return (b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": '
            b'"json_schema", "json_schema": {"name": "x", "schema": '
            + b'{"items": ' * levels + b"true" + b"}" * levels + b"}}}")


# The param of a too-deep value: its path down to the first level past the limit.
DEEP_PART_TYPE = param_of(["messages", 0, "content", 0, "type", *[0] * (MAX_NESTING - 5)])
DEEP_SCHEMA = param_of(["response_format", "json_schema", "schema",
                        *["items"] * (MAX_NESTING - 4)])


# (request body: a dict sent as JSON or raw bytes, status, code, param)
CASES = [
    pytest.param(_deep_part_type(1000), 400, "invalid_value", DEEP_PART_TYPE,
                 id="deep-content-part-type"),
    pytest.param(_deep_part_type(2000), 400, "invalid_value", DEEP_PART_TYPE,
                 id="deep-content-part-type-beyond-the-parser"),
    pytest.param(_deep_schema(500), 400, "invalid_value", DEEP_SCHEMA, id="deep-schema"),
    pytest.param(b'{"messages": [', 400, "invalid_json", None, id="invalid-json"),
    pytest.param(b"{'messages': []}", 400, "invalid_json", None, id="single-quoted-json"),
    pytest.param(b"", 400, "invalid_json", None, id="empty-body"),
    pytest.param(b'[{"role": "user", "content": "hi"}]', 400, "invalid_type", None,
                 id="array-body"),
    pytest.param(b'"hello"', 400, "invalid_type", None, id="string-body"),
    pytest.param({"model": "demo"}, 400, "missing_required_parameter", "messages",
                 id="messages-missing"),
    pytest.param({"messages": None}, 400, "missing_required_parameter", "messages",
                 id="messages-null"),
    pytest.param({"messages": "Say something."}, 400, "invalid_type", "messages",
                 id="messages-not-array"),
    pytest.param({"messages": []}, 400, "invalid_value", "messages", id="messages-empty"),
    pytest.param(_body(USER, "hello"), 400, "invalid_type", "messages[1]",
                 id="message-not-object"),
    pytest.param(_body(SYSTEM, {"content": "hi"}), 400, "missing_required_parameter",
                 "messages[1].role", id="role-missing"),
    pytest.param(_body({"role": "robot", "content": "hi"}), 400, "invalid_value",
                 "messages[0].role", id="role-unknown"),
    pytest.param(_body(SYSTEM, {"role": "user", "content": 42}), 400, "invalid_type",
                 "messages[1].content", id="content-wrong-type"),
    pytest.param(_body(SYSTEM, {"role": "user"}), 400, "missing_required_parameter",
                 "messages[1].content", id="content-missing"),
    pytest.param(_body({"role": "user", "content": [{"type": "text", "text": "a"},
                                                    {"type": "text"}]}),
                 400, "missing_required_parameter", "messages[0].content[1].text",
                 id="content-part-missing-text"),
    pytest.param(_body({"role": "user", "content": [{"type": "hologram", "text": "a"}]}),
                 400, "invalid_value", "messages[0].content[0].type",
                 id="content-part-unknown-type"),
    pytest.param(_body({"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}),
                 400, "invalid_value", "messages[0].content[0].type", id="content-part-audio"),
    # OpenAI's schema gives these roles text parts only, and its API refuses an image in
    # them: accepted here, a client found out only on OpenAI.
    *(pytest.param(_body(*before, {"role": role, "content": [
        {"type": "text", "text": "see"}, {"type": "image_url", "image_url": {
            "url": "data:image/png;base64,iVBORw0KGgo="}}]}, *after),
        400, "invalid_value", f"messages[{len(before)}].content[1].image_url",
        id=f"image-in-{role}-message")
      for role, before, after in (("system", (), (USER,)), ("developer", (), (USER,)),
                                  ("assistant", (USER,), (USER,)))),
    pytest.param(_body(USER, {"role": "assistant", "tool_calls": [CALL]},
                       {"role": "tool", "content": "sunny"}),
                 400, "missing_required_parameter", "messages[2].tool_call_id",
                 id="tool-message-without-tool-call-id"),
    pytest.param(_body(USER, {"role": "assistant", "content": None}, USER),
                 400, "missing_required_parameter", "messages[1].content",
                 id="assistant-without-content-or-tool-calls"),
    pytest.param(_body(USER, {"role": "assistant", "tool_calls": [
        CALL, {"id": "call_2", "type": "function", "function": {"arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}),
        400, "missing_required_parameter", "messages[1].tool_calls[1].function.name",
        id="tool-call-without-name"),
    pytest.param(_body(SYSTEM, {"role": "assistant", "content": "Hello!"}, SYSTEM),
                 400, "missing_user_message", "messages", id="no-user-message"),
    pytest.param(_body(SYSTEM, USER, {"role": "assistant", "content": "Sure."}),
                 400, "invalid_last_message", "messages[2].role", id="trailing-assistant"),
    pytest.param(_body(temperature=2.5), 400, "invalid_value", "temperature",
                 id="temperature-out-of-range"),
    pytest.param(_body(temperature=-1), 400, "invalid_value", "temperature",
                 id="temperature-negative"),
    pytest.param(_body(temperature="hot"), 400, "invalid_type", "temperature",
                 id="temperature-wrong-type"),
    pytest.param(_body(top_p=1.1), 400, "invalid_value", "top_p", id="top-p-out-of-range"),
    pytest.param(_body(max_tokens=0), 400, "invalid_value", "max_tokens", id="max-tokens-0"),
    pytest.param(_body(max_tokens="5"), 400, "invalid_type", "max_tokens",
                 id="max-tokens-string"),
    pytest.param(_body(max_tokens=1.5), 400, "invalid_type", "max_tokens",
                 id="max-tokens-fraction"),
    pytest.param(_body(max_tokens=True), 400, "invalid_type", "max_tokens",
                 id="max-tokens-boolean"),
    pytest.param(_body(max_completion_tokens=-3), 400, "invalid_value",
                 "max_completion_tokens", id="max-completion-tokens-negative"),
    pytest.param(_body(n=9), 400, "invalid_value", "n", id="n-9"),
    pytest.param(_body(seed="42"), 400, "invalid_type", "seed", id="seed-string"),
    pytest.param(_body(stream="yes"), 400, "invalid_type", "stream", id="stream-not-bool"),
    pytest.param(_body(stream_options={"include_usage": True}), 400, "invalid_value",
                 "stream_options", id="stream-options-without-stream"),
    pytest.param(_body(stop=[f"s{i}" for i in range(17)]), 400, "invalid_value", "stop",
                 id="stop-seventeen-entries"),
    pytest.param(_body(stop=["END", 7]), 400, "invalid_type", "stop[1]",
                 id="stop-non-string-entry"),
    pytest.param(_body(stop=12), 400, "invalid_type", "stop", id="stop-number"),
    pytest.param(_body(logprobs=True, top_logprobs=21), 400, "invalid_value", "top_logprobs",
                 id="top-logprobs-above-20"),
    pytest.param(_body(functions=[{"name": "get_weather", "parameters": {}}]), 400,
                 "invalid_value", "functions", id="legacy-functions"),
    pytest.param(_body(tools=[{"type": "function", "function": {"name": "get weather"}}]),
                 400, "invalid_value", "tools[0].function.name", id="tool-name-invalid"),
    pytest.param(_body(tools=[WEATHER], tool_choice={"type": "function"}), 400,
                 "missing_required_parameter", "tool_choice.function",
                 id="tool-choice-without-function"),
    pytest.param(_body(model=7), 400, "invalid_type", "model", id="model-wrong-type"),
    pytest.param(_body(model="gpt-nonexistent"), 404, "model_not_found", "model",
                 id="unknown-model"),
    pytest.param(_body(model="gpt-nonexistent", stream=True), 404, "model_not_found",
                 "model", id="unknown-model-streaming"),
    pytest.param(_body(max_tokens=DEMO_CONTEXT + 1000), 400, "context_length_exceeded",
                 "messages", id="max-tokens-beyond-context"),
    pytest.param(_body(max_tokens=DEMO_CONTEXT, stream=True), 400,
                 "context_length_exceeded", "messages",
                 id="max-tokens-beyond-context-streaming"),
]


@pytest.mark.parametrize(("body", "status", "code", "param"), CASES)
def test_bad_request(
    server: ServerProcess,
    http: httpx.Client,
    request: pytest.FixtureRequest,
    body: dict[str, Any] | bytes,
    status: int,
    code: str,
    param: str | None,
) -> None:
    request_id = "err-" + request.node.callspec.id
    start = len(server.raw_lines)
    headers = {"X-Request-ID": request_id, "Content-Type": "application/json"}
    if isinstance(body, bytes):
        response = http.post("/v1/chat/completions", content=body, headers=headers)
    else:
        response = http.post("/v1/chat/completions", json=body, headers=headers)
    check_error(response, status, code, param)
    # The error still carries the client's request id, and the access log records the
    # refusal without any generation having run.
    assert response.headers["x-request-id"] == request_id
    event = server.wait_event("request", timeout=10, request_id=request_id)
    assert event["status"] == status
    assert "completion_tokens" not in event
    log = "".join(server.raw_lines[start:])
    assert "Traceback" not in log
    assert "unhandled error" not in log


def _send(http: httpx.Client, body: Any, request_id: str) -> httpx.Response:
    return http.post("/v1/chat/completions", json=body, headers={"X-Request-ID": request_id})


def test_remote_image_url_refused(http: httpx.Client) -> None:
    """afmd never fetches URLs: a text-only build refuses the part, a vision one the URL."""
    body = _body(SYSTEM, {"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    ]})
    response = _send(http, body, "err-remote-image")
    error = response.json().get("error", {})
    expected = {
        ("invalid_value", "messages[1].content[1].type"),
        ("unsupported_image_url", "messages[1].content[1].image_url.url"),
    }
    assert (error.get("code"), error.get("param")) in expected, response.text
    check_error(response, 400, error["code"], error["param"])


def test_tool_choice_naming_unknown_tool(http: httpx.Client) -> None:
    body = _body(tools=[WEATHER],
                 tool_choice={"type": "function", "function": {"name": "get_time"}})
    response = _send(http, body, "err-unknown-tool")
    error = response.json().get("error", {})
    assert error.get("code") in ("invalid_value", "unknown_tool"), response.text
    check_error(response, 400, error["code"], "tool_choice.function.name")
    assert "get_time" in error["message"]


IGNORED = {
    "user": "user-1234",
    "metadata": {"purpose": "test"},
    "store": False,
    "logprobs": False,
    "service_tier": "auto",
    "reasoning_effort": "low",
}


@pytest.mark.parametrize(("key", "value"), list(IGNORED.items()), ids=list(IGNORED))
def test_ignored_field_accepted(http: httpx.Client, key: str, value: Any) -> None:
    response = http.post("/v1/chat/completions",
                         json=_body(max_tokens=2, temperature=0, **{key: value}))
    assert response.status_code == 200, response.text
    body = response.json()
    validate_response(body)
    assert body["usage"]["completion_tokens"] == 2
    assert "X-AFM-Ignored-Fields" not in response.headers  # OpenAI's fields: known


def test_unknown_top_level_field_ignored_and_named(http: httpx.Client) -> None:
    """A misspelt field is no error by default ([api] strict is off), but the response
    says it was ignored (tests/server/test_tolerant_requests.py covers strict mode)."""
    response = http.post("/v1/chat/completions",
                         json=_body(max_tokens=2, temprature=0.2))
    assert response.status_code == 200, response.text
    validate_response(response.json())
    assert response.headers["X-AFM-Ignored-Fields"] == "temprature"


def test_all_ignored_fields_together_change_nothing(http: httpx.Client) -> None:
    # reasoning_effort may steer a thinking model, so it is left out of this comparison.
    ignored = {k: v for k, v in IGNORED.items() if k != "reasoning_effort"}
    plain = http.post("/v1/chat/completions", json=_body(max_tokens=6, temperature=0))
    with_ignored = http.post("/v1/chat/completions",
                             json=_body(max_tokens=6, temperature=0, **ignored))
    assert plain.status_code == with_ignored.status_code == 200, with_ignored.text
    assert (with_ignored.json()["choices"][0]["message"]["content"]
            == plain.json()["choices"][0]["message"]["content"])


def test_stop_with_four_entries_accepted(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions",
                         json=_body(max_tokens=2, stop=["\u2603", "\u2604", "\u2605", "\u2606"]))
    assert response.status_code == 200, response.text
    validate_response(response.json())


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/nope"), ("POST", "/v1/edits"), ("GET", "/v1"), ("GET", "/nope"),
     ("POST", "/v1/chat/completion")],
    ids=["get-unknown", "legacy-edits", "bare-v1", "top-level", "typo"],
)
def test_unknown_path(http: httpx.Client, method: str, path: str) -> None:
    response = http.request(method, path, json=_body())
    error = check_error(response, 404, "unknown_url", None)
    assert path in error["message"]


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/chat/completions", "POST"),
        ("DELETE", "/chat/completions", "POST"),
        ("POST", "/health", "GET"),
        ("POST", "/v1/models", "GET"),
    ],
    ids=["get-chat", "put-chat", "delete-root-chat", "post-health", "post-models"],
)
def test_wrong_method(http: httpx.Client, method: str, path: str, allowed: str) -> None:
    response = http.request(method, path)
    error = check_error(response, 405, "method_not_allowed", None)
    allow = {m.strip() for m in response.headers["allow"].split(",")}
    assert allowed in allow
    assert method not in allow
    assert method in error["message"]


@pytest.mark.parametrize(
    "value", ["has space", "x" * 129, "semi;colon", "quote\"d"],
    ids=["space", "too-long", "semicolon", "quote"],
)
def test_invalid_request_id(http: httpx.Client, value: str) -> None:
    response = http.post("/v1/chat/completions", json=_body(max_tokens=1),
                         headers={"X-Request-ID": value})
    check_error(response, 400, "invalid_value", "X-Request-ID")
    assert response.headers.get("x-request-id") != value


def test_request_id_of_128_characters_accepted(http: httpx.Client) -> None:
    value = "a.b_c:d-" * 16
    response = http.post("/v1/chat/completions", json=_body(max_tokens=1),
                         headers={"X-Request-ID": value})
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == value


def _check_header_limit(status: int, content_type: str, raw: bytes) -> None:
    response = httpx.Response(status, headers={"content-type": content_type}, content=raw)
    error = check_error(response, 431, "malformed_request", None)
    assert "max_header_bytes" in error["message"]
    assert "body" not in error["message"]


def test_oversized_header_is_not_blamed_on_the_body(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json=_body(max_tokens=1),
                         headers={"X-Padding": "p" * 70_000})
    _check_header_limit(response.status_code, response.headers["content-type"],
                        response.content)


def test_oversized_url_is_not_blamed_on_the_body(server: ServerProcess) -> None:
    # httpx refuses such URLs itself, so this one goes through http.client.
    conn = HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("GET", "/v1/models/" + "m" * 70_000)
        response = conn.getresponse()
        _check_header_limit(response.status, response.getheader("content-type") or "",
                            response.read())
    finally:
        conn.close()


def test_unknown_model_lists_available_models(http: httpx.Client) -> None:
    error = check_error(http.post("/v1/chat/completions", json=_body(model="nope-7b")),
                        404, "model_not_found", "model")
    assert "nope-7b" in error["message"] and "demo" in error["message"]


def test_long_values_are_cut_short_in_errors(http: httpx.Client) -> None:
    """A 200,000-character value makes a small error, never a 200 KB one."""
    long = "t" * 200_000
    response = http.post("/v1/chat/completions", json=_body(
        {"role": "user", "content": [{"type": long}]}))
    error = check_error(response, 400, "invalid_value", "messages[0].content[0].type")
    assert len(response.content) < 2048 and "(200000 characters)" in error["message"]
    # The model name is quoted by another layer; every error body is bounded all the same.
    response = http.post("/v1/chat/completions", json=_body(model=long))
    check_error(response, 404, "model_not_found", "model")
    assert len(response.content) < 2048, len(response.content)


def test_every_error_message_and_param_is_bounded() -> None:
    err = ServerError("Boom " + "x" * 100_000, param="p" * 10_000)
    assert len(err.message) < MAX_MESSAGE_CHARS + 100
    assert err.message.startswith("Boom xxx") and "100005 characters" in err.message
    assert err.param is not None and len(err.param) == MAX_PARAM_CHARS
    assert err.envelope()["error"]["message"] == err.message
    short = InvalidRequestError("Fine as it is.", param="messages[0]")
    assert (short.message, short.param) == ("Fine as it is.", "messages[0]")


def test_context_budget_boundary_on_demo(http: httpx.Client) -> None:
    """Prompt plus max_tokens may fill the 131,072-token window exactly, not one more."""
    probe = http.post("/v1/chat/completions", json=_body(max_tokens=1))
    assert probe.status_code == 200, probe.text
    prompt_tokens = probe.json()["usage"]["prompt_tokens"]
    over = DEMO_CONTEXT - prompt_tokens + 1
    for key in ("max_tokens", "max_completion_tokens"):
        error = check_error(http.post("/v1/chat/completions", json=_body(**{key: over})),
                            400, "context_length_exceeded", "messages")
        assert str(DEMO_CONTEXT) in error["message"]
        assert str(DEMO_CONTEXT + 1) in error["message"]


# --------------------------------------------------------------------------- small context

TINY_CONTEXT = 64
TINY_BODY_LIMIT = 100_000
TINY_CONFIG = f"""
[server]
max_request_body_bytes = {TINY_BODY_LIMIT}

[[models.model]]
id = "tiny-ctx"
path = "afmd:demo"
context_length = {TINY_CONTEXT}
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(Path(tmp_path_factory.mktemp("tiny-ctx")), config=TINY_CONFIG)
    yield proc
    proc.stop()


def _tiny_post(tiny: ServerProcess, body: dict[str, Any], request_id: str) -> httpx.Response:
    with httpx.Client(base_url=tiny.url, timeout=60) as c:
        return c.post("/v1/chat/completions", json={"model": "tiny-ctx", **body},
                      headers={"X-Request-ID": request_id})


def _prompt_tokens(tiny: ServerProcess, request_id: str) -> int:
    """Load the tiny-context model with a request that fits, and measure the short prompt
    (greedy: a sampled demo model ends with its end token after one token now and then)."""
    response = _tiny_post(tiny, _body(max_tokens=2, temperature=0), request_id)
    assert response.status_code == 200, response.text
    assert tiny.wait_event("request", timeout=10, request_id=request_id)["status"] == 200
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == 2
    assert usage["prompt_tokens"] + 2 <= TINY_CONTEXT
    return usage["prompt_tokens"]


def test_context_length_from_model_entry(tiny: ServerProcess) -> None:
    prompt_tokens = _prompt_tokens(tiny, "tiny-warm-budget")
    fits = TINY_CONTEXT - prompt_tokens
    response = _tiny_post(tiny, _body(max_tokens=fits, temperature=0), "tiny-fits")
    assert response.status_code == 200, response.text
    assert 0 < response.json()["usage"]["completion_tokens"] <= fits
    error = check_error(_tiny_post(tiny, _body(max_tokens=fits + 1), "tiny-over"),
                        400, "context_length_exceeded", "messages")
    assert f"{TINY_CONTEXT} tokens" in error["message"]
    # Without max_tokens the completion gets whatever the prompt leaves.
    response = _tiny_post(tiny, _body(temperature=0), "tiny-rest")
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= fits


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_long_prompt_refused_before_generation(tiny: ServerProcess, stream: bool) -> None:
    request_id = f"tiny-long-{stream}".lower()
    # The model is loaded and its log line written: what follows is the refusal alone.
    _prompt_tokens(tiny, f"{request_id}-warm")
    long_prompt = " ".join(f"word{i}" for i in range(3000))
    start = len(tiny.raw_lines)
    t0 = time.perf_counter()
    response = _tiny_post(tiny, _body({"role": "user", "content": long_prompt},
                                      stream=stream), request_id)
    elapsed = time.perf_counter() - t0
    error = check_error(response, 400, "context_length_exceeded", "messages")
    assert f"{TINY_CONTEXT} tokens" in error["message"]
    assert elapsed < 2.0, f"refusal took {elapsed:.2f}s"
    event = tiny.wait_event("request", timeout=10, request_id=request_id)
    assert event["status"] == 400
    assert event["model"] == "tiny-ctx"
    assert "completion_tokens" not in event and "prompt_tokens" not in event
    log = "".join(tiny.raw_lines[start:])
    assert "completion_tokens" not in log
    assert "Traceback" not in log
    with httpx.Client(base_url=tiny.url, timeout=10) as c:
        assert c.get("/health").json()["active_requests"] == 0


def test_oversized_body(tiny: ServerProcess) -> None:
    body = _body({"role": "user", "content": "x" * (TINY_BODY_LIMIT + 10)})
    response = _tiny_post(tiny, body, "tiny-big-body")
    error = check_error(response, 413, "malformed_request", None)
    assert "max_request_body_bytes" in error["message"]


@pytest.mark.parametrize("max_tokens", [None, 8], ids=["no-max-tokens", "max-tokens"])
def test_long_prompt_worded_as_openai_words_an_input_overflow(tiny: ServerProcess,
                                                               max_tokens: int | None) -> None:
    """Clients tell a context overflow from other 400s by the message alone (the openai SDK
    3.x puts only the message in the exception's text, which is what LangChain searches for
    OpenAI's ``Input tokens exceed the configured limit``): a prompt that alone fills the
    window says so, with or without ``max_tokens``."""
    import openai

    _prompt_tokens(tiny, f"tiny-input-words-{max_tokens}-warm")
    client = openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="unused", max_retries=0)
    long_prompt = " ".join(f"word{i}" for i in range(3000))
    extra: dict[str, Any] = {} if max_tokens is None else {"max_tokens": max_tokens}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny-ctx", messages=[{"role": "user", "content": long_prompt}], **extra)
    assert info.value.code == "context_length_exceeded"
    assert info.value.param == "messages"
    assert "Input tokens exceed the configured limit of 64 tokens." in str(info.value)
    assert "Please reduce the length of the messages." in info.value.message
