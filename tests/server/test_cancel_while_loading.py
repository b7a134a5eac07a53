"""A request is cancellable from its arrival, not only once its run exists: cancelled while
it waits for its model (loading, or waiting for room beside a busy one), it ends at once as
cancelled, in its dialect's own way, with no tokens counted; a second request under its
id is refused while it waits.

Before, the cancel endpoints found nothing under the id until the model was there and the
prompt rendered: the canceller got 404 ``not_found`` and the request went on to load its
model and generate its whole answer.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from afmd.engine.demo.tokenizer import shipped

from conftest import ServerProcess, parse_sse, start_server

CHAT = "/v1/chat/completions"
WAITER = "demo-32k"  # the model the cancelled requests wait for
#: The demo tokenizer's ending, tool-call and think tokens, never chosen: the busy stream
#: cannot end before the test does.
NEVER = {str(t["id"]): -100
         for t in json.loads(shipped("demo_tokenizer.json"))["added_tokens"]
         if t["content"] in ("<|endoftext|>", "<|im_end|>", "<tool_call>", "<think>")}


@pytest.fixture(scope="module")
def one_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One model loaded at a time: a request for another waits while the loaded one is busy."""
    proc = start_server(tmp_path_factory.mktemp("one-model"),
                        config="[models]\nmax_loaded = 1\n")
    yield proc
    proc.stop()


class Sent:
    """One request on its own thread: its status, headers and text once it ended."""

    def __init__(self, url: str, path: str, body: dict[str, Any], request_id: str) -> None:
        self.status: int | None = None
        self.headers: httpx.Headers | None = None
        self.text = ""
        self.first = threading.Event()
        self._thread = threading.Thread(target=self._send, args=(url + path, body, request_id),
                                        daemon=True)
        self._thread.start()

    def _send(self, url: str, body: dict[str, Any], request_id: str) -> None:
        try:
            with httpx.Client(timeout=120) as client, client.stream(
                    "POST", url, json=body, headers={"X-Request-ID": request_id}) as response:
                self.status, self.headers = response.status_code, response.headers
                for chunk in response.iter_text():
                    self.text += chunk
                    self.first.set()
        finally:
            self.first.set()

    def join(self, timeout: float) -> Sent:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the request did not end"
        return self

    def json(self) -> Any:
        return json.loads(self.text)


@pytest.fixture()
def busy(one_model: ServerProcess) -> Iterator[str]:
    """The default model busy with a long stream: a request for another model waits."""
    rid = "hog-" + uuid.uuid4().hex[:10]
    hog = Sent(one_model.url, CHAT, {"messages": [{"role": "user", "content": "Go on."}],
                                     "max_tokens": 20000, "temperature": 0, "stream": True,
                                     "logit_bias": NEVER}, rid)
    assert hog.first.wait(60)
    yield rid
    httpx.post(f"{one_model.url}{CHAT}/{rid}/cancel", timeout=10)
    hog.join(30)


def waiting_for_model(url: str) -> None:
    deadline = time.monotonic() + 30
    while httpx.get(url + "/health", timeout=5).json()["models"][WAITER] != \
            "unavailable: loading":
        assert time.monotonic() < deadline, "the request never waited for its model"
        time.sleep(0.02)


def _chat(stream: bool) -> dict[str, Any]:
    return {"model": WAITER, "messages": [{"role": "user", "content": "Hi."}],
            "max_tokens": 8, "stream": stream}


# (route, cancel route, body, how the dialect says the request was cancelled)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "chat": (CHAT, CHAT, _chat(False)),
    "chat-stream": (CHAT, CHAT, _chat(True)),
    "chat-n2": (CHAT, CHAT, {**_chat(False), "n": 2}),
    "completions-stream": ("/v1/completions", "/v1/completions",
                           {"model": WAITER, "prompt": ["a", "b"], "max_tokens": 8,
                            "stream": True}),
    "messages-stream": ("/v1/messages", "/v1/messages",
                        {"model": WAITER, "messages": [{"role": "user", "content": "Hi."}],
                         "max_tokens": 8, "stream": True}),
    "responses": ("/v1/responses", "/v1/responses",
                  {"model": WAITER, "input": "Hi.", "max_output_tokens": 16}),
    "ollama-chat-stream": ("/api/chat", CHAT,
                           {"model": WAITER, "messages": [{"role": "user", "content": "Hi."}]}),
}


def cancelled_ending(case: str, text: str) -> None:
    """The dialect's own ending of a cancelled request, with no tokens counted."""
    if case.startswith("chat") or case.startswith("completions"):
        if case.endswith("stream"):
            events = parse_sse(text)
            assert events[-1] == "[DONE]"
            reasons = [c["finish_reason"] for e in events[:-1] for c in e["choices"]
                       if c["finish_reason"]]
            assert reasons == ["cancelled"] * (2 if case.startswith("completions") else 1)
            return
        body = json.loads(text)
        assert [c["finish_reason"] for c in body["choices"]] == \
            ["cancelled"] * (2 if case == "chat-n2" else 1)
        assert body["usage"]["prompt_tokens"] == body["usage"]["completion_tokens"] == 0
    elif case == "messages-stream":
        deltas = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: ") and "message_delta" in line]
        assert deltas[-1]["delta"]["stop_reason"] == "cancelled"
        assert deltas[-1]["usage"]["output_tokens"] == 0
        assert text.rstrip().endswith('{"type":"message_stop"}')
    elif case == "responses":
        body = json.loads(text)
        assert body["status"] == "cancelled" and body["output"] == []
        assert body["usage"]["input_tokens"] == body["usage"]["output_tokens"] == 0
    else:  # Ollama's NDJSON
        last = json.loads(text.strip().splitlines()[-1])
        assert last["done"] is True and last["done_reason"] == "cancelled"
        assert last["eval_count"] == 0


@pytest.mark.parametrize("case", list(CASES))
def test_cancel_while_the_model_is_waited_for(one_model: ServerProcess, busy: str,
                                              case: str) -> None:
    path, cancel_path, body = CASES[case]
    rid = f"waiting-{case}-{uuid.uuid4().hex[:8]}"
    sent = Sent(one_model.url, path, body, rid)
    waiting_for_model(one_model.url)
    answer = httpx.post(f"{one_model.url}{cancel_path}/{rid}/cancel", timeout=10)
    assert answer.status_code == 200, answer.text
    assert answer.json().get("cancelled") is True
    response = sent.join(10)
    assert response.status == 200, response.text
    assert response.headers is not None and response.headers["x-request-id"] == rid
    cancelled_ending(case, response.text)
    # Over: the id names nothing any more, and nothing was loaded for the request.
    assert httpx.post(f"{one_model.url}{cancel_path}/{rid}/cancel",
                      timeout=10).status_code == 404
    health = httpx.get(one_model.url + "/health", timeout=5).json()
    assert health["model_details"]["demo"]["active"] == 1, "the busy request was disturbed"
    assert health["model_details"][WAITER]["state"] != "loaded"


@pytest.mark.parametrize("path", ["/v1/embeddings", "/api/embed"])
def test_cancel_an_embeddings_request_while_its_model_is_waited_for(
    one_model: ServerProcess, busy: str, path: str
) -> None:
    rid = "waiting-embed-" + uuid.uuid4().hex[:8]
    sent = Sent(one_model.url, path, {"model": "demo-embedding", "input": "Hi."}, rid)
    deadline = time.monotonic() + 30
    while httpx.get(one_model.url + "/health", timeout=5).json()["models"][
            "demo-embedding"] != "unavailable: loading":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    answer = httpx.post(f"{one_model.url}/v1/embeddings/{rid}/cancel", timeout=10)
    assert answer.status_code == 200, answer.text
    response = sent.join(10)
    assert response.status == 409, response.text
    if path == "/api/embed":
        assert "cancelled" in response.json()["error"]
    else:
        assert response.json()["error"]["code"] == "request_cancelled"


def test_a_second_request_under_a_waiting_id_is_refused_at_once(
    one_model: ServerProcess, busy: str
) -> None:
    rid = "waiting-dup-" + uuid.uuid4().hex[:8]
    first = Sent(one_model.url, CHAT, _chat(False), rid)
    waiting_for_model(one_model.url)
    started = time.monotonic()
    second = httpx.post(one_model.url + CHAT, json=_chat(False), timeout=30,
                        headers={"X-Request-ID": rid})
    assert second.status_code == 409, second.text
    assert second.json()["error"]["code"] == "duplicate_request_id"
    assert time.monotonic() - started < 5
    assert httpx.post(f"{one_model.url}{CHAT}/{rid}/cancel", timeout=10).status_code == 200
    assert first.join(10).json()["choices"][0]["finish_reason"] == "cancelled"
