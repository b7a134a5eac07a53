"""The official ``openai`` client against the real server on the real demo model."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from conftest import parse_sse, start_server
from helpers.openai_schemas import validate_chunk, validate_models, validate_response
from helpers.smoke import MESSAGES, check_completion


def test_non_streaming_completion(client) -> None:
    completion = check_completion(client)
    usage = completion.usage
    assert usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0
    assert usage.completion_tokens_details.reasoning_tokens == 0
    assert completion.id.startswith("chatcmpl-")


def test_streaming_completion_with_usage(client) -> None:
    stream = client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    for chunk in chunks:
        validate_chunk(chunk.model_dump(exclude_unset=True))
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    assert usage_chunks[0].choices == []
    usage = usage_chunks[0].usage
    assert usage.completion_tokens == 16
    assert usage.total_tokens == usage.prompt_tokens + 16

    # Streamed and non-streamed greedy runs produce the same text.
    whole = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=16, temperature=0
    )
    assert whole.choices[0].message.content == text


def test_stream_wire_format(http) -> None:
    response = http.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}},
        headers={"X-Request-ID": "trace-123"},
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    assert response.headers["x-request-id"] == "trace-123"
    assert response.headers["openai-request-id"] == "trace-123"
    body = response.text
    assert body.endswith("data: [DONE]\n\n")
    events = parse_sse(body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for chunk in chunks:
        validate_chunk(chunk)
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["model"] == "demo"
        assert chunk["system_fingerprint"].startswith("fp_")
        assert chunk["created"] == chunks[0]["created"]
    assert chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_max_tokens_exact(client) -> None:
    for key in ("max_tokens", "max_completion_tokens"):
        completion = client.chat.completions.create(
            model="demo", messages=MESSAGES, temperature=0, **{key: 5}
        )
        assert completion.usage.completion_tokens == 5
        assert completion.choices[0].finish_reason == "length"


def test_greedy_is_deterministic(client) -> None:
    texts = {
        client.chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=24, temperature=0
        ).choices[0].message.content
        for _ in range(2)
    }
    assert len(texts) == 1


def test_seed_is_deterministic(client) -> None:
    def sample(seed: int) -> str:
        return client.chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=24, temperature=1.0, seed=seed
        ).choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1


def test_alias_and_default_model(client) -> None:
    via_alias = client.chat.completions.create(
        model="gpt-4o-mini", messages=MESSAGES, max_tokens=8, temperature=0
    )
    assert via_alias.model == "gpt-4o-mini"
    direct = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=8, temperature=0
    )
    assert via_alias.choices[0].message.content == direct.choices[0].message.content


def test_default_model_when_omitted(http) -> None:
    response = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3})
    assert response.status_code == 200
    body = response.json()
    validate_response(body)
    assert body["model"] == "demo"


def test_root_chat_path(http) -> None:
    response = http.post("/chat/completions", json={"messages": MESSAGES, "max_tokens": 3})
    assert response.status_code == 200
    validate_response(response.json())


def test_a_base_url_without_v1_reaches_the_models_too(server) -> None:
    """Chat, completions, embeddings and Responses answer at the root as well, for
    clients whose base URL leaves out ``/v1``; the model listing did not (404), and
    ``models.list()``, which apps call first to fill their model picker, failed there."""
    root = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    listed = root.models.with_raw_response.list()
    assert listed.http_request.url.path == "/models"
    assert [m.id for m in listed.parse()] == [
        m.id for m in openai.OpenAI(base_url=server.url + "/v1", api_key="unused").models.list()]
    assert root.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
    with pytest.raises(openai.NotFoundError) as missing:
        root.models.retrieve("nope")
    assert missing.value.code == "model_not_found"
    chat = root.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=2)
    assert chat.choices[0].finish_reason == "length"


def test_models_endpoints(client, http) -> None:
    listed = http.get("/v1/models").json()
    validate_models(listed)
    ids = {m["id"]: m for m in listed["data"]}
    assert "demo" in ids
    assert ids["gpt-4o-mini"]["parent"] == "demo"
    assert [m.id for m in client.models.list()] == list(ids)
    assert client.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
    missing = http.get("/v1/models/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def test_ids_in_a_path_are_read_as_the_client_encoded_them(tmp_path: Path) -> None:
    """The SDK percent-encodes an id it puts in a path: a Hugging Face repo id's slash, a
    space, an X-Request-ID's colon. Sanic hands path parameters over still encoded, so
    ``models.retrieve("org/name")`` was a 404 naming ``org%2Fname``."""
    server = start_server(tmp_path, config='[models.aliases]\n"mlx-community/A model" = "demo"\n')
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        assert client.models.retrieve("mlx-community/A model").id == "mlx-community/A model"
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.get("/v1/models/mlx-community%2FA%20model").status_code == 200
            done: dict[str, str] = {}

            def long_stream() -> None:
                with httpx.Client(base_url=server.url, timeout=60) as c:
                    body = {"messages": MESSAGES, "max_tokens": 4000, "stream": True,
                            "logit_bias": {"5": 100}}
                    with c.stream("POST", "/v1/chat/completions", json=body,
                                  headers={"X-Request-ID": "run:1"}) as r:
                        done["text"] = r.read().decode()

            thread = threading.Thread(target=long_stream)
            thread.start()
            try:
                deadline = time.monotonic() + 30
                while http.get("/health").json()["active_requests"] < 1:
                    assert time.monotonic() < deadline, "the stream never started"
                    time.sleep(0.02)
                cancelled = http.post("/v1/chat/completions/run%3A1/cancel")
                assert cancelled.status_code == 200, cancelled.text
                assert cancelled.json() == {"id": "run:1", "cancelled": True,
                                            "object": "chat.completion.cancellation"}
            finally:
                thread.join(60)
            assert '"finish_reason":"cancelled"' in done["text"].replace(" ", "")
    finally:
        server.stop()


def test_health_answers_during_long_generation(server, http) -> None:
    done = threading.Event()
    result: dict[str, int] = {}

    def long_generation() -> None:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            r = c.post("/v1/chat/completions",
                       json={"messages": MESSAGES, "max_tokens": 1500, "temperature": 0})
            result["tokens"] = r.json()["usage"]["completion_tokens"]
        done.set()

    thread = threading.Thread(target=long_generation)
    thread.start()
    try:
        seen_active = False
        latencies = []
        deadline = time.monotonic() + 60
        while not done.is_set() and time.monotonic() < deadline:
            t0 = time.perf_counter()
            health = http.get("/health")
            latencies.append(time.perf_counter() - t0)
            assert health.status_code == 200
            if health.json()["active_requests"] >= 1:
                seen_active = True
            time.sleep(0.02)
        assert seen_active, "the long generation was never reported as active"
        assert max(latencies) < 1.0
    finally:
        thread.join(120)
    assert result["tokens"] > 0
    assert http.get("/health").json()["active_requests"] == 0


def test_every_answer_has_a_request_id(client: openai.OpenAI, http: httpx.Client) -> None:
    """OpenAI's API names the request on every answer, and its SDK reads the id of any
    (``_request_id``): a model listing, one model, and afmd's own state routes had none."""
    listed = client.models.with_raw_response.list()
    assert listed.request_id and listed.request_id.startswith("req_")
    assert listed.parse()._request_id == listed.request_id
    one = client.models.with_raw_response.retrieve("demo")
    assert one.request_id and one.request_id != listed.request_id
    with_id = client.models.with_raw_response.retrieve(
        "demo", extra_headers={"X-Request-ID": "mine-models-1"})
    assert with_id.request_id == "mine-models-1"
    for path in ("/health", "/v1/models/nope"):
        answer = http.get(path, headers={"X-Request-ID": "mine-state-2"})
        assert answer.headers["x-request-id"] == "mine-state-2", (path, answer.headers)
    assert http.get("/health").headers["x-request-id"].startswith("req_")
