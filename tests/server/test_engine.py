"""The engine under load, end to end: batching, the queue, timeouts, cancellation,
disconnects, the prefix cache and stop sequences, on the real server and demo model."""

from __future__ import annotations

import itertools
import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from conftest import ServerProcess, parse_sse, start_server
from helpers.openai_schemas import validate_chunk, validate_error
from helpers.openai_schemas import validate_response as validate_openai_response

CHAT = "/v1/chat/completions"
LONG = 8000  # tokens: ~20 s of decoding here, far longer than any test waits


def messages(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


def body(text: str = "Tell me a long story.", *, max_tokens: int = 16, stream: bool = False,
         **extra: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"messages": messages(text), "max_tokens": max_tokens,
                         "temperature": 0, **extra}
    if stream:
        b["stream"] = True
        b["stream_options"] = {"include_usage": True}
    return b


def new_id(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:12]}"


def health(url: str) -> dict[str, Any]:
    response = httpx.get(url + "/health", timeout=5)
    assert response.status_code == 200
    return response.json()


def wait_health(url: str, predicate: Callable[[dict[str, Any]], bool],
                timeout: float = 10.0) -> dict[str, Any]:
    """Poll /health until ``predicate`` holds; fail with the last body after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        last = health(url)
        if predicate(last):
            return last
        time.sleep(0.02)
    raise AssertionError(f"/health never matched within {timeout} s; last: {last}")


def idle(h: dict[str, Any]) -> bool:
    return h["active_requests"] == 0 and h["queued_requests"] == 0


def cancel(url: str, request_id: str) -> httpx.Response:
    return httpx.post(f"{url}{CHAT}/{request_id}/cancel", timeout=10)


def content_of(events: list[Any]) -> str:
    return "".join(
        (e["choices"][0]["delta"].get("content") or "")
        for e in events
        if isinstance(e, dict) and e.get("choices")
    )


def finish_reasons(events: list[Any]) -> list[str]:
    return [
        e["choices"][0]["finish_reason"]
        for e in events
        if isinstance(e, dict) and e.get("choices") and e["choices"][0].get("finish_reason")
    ]


def usage_of(events: list[Any]) -> dict[str, Any]:
    found = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
    assert len(found) == 1, events
    return found[0]


def _as_openai(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with afmd's extra finish reason "cancelled" (not in OpenAI's enum) shown as
    "stop", so the rest of it can be checked against OpenAI's schema."""
    out = json.loads(json.dumps(obj))
    for choice in out.get("choices", []):
        if choice.get("finish_reason") == "cancelled":
            choice["finish_reason"] = "stop"
    return out


def validate_response(obj: dict[str, Any]) -> None:
    validate_openai_response(_as_openai(obj))


def validate_stream_chunk(obj: dict[str, Any]) -> None:
    validate_chunk(_as_openai(obj))


class Background:
    """One chat request on its own thread, streamed or not; the outcome lands in attributes.

    ``started`` is set when the status line arrives (for a stream: its first token, since
    the status waits for it), ``first_chunk`` when the first content chunk arrives.
    """

    def __init__(self, url: str, payload: dict[str, Any], request_id: str | None = None,
                 *, headers: dict[str, str] | None = None, timeout: float = 120.0) -> None:
        self.url = url
        self.payload = payload
        self.request_id = request_id
        self.headers = {**({"X-Request-ID": request_id} if request_id else {}), **(headers or {})}
        self.timeout = timeout
        self.status: int | None = None
        self.response_headers: httpx.Headers | None = None
        self.text = ""
        self.events: list[Any] = []
        self.json: Any = None
        self.error: BaseException | None = None
        self.sent_at = time.monotonic()
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.started = threading.Event()
        self.first_chunk = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with httpx.Client(timeout=self.timeout) as c, c.stream(
                "POST", self.url + CHAT, json=self.payload, headers=self.headers
            ) as r:
                self.status = r.status_code
                self.response_headers = r.headers
                self.started_at = time.monotonic()
                self.started.set()
                if not r.headers.get("content-type", "").startswith("text/event-stream"):
                    self.json = json.loads(r.read())
                    return
                for line in r.iter_lines():
                    self.text += line + "\n"
                    if not line.startswith("data: "):
                        continue
                    payload = line[len("data: "):]
                    event = payload if payload == "[DONE]" else json.loads(payload)
                    self.events.append(event)
                    if content_of([event]):
                        self.first_chunk.set()
        except BaseException as exc:  # surfaced by join()
            self.error = exc
        finally:
            self.finished_at = time.monotonic()
            self.started.set()
            self.first_chunk.set()
            self.done.set()

    def join(self, timeout: float = 60.0) -> Background:
        assert self.done.wait(timeout), f"request {self.request_id} still running"
        if self.error is not None:
            raise self.error
        return self

    def wait_first_chunk(self, timeout: float = 30.0) -> None:
        assert self.first_chunk.wait(timeout), "no content arrived"
        assert self.error is None, self.error
        assert self.status == 200 and self.events, (self.status, self.json)


def raw_request(url: str, payload: dict[str, Any]) -> socket.socket:
    """A socket that has sent a chat request: the cheapest client that can vanish."""
    data = json.dumps(payload).encode()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def assert_stream_shape(events: list[Any], finish: str) -> dict[str, Any]:
    """Valid chunks, one finish chunk with ``finish``, the usage chunk last, then [DONE]."""
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for chunk in chunks:
        validate_stream_chunk(chunk)
    assert finish_reasons(chunks) == [finish]
    assert chunks[-2]["choices"][0]["finish_reason"] == finish
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    return usage


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One slot, one queue place."""
    proc = start_server(
        tmp_path_factory.mktemp("tight"),
        config="[queue]\nmax_concurrent_requests = 1\nmax_queued_requests = 1\n",
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One slot and a queue long enough to line requests up; no prefix cache."""
    proc = start_server(
        tmp_path_factory.mktemp("single"),
        config="[queue]\nmax_concurrent_requests = 1\nmax_queued_requests = 8\n"
        "[cache]\nprompt_cache_bytes = 0\n",
    )
    yield proc
    proc.stop()


@pytest.fixture()
def occupied(single: ServerProcess) -> Iterator[Background]:
    """A long stream holding ``single``'s only slot; cancelled and drained afterwards."""
    wait_health(single.url, idle)
    hog = Background(single.url, body(max_tokens=LONG, stream=True), new_id("hog"))
    hog.wait_first_chunk()
    wait_health(single.url, lambda h: h["active_requests"] == 1)
    yield hog
    if not hog.done.is_set():
        cancel(single.url, hog.request_id or "")
    hog.join()
    wait_health(single.url, idle)


# -- continuous batching ---------------------------------------------------------------


def test_concurrent_greedy_streams_match_solo_runs(server: ServerProcess, http) -> None:
    topics = ["cats", "the sea", "rust and iron", "a quiet library", "mountain weather",
              "prime numbers", "an old clock", "bread baking at dawn"]
    prompts = [f"Write about {topic}, please (variant {i})." for i, topic in enumerate(topics)]
    solo: list[tuple[str, str, int]] = []
    for prompt in prompts:
        r = http.post(CHAT, json=body(prompt, max_tokens=48))
        assert r.status_code == 200
        data = r.json()
        validate_response(data)
        choice = data["choices"][0]
        solo.append((choice["message"]["content"], choice["finish_reason"],
                     data["usage"]["completion_tokens"]))
    assert len({text for text, _, _ in solo}) > 1, "distinct prompts should give distinct text"

    runs = [Background(server.url, body(p, max_tokens=48, stream=True)) for p in prompts]
    for run in runs:
        run.join()
    for run, (text, reason, tokens) in zip(runs, solo, strict=True):
        assert run.status == 200
        usage = assert_stream_shape(run.events, reason)
        assert content_of(run.events) == text
        assert usage["completion_tokens"] == tokens
    # They really ran together: some streams were decoding at the same time.
    spans = sorted((r.started_at or 0.0, r.finished_at or 0.0) for r in runs)
    assert any(b_start < a_end for (_, a_end), (b_start, _) in itertools.pairwise(spans)), spans
    wait_health(server.url, idle)


# -- the queue -------------------------------------------------------------------------


def test_queue_full_is_refused_at_once_and_cancel_frees_the_slot(tight: ServerProcess) -> None:
    url = tight.url
    wait_health(url, idle)
    a = Background(url, body(max_tokens=LONG, stream=True), new_id("a"))
    wait_health(url, lambda h: h["active_requests"] == 1)
    a.wait_first_chunk()
    b = Background(url, body("Queued one.", max_tokens=8), new_id("b"))
    h = wait_health(url, lambda h: h["queued_requests"] == 1)
    assert h["active_requests"] == 1

    t0 = time.monotonic()
    c = httpx.post(url + CHAT, json=body("Refused one.", max_tokens=8), timeout=30)
    elapsed = time.monotonic() - t0
    assert c.status_code == 429, c.text
    assert elapsed < 2.0
    assert int(c.headers["Retry-After"]) >= 1
    validate_error(c.json())
    assert c.json()["error"]["code"] == "rate_limited"
    assert c.json()["error"]["type"] == "rate_limit_error"
    assert not b.done.is_set(), "B ran although the only slot was taken"
    assert health(url)["queued_requests"] == 1  # the refused request left no trace

    t_cancel = time.monotonic()
    assert cancel(url, a.request_id or "").status_code == 200
    b.join(30)
    assert b.status == 200, b.json
    validate_response(b.json)
    assert b.json["choices"][0]["finish_reason"] == "length"
    assert b.json["usage"]["completion_tokens"] == 8
    assert (b.finished_at or 0) - t_cancel < 10.0, "B did not start when A's slot was freed"
    a.join()
    assert_stream_shape(a.events, "cancelled")
    wait_health(url, idle)


def test_queue_is_first_in_first_out(single: ServerProcess, occupied: Background) -> None:
    url = single.url
    waiting: list[Background] = []
    for i in range(3):
        waiting.append(
            Background(url, body(f"Queued number {i}.", max_tokens=32, stream=True),
                       new_id(f"q{i}"))
        )
        wait_health(url, lambda h, n=i + 1: h["queued_requests"] == n)
    assert not any(w.started.is_set() for w in waiting)
    assert cancel(url, occupied.request_id or "").status_code == 200
    for w in waiting:
        w.join(30)
        assert w.status == 200
        usage = assert_stream_shape(w.events, "length")
        assert usage["completion_tokens"] == 32
    # The server's own record, not the clients' clocks: a client thread can wake late on a
    # loaded machine. With one slot a request finishes before the next starts, so the order
    # of the access log's lines is the order the queue handed out the slot.
    ids = [w.request_id for w in waiting]
    deadline = time.monotonic() + 10
    while True:
        with single._cond:
            logged = [e.get("request_id") for e in single.events
                      if e.get("event") == "request" and e.get("request_id") in ids]
        if len(logged) == len(ids) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert logged == ids, "queued requests did not run in arrival order"


def test_disconnect_while_queued_leaves_the_queue(single: ServerProcess,
                                                  occupied: Background) -> None:
    url = single.url
    sock = raw_request(url, body("Queued then gone.", max_tokens=8, stream=True))
    try:
        wait_health(url, lambda h: h["queued_requests"] == 1)
    finally:
        sock.close()
    h = wait_health(url, lambda h: h["queued_requests"] == 0, timeout=5)
    assert h["active_requests"] == 1  # the running stream is untouched
    assert not occupied.done.is_set()


# -- request_timeout -------------------------------------------------------------------


def test_request_timeout_504_and_stream_error_chunk(tmp_path: Path) -> None:
    """request_timeout covers queueing and generation: a non-streaming request queued behind
    a long stream gets 504 ``timeout`` about request_timeout after it was sent, and the
    stream, past its own deadline after streaming began, ends with an error event.

    (With one timeout for all, the stream ahead always times out first, so the waiting
    request's 504 may come from its queue wait or from its first moments of generation;
    either way the client sees the same 504.)
    """
    srv = start_server(
        tmp_path, config="[server]\nrequest_timeout = 1.0\n[queue]\nmax_concurrent_requests = 1\n"
    )
    try:
        url = srv.url
        a = Background(url, body(max_tokens=LONG, stream=True), new_id("slow"))
        a.wait_first_chunk()
        t0 = time.monotonic()
        b = httpx.post(url + CHAT, json=body("Waiting.", max_tokens=LONG), timeout=30)
        elapsed = time.monotonic() - t0
        assert b.status_code == 504, b.text
        validate_error(b.json())
        assert b.json()["error"]["code"] == "timeout"
        assert b.headers["x-should-retry"] == "false"  # the SDKs' retries would meet it again
        assert 0.8 <= elapsed < 5.0, elapsed

        a.join(10)
        assert a.status == 200
        assert (a.finished_at or 0) - a.sent_at < 6.0, "the stream outlived request_timeout"
        events = a.events
        assert events[-1] == "[DONE]"
        error = events[-2]
        assert set(error) == {"error"}, error
        validate_error(error)
        assert error["error"]["code"] == "timeout"
        chunks = events[:-2]
        for chunk in chunks:
            validate_chunk(chunk)
        assert content_of(chunks), "the stream had begun before it timed out"
        assert finish_reasons(chunks) == []
        wait_health(url, idle)
        # The openai SDK retries a 504 twice unless told not to: the generation past
        # request_timeout would have run three times.
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=2)
        before = len(srv.events)
        with pytest.raises(openai.APIStatusError) as timed_out:
            # Greedy, as above: sampled, the tiny model may end before the bound.
            client.chat.completions.create(model="demo", max_tokens=LONG, temperature=0,
                                           messages=messages("Tell me a long story."))
        assert timed_out.value.status_code == 504
        sent = [e for e in list(srv.events)[before:]
                if e.get("event") == "request" and e.get("path") == CHAT]
        assert [e["status"] for e in sent] == [504], sent
    finally:
        srv.stop()


# -- cancellation ----------------------------------------------------------------------


def test_cancel_running_stream(server: ServerProcess) -> None:
    rid = new_id("run")
    run = Background(server.url, body(max_tokens=LONG, stream=True), rid)
    run.wait_first_chunk()
    r = cancel(server.url, rid)
    assert r.status_code == 200
    assert r.json() == {"id": rid, "object": "chat.completion.cancellation", "cancelled": True}
    run.join(10)
    assert run.response_headers is not None and run.response_headers["x-request-id"] == rid
    usage = assert_stream_shape(run.events, "cancelled")
    assert 0 < usage["completion_tokens"] < LONG
    assert content_of(run.events)
    # Finished now: the id is unknown again.
    gone = cancel(server.url, rid)
    assert gone.status_code == 404
    assert gone.json()["cancelled"] is False
    wait_health(server.url, idle)


def test_cancel_queued_request(single: ServerProcess, occupied: Background) -> None:
    url = single.url
    rid = new_id("queued")
    queued = Background(url, body("Never started.", max_tokens=8), rid)
    wait_health(url, lambda h: h["queued_requests"] == 1)
    r = cancel(url, rid)
    assert r.status_code == 200
    assert r.json() == {"id": rid, "object": "chat.completion.cancellation", "cancelled": True}
    queued.join(10)
    assert queued.status == 200
    validate_response(queued.json)
    choice = queued.json["choices"][0]
    assert choice["finish_reason"] == "cancelled"
    assert choice["message"]["content"] in ("", None)
    assert queued.json["usage"]["completion_tokens"] == 0
    h = wait_health(url, lambda h: h["queued_requests"] == 0)
    assert h["active_requests"] == 1
    assert not occupied.done.is_set()


def test_cancel_queued_stream(single: ServerProcess, occupied: Background) -> None:
    url = single.url
    rid = new_id("queued-stream")
    queued = Background(url, body("Never started.", max_tokens=8, stream=True), rid)
    wait_health(url, lambda h: h["queued_requests"] == 1)
    assert cancel(url, rid).status_code == 200
    queued.join(10)
    assert queued.status == 200
    usage = assert_stream_shape(queued.events, "cancelled")
    assert usage["completion_tokens"] == 0
    assert content_of(queued.events) == ""


@pytest.mark.parametrize("known", [False, True], ids=["unknown", "finished"])
def test_cancel_not_found(http, known: bool) -> None:
    rid = new_id("nf")
    if known:
        done = http.post(CHAT, json=body(max_tokens=2), headers={"X-Request-ID": rid})
        assert done.status_code == 200
    r = http.post(f"{CHAT}/{rid}/cancel")
    assert r.status_code == 404
    data = r.json()
    assert set(data) == {"id", "object", "cancelled", "error"}
    assert data["id"] == rid
    assert data["object"] == "chat.completion.cancellation"
    assert data["cancelled"] is False
    validate_error({"error": data["error"]})
    assert set(data["error"]) == {"message", "type", "param", "code"}
    assert data["error"]["code"] == "not_found"


def test_cancel_non_streaming_returns_partial_text(server: ServerProcess) -> None:
    rid = new_id("partial")
    run = Background(server.url, body(max_tokens=LONG), rid)
    wait_health(server.url, lambda h: h["active_requests"] == 1)
    time.sleep(0.3)  # let it decode some tokens (not an assertion)
    r = cancel(server.url, rid)
    assert r.status_code == 200 and r.json()["cancelled"] is True
    run.join(10)
    assert run.status == 200
    validate_response(run.json)
    choice = run.json["choices"][0]
    assert choice["finish_reason"] == "cancelled"
    assert choice["message"]["content"]
    assert 0 < run.json["usage"]["completion_tokens"] < LONG
    wait_health(server.url, idle)


def test_duplicate_live_request_id(server: ServerProcess) -> None:
    rid = new_id("dup")
    first = Background(server.url, body(max_tokens=LONG, stream=True), rid)
    first.wait_first_chunk()
    for stream in (False, True):
        r = httpx.post(server.url + CHAT, json=body(max_tokens=4, stream=stream),
                       headers={"X-Request-ID": rid}, timeout=10)
        assert r.status_code == 409, r.text
        validate_error(r.json())
        assert r.json()["error"]["code"] == "duplicate_request_id"
    assert not first.done.is_set(), "the duplicate disturbed the live request"
    assert cancel(server.url, rid).status_code == 200
    first.join(10)
    assert_stream_shape(first.events, "cancelled")
    # Once finished (its stream may end a moment before the server lets go), the id may be
    # used again.
    deadline = time.monotonic() + 5
    while True:
        again = httpx.post(server.url + CHAT, json=body(max_tokens=2),
                           headers={"X-Request-ID": rid}, timeout=30)
        if again.status_code != 409 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert again.status_code == 200, again.text


# -- disconnects -----------------------------------------------------------------------


_CONTENT = re.compile(rb'"content":"[^"]')


def test_clients_disconnecting_mid_stream_free_their_slots(server: ServerProcess) -> None:
    url = server.url
    wait_health(url, idle)

    def hang_up(i: int) -> bool:
        """Open a long stream, read until its first content chunk, vanish."""
        sock = raw_request(url, body(f"Client {i % 7}.", max_tokens=LONG, stream=True))
        with sock:
            received = b""
            while not _CONTENT.search(received):
                chunk = sock.recv(65536)
                if not chunk:
                    return False
                received += chunk
            return received.startswith(b"HTTP/1.1 200")

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(hang_up, range(200)))
    assert all(results)
    assert time.monotonic() - t0 < 60
    wait_health(url, idle, timeout=5)

    t1 = time.monotonic()
    r = httpx.post(url + CHAT, json=body(max_tokens=4), timeout=10)
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 4
    assert time.monotonic() - t1 < 2.0


# -- prefix cache ----------------------------------------------------------------------


def test_prefix_cache_reports_cached_tokens(http, single: ServerProcess) -> None:
    nonce = uuid.uuid4().hex
    system = f"Session {nonce}. " + " ".join(
        f"Rule {i}: answer about topic {i * 7 % 13} briefly and politely." for i in range(40)
    )
    first_messages = [{"role": "system", "content": system},
                      {"role": "user", "content": "Hello there."}]
    first = http.post(CHAT, json={"messages": first_messages, "max_tokens": 8,
                                  "temperature": 0}).json()
    p1 = first["usage"]["prompt_tokens"]
    assert p1 > 300
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < p1 // 2

    second_messages = [*first_messages,
                       {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                       {"role": "user", "content": "And then?"}]
    second = http.post(CHAT, json={"messages": second_messages, "max_tokens": 8,
                                   "temperature": 0}).json()
    validate_response(second)
    usage = second["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert usage["prompt_tokens"] > p1
    assert cached > 0
    assert p1 - 2 <= cached <= usage["prompt_tokens"], (cached, p1, usage)

    # Reusing the cached state changes nothing: a server without a cache says the same.
    cold = httpx.post(single.url + CHAT, json={"messages": second_messages, "max_tokens": 8,
                                               "temperature": 0}, timeout=60).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cold["usage"]["prompt_tokens"] == usage["prompt_tokens"]
    assert cold["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]


# -- stop sequences --------------------------------------------------------------------


STOP_PROMPT = "Count things and describe them at length."


def greedy_stream(http, *, max_tokens: int = 64, **extra: Any) -> tuple[list[str], str]:
    """The content deltas of a greedy stream, and its finish reason."""
    r = http.post(CHAT, json=body(STOP_PROMPT, max_tokens=max_tokens, stream=True, **extra))
    assert r.status_code == 200, r.text
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    deltas = [
        e["choices"][0]["delta"]["content"]
        for e in events[:-1]
        if e["choices"] and e["choices"][0]["delta"].get("content")
    ]
    reasons = finish_reasons(events)
    assert len(reasons) == 1
    return deltas, reasons[0]


def greedy_whole(http, *, max_tokens: int = 64, **extra: Any) -> tuple[str, str]:
    r = http.post(CHAT, json=body(STOP_PROMPT, max_tokens=max_tokens, **extra))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


@pytest.fixture(scope="module")
def reference(server: ServerProcess) -> tuple[list[str], str]:
    """The unstopped greedy deltas and their text."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        deltas, reason = greedy_stream(c)
        whole, _ = greedy_whole(c)
    text = "".join(deltas)
    assert reason == "length" and text == whole
    return deltas, text


def boundary_stop(deltas: list[str], text: str) -> tuple[str, int]:
    """A stop string straddling a delta (hence token) boundary in the middle of ``text``,
    whose first occurrence is at that boundary; and where that occurrence starts."""
    offset = 0
    bounds = []
    for d in deltas[:-1]:
        offset += len(d)
        bounds.append(offset)
    middle = sorted(bounds, key=lambda b: abs(b - len(text) // 2))
    for b in middle:
        stop = text[b - 2:b + 2]
        if b >= 4 and len(stop) == 4 and text.find(stop) == b - 2 and stop.strip():
            return stop, b - 2
    raise AssertionError(f"no usable token boundary in {deltas!r}")


def test_stop_across_token_boundary(http, reference) -> None:
    deltas, text = reference
    stop, at = boundary_stop(deltas, text)
    expected = text[:at]
    for stop_value in (stop, [stop]):
        whole, reason = greedy_whole(http, stop=stop_value)
        assert (whole, reason) == (expected, "stop")
        streamed, reason = greedy_stream(http, stop=stop_value)
        assert reason == "stop"
        assert "".join(streamed) == expected
        assert not any(stop in d for d in streamed)


def test_stop_completed_by_the_last_allowed_token(http, reference) -> None:
    """A stop sequence that the max_tokens-th token completes still ends with "stop"."""
    _, text = reference
    k = 3
    while text.find(text[-k:]) != len(text) - k:  # the shortest suffix found only there
        k += 1
    stop = text[-k:]
    for stream in (False, True):
        if stream:
            deltas, reason = greedy_stream(http, stop=stop)
            content = "".join(deltas)
        else:
            content, reason = greedy_whole(http, stop=stop)
        assert (content, reason) == (text[:-k], "stop"), (stream, stop)


def test_partial_stop_is_held_back_then_released(http, reference) -> None:
    deltas, text = reference
    # Three characters straddling a token boundary near the middle: a stream that did not
    # hold them back would end a delta inside them.
    boundary = boundary_stop(deltas, text)[1] + 2
    prefix = text[boundary - 1:boundary + 2]
    stop = prefix + "\u2603\u2603"  # its start occurs, the whole never does
    assert stop not in text and prefix[0] != prefix[1]
    streamed, reason = greedy_stream(http, stop=stop)
    assert reason == "length"
    assert "".join(streamed) == text  # everything held back was released
    whole, reason = greedy_whole(http, stop=stop)
    assert (whole, reason) == (text, "length")
    # Held back: a delta never ends in a way that could still be the start of the stop,
    # unless the next delta begins with the held text (the held part opens the next one).
    emitted = 0
    for d in streamed[:-1]:
        emitted += len(d)
        so_far = text[:emitted]
        could_start = any(so_far.endswith(stop[:j]) for j in range(1, len(stop)))
        assert not could_start or text[emitted:].startswith(stop[0]), (so_far[-6:], stop)


def test_earliest_of_four_stops_wins(http, reference) -> None:
    _, text = reference
    # Four 3-character stops whose first occurrences are well apart.
    stops: list[tuple[int, str]] = []
    for at in range(len(text) // 5, len(text) - 3):
        candidate = text[at:at + 3]
        first = text.find(candidate)
        if not candidate.strip() or any(abs(first - p) < 4 or s == candidate for p, s in stops):
            continue
        stops.append((first, candidate))
        if len(stops) == 4:
            break
    assert len(stops) == 4, text
    earliest = min(stops)
    expected = text[: earliest[0]]
    ordered = [s for _, s in sorted(stops, reverse=True)]  # the earliest listed last
    whole, reason = greedy_whole(http, stop=ordered)
    assert (whole, reason) == (expected, "stop")
    streamed, reason = greedy_stream(http, stop=ordered)
    assert ("".join(streamed), reason) == (expected, "stop")
