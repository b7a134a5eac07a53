"""Tolerant requests: fields meant for other servers are ignored and named, not refused.

IDE plugins and agent frameworks send Ollama's and llama.cpp's fields (``options``,
``cache_prompt``, ``num_ctx``) to whatever server they are pointed at. By default afmd
ignores an unknown top-level field and names it in ``X-AFM-Ignored-Fields``; ``[api]
strict = true`` refuses it as OpenAI does (and as Anthropic does on ``/v1/messages``).
The local-server extensions are honoured: ``chat_template_kwargs`` reaches the chat
template, ``repeat_penalty`` is ``repetition_penalty``. Everything runs against real
servers on the demo model, through the official clients where they exist.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from afmd.config.load import load_config
from afmd.http.routes.ignored import MAX_NAME_CHARS, MAX_NAMES, header_value

from conftest import ServerProcess, parse_sse, start_server
from helpers.openai_schemas import validate_chunk, validate_error, validate_response

HEADER = "X-AFM-Ignored-Fields"
USER = [{"role": "user", "content": "Say something."}]
#: What an IDE plugin configured for Ollama or llama.cpp adds to every request.
FOREIGN = {"options": {"num_ctx": 4096}, "cache_prompt": True, "num_ctx": 4096}
FOREIGN_NAMES = "options, cache_prompt, num_ctx"
EVIL = "x\r\nSet-Cookie: stolen=1"


@pytest.fixture(scope="module")
def tolerant(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The default [api] settings, logging at debug (the ignored fields' log line)."""
    proc = start_server(tmp_path_factory.mktemp("tolerant"), config='[log]\nlevel = "debug"\n')
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("strict"), config="[api]\nstrict = true\n")
    yield proc
    proc.stop()


@pytest.fixture()
def http(tolerant: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tolerant.url, timeout=60) as c:
        yield c


@pytest.fixture()
def client(tolerant: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=tolerant.url + "/v1", api_key="unused", max_retries=0)


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "demo", "messages": USER, "max_tokens": 4, "temperature": 0, **fields}


# ---------------------------------------------------------------------------- the default


def test_openai_client_with_foreign_fields_gets_its_answer(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="demo", messages=USER, max_tokens=4, temperature=0, extra_body=FOREIGN)
    assert raw.http_response.status_code == 200
    completion = raw.parse()
    validate_response(completion.model_dump(exclude_unset=True))
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    assert raw.headers[HEADER] == FOREIGN_NAMES
    # Ignoring them changes nothing: the same greedy answer as without them.
    plain = client.chat.completions.create(model="demo", messages=USER, max_tokens=4,
                                           temperature=0)
    assert completion.choices[0].message.content == plain.choices[0].message.content


def test_the_header_is_absent_when_nothing_was_ignored(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json=_chat(user="u", keep_alive="5m"))
    assert response.status_code == 200, response.text
    assert HEADER not in response.headers


def test_a_stream_names_them_on_its_head(tolerant: ServerProcess,
                                         client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="demo", messages=USER, max_tokens=4, temperature=0, stream=True,
        extra_body=FOREIGN))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"
    with httpx.stream("POST", tolerant.url + "/v1/chat/completions", timeout=60,
                      json=_chat(stream=True, **FOREIGN)) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers[HEADER] == FOREIGN_NAMES
        events = parse_sse(response.read().decode())
    assert events[-1] == "[DONE]"
    for chunk in events[:-1]:
        validate_chunk(chunk)


def test_the_ignored_fields_are_logged_at_debug(tolerant: ServerProcess,
                                                http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json=_chat(num_ctx=1),
                         headers={"X-Request-ID": "tolerant-log-1"})
    assert response.status_code == 200, response.text
    event = tolerant.wait_event("ignored_fields", request_id="tolerant-log-1")
    assert (event["level"], event["fields"], event["count"]) == ("debug", "num_ctx", 1)


def test_a_known_field_with_a_wrong_value_is_still_a_400(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json=_chat(temperature="hot", **FOREIGN))
    assert response.status_code == 400
    validate_error(response.json())
    assert response.json()["error"]["param"] == "temperature"
    assert HEADER not in response.headers
    # A nested unknown field stays an error: only top-level fields are tolerated.
    response = http.post("/v1/chat/completions",
                         json=_chat(stream=True, stream_options={"include_usage": True,
                                                                 "chunk_size": 1}))
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "unknown_parameter"
    assert response.json()["error"]["param"] == "stream_options.chunk_size"
    # The deprecated function-calling fields are refused, never silently dropped.
    response = http.post("/v1/chat/completions", json=_chat(functions=[{"name": "f"}]))
    assert (response.status_code, response.json()["error"]["param"]) == (400, "functions")


def test_completions(client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(
        model="demo", prompt="def add(a, b):", max_tokens=3, temperature=0,
        extra_body={**FOREIGN, "chat_template_kwargs": {"enable_thinking": False},
                    "repeat_penalty": 1.1})
    assert raw.http_response.status_code == 200
    assert raw.parse().choices[0].finish_reason == "length"
    # No chat template on this endpoint: its kwargs are ignored, and said so.
    assert raw.headers[HEADER] == FOREIGN_NAMES + ", chat_template_kwargs"


def test_completions_stream(tolerant: ServerProcess) -> None:
    with httpx.stream("POST", tolerant.url + "/v1/completions", timeout=60,
                      json={"model": "demo", "prompt": "x", "max_tokens": 2, "stream": True,
                            "num_predict": 2}) as response:
        assert response.status_code == 200
        assert response.headers[HEADER] == "num_predict"
        assert parse_sse(response.read().decode())[-1] == "[DONE]"


def test_embeddings(client: openai.OpenAI) -> None:
    raw = client.embeddings.with_raw_response.create(
        model="demo-embedding", input=["a", "b"], extra_body={"truncate": True, **FOREIGN})
    assert raw.http_response.status_code == 200
    assert len(raw.parse().data) == 2
    assert raw.headers[HEADER] == "truncate, " + FOREIGN_NAMES


def test_responses(client: openai.OpenAI, http: httpx.Client) -> None:
    raw = client.responses.with_raw_response.create(
        model="demo", input="Hi", max_output_tokens=16, extra_body=FOREIGN)
    assert raw.http_response.status_code == 200
    assert raw.parse().status in ("completed", "incomplete")
    assert raw.headers[HEADER] == FOREIGN_NAMES
    with http.stream("POST", "/v1/responses", json={"model": "demo", "input": "Hi",
                                                    "max_output_tokens": 16, "stream": True,
                                                    "num_ctx": 1}) as response:
        assert response.status_code == 200
        assert response.headers[HEADER] == "num_ctx"
        response.read()
    counted = http.post("/v1/responses/input_tokens",
                        json={"model": "demo", "input": "Hi", "num_ctx": 1})
    assert counted.status_code == 200, counted.text
    assert counted.headers[HEADER] == "num_ctx"


def test_anthropic_messages(tolerant: ServerProcess) -> None:
    claude = anthropic.Anthropic(base_url=tolerant.url, api_key="unused", max_retries=0)
    raw = claude.messages.with_raw_response.create(
        model="demo", max_tokens=4, messages=USER,
        extra_body={**FOREIGN, "metadata": {"user_id": "u"}, "container": None,
                    "temperature": 0})
    assert raw.http_response.status_code == 200
    assert raw.parse().usage.output_tokens == 4
    # Unknown fields are named first, then Anthropic's own that change nothing locally
    # (metadata, container): accepted, and named too, so a client can tell.
    assert raw.headers[HEADER] == FOREIGN_NAMES + ", container, metadata"
    with claude.messages.with_streaming_response.create(
            model="demo", max_tokens=4, messages=USER, stream=True,
            extra_body={"num_ctx": 1}) as streamed:
        assert streamed.headers[HEADER] == "num_ctx"
        streamed.read()
    counted = claude.messages.with_raw_response.count_tokens(
        model="demo", messages=USER, extra_body={"max_tokens": 5, "options": {}})
    assert counted.parse().input_tokens > 0
    assert counted.headers[HEADER] == "max_tokens, options"  # not count_tokens' fields


# ---------------------------------------------------------------------------- the header


def _raw_post(server: ServerProcess, body: bytes, path: str = "/v1/chat/completions") -> bytes:
    """The response's head, as the bytes that came over the socket."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
    return data.split(b"\r\n\r\n", 1)[0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_field_name_cannot_inject_a_header(tolerant: ServerProcess, stream: bool) -> None:
    body = json.dumps(_chat(stream=stream, **{EVIL: 1, "b\u00e9\u2028,%": 2})).encode()
    assert b"\\r\\n" in body  # JSON escapes, which decode to a real CR LF in the key
    head = _raw_post(tolerant, body)
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 200 OK", head
    assert not any(line.lower().startswith(b"set-cookie") for line in lines), head
    named = [line for line in lines if line.lower().startswith(HEADER.lower().encode())]
    assert named == [b"X-AFM-Ignored-Fields: x%0D%0ASet-Cookie%3A%20stolen%3D1, "
                     b"b%C3%A9%E2%80%A8%2C%25"], head
    assert all(32 <= byte < 127 for line in lines for byte in line)


def test_the_header_is_bounded(http: httpx.Client) -> None:
    fields = {f"field_{i}": i for i in range(MAX_NAMES + 4)}
    fields["L" * 5000] = 1
    response = http.post("/v1/chat/completions", json=_chat(**fields))
    assert response.status_code == 200, response.text
    names = response.headers[HEADER].split(", ")
    assert names == [f"field_{i}" for i in range(MAX_NAMES)] + ["..."]
    assert len(response.headers[HEADER]) < MAX_NAMES * (MAX_NAME_CHARS + 2) + 5


def test_header_value_cuts_long_names_between_escapes() -> None:
    assert header_value(["a" * 100]) == "a" * (MAX_NAME_CHARS - 3) + "..."
    # "é" is %C3%A9: a cut never leaves part of an escape behind.
    for lead in range(4):
        value = header_value(["a" * lead + "\u00e9" * 40])
        assert len(value) <= MAX_NAME_CHARS and value.endswith("...")
        assert value[:-3].replace("%C3%A9", "").strip("a") == "", value
    assert header_value(["", "%"]) == ", %25"


# ---------------------------------------------------------------------------- strict mode


def _assert_unknown(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    validate_error(response.json())
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "unknown_parameter", param, "invalid_request_error")
    assert HEADER not in response.headers


def test_strict_openai_client_gets_openais_400(strict: ServerProcess) -> None:
    client = openai.OpenAI(base_url=strict.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="demo", messages=USER, max_tokens=2,
                                       extra_body={"cache_prompt": True})
    assert raised.value.code == "unknown_parameter"
    assert raised.value.param == "cache_prompt"
    # The extensions afmd knows pass in strict mode too.
    completion = client.chat.completions.create(
        model="demo", messages=USER, max_tokens=2, extra_body={
            "chat_template_kwargs": {"enable_thinking": False}, "repeat_penalty": 1.1,
            "top_k": 5, "min_p": 0.1, "keep_alive": "5m"})
    assert completion.usage is not None and completion.usage.completion_tokens == 2


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", _chat(stream=True, num_ctx=1), "num_ctx"),
    ("/v1/completions", {"prompt": "x", "num_ctx": 1}, "num_ctx"),
    ("/v1/completions", {"prompt": "x", "chat_template_kwargs": {}, "num_ctx": 1},
     "chat_template_kwargs"),
    ("/v1/embeddings", {"model": "demo-embedding", "input": "x", "num_ctx": 1}, "num_ctx"),
    ("/v1/responses", {"input": "x", "num_ctx": 1}, "num_ctx"),
    ("/v1/responses/input_tokens", {"input": "x", "stream": True, "num_ctx": 1}, "stream"),
], ids=["chat-stream", "completions", "completions-template-kwargs", "embeddings",
        "responses", "responses-count"])
def test_strict_refuses_every_openai_dialect(strict: ServerProcess, path: str,
                                             body: dict[str, Any], param: str) -> None:
    _assert_unknown(httpx.post(strict.url + path, json=body, timeout=60), param)


#: A key no API defines, inside an object of each dialect's body, and its param.
NESTED_UNKNOWN = [
    ("/v1/chat/completions", _chat(messages=[{**USER[0], "bogus": 1}]), "messages[0].bogus"),
    ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": {"name": "f"}},
                                          {"type": "function", "function": {
                                              "name": "g", "bogus": 1}}]),
     "tools[1].function.bogus"),
    ("/v1/responses", {"model": "demo", "max_output_tokens": 16, "input": [
        {"role": "user", "content": "Hi"},
        {"role": "user", "content": [{"type": "input_text", "text": "x", "bogus": 1}]}]},
     "input[1].content[0].bogus"),
    ("/v1/responses/input_tokens", {"model": "demo", "input": [
        {"role": "user", "content": "Hi", "bogus": 1}]}, "input[0].bogus"),
]


@pytest.mark.parametrize(("path", "body", "param"), NESTED_UNKNOWN,
                         ids=[param for _, _, param in NESTED_UNKNOWN])
def test_strict_refuses_unknown_keys_inside_objects(
    strict: ServerProcess, tolerant: ServerProcess, path: str, body: dict[str, Any],
    param: str
) -> None:
    """As OpenAI does; without strict the key is ignored unnamed (clients echo back the
    fields of what they were sent, which are no request field of theirs to name)."""
    _assert_unknown(httpx.post(strict.url + path, json=body, timeout=60), param)
    served = httpx.post(tolerant.url + path, json=body, timeout=60)
    assert served.status_code == 200, served.text
    assert HEADER not in served.headers


def test_strict_openai_client_sends_afmds_answer_back(strict: ServerProcess) -> None:
    """An assistant message as afmd answered it (``refusal``, ``annotations``) goes back
    in the next request, through the official client, on a strict server."""
    client = openai.OpenAI(base_url=strict.url + "/v1", api_key="unused", max_retries=0)
    first = client.chat.completions.create(model="demo", messages=USER, max_tokens=2)
    answer = first.choices[0].message.model_dump(exclude_none=False)
    assert {"refusal", "annotations"} <= answer.keys()
    second = client.chat.completions.create(
        model="demo", max_tokens=2,
        messages=[*USER, answer, {"role": "user", "content": "More."}])
    assert second.usage is not None and second.usage.completion_tokens == 2


def test_strict_anthropic_answers_as_anthropic(strict: ServerProcess) -> None:
    claude = anthropic.Anthropic(base_url=strict.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(model="demo", max_tokens=4, messages=USER,
                               extra_body={"response_format": {"type": "json_object"}})
    error = raised.value.body["error"]
    assert error == {"type": "invalid_request_error",
                     "message": "response_format: Extra inputs are not permitted"}
    # Anthropic's own fields, and afmd's seed and keep_alive, are known.
    message = claude.messages.create(
        model="demo", max_tokens=2, messages=USER, metadata={"user_id": "u"},
        extra_body={"container": None, "seed": 3, "keep_alive": 60})
    assert message.usage.output_tokens == 2
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.count_tokens(model="demo", messages=USER,
                                     extra_body={"max_tokens": 5})


def test_strict_anthropic_refuses_unknown_keys_inside_objects(
    strict: ServerProcess, tolerant: ServerProcess
) -> None:
    """In Anthropic's words, the param first; a reply of afmd's sent back as the client
    got it passes, and without strict the unknown key is ignored."""
    claude = anthropic.Anthropic(base_url=strict.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(model="demo", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "Hi", "bogus": 1}]}])
    assert raised.value.body["error"] == {
        "type": "invalid_request_error",
        "message": "messages[0].content[0].bogus: Extra inputs are not permitted"}
    first = claude.messages.create(model="demo", max_tokens=2, messages=USER)
    reply = {"role": "assistant",
             "content": [block.model_dump() for block in first.content]}
    second = claude.messages.create(model="demo", max_tokens=2, messages=[
        *USER, reply, {"role": "user", "content": "More."}])
    assert second.usage.output_tokens == 2
    served = httpx.post(tolerant.url + "/v1/messages", timeout=60, json={
        "model": "demo", "max_tokens": 2, "messages": [{**USER[0], "bogus": 1}]})
    assert served.status_code == 200, served.text


@pytest.mark.parametrize(("path", "body"), [
    ("/api/chat", {"model": "demo", "messages": USER, "stream": False, "num_ctx": 1,
                   "options": {"num_predict": 2}}),
    ("/api/generate", {"model": "demo", "prompt": "x", "stream": False, "num_ctx": 1,
                       "options": {"num_predict": 2}}),
    ("/api/embed", {"model": "demo-embedding", "input": "x", "num_ctx": 1}),
    # Bodies that only load or unload the model: "keep_alve" is the unload misspelt.
    ("/api/chat", {"model": "demo", "keep_alve": 0}),
    ("/api/generate", {"model": "demo", "keep_alve": 0}),
    ("/api/show", {"model": "demo", "verbos": True}),
], ids=["chat", "generate", "embed", "chat-load", "generate-load", "show"])
def test_strict_refuses_ollamas_unknown_fields(
    strict: ServerProcess, tolerant: ServerProcess, path: str, body: dict[str, Any]
) -> None:
    """Ollama's envelope names no param: the message does. Without strict, the same body
    is served and its field named in the header."""
    name = next(key for key in body if key in ("num_ctx", "keep_alve", "verbos"))
    refused = httpx.post(strict.url + path, json=body, timeout=60)
    assert refused.status_code == 400, refused.text
    assert refused.json() == {"error": f"Unrecognized request argument supplied: {name}"}
    served = httpx.post(tolerant.url + path, json=body, timeout=60)
    assert served.status_code == 200, served.text
    assert served.headers[HEADER] == name


@pytest.mark.parametrize(("path", "body"), [
    # A misspelt ``model`` beside ``name`` would delete or fetch the model ``name`` says.
    ("/api/delete", {"name": "demo", "modle": "other"}),
    ("/api/pull", {"model": "owner/repo", "stream": False, "insecure": True, "modle": "x"}),
], ids=["delete", "pull"])
def test_strict_refuses_unknown_fields_of_ollamas_model_requests(
    strict: ServerProcess, path: str, body: dict[str, Any]
) -> None:
    """Refused before anything is looked up or fetched (Ollama's own fields pass)."""
    refused = httpx.request("DELETE" if path == "/api/delete" else "POST", strict.url + path,
                            json=body, timeout=60)
    assert refused.status_code == 400, refused.text
    assert refused.json() == {"error": "Unrecognized request argument supplied: modle"}


# ---------------------------------------------------------------------------- extensions


def _prompt_tokens(http: httpx.Client, **fields: Any) -> int:
    response = http.post("/v1/chat/completions", json=_chat(max_tokens=1, **fields))
    assert response.status_code == 200, response.text
    assert HEADER not in response.headers
    return int(response.json()["usage"]["prompt_tokens"])


def test_chat_template_kwargs_reach_the_template(http: httpx.Client) -> None:
    """The demo template closes an empty thinking block when ``enable_thinking`` is false
    (as Qwen3's does): four more prompt tokens."""
    plain = _prompt_tokens(http)
    off = _prompt_tokens(http, chat_template_kwargs={"enable_thinking": False})
    assert off > plain
    assert _prompt_tokens(http, chat_template_kwargs={"enable_thinking": True}) == plain
    # afmd maps reasoning_effort onto the same switch; the client's explicit value wins.
    assert _prompt_tokens(http, reasoning_effort="none") == off
    assert _prompt_tokens(http, reasoning_effort="high",
                          chat_template_kwargs={"enable_thinking": False}) == off
    assert _prompt_tokens(http, reasoning_effort="none",
                          chat_template_kwargs={"enable_thinking": True}) == plain
    # A variable no template reads changes nothing.
    assert _prompt_tokens(http, chat_template_kwargs={"unused_by_template": 1}) == plain


def test_chat_template_kwargs_on_responses(http: httpx.Client) -> None:
    def count(**fields: Any) -> int:
        response = http.post("/v1/responses/input_tokens",
                             json={"model": "demo", "input": "Hi", **fields})
        assert response.status_code == 200, response.text
        assert HEADER not in response.headers
        return int(response.json()["input_tokens"])

    assert count(chat_template_kwargs={"enable_thinking": False}) > count()
    response = http.post("/v1/responses", json={
        "model": "demo", "input": "Hi", "max_output_tokens": 16,
        "chat_template_kwargs": {"enable_thinking": False}, "repeat_penalty": 1.2})
    assert response.status_code == 200, response.text
    assert HEADER not in response.headers


def _greedy(http: httpx.Client, **fields: Any) -> str:
    response = http.post("/v1/chat/completions", json=_chat(max_tokens=24, **fields))
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def test_repeat_penalty_is_repetition_penalty(http: httpx.Client) -> None:
    penalized = _greedy(http, repetition_penalty=1.8)
    assert _greedy(http, repeat_penalty=1.8) == penalized
    assert _greedy(http, repeat_penalty=1.8, repetition_penalty=1.8) == penalized
    assert _greedy(http) != penalized  # the penalty is applied, not ignored


@pytest.mark.parametrize(("fields", "code", "param"), [
    ({"chat_template_kwargs": "enable_thinking=false"}, "invalid_type",
     "chat_template_kwargs"),
    ({"chat_template_kwargs": [["enable_thinking", False]]}, "invalid_type",
     "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "invalid_value",
     "chat_template_kwargs.add_generation_prompt"),
    ({"chat_template_kwargs": {"tools": []}}, "invalid_value", "chat_template_kwargs.tools"),
    ({"chat_template_kwargs": {"messages": []}}, "invalid_value",
     "chat_template_kwargs.messages"),
    ({"repeat_penalty": "1.1"}, "invalid_type", "repeat_penalty"),
    ({"repeat_penalty": 11}, "invalid_value", "repeat_penalty"),
    ({"repeat_penalty": 1.1, "repetition_penalty": 1.2}, "invalid_value", "repeat_penalty"),
    ({"top_k": -1}, "invalid_value", "top_k"),
    ({"top_k": 2.5}, "invalid_type", "top_k"),
    ({"min_p": 1.5}, "invalid_value", "min_p"),
], ids=["kwargs-string", "kwargs-array", "kwargs-generation-prompt", "kwargs-tools",
        "kwargs-messages", "repeat-type", "repeat-range", "repeat-conflict", "top-k-negative",
        "top-k-fraction", "min-p-range"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_bad_extensions_are_400s(http: httpx.Client, path: str, fields: dict[str, Any],
                                 code: str, param: str) -> None:
    body = _chat(**fields) if path.endswith("completions") else {
        "model": "demo", "input": "Hi", **fields}
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    validate_error(response.json())
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error


def test_repeat_penalty_conflict_on_completions(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={
        "model": "demo", "prompt": "x", "repeat_penalty": 1.0, "repetition_penalty": 1.3})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "repeat_penalty"


def test_api_strict_setting() -> None:
    assert load_config(None, env={}).api.strict is False
    assert load_config(None, env={"AFMD_API_STRICT": "true"}).api.strict is True


def test_strict_refuses_the_generate_fields_afmd_does_not_act_on(
    strict: ServerProcess
) -> None:
    """Ollama defines ``template``, but afmd's answer would not honour it: strict says
    so. ``context`` it honours (the earlier answer's ids come first), so strict takes it."""
    body = {"model": "demo", "prompt": "x", "stream": False, "options": {"num_predict": 2}}
    refused = httpx.post(strict.url + "/api/generate", json={
        **body, "template": "{{ .Prompt }}"}, timeout=60)
    assert refused.status_code == 400, refused.text
    assert refused.json() == {"error": "Unrecognized request argument supplied: template"}
    taken = httpx.post(strict.url + "/api/generate", json={**body, "context": [1, 2]},
                       timeout=60)
    assert taken.status_code == 200, taken.text
    assert taken.json()["context"][:2] == [1, 2]
