"""A body near the size limit is read into its request off the event loop.

Each of these bodies holds hundreds of thousands of messages and ends in one the dialect
refuses, so the whole body is read before the 400 and nothing is rendered. Read on the
event loop, they took two to five seconds each on a 2-core machine, and /health (every
other client, every stream) waited as long. The Responses API reads its stores while it
parses (``previous_response_id``, ``item_reference``): those lookups still run on the loop,
which owns the stores, and their answers and errors reach the parse on its thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from conftest import ServerProcess, start_server
from helpers.loop_watch import worst_health_while
from helpers.smoke import grown_mib_while

#: A user turn and the assistant's, as each dialect writes them.
TURNS: dict[str, list[dict[str, Any]]] = {
    "/v1/chat/completions": [{"role": "user", "content": "a"},
                             {"role": "assistant", "content": "b"}],
    "/v1/messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    "/v1/responses": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    "/api/chat": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
}
#: Where each dialect's refusal of the last message points, and its error's shape.
LAST = {
    "/v1/chat/completions": ("messages", "messages[{n}].content"),
    "/v1/messages": ("messages", "messages[{n}].content"),
    "/v1/responses": ("input", "input[{n}].content"),
    "/api/chat": ("messages", None),
}
#: Pairs of turns: about 14 MB of JSON for the quick dialects, fewer for the slower ones.
PAIRS = {"/v1/chat/completions": 230_000, "/v1/messages": 160_000,
         "/v1/responses": 160_000, "/api/chat": 230_000}


def _body(path: str) -> tuple[bytes, int]:
    """The body and the index of its last, refused, message."""
    key, _ = LAST[path]
    turns = TURNS[path] * PAIRS[path] + [{"role": "user", "content": 5}]
    body: dict[str, Any] = {"model": "demo", key: turns}
    if path == "/v1/messages":
        body["max_tokens"] = 1
    elif path == "/api/chat":
        body["stream"] = False
    return orjson.dumps(body), len(turns) - 1


@pytest.mark.parametrize("path", list(TURNS))
def test_a_body_of_many_messages_does_not_stall_the_event_loop(
        server: ServerProcess, path: str) -> None:
    raw, last = _body(path)
    response, worst = worst_health_while(server.url, lambda: httpx.post(
        server.url + path, content=raw, timeout=120,
        headers={"Content-Type": "application/json"}))
    assert response.status_code == 400, response.text[:500]
    _, param = LAST[path]
    error = response.json()["error"]
    if path == "/v1/messages":  # Anthropic's envelope names the field in its message
        assert error["message"].startswith(param.format(n=last) + ":"), response.text
    elif param is not None:
        assert error["param"] == param.format(n=last), response.text
    assert worst < 1.0, f"/health took {worst:.2f} s while a {len(raw) >> 20} MB body was read"


def test_responses_lookups_from_a_large_body_read_the_stores(http: httpx.Client) -> None:
    """A large body's ``previous_response_id`` and ``item_reference`` find what the stores
    hold (counted: a turn would prefill the padding's many tokens), and an id they do not
    hold is the same error a small body gets."""
    first = http.post("/v1/responses", json={
        "model": "demo", "input": "Hello there.", "max_output_tokens": 16, "store": True})
    assert first.status_code == 200, first.text
    stored = first.json()
    reference = {"type": "item_reference", "id": stored["output"][0]["id"]}
    padding = {"role": "user", "content": "word " * 60_000}  # past large_bodies.LARGE_BODY

    def count(**fields: Any) -> httpx.Response:
        return http.post("/v1/responses/input_tokens", json={"model": "demo", **fields})

    alone = count(input=[padding])
    continued = count(previous_response_id=stored["id"], input=[reference, padding])
    assert alone.status_code == 200 and continued.status_code == 200, continued.text
    assert continued.json()["input_tokens"] > alone.json()["input_tokens"]
    unknown = http.post("/v1/responses", json={
        "model": "demo", "previous_response_id": "resp_unknown", "input": [padding]})
    assert unknown.status_code == 400, unknown.text
    assert unknown.json()["error"]["code"] == "previous_response_not_found"
    assert unknown.json()["error"]["param"] == "previous_response_id"


#: A message of about 8 MB: some sixty times the demo model's window.
FAR_TOO_LONG = "hello world " * 700_000
#: Each dialect's body with that message, and how its refusal shows the count.
FAR_BODIES: dict[str, tuple[dict[str, Any], Callable[[dict[str, Any]], str]]] = {
    "/v1/chat/completions": (
        {"model": "demo", "max_tokens": 1,
         "messages": [{"role": "user", "content": FAR_TOO_LONG}]},
        lambda answer: answer["error"]["message"]),
    "/v1/messages": (
        {"model": "demo", "max_tokens": 1,
         "messages": [{"role": "user", "content": FAR_TOO_LONG}]},
        lambda answer: answer["error"]["message"]),
    "/v1/messages/count_tokens": (  # refuses what its create would, as a create does
        {"model": "demo", "messages": [{"role": "user", "content": FAR_TOO_LONG}]},
        lambda answer: answer["error"]["message"]),
    "/api/chat": (  # trimming on (Ollama's truncate): the last message cannot go
        {"model": "demo", "stream": False, "options": {"num_predict": 1},
         "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                      {"role": "user", "content": FAR_TOO_LONG}]},
        lambda answer: answer["error"]),
    "/v1/completions": (  # no template: the prompt is encoded as given
        {"model": "demo", "max_tokens": 1, "prompt": FAR_TOO_LONG},
        lambda answer: answer["error"]["message"]),
    "/api/generate": (  # raw: the completions path in Ollama's words
        {"model": "demo", "stream": False, "raw": True, "prompt": FAR_TOO_LONG,
         "options": {"num_predict": 1}},
        lambda answer: answer["error"]),
}


@pytest.mark.parametrize("path", list(FAR_BODIES))
def test_a_prompt_far_past_the_window_is_refused_without_encoding_it_whole(
        server: ServerProcess, path: str) -> None:
    """A body's worth of text was encoded whole before the context check: the fast
    tokenizer's encoding of megabytes (ids, token strings, offsets, per-byte alignments)
    took the server up by gigabytes and its CPU for tens of seconds, on past the request's
    deadline. It is counted in pieces now, and counting stops once the prompt is clearly
    past the window: the refusal is the context error it was, with the count so far."""
    body, message = FAR_BODIES[path]
    response, grown_mib = _grown_mib(server, path, body)
    assert response.status_code == 400, response.text[:500]
    text = message(response.json())
    if path == "/v1/chat/completions":
        assert response.json()["error"]["code"] == "context_length_exceeded"
        assert "resulted in at least " in text, text
    elif path == "/v1/completions":
        assert response.json()["error"]["code"] == "context_length_exceeded"
        assert response.json()["error"]["param"] == "prompt"
        assert "however you requested at least " in text, text
    elif path.startswith("/v1/messages"):
        assert text.startswith("prompt is too long: ") and text.endswith(" > 131072 maximum")
    else:
        assert text.endswith("exceeds the model's maximum context length (131072 tokens)")
    assert grown_mib < 250, f"the server grew by {grown_mib:.0f} MiB for an 8 MB message"


def _grown_mib(server: ServerProcess, path: str, body: dict[str, Any],
               ) -> tuple[httpx.Response, float]:
    """The answer to ``body`` and how far above where it was the server's RSS rose while
    it was answered, in MiB."""
    return grown_mib_while(server.proc.pid, lambda: httpx.post(
        server.url + path, content=orjson.dumps(body), timeout=120,
        headers={"Content-Type": "application/json"}))


def test_a_text_to_embed_far_past_the_context_is_not_encoded_whole(
        server: ServerProcess) -> None:
    """An embedding input of megabytes was encoded whole, then cut to the model's context
    (Ollama's ``truncate``, on by default) or refused (OpenAI's): gigabytes and tens of
    seconds of a core for one request. Only its start is encoded when it is cut, and a
    refusal counts it only until it is clearly past the context: the vector is the one of
    the text's start, and the refusal the context error it was, its count a lower bound."""
    model = "demo-embedding"
    start = "hello world " * 2_000  # well past the model's context on its own
    short = httpx.post(server.url + "/api/embed", json={"model": model, "input": start},
                       timeout=60)
    assert short.status_code == 200, short.text
    cut, grown = _grown_mib(server, "/api/embed", {"model": model, "input": FAR_TOO_LONG})
    assert cut.status_code == 200, cut.text[:300]
    assert cut.json()["embeddings"] == short.json()["embeddings"]
    assert grown < 250, f"the server grew by {grown:.0f} MiB for an 8 MB text"
    refused, grown = _grown_mib(server, "/v1/embeddings",
                                {"model": model, "input": ["a", FAR_TOO_LONG]})
    assert refused.status_code == 400, refused.text[:300]
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "input[1]", error
    assert "however you requested at least " in error["message"], error
    assert grown < 250, f"the server grew by {grown:.0f} MiB for an 8 MB text"


#: A prompt of about 126,000 of the demo model's tokens: just within its window.
WITHIN = "hello world " * 21_000


def test_tokenizing_many_prompts_gives_up_at_the_deadline(tmp_path: Path) -> None:
    """Completions tokenized every prompt of a body with no deadline: a body of prompts
    each just within the window is seconds of a tokenizer per prompt, and the 504 came
    only once all were done, far past ``request_timeout``. The tokenizing is given up at
    the deadline now, and stops before the next prompt."""
    proc = start_server(tmp_path, config="[server]\nrequest_timeout = 1\n")
    try:
        started = time.monotonic()
        response = httpx.post(proc.url + "/v1/completions", timeout=120,
                              json={"model": "demo", "max_tokens": 1, "prompt": [WITHIN] * 32})
        took = time.monotonic() - started
        assert response.status_code == 504, response.text[:500]
        assert response.json()["error"]["code"] == "timeout"
        assert took < 4, f"the 504 came after {took:.1f} s"
        assert httpx.get(proc.url + "/health", timeout=5).status_code == 200
    finally:
        proc.stop()
