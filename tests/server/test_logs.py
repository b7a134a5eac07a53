"""Logging: client-controlled text can never forge, split or disguise a log line."""

from __future__ import annotations

import io
import json
import logging
import re
import socket
import threading
import time
import unicodedata
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from afmd import logs
from afmd.logs import sanitize

from conftest import ServerProcess

UNSAFE_CATEGORIES = ("Cc", "Cf", "Zl", "Zp", "Cs")
LINE_BREAKERS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


# ---------------------------------------------------------------------------- sanitize


@pytest.mark.parametrize(
    ("char", "encoded"),
    [
        ("\r", "%0D"),
        ("\n", "%0A"),
        ("\x00", "%00"),
        ("\x1b", "%1B"),
        ("\x7f", "%7F"),
        ("\t", "%09"),
        ("\u2028", "%E2%80%A8"),
        ("\u2029", "%E2%80%A9"),
        ("\u0085", "%C2%85"),
        ("\u202e", "%E2%80%AE"),
        ("\u2066", "%E2%81%A6"),
        ("\u2067", "%E2%81%A7"),
        ("\u2068", "%E2%81%A8"),
        ("\u2069", "%E2%81%A9"),
        ("\u200f", "%E2%80%8F"),
        ("\ufeff", "%EF%BB%BF"),
        ("%", "%25"),
    ],
)
def test_sanitize_encodes_unsafe_characters(char: str, encoded: str) -> None:
    assert sanitize(char) == encoded
    assert sanitize(f"a{char}b") == f"a{encoded}b"
    assert unquote(sanitize(f"a{char}b")) == f"a{char}b"


@pytest.mark.parametrize(
    "text",
    ["", "hello world", "GET /v1/chat/completions?x=1&y=2", "é", "日本", "naïve café",
     "Ünïcödé 日本語 текст ελληνικά عربى", "emoji 🙂", "quotes \" ' and \\ backslash",
     "{\"json\": [1, 2]}"],
)
def test_sanitize_leaves_normal_text_alone(text: str) -> None:
    assert sanitize(text) == text


def test_sanitize_forged_line() -> None:
    forged = 'ok\r\n{"event":"request","status":200}\u2028\x1b[2K\u202eevil'
    out = sanitize(forged)
    assert out == ('ok%0D%0A{"event":"request","status":200}%E2%80%A8%1B[2K%E2%80%AEevil')
    assert len(out.splitlines()) == 1


def test_sanitize_lone_surrogate() -> None:
    # Header bytes that are not UTF-8 reach Python as surrogate escapes.
    assert sanitize("a\udcffb") == "a%ED%B3%BFb"


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_sanitize_property(text: str) -> None:
    out = sanitize(text)
    assert unquote(out, errors="strict") == text  # lossless
    assert not any(unicodedata.category(ch) in UNSAFE_CATEGORIES for ch in out)
    assert not any(ch in LINE_BREAKERS for ch in out)
    assert sanitize(out) == out.replace("%", "%25")  # only "%" is touched a second time


# ---------------------------------------------------------------------------- renderers


@pytest.fixture()
def restore_logging() -> Iterator[None]:
    """configure() is process-global; put structlog and stdlib logging back afterwards."""
    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    names = ("sanic.access", "sanic.root", "sanic.server", "sanic.error", "afmd.test")
    levels = {name: logging.getLogger(name).level for name in names}
    yield
    structlog.configure(**saved)
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, lvl in levels.items():
        logging.getLogger(name).setLevel(lvl)


EVIL_KEY = 'k\ney\u2028"x":1'
EVIL_VALUE = 'v\r\n{"event":"request","status":200}\u2029\x1b[31m\u202eevil\x00%\x85\x7f'


class _Evil:
    """An object whose str() carries line breaks, as an exception message might."""

    def __str__(self) -> str:
        return "obj\u2028line\x85two\x7f\u202e"

    __repr__ = __str__


def _one_line(output: str) -> str:
    assert output.endswith("\n"), repr(output)
    body = output[:-1]
    assert "\n" not in body, repr(output)
    assert len(output.splitlines()) == 1, repr(output)
    assert not any(unicodedata.category(ch) in UNSAFE_CATEGORIES for ch in body), repr(body)
    return body


def test_json_renderer_one_line(restore_logging: None) -> None:
    stream = io.StringIO()
    logs.configure(fmt="json", stream=stream)
    logs.get_logger("afmd.test").info("evil\nevent\u2028", **{EVIL_KEY: EVIL_VALUE})
    event = json.loads(_one_line(stream.getvalue()))
    assert event["event"] == "evil%0Aevent%E2%80%A8"
    assert event[sanitize(EVIL_KEY)] == sanitize(EVIL_VALUE)
    assert unquote(event[sanitize(EVIL_KEY)]) == EVIL_VALUE
    assert event["level"] == "info"


def test_json_renderer_nested_values(restore_logging: None) -> None:
    stream = io.StringIO()
    logs.configure(fmt="json", stream=stream)
    logs.get_logger("afmd.test").info(
        "nested", items=[EVIL_VALUE, {"k\n": (EVIL_VALUE, 1)}], n=3, ok=True, none=None
    )
    event = json.loads(_one_line(stream.getvalue()))
    assert event["items"] == [sanitize(EVIL_VALUE), {"k%0A": [sanitize(EVIL_VALUE), 1]}]
    assert (event["n"], event["ok"], event["none"]) == (3, True, None)


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_non_string_values_are_sanitized(restore_logging: None, fmt: str) -> None:
    stream = io.StringIO()
    logs.configure(fmt=fmt, stream=stream)
    logs.get_logger("afmd.test").info(
        "objects", obj=_Evil(), exc=ValueError("bad\u2028value\x85"), items={_Evil()}
    )
    _one_line(stream.getvalue())


def test_console_renderer_one_line(restore_logging: None) -> None:
    stream = io.StringIO()
    logs.configure(fmt="console", stream=stream)
    logs.get_logger("afmd.test").info("evil\nevent", **{EVIL_KEY: EVIL_VALUE})
    line = _one_line(stream.getvalue())
    assert "evil%0Aevent" in line
    assert sanitize(EVIL_VALUE) in line
    assert "\x1b" not in line  # colors are off: nothing can recolor the terminal


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_stdlib_logging_is_routed_and_sanitized(restore_logging: None, fmt: str) -> None:
    stream = io.StringIO()
    logs.configure(fmt=fmt, stream=stream)
    std = logging.getLogger("afmd.test")
    std.warning("model %s failed:\n%s", "x\u2028y", EVIL_VALUE)
    line = _one_line(stream.getvalue())
    if fmt == "json":
        event = json.loads(line)
        assert event["logger"] == "afmd.test"
        assert event["level"] == "warning"
        assert unquote(event["event"]) == f"model x\u2028y failed:\n{EVIL_VALUE}"


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_tracebacks_stay_on_one_line(restore_logging: None, fmt: str) -> None:
    stream = io.StringIO()
    logs.configure(fmt=fmt, stream=stream)
    try:
        raise RuntimeError("boom\nsecond line\u2028")
    except RuntimeError:
        logs.get_logger("afmd.test").exception("failed")
        logging.getLogger("sanic.error").exception("sanic failed")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, stream.getvalue()
    if fmt == "json":
        for line in lines:
            event = json.loads(line)
            assert "RuntimeError: boom%0Asecond line%E2%80%A8" in event["exception"]


def test_level_filtering(restore_logging: None) -> None:
    stream = io.StringIO()
    logs.configure(level="warning", fmt="json", stream=stream)
    logs.get_logger("afmd.test").info("hidden")
    logs.get_logger("afmd.test").warning("shown")
    logging.getLogger("afmd.test").info("hidden too")
    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [e["event"] for e in events] == ["shown"]


# ---------------------------------------------------------------------------- end to end


def _poll(predicate: Callable[[], Any], timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.02)


def _access_events(server: ServerProcess, **match: Any) -> list[dict[str, Any]]:
    with server._cond:
        events = list(server.events)
    return [
        e for e in events
        if e.get("event") == "request" and all(e.get(k) == v for k, v in match.items())
    ]


def _raw_http(server: ServerProcess, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        conn.sendall(request)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    return data


def test_access_log_for_chat_completion(server: ServerProcess, http: Any) -> None:
    rid = f"logs-{uuid.uuid4().hex[:12]}"
    response = http.post(
        "/v1/chat/completions",
        json={"model": "demo", "messages": [{"role": "user", "content": "hi"}],
              "max_tokens": 5, "temperature": 0},
        headers={"X-Request-ID": rid, "User-Agent": "afmd-tests/1.0"},
    )
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    events = _poll(lambda: _access_events(server, request_id=rid))
    assert len(events) == 1, events
    event = events[0]
    assert event["method"] == "POST"
    assert event["path"] == "/v1/chat/completions"
    assert event["status"] == 200
    assert event["request_id"] == rid
    assert event["bytes"] == len(response.content)
    assert event["model"] == "demo"
    assert event["prompt_tokens"] == usage["prompt_tokens"]
    assert event["completion_tokens"] == usage["completion_tokens"]
    assert isinstance(event["duration_ms"], int | float) and event["duration_ms"] > 0
    assert event["level"] == "info"


def test_access_log_for_streamed_chat_completion(server: ServerProcess, http: Any) -> None:
    rid = f"logs-{uuid.uuid4().hex[:12]}"
    response = http.post(
        "/v1/chat/completions",
        json={"model": "demo", "messages": [{"role": "user", "content": "hi"}],
              "max_tokens": 4, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}},
        headers={"X-Request-ID": rid},
    )
    assert response.status_code == 200
    usage_chunk = json.loads(response.text.split("data: ")[-2])
    events = _poll(lambda: _access_events(server, request_id=rid))
    assert len(events) == 1, events
    event = events[0]
    assert (event["method"], event["path"], event["status"]) == ("POST", "/v1/chat/completions",
                                                                 200)
    assert event["bytes"] == len(response.content)
    assert event["model"] == "demo"
    assert event["completion_tokens"] == usage_chunk["usage"]["completion_tokens"] == 4
    assert event["prompt_tokens"] == usage_chunk["usage"]["prompt_tokens"]
    assert event["duration_ms"] > 0


@pytest.mark.parametrize("sent", [True, False])
def test_a_gate_refusal_names_its_request_id_in_its_answer_and_its_log_line(
    server: ServerProcess, sent: bool
) -> None:
    """A refusal the gate answers itself (an unknown URL, a wrong method) names a request
    id as every other answer does (the client's own when valid), and its ``refused``
    line names the same: it carried none, so a client's report of it led nowhere."""
    rid = f"gate-{uuid.uuid4().hex[:12]}"
    for method, path in (("GET", "/no-such-path"), ("PUT", "/health")):
        before = len(server.raw_lines)
        sent_id = f"X-Request-ID: {rid}\r\n" if sent else ""
        reply = _raw_http(server, f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n"
                                  f"{sent_id}Connection: close\r\n\r\n".encode())
        head = reply.partition(b"\r\n\r\n")[0].decode("latin-1")
        told = re.search(r"\r\nx-request-id: (\S+)(?:\r\n|$)", head, re.IGNORECASE)
        assert told is not None, head
        assert told.group(1) == rid if sent else told.group(1).startswith("req_")

        def refused(before: int = before) -> list[dict[str, Any]]:
            with server._cond:
                lines = server.raw_lines[before:]
            return [e for e in map(json.loads, lines) if e.get("event") == "refused"]

        events = _poll(refused)
        assert [e["request_id"] for e in events] == [told.group(1)], events


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/health"),  # answered by the connection itself
    ("GET", "/api/ps"),
    ("GET", "/v1/models/no-such-model"),  # an error, from a route that reads no id
    ("POST", "/v1/chat/completions/no-such-request/cancel"),
])
@pytest.mark.parametrize("sent", [True, False])
def test_access_log_names_the_request_id_the_answer_carries(
    server: ServerProcess, http: Any, method: str, path: str, sent: bool
) -> None:
    """Every answer names its request (X-Request-ID, the client's own when it sent one);
    its log line must name the same id, or a client's id leads nowhere in the log."""
    rid = f"logs-{uuid.uuid4().hex[:12]}"
    response = http.request(method, path, headers={"X-Request-ID": rid} if sent else {})
    told = response.headers["x-request-id"]
    assert told == rid if sent else told.startswith("req_")
    events = _poll(lambda: _access_events(server, request_id=told))
    assert [(e["method"], e["path"], e["status"]) for e in events] == [
        (method, path, response.status_code)], _access_events(server, path=path)[-2:]


def test_access_log_for_model_alias(server: ServerProcess, http: Any) -> None:
    rid = f"logs-{uuid.uuid4().hex[:12]}"
    response = http.post(
        "/v1/chat/completions",
        json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}],
              "max_tokens": 2},
        headers={"X-Request-ID": rid},
    )
    assert response.status_code == 200
    events = _poll(lambda: _access_events(server, request_id=rid))
    assert len(events) == 1
    assert events[0]["model"] == response.json()["model"]


def test_encoded_line_breaks_in_path_stay_on_one_line(server: ServerProcess) -> None:
    marker = uuid.uuid4().hex[:12]
    before = len(server.raw_lines)
    path = f"/v1/models/{marker}a%0D%0Ab%E2%80%A8c%0A%7B%22event%22%3A%22forged%22%7D"
    reply = _raw_http(
        server,
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode(),
    )
    assert reply.startswith(b"HTTP/1.1 404 "), reply[:200]

    def mine() -> list[str]:
        with server._cond:
            return [line for line in server.raw_lines[before:] if marker in line]

    lines = _poll(mine)
    time.sleep(0.2)  # anything a forged newline would have produced has arrived by now
    lines = mine()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.endswith("\n") and len(line.splitlines()) == 1
    assert not any(ch in LINE_BREAKERS for ch in line[:-1])
    event = json.loads(line)
    assert event["event"] == "request"
    assert event["status"] == 404
    assert event["method"] == "GET"
    assert "\n" not in event["path"] and "\u2028" not in event["path"]
    assert unquote(event["path"]) == path  # sanitize is reversible: nothing is lost
    assert not any(e.get("event") == "forged" for e in server.events)
    # Every line written meanwhile is a complete JSON object.
    with server._cond:
        for raw in server.raw_lines[before:]:
            assert isinstance(json.loads(raw), dict), raw


def _clean_new_lines(server: ServerProcess, before: int) -> list[dict[str, Any]]:
    """Every line logged since ``before``: one line each, no unsafe character, JSON."""
    with server._cond:
        lines = server.raw_lines[before:]
    for raw in lines:
        assert raw.endswith("\n") and len(raw.splitlines()) == 1, raw
        assert not any(unicodedata.category(ch) in UNSAFE_CATEGORIES for ch in raw[:-1]), raw
        assert isinstance(json.loads(raw), dict)
    return [json.loads(raw) for raw in lines]


def _chat_with_headers(server: ServerProcess, headers: bytes) -> bytes:
    body = b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
    return _raw_http(
        server,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers
        + b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
        + b"\r\nConnection: close\r\n\r\n" + body,
    )


def test_invalid_request_id_with_raw_bytes(server: ServerProcess) -> None:
    """Raw control bytes in header values: the gate's 400 before any handler runs, the
    forged id is never echoed, and the log stays clean JSON."""
    before = len(server.raw_lines)
    reply = _chat_with_headers(
        server,
        b"X-Request-ID: \xff\x1b[31mforged\xe2\x80\xa8id\x7f\r\n"
        b"User-Agent: evil\xe2\x80\xa8agent\xc2\x85\x1b[2J\r\n",
    )
    assert reply.startswith(b"HTTP/1.1 400 "), reply[:200]
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b"forged" not in reply
    # The refusal names a request of its own, never the forged id.
    assert re.search(rb"\r\nx-request-id: req_[0-9a-f]{32}(?:\r\n|$)", head, re.IGNORECASE), head
    assert json.loads(body)["error"]["code"] == "malformed_request"
    assert "control character" in json.loads(body)["error"]["message"]

    def refusals() -> list[dict[str, Any]]:
        return [e for e in _clean_new_lines(server, before) if e.get("event") == "refused"]

    assert _poll(refusals)
    time.sleep(0.2)
    events = _clean_new_lines(server, before)
    assert [(e["status"], e["code"]) for e in events if e.get("event") == "refused"] == [
        (400, "malformed_request")]
    assert not [e for e in events if e.get("event") == "request"]  # no handler ran


def test_invalid_request_id_with_raw_non_ascii_bytes(server: ServerProcess) -> None:
    """Non-UTF-8 bytes and Unicode line separators (no control bytes) pass the gate: the
    handler's 400 names X-Request-ID, and the access line stays clean JSON."""
    before = len(server.raw_lines)
    reply = _chat_with_headers(
        server,
        b"X-Request-ID: \xffforged\xe2\x80\xa8id\r\n"
        b"User-Agent: evil\xe2\x80\xa8agent\xc2\x85\r\n",
    )
    assert reply.startswith(b"HTTP/1.1 400 "), reply[:200]
    assert b"X-Request-ID" in reply

    def access() -> list[dict[str, Any]]:
        return [e for e in _clean_new_lines(server, before) if e.get("event") == "request"]

    events = _poll(access)
    time.sleep(0.2)
    assert len(access()) == 1, _clean_new_lines(server, before)
    event = events[0]
    assert (event["method"], event["path"], event["status"]) == ("POST", "/v1/chat/completions",
                                                                 400)
    # The invalid id is neither echoed nor logged: the line names the fresh one the answer
    # carries in its place.
    head = reply.partition(b"\r\n\r\n")[0].decode("latin-1").lower()
    told = head.split("x-request-id: ", 1)[1].split("\r\n", 1)[0]
    assert told.startswith("req_") and event["request_id"] == told
    assert event["bytes"] > 0


@pytest.mark.parametrize(
    "target",
    [b"/v1/models/x\xe2\x80\xa8y\x7fz", b"/v1/models/x\x1b[31my", b"/v1/models/a\x00b",
     b"/v1/models/\xff\xfe"],
)
def test_raw_bytes_in_request_target(server: ServerProcess, target: bytes) -> None:
    """Unencoded control or non-ASCII bytes in the path: a 400, and clean one-line logs."""
    before = len(server.raw_lines)
    reply = _raw_http(
        server, b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    assert reply.startswith(b"HTTP/1.1 400 "), reply[:200]
    assert b'"error"' in reply

    def new_lines() -> list[str]:
        with server._cond:
            return server.raw_lines[before:]

    assert _poll(new_lines)
    time.sleep(0.2)
    for raw in new_lines():
        assert raw.endswith("\n") and len(raw.splitlines()) == 1, raw
        assert not any(unicodedata.category(ch) in UNSAFE_CATEGORIES for ch in raw[:-1]), raw
        event = json.loads(raw)
        assert event.get("level") != "error", event  # a bad client is not a server error
        assert "Traceback" not in raw


def _post_chat(server: ServerProcess, payload: dict[str, Any], rid: str) -> Any:
    import httpx

    return httpx.post(server.url + "/v1/chat/completions", json=payload,
                      headers={"X-Request-ID": rid}, timeout=30)


def test_access_log_of_a_400_names_its_code_and_param(server: ServerProcess) -> None:
    """An operator reads why a request was refused from the access line alone; the param,
    a key the client chose, cannot forge a line or smuggle terminal escapes."""
    rid = f"logs-{uuid.uuid4().hex[:12]}"
    key = 'x\r\n{"event":"forged","status":200}\x1b[2K\u2028"q\''
    before = len(server.raw_lines)
    # A nested unknown field is refused whatever [api] strict says.
    response = _post_chat(server, {"messages": [{"role": "user", "content": "hi"}],
                                   "stream": True, "stream_options": {key: 1}}, rid)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "stream_options." + key
    events = _poll(lambda: _access_events(server, request_id=rid))
    assert len(events) == 1, events
    event = events[0]
    assert event["status"] == 400
    assert event["error_code"] == "unknown_parameter"
    assert unquote(event["error_param"]) == "stream_options." + key  # percent-encoded
    assert "\n" not in event["error_param"] and "\x1b" not in event["error_param"]
    assert event["level"] == "info"  # a client's mistake is not the server's error
    time.sleep(0.2)
    with server._cond:
        new = server.raw_lines[before:]
    for raw in new:
        assert raw.endswith("\n") and len(raw.splitlines()) == 1, raw
        assert not any(unicodedata.category(ch) in UNSAFE_CATEGORIES for ch in raw[:-1]), raw
        assert isinstance(json.loads(raw), dict)
    assert not any(e.get("event") == "forged" for e in server.events)


@pytest.mark.parametrize(
    ("payload", "status", "code", "param"),
    [
        # Raised by the pipeline after parsing: the context check, the model lookup.
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9},
         400, "context_length_exceeded", "messages"),
        ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
         404, "model_not_found", "model"),
    ],
)
def test_access_log_of_pipeline_errors(server: ServerProcess, payload: dict[str, Any],
                                       status: int, code: str, param: str) -> None:
    rid = f"logs-{uuid.uuid4().hex[:12]}"
    response = _post_chat(server, payload, rid)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    events = _poll(lambda: _access_events(server, request_id=rid))
    assert len(events) == 1, events
    assert (events[0]["status"], events[0]["error_code"], events[0]["error_param"]) == (
        status, code, param)


def test_a_huge_model_name_makes_an_ordinary_line(server: ServerProcess) -> None:
    """The model field is the client's until it resolves: a request naming a model of a
    megabyte is logged, and kept in the dashboard's ring of recent requests, cut short
    with its length noted, not whole (each such request added its megabytes to the ring,
    for the life of the server, and to the log)."""
    import httpx

    rid = f"logs-{uuid.uuid4().hex[:12]}"
    name = "huge-" + "m" * 1_000_000
    response = _post_chat(server, {"model": name,
                                   "messages": [{"role": "user", "content": "hi"}]}, rid)
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "model_not_found"
    events = _poll(lambda: _access_events(server, request_id=rid))
    assert len(events) == 1, events
    logged = events[0]["model"]
    assert logged.startswith("huge-mmm") and logged.endswith(f"({len(name)} characters)")
    assert len(logged) < 1000
    ring = httpx.get(server.url + "/ui/api/activity", timeout=30).json()["requests"]
    kept = [r for r in ring if r["request_id"] == rid]
    assert len(kept) == 1 and kept[0]["model"] == unquote(logged)


NOT_A_SCHEMA = {"type": "object", "properties": {"a": {"type": "nope"}}}


@pytest.mark.parametrize(
    ("path", "payload", "param"),
    [
        ("/v1/responses", {"input": "hi", "max_output_tokens": 16, "text": {"format": {
            "type": "json_schema", "name": "x", "schema": NOT_A_SCHEMA}}},
         "text.format.schema"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 10**9}, "input"),
        ("/v1/messages", {"model": "demo", "max_tokens": 8, "messages": [
            {"role": "user", "content": "hi"}], "output_config": {"format": {
                "type": "json_schema", "schema": NOT_A_SCHEMA}}},
         "output_config.format.schema"),
        ("/v1/messages", {"model": "demo", "max_tokens": 8, "messages": [
            {"role": "user", "content": "hi"}], "tools": [{"name": "f", "input_schema": {
                "type": "object", "properties": {"a": {"type": "nope"}}}}]},
         "tools[0].input_schema"),
        ("/api/chat", {"model": "demo", "stream": False, "messages": [
            {"role": "user", "content": "hi"}], "format": NOT_A_SCHEMA}, "format"),
    ],
    ids=["responses-schema", "responses-context", "messages-schema", "messages-tool",
         "ollama-schema"],
)
def test_access_log_names_the_param_as_the_dialect_does(
    server: ServerProcess, path: str, payload: dict[str, Any], param: str
) -> None:
    """The line's param is the one the client was told: the pipeline's errors name chat's
    fields (``response_format.json_schema.schema``), which a Responses or Messages client
    never sent, and the line said so where the answer named the client's own field."""
    import httpx

    rid = f"logs-{uuid.uuid4().hex[:12]}"
    response = httpx.post(server.url + path, json=payload, headers={"X-Request-ID": rid},
                          timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if isinstance(error, str):  # Ollama's: one message
        error = {"message": error}
    told = error.get("param") or error["message"].split(": ", 1)[0]
    assert told == param
    events = _poll(lambda: _access_events(server, request_id=rid))
    assert len(events) == 1, events
    assert unquote(events[0]["error_param"]) == param


def test_access_log_of_a_success_has_no_error_fields(server: ServerProcess) -> None:
    rid = f"logs-{uuid.uuid4().hex[:12]}"
    response = _post_chat(
        server, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, rid)
    assert response.status_code == 200
    events = _poll(lambda: _access_events(server, request_id=rid))
    assert len(events) == 1
    assert not {"error_code", "error_param", "disconnected"} & events[0].keys()


def test_gate_refusals_are_logged_with_status_and_code(server: ServerProcess) -> None:
    """A request the gate refuses before Sanic sees it still leaves a line saying why."""
    marker = uuid.uuid4().hex[:12]
    before = len(server.raw_lines)
    reply = _raw_http(
        server,
        f"GET /health HTTP/1.1\r\nHost: evil-{marker}.example\r\nConnection: close\r\n\r\n"
        .encode(),
    )
    status = int(reply.split(b" ", 2)[1])
    assert status >= 400, reply[:200]
    code = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"]

    def refused() -> list[dict[str, Any]]:
        with server._cond:
            lines = server.raw_lines[before:]
        return [e for e in map(json.loads, lines) if e.get("event") == "refused"]

    events = _poll(refused)
    assert events, server.raw_lines[before:]
    assert (events[0]["status"], events[0]["code"]) == (status, code)


class _BrokenStream(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize("stream", [_BrokenStream(), "closed"])
def test_logging_to_a_dead_stream_never_raises(restore_logging: None, stream: Any) -> None:
    """A reader that went away must not make log calls raise in their callers (e.g. in
    the SIGTERM handler, which would then never stop the server)."""
    if stream == "closed":
        stream = io.StringIO()
        stream.close()
    logs.configure(fmt="json", stream=stream)
    logs.get_logger("afmd.test").info("stopping", reason="SIGTERM")
    logs.get_logger("afmd.test").error("boom")


class _SlowStream(io.StringIO):
    """A stream that gives other threads their turn within every write, as a pipe to a
    busy reader may."""

    def write(self, text: str) -> int:
        written = super().write(text)
        time.sleep(0.0005)
        return written


def test_lines_from_several_threads_stay_whole(restore_logging: None) -> None:
    """afmd's own events (structlog) and those of the libraries and the model threads
    (stdlib logging) go to one stream from several threads. structlog wrote a line and
    its newline in two writes under a lock of its own, so a stdlib line landed between
    them: two JSON objects on one line and an empty one after it, both events lost to a
    reader of JSON lines (found on a live server as a model loaded beside the access
    log)."""
    stream = _SlowStream()
    logs.configure(fmt="json", stream=stream)
    own, library = logs.get_logger("afmd.test"), logging.getLogger("afmd.test")
    go = threading.Barrier(2)

    def write(log: Callable[..., None]) -> None:
        go.wait(10)
        for i in range(50):
            log("line %d", i)

    threads = [threading.Thread(target=write, args=(own.info,)),
               threading.Thread(target=write, args=(library.warning,))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 100, [line for line in lines if not line.startswith("{")][:3]
    assert all(json.loads(line)["event"].startswith("line ") for line in lines)
