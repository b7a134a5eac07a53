"""SIGTERM with streams still running past ``shutdown_grace``, on the real server.

A stream the shutdown cuts ends like any failure after the 200: an error event
(``server_shutting_down``), ``data: [DONE]`` and the chunked body's last chunk, so a
client can tell a stopped server from a broken connection; a request still waiting for
a slot gets a plain 503 with the same code; the process still exits 0.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from afmd.engine.demo.tokenizer import shipped

from conftest import ServerProcess, parse_sse, start_server

pytestmark = pytest.mark.slow  # servers stopped mid-stream

CHAT = "/v1/chat/completions"
LONG = 8000  # tokens: far longer than the test runs
SLOTS = 4


#: The demo tokenizer's end-of-text, end-of-turn, tool-call and think tokens: never chosen,
#: so a stream (whose prompt carries a random tag) cannot end before the shutdown cuts it.
NEVER = {str(t["id"]): -100
         for t in json.loads(shipped("demo_tokenizer.json"))["added_tokens"]
         if t["content"] in ("<|endoftext|>", "<|im_end|>", "<tool_call>", "<think>")}


def _body(text: str, *, stream: bool) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": LONG,
            "temperature": 0, "stream": stream, "logit_bias": NEVER}


@dataclass
class Stream:
    """One streamed request read by httpx in a thread; httpx raises on a chunked body
    that ends without its last chunk."""

    url: str
    rid: str
    first: threading.Event = field(default_factory=threading.Event)
    text: str = ""
    status: int | None = None
    error: BaseException | None = None

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        parts: list[str] = []
        try:
            with httpx.stream("POST", self.url + CHAT, json=_body(self.rid, stream=True),
                              headers={"X-Request-ID": self.rid}, timeout=60) as response:
                self.status = response.status_code
                for chunk in response.iter_text():
                    parts.append(chunk)
                    if '"content"' in "".join(parts[-2:]):
                        self.first.set()
        except BaseException as exc:  # recorded for the test to report
            self.error = exc
        finally:
            self.text = "".join(parts)
            self.first.set()


def _raw_stream(server: ServerProcess, rid: str) -> socket.socket:
    body = json.dumps(_body(rid, stream=True)).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(
        f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"X-Request-ID: {rid}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    )
    return sock


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _assert_ends_with_shutdown_error(text: str) -> None:
    events = parse_sse(text)
    assert events[-1] == "[DONE]", text[-500:]
    error = events[-2]
    assert set(error) == {"error"}, error
    assert error["error"]["code"] == "server_shutting_down"
    assert error["error"]["type"] == "server_error"
    assert "stopping" in error["error"]["message"]
    assert any(isinstance(e, dict) and e.get("choices") for e in events[:-2])


def test_sigterm_ends_cut_streams_with_an_error_event(tmp_path: Path) -> None:
    server = start_server(
        tmp_path,
        config=f"[server]\nshutdown_grace = 1.0\n[queue]\nmax_concurrent_requests = {SLOTS}\n",
    )
    try:
        tag = uuid.uuid4().hex[:8]
        streams = [Stream(server.url, f"cut-{tag}-{i}") for i in range(SLOTS - 1)]
        threads = [s.start() for s in streams]
        raw_rid = f"raw-{tag}"
        raw = _raw_stream(server, raw_rid)  # the fourth slot: read byte for byte
        for s in streams:
            assert s.first.wait(60), s.rid
        head = b""
        while b'"content"' not in head:
            chunk = raw.recv(65536)
            assert chunk, head
            head += chunk
        # One more request waits in the queue when the grace period ends.
        queued: dict[str, Any] = {}

        def wait_in_queue() -> None:
            try:
                r = httpx.post(server.url + CHAT, json=_body("queued", stream=False),
                               headers={"X-Request-ID": f"queued-{tag}"}, timeout=60)
                queued["status"], queued["body"] = r.status_code, r.json()
                queued["retry_after"] = r.headers.get("Retry-After")
            except BaseException as exc:
                queued["error"] = exc

        waiter = threading.Thread(target=wait_in_queue, daemon=True)
        waiter.start()
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/health", timeout=5).json()["queued_requests"] < 1:
            assert time.monotonic() < deadline, "the extra request never queued"
            time.sleep(0.02)

        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rest = _read_all(raw)
        raw.close()
        for t in threads:
            t.join(30)
        waiter.join(30)
        code = server.proc.wait(30)
        elapsed = time.monotonic() - t0
    finally:
        server.stop()

    for s in streams:
        assert s.error is None, (s.rid, repr(s.error), s.text[-300:])
        assert s.status == 200
        _assert_ends_with_shutdown_error(s.text)

    data = head + rest
    assert data.startswith(b"HTTP/1.1 200 ")
    assert data.endswith(b"\r\n0\r\n\r\n"), data[-300:]  # the last chunk is there
    body = b"".join(_dechunk(data.split(b"\r\n\r\n", 1)[1]))
    _assert_ends_with_shutdown_error(body.decode())

    assert "error" not in queued, repr(queued.get("error"))
    assert queued["status"] == 503, queued
    assert queued["body"]["error"]["code"] == "server_shutting_down"
    assert queued["retry_after"] == "1"  # as every 503 says when to come back

    assert code == 0, server.log_text()[-3000:]
    assert elapsed < 10, elapsed

    access = {e["request_id"]: e for e in server.events if e.get("event") == "request"}
    for rid in [s.rid for s in streams] + [raw_rid]:
        event = access[rid]
        assert event["status"] == 200
        assert event["stream_error"] == "server_shutting_down"
        assert "disconnected" not in event
    assert access[f"queued-{tag}"]["status"] == 503
    assert access[f"queued-{tag}"]["error_code"] == "server_shutting_down"
    assert not [e for e in server.events if e.get("level") == "error"]


def _dechunk(data: bytes) -> list[bytes]:
    """The chunks of a complete chunked body (asserting its framing)."""
    out: list[bytes] = []
    while True:
        size_line, data = data.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            assert data == b"\r\n", data
            return out
        out.append(data[:size])
        assert data[size:size + 2] == b"\r\n"
        data = data[size + 2:]


#: A stream per endpoint that goes through the turn handler, each in its own wire format:
#: path, body, and the text that shows its first content went out.
OTHER_STREAMS = {
    "completions": ("/v1/completions",
                    {"prompt": "Once", "max_tokens": LONG, "temperature": 0, "stream": True},
                    '"text"'),
    "responses": ("/v1/responses",
                  {"input": "Once", "max_output_tokens": LONG, "temperature": 0,
                   "stream": True, "store": False},
                  "response.output_text.delta"),
    "messages": ("/v1/messages",
                 {"model": "demo", "messages": [{"role": "user", "content": "Once"}],
                  "max_tokens": LONG, "temperature": 0, "stream": True},
                 "content_block_delta"),
}


def _sse_events(text: str) -> list[tuple[str | None, Any]]:
    """(``event:`` name or None, JSON-decoded ``data:``) per block of an SSE body."""
    out: list[tuple[str | None, Any]] = []
    for block in text.split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = line[len("data: "):]
        if data is not None:
            out.append((name, data if data == "[DONE]" else json.loads(data)))
    return out


def test_sigterm_ends_every_endpoint_in_its_wire_format(tmp_path: Path) -> None:
    """Completions, Responses and Messages streams cut by the shutdown end with their own
    error events; an embeddings request still waiting for a slot gets the same 503 as a
    queued chat request, not a cut connection or an answer after the grace period."""
    server = start_server(
        tmp_path,
        config=("[server]\nshutdown_grace = 1.0\n"
                f"[queue]\nmax_concurrent_requests = {len(OTHER_STREAMS)}\n"),
    )
    tag = uuid.uuid4().hex[:8]
    texts: dict[str, str] = {}
    statuses: dict[str, int] = {}
    errors: dict[str, BaseException] = {}
    first = {name: threading.Event() for name in OTHER_STREAMS}

    def read(name: str) -> None:
        path, body, marker = OTHER_STREAMS[name]
        parts: list[str] = []
        try:
            with httpx.stream("POST", server.url + path, json=body, timeout=60,
                              headers={"X-Request-ID": f"{name}-{tag}"}) as response:
                statuses[name] = response.status_code
                for chunk in response.iter_text():
                    parts.append(chunk)
                    if marker in "".join(parts[-2:]):
                        first[name].set()
        except BaseException as exc:  # recorded for the test to report
            errors[name] = exc
        finally:
            texts[name] = "".join(parts)
            first[name].set()

    queued: dict[str, Any] = {}

    def embed_in_queue() -> None:
        try:
            r = httpx.post(server.url + "/v1/embeddings", json={"input": "queued"},
                           headers={"X-Request-ID": f"embed-{tag}"}, timeout=60)
            queued["status"], queued["body"] = r.status_code, r.json()
            queued["retry_after"] = r.headers.get("Retry-After")
        except BaseException as exc:
            queued["error"] = exc

    try:
        # The embedding model loaded first: the request below waits for a slot only.
        warm = httpx.post(server.url + "/v1/embeddings", json={"input": "warm"}, timeout=60)
        assert warm.status_code == 200, warm.text
        threads = [threading.Thread(target=read, args=(name,), daemon=True)
                   for name in OTHER_STREAMS]
        for t in threads:
            t.start()
        for name, event in first.items():
            assert event.wait(60), name
        assert not errors, errors
        waiter = threading.Thread(target=embed_in_queue, daemon=True)
        waiter.start()
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/health", timeout=5).json()["queued_requests"] < 1:
            assert time.monotonic() < deadline, "the embeddings request never queued"
            time.sleep(0.02)

        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        waiter.join(30)
        code = server.proc.wait(30)
    finally:
        server.stop()

    for name in OTHER_STREAMS:
        assert name not in errors, (name, repr(errors[name]), texts[name][-300:])
        assert statuses[name] == 200
    events = _sse_events(texts["completions"])
    assert events[-1] == (None, "[DONE]"), texts["completions"][-500:]
    assert events[-2][1]["error"]["code"] == "server_shutting_down"
    assert any("choices" in data for _, data in events[:-2] if isinstance(data, dict))

    events = _sse_events(texts["responses"])
    assert [name for name, _ in events[-2:]] == ["error", "response.failed"], events[-2:]
    assert events[-2][1]["code"] == "server_shutting_down"
    failed = events[-1][1]["response"]  # its error code is one of OpenAI's enum
    assert (failed["status"], failed["error"]["code"]) == ("failed", "server_error")
    assert "stopping" in failed["error"]["message"]

    events = _sse_events(texts["messages"])
    name, data = events[-1]
    assert name == "error", texts["messages"][-500:]
    assert data["error"]["type"] == "overloaded_error"
    assert "stopping" in data["error"]["message"]

    assert "error" not in queued, repr(queued.get("error"))
    assert queued["status"] == 503, queued
    assert queued["body"]["error"]["code"] == "server_shutting_down"
    assert queued["retry_after"] == "1"  # as every 503 says when to come back

    assert code == 0, server.log_text()[-3000:]
    access = {e["request_id"]: e for e in server.events if e.get("event") == "request"}
    for name in OTHER_STREAMS:
        assert access[f"{name}-{tag}"]["stream_error"] == "server_shutting_down"
    assert access[f"embed-{tag}"]["error_code"] == "server_shutting_down"
    assert not [e for e in server.events if e.get("level") == "error"]


@pytest.mark.parametrize(("path", "body", "status"), [
    (CHAT, {"model": "demo-32k", "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hi."}]}, 503),  # a turn
    ("/v1/messages/count_tokens", {"model": "demo-32k",
                                   "messages": [{"role": "user", "content": "Hi."}]},
     529),  # Anthropic's own for a server that cannot serve now
    ("/api/generate", {"model": "demo-32k"}, 503),  # Ollama's load body
    ("/ui/api/load", {"model": "demo-32k"}, 503),  # the dashboard's
])
def test_a_request_waiting_for_its_model_at_shutdown_gets_the_503_and_loads_nothing(
    tmp_path: Path, path: str, body: dict[str, Any], status: int,
) -> None:
    """A request still waiting for its model (``max_loaded`` 1, the loaded one busy) when
    the grace period ends is answered the 503 at once: before, a turn waited on, had its
    model loaded once the busy stream was cut, and only then heard the server was
    stopping. Counting tokens, Ollama's load bodies and the dashboard's load wait for their
    model without a turn, so the shutdown's end of the turns did not reach them at all:
    the model was loaded for them in the server's last moment (a large model's load
    outlasting it, the connection was then closed unanswered). Nothing loads once the
    grace period is over: they get the 503 a turn gets."""
    server = start_server(tmp_path, config="[server]\nshutdown_grace = 0.5\n"
                                           "[models]\nmax_loaded = 1\n")
    tag = uuid.uuid4().hex[:8]
    busy = Stream(server.url, f"busy-{tag}")
    busy_thread = busy.start()
    waiting: dict[str, Any] = {}

    def wait_for_model() -> None:
        r = httpx.post(server.url + path, json=body, timeout=60)
        waiting["status"], waiting["body"] = r.status_code, r.json()

    try:
        assert busy.first.wait(60)
        waiter = threading.Thread(target=wait_for_model, daemon=True)
        waiter.start()
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/health", timeout=5).json()["models"]["demo-32k"] != \
                "unavailable: loading":
            assert time.monotonic() < deadline, "the request never waited for its model"
            time.sleep(0.02)
        server.proc.send_signal(signal.SIGTERM)
        waiter.join(30)
        busy_thread.join(30)
        code = server.proc.wait(30)
    finally:
        server.stop()
    assert waiting.get("status") == status, waiting
    assert "stopping" in str(waiting["body"]), waiting
    if path == CHAT:
        assert waiting["body"]["error"]["code"] == "server_shutting_down"
    _assert_ends_with_shutdown_error(busy.text)
    assert code == 0
    loaded = [e for e in server.events if "model loaded: demo-32k" in str(e.get("event"))]
    assert loaded == [], "a model was loaded for a request the shutdown ended"
