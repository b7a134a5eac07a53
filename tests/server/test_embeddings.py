"""POST /v1/embeddings on the real server and the built-in demo-embedding model.

Every response is checked against OpenAI's published schemas (tests/data/
openai-embeddings-schemas.json), the vectors against mlx-lm's own computation on the same
model folder, and each bad input against the error it must get.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import openai
import pytest

from conftest import ServerProcess, start_server
from helpers.openai_schemas import _allow_nullable, validate_models
from helpers.paths import TESTS_DIR

EMBED = "/v1/embeddings"
MODEL = "demo-embedding"
WIDTH = 64  # demo-embedding's hidden size
TEXTS = ["The quick brown fox.", "Embeddings map text to vectors.", "a", "héllo wörld ✓"]
_SCHEMAS = TESTS_DIR / "data" / "openai-embeddings-schemas.json"


@functools.cache
def _validator(name: str) -> jsonschema.protocols.Validator:
    doc = json.loads(_SCHEMAS.read_text())
    components = _allow_nullable(copy.deepcopy(doc["components"]))
    return jsonschema.Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": components}
    )


def validate(name: str, instance: Any) -> None:
    _validator(name).validate(instance)


def decode(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<f4")


def validate_response(body: dict[str, Any]) -> None:
    """CreateEmbeddingResponse; a base64 vector (a string on OpenAI's wire too, which the
    published schema does not describe) is checked as the floats it encodes."""
    as_floats = copy.deepcopy(body)
    for item in as_floats.get("data", []):
        if isinstance(item.get("embedding"), str):
            item["embedding"] = decode(item["embedding"]).tolist()
    validate("CreateEmbeddingResponse", as_floats)


def post(url: str, payload: Any, *, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(url + EMBED, json=payload, headers=headers, timeout=60)


def embed(url: str, **payload: Any) -> dict[str, Any]:
    payload.setdefault("model", MODEL)
    validate("CreateEmbeddingRequest", payload)
    r = httpx.post(url + EMBED, json=payload, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    validate_response(body)
    return body


def vectors(body: dict[str, Any]) -> np.ndarray:
    rows = [item["embedding"] for item in sorted(body["data"], key=lambda d: d["index"])]
    if rows and isinstance(rows[0], str):
        return np.stack([decode(r) for r in rows])
    return np.array(rows, dtype=np.float32)


def wait_loaded(url: str, model: str = MODEL, headers: dict[str, str] | None = None) -> None:
    """The first request starts the model's load and may get 503 busy until it is ready."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = httpx.post(url + EMBED, json={"model": model, "input": "warm up"},
                       headers=headers, timeout=30)
        if r.status_code != 503:
            return
        time.sleep(0.2)
    raise AssertionError(f"{model} never loaded")


@pytest.fixture(scope="module")
def url(server: ServerProcess) -> str:
    wait_loaded(server.url)
    return server.url


@functools.cache
def reference_model() -> tuple[Any, Any]:
    """demo-embedding as mlx-lm loads it, from the folder the server built."""
    import mlx_lm

    from afmd.engine.demo import builtin as demo

    return mlx_lm.load(str(demo.materialize(MODEL)))


def reference(ids: list[int]) -> np.ndarray:
    """mlx-lm's own computation: the last token's final hidden state, L2-normalized."""
    import mlx.core as mx

    model, _ = reference_model()
    hidden = np.array(model.model(mx.array([ids]))[0, -1].astype(mx.float32))
    return hidden / np.linalg.norm(hidden)


# -- the happy paths ---------------------------------------------------------------------


def test_float_vectors_match_mlx_lm(url: str) -> None:
    body = embed(url, input=TEXTS, encoding_format="float")
    assert body["object"] == "list" and body["model"] == MODEL
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    got = vectors(body)
    assert got.shape == (len(TEXTS), WIDTH)
    _, tokenizer = reference_model()
    ids = [tokenizer.encode(t) for t in TEXTS]  # the tokenizer appends <|endoftext|>
    assert all(row[-1] == tokenizer.convert_tokens_to_ids("<|endoftext|>") for row in ids)
    for i, row in enumerate(ids):
        np.testing.assert_allclose(got[i], reference(row), atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    total = sum(len(row) for row in ids)
    assert body["usage"] == {"prompt_tokens": total, "total_tokens": total}


def test_base64_is_the_same_float32_vectors(url: str) -> None:
    floats = vectors(embed(url, input=TEXTS))
    raw = embed(url, input=TEXTS, encoding_format="base64")
    assert all(isinstance(d["embedding"], str) for d in raw["data"])
    assert np.array_equal(vectors(raw), floats)  # JSON floats round-trip float32 exactly


def test_token_id_inputs_equal_text_inputs(url: str) -> None:
    _, tokenizer = reference_model()
    ids = [tokenizer.encode(t) for t in TEXTS[:2]]
    texts = vectors(embed(url, input=TEXTS[:2]))
    arrays = vectors(embed(url, input=ids))
    single = vectors(embed(url, input=ids[0]))
    np.testing.assert_allclose(arrays, texts, atol=1e-6)
    np.testing.assert_allclose(single[0], texts[0], atol=1e-6)


def test_dimensions_truncate_and_renormalize(url: str) -> None:
    full = vectors(embed(url, input=TEXTS))
    short = vectors(embed(url, input=TEXTS, dimensions=16))
    assert short.shape == (len(TEXTS), 16)
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(short, expected, atol=1e-5)
    same = vectors(embed(url, input=TEXTS, dimensions=WIDTH))
    np.testing.assert_allclose(same, full, atol=1e-6)


def test_openai_client_float_and_base64(url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    decoded = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    default = client.embeddings.create(model=MODEL, input=TEXTS)  # base64 under the hood
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=TEXTS)
    validate_response(json.loads(raw.http_response.text))
    assert floats.object == "list" and floats.model == MODEL
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS)
    expected = np.array([d.embedding for d in floats.data], dtype=np.float32)
    # Asked for base64 explicitly, the client hands the strings over as they came.
    assert np.array_equal(np.stack([decode(d.embedding) for d in decoded.data]), expected)
    # Left to itself, it asks for base64 and decodes it.
    assert all(isinstance(d.embedding, list) for d in default.data)
    assert np.array_equal(np.array([d.embedding for d in default.data], np.float32), expected)
    assert [d.index for d in default.data] == list(range(len(TEXTS)))


def test_input_over_the_window_is_worded_as_openai_words_it(url: str) -> None:
    """An input over the model's window says OpenAI's embeddings sentence, which clients
    match to split the input and retry (LiteLLM raises its ContextWindowExceededError on
    it); the param still names the input."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input=["a", LONG_TEXT])
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "input[1]")
    body = info.value.body
    assert isinstance(body, dict)
    assert body["message"].startswith(
        "This model's maximum context length is 512 tokens, however you requested ")
    assert body["message"].endswith(
        " in your prompt; 0 for the completion). Please reduce your prompt; or completion "
        "length.")


def test_concurrent_requests_get_their_own_vectors(url: str) -> None:
    """Requests batched together (different lengths, padded into one pass) each get what
    they would get alone."""
    inputs = [[f"sentence {i} " * (1 + i % 5), f"other {i}"] for i in range(12)]
    alone = [vectors(embed(url, input=texts)) for texts in inputs]
    with ThreadPoolExecutor(12) as pool:
        together = list(pool.map(lambda texts: vectors(embed(url, input=texts)), inputs))
    for a, b in zip(alone, together, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_models_list_each_kind(server: ServerProcess, url: str) -> None:
    body = httpx.get(url + "/v1/models", timeout=10).json()
    validate_models(body)
    kinds = {m["id"]: m["kind"] for m in body["data"]}
    assert kinds["demo"] == kinds["demo-32k"] == "chat"
    assert kinds[MODEL] == "embedding"
    assert kinds["gpt-4o-mini"] == "chat"  # an alias has its model's kind
    one = httpx.get(url + f"/v1/models/{MODEL}", timeout=10).json()
    assert one["kind"] == "embedding"


def test_profile_header_is_ignored(url: str) -> None:
    for value in ("true", "extended", "bogus"):
        r = httpx.post(url + EMBED, json={"model": MODEL, "input": "x"},
                       headers={"X-AFM-Profile": value}, timeout=30)
        assert r.status_code == 200, r.text
        assert set(r.json()) == {"object", "data", "model", "usage"}


def test_model_omitted_uses_the_first_embedding_model(url: str) -> None:
    r = httpx.post(url + EMBED, json={"input": "x"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL


# -- errors ------------------------------------------------------------------------------

LONG_TEXT = "word " * 600  # past demo-embedding's 512-token context
BAD: list[tuple[Any, int, str, str | None]] = [
    # body, status, code, param
    ({"model": MODEL}, 400, "missing_required_parameter", "input"),
    ({"model": MODEL, "input": None}, 400, "missing_required_parameter", "input"),
    ({"model": MODEL, "input": ""}, 400, "invalid_value", "input"),
    ({"model": MODEL, "input": []}, 400, "invalid_value", "input"),
    ({"model": MODEL, "input": ["a", ""]}, 400, "invalid_value", "input[1]"),
    ({"model": MODEL, "input": ["a", 1]}, 400, "invalid_type", "input[1]"),
    ({"model": MODEL, "input": [1, "a"]}, 400, "invalid_type", "input[1]"),
    ({"model": MODEL, "input": [[1, 2], []]}, 400, "invalid_value", "input[1]"),
    ({"model": MODEL, "input": [[1, 2], [1, "x"]]}, 400, "invalid_type", "input[1][1]"),
    ({"model": MODEL, "input": [[1], 2]}, 400, "invalid_type", "input[1]"),
    ({"model": MODEL, "input": [5, -1]}, 400, "invalid_value", "input[1]"),
    ({"model": MODEL, "input": [True]}, 400, "invalid_type", "input[0]"),
    ({"model": MODEL, "input": [{"text": "a"}]}, 400, "invalid_type", "input[0]"),
    ({"model": MODEL, "input": {"text": "a"}}, 400, "invalid_type", "input"),
    ({"model": MODEL, "input": 5}, 400, "invalid_type", "input"),
    ({"model": MODEL, "input": ["a"] * 2049}, 400, "invalid_value", "input"),
    ({"model": MODEL, "input": [7, 99999]}, 400, "invalid_value", "input[1]"),
    ({"model": MODEL, "input": [[7], [1, 99999]]}, 400, "invalid_value", "input[1][1]"),
    ({"model": MODEL, "input": ["a", "b", "c", LONG_TEXT]}, 400, "context_length_exceeded",
     "input[3]"),
    ({"model": MODEL, "input": [1] * 513}, 400, "context_length_exceeded", "input"),
    ({"model": MODEL, "input": LONG_TEXT}, 400, "context_length_exceeded", "input"),
    ({"model": 5, "input": "a"}, 400, "invalid_type", "model"),
    ({"model": "nope", "input": "a"}, 404, "model_not_found", "model"),
    ({"model": "demo", "input": "a"}, 400, "invalid_model_kind", "model"),
    ({"model": "gpt-4o-mini", "input": "a"}, 400, "invalid_model_kind", "model"),
    ({"model": MODEL, "input": "a", "encoding_format": "int8"}, 400, "invalid_value",
     "encoding_format"),
    ({"model": MODEL, "input": "a", "encoding_format": 1}, 400, "invalid_type",
     "encoding_format"),
    ({"model": MODEL, "input": "a", "dimensions": 0}, 400, "invalid_value", "dimensions"),
    ({"model": MODEL, "input": "a", "dimensions": "8"}, 400, "invalid_type", "dimensions"),
    ({"model": MODEL, "input": "a", "dimensions": True}, 400, "invalid_type", "dimensions"),
    ({"model": MODEL, "input": "a", "dimensions": 65}, 400, "invalid_value", "dimensions"),
    ({"model": MODEL, "input": "a", "user": 1}, 400, "invalid_type", "user"),
    (["a"], 400, "invalid_type", None),
]


@pytest.mark.parametrize(("payload", "status", "code", "param"), BAD,
                         ids=[f"{b[2]}-{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input(url: str, payload: Any, status: int, code: str, param: str | None) -> None:
    r = httpx.post(url + EMBED, json=payload, timeout=30)
    assert r.status_code == status, r.text
    body = r.json()
    validate("ErrorResponse", body)
    assert body["error"]["code"] == code, body
    assert body["error"]["param"] == param, body
    if code == "invalid_model_kind":
        assert "'demo'" in body["error"]["message"]


def test_apples_model_is_a_chat_model_even_where_it_cannot_answer(url: str) -> None:
    """Embeddings from ``system`` can never be had, so the answer is the 400 that says so,
    not the 503 ``model_unavailable`` (with ``Retry-After``, which the SDKs retry) of a
    machine without Apple's framework: that was the answer here."""
    r = httpx.post(url + EMBED, json={"model": "system", "input": "a"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_model_kind", "model")
    assert "retry-after" not in r.headers


def test_malformed_json_is_invalid_json(url: str) -> None:
    r = httpx.post(url + EMBED, content=b'{"input": ', timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    validate("ErrorResponse", r.json())
    assert r.json()["error"]["code"] == "invalid_json"


def test_chat_on_an_embedding_model_is_invalid_model_kind(url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    error = info.value.body
    assert isinstance(error, dict)
    assert error["code"] == "invalid_model_kind" and error["param"] == "model"
    assert f"'{MODEL}'" in error["message"]


def test_errors_carry_the_request_id(url: str) -> None:
    rid = "emb-" + uuid.uuid4().hex
    r = httpx.post(url + EMBED, json={"model": MODEL, "input": ""},
                   headers={"X-Request-ID": rid}, timeout=30)
    assert r.status_code == 400 and r.headers["X-Request-ID"] == rid
    ok = httpx.post(url + EMBED, json={"model": MODEL, "input": "x"},
                    headers={"X-Request-ID": rid}, timeout=30)
    assert ok.headers["X-Request-ID"] == ok.headers["OpenAI-Request-ID"] == rid


# -- screening, queue, cancel, timeout: a server of its own --------------------------------

KEY = "sk-embeddings-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One slot, one queue place, an API key, a small body limit, an allowed origin, and an
    embedding model without Matryoshka vectors (the chat demo read as an embedding model)."""
    proc = start_server(
        tmp_path_factory.mktemp("embeddings"),
        config=(
            "[server]\n"
            f'api_key = "{KEY}"\n'
            "max_request_body_bytes = 65536\n"
            'allowed_origins = ["http://good.example"]\n'
            "[queue]\nmax_concurrent_requests = 1\nmax_queued_requests = 1\n"
            '[[models.model]]\nid = "plain-embedding"\npath = "afmd:demo"\nkind = "embedding"\n'
        ),
    )
    wait_loaded(proc.url, headers=AUTH)
    wait_loaded(proc.url, "plain-embedding", headers=AUTH)
    yield proc
    proc.stop()


@pytest.mark.parametrize(
    ("headers", "content", "status", "code"),
    [
        ({}, None, 401, "invalid_api_key"),
        ({**AUTH, "Host": "evil.example"}, None, 421, "invalid_host"),
        ({**AUTH, "Origin": "http://evil.example"}, None, 403, "origin_not_allowed"),
        ({**AUTH, "Content-Type": "text/plain"}, b'{"input": "x"}', 415,
         "unsupported_media_type"),
        (AUTH, b'{"input": "' + b"x" * 70000 + b'"}', 413, "malformed_request"),
    ],
)
def test_screening(strict: ServerProcess, headers: dict[str, str], content: bytes | None,
                   status: int, code: str) -> None:
    body = content if content is not None else json.dumps({"model": MODEL, "input": "x"})
    headers = {"Content-Type": "application/json", **headers}
    r = httpx.post(strict.url + EMBED, content=body, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    validate("ErrorResponse", r.json())
    assert r.json()["error"]["code"] == code


def test_allowed_origin_gets_cors(strict: ServerProcess) -> None:
    r = httpx.post(strict.url + EMBED, json={"model": MODEL, "input": "x"},
                   headers={**AUTH, "Origin": "http://good.example"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["Access-Control-Allow-Origin"] == "http://good.example"


def test_dimensions_on_a_model_without_matryoshka(strict: ServerProcess) -> None:
    r = httpx.post(strict.url + EMBED, json={"model": "plain-embedding", "input": "x",
                                             "dimensions": 8}, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("invalid_value",
                                                                      "dimensions")
    full = httpx.post(strict.url + EMBED, json={"model": "plain-embedding", "input": "x"},
                      headers=AUTH, timeout=30)
    assert full.status_code == 200 and len(full.json()["data"][0]["embedding"]) == WIDTH


def _health(url: str) -> dict[str, Any]:
    return httpx.get(url + "/health", timeout=10).json()


def _wait(url: str, predicate: Callable[[dict[str, Any]], bool]) -> None:
    deadline = time.monotonic() + 30
    while not predicate(_health(url)):
        assert time.monotonic() < deadline, _health(url)
        time.sleep(0.02)


def test_queue_429_duplicate_id_and_cancel(strict: ServerProcess) -> None:
    """A chat stream holds the only slot: an embeddings request waits in the queue (the
    same queue), the next is refused with 429, a second request under the waiting one's
    X-Request-ID is a 409, and cancelling the waiting one by its id ends it."""
    url = strict.url
    hog_id, waiting_id = "hog-" + uuid.uuid4().hex, "emb-" + uuid.uuid4().hex
    # Greedy, this chat runs to max_tokens on the demo model (as in tests/server/test_engine.py).
    chat = {"model": "demo", "max_tokens": 8000, "stream": True, "temperature": 0,
            "messages": [{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": "Tell me a long story."}]}
    with ThreadPoolExecutor(2) as pool:
        hog: Future[httpx.Response] = pool.submit(
            httpx.post, url + "/v1/chat/completions", json=chat, timeout=120,
            headers={**AUTH, "X-Request-ID": hog_id})
        _wait(url, lambda h: h["active_requests"] == 1)
        waiting = pool.submit(post, url, {"model": MODEL, "input": "queued"},
                              headers={**AUTH, "X-Request-ID": waiting_id})
        _wait(url, lambda h: h["queued_requests"] == 1)
        refused = post(url, {"model": MODEL, "input": "refused"}, headers=AUTH)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rate_limited"
        assert int(refused.headers["Retry-After"]) >= 1
        twin = post(url, {"model": MODEL, "input": "twin"},
                    headers={**AUTH, "X-Request-ID": waiting_id})
        assert twin.status_code == 409, twin.text
        assert twin.json()["error"]["code"] == "duplicate_request_id"
        assert twin.json()["error"]["param"] == "X-Request-ID"
        # An id names one live request across endpoints: a chat under it is refused too.
        chat_twin = httpx.post(url + "/v1/chat/completions", timeout=30,
                               json={**chat, "stream": False, "max_tokens": 2},
                               headers={**AUTH, "X-Request-ID": waiting_id})
        assert chat_twin.status_code == 409, chat_twin.text
        assert chat_twin.json()["error"]["code"] == "duplicate_request_id"

        cancel = httpx.post(url + f"{EMBED}/{waiting_id}/cancel", headers=AUTH, timeout=30)
        assert cancel.status_code == 200, cancel.text
        assert cancel.json() == {"id": waiting_id, "object": "embedding.cancellation",
                                 "cancelled": True}
        ended = waiting.result(30)
        assert ended.status_code == 409, ended.text
        validate("ErrorResponse", ended.json())
        assert ended.json()["error"]["code"] == "request_cancelled"
        again = httpx.post(url + f"{EMBED}/{waiting_id}/cancel", headers=AUTH, timeout=30)
        assert again.status_code == 404 and again.json()["cancelled"] is False

        httpx.post(url + f"/v1/chat/completions/{hog_id}/cancel", headers=AUTH, timeout=30)
        assert hog.result(60).status_code == 200
    _wait(url, lambda h: h["active_requests"] == 0 and h["queued_requests"] == 0)
    after = post(url, {"model": MODEL, "input": "after"}, headers=AUTH)
    assert after.status_code == 200, after.text


@pytest.mark.parametrize(("path", "body", "ended_error"), [
    (EMBED, {"model": MODEL, "input": "queued"},
     lambda body: body["error"]["code"] == "request_cancelled"),
    ("/api/embed", {"model": MODEL, "input": ["queued"]},
     lambda body: set(body) == {"error"} and "cancelled" in body["error"]),
], ids=["openai", "ollama"])
def test_the_chat_cancel_path_cancels_an_embeddings_request(
    strict: ServerProcess, path: str, body: dict[str, Any],
    ended_error: Callable[[dict[str, Any]], bool],
) -> None:
    """Every dialect's requests are cancelled by the chat path, Ollama's embed included,
    which has no cancel route of its own: it answered 404 there and the request went on
    waiting for its slot."""
    url = strict.url
    hog_id, waiting_id = "hog-" + uuid.uuid4().hex, "emb-" + uuid.uuid4().hex
    chat = {"model": "demo", "max_tokens": 8000, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    with ThreadPoolExecutor(2) as pool:
        hog: Future[httpx.Response] = pool.submit(
            httpx.post, url + "/v1/chat/completions", json=chat, timeout=120,
            headers={**AUTH, "X-Request-ID": hog_id})
        _wait(url, lambda h: h["active_requests"] == 1)
        waiting = pool.submit(httpx.post, url + path, json=body, timeout=60,
                              headers={**AUTH, "X-Request-ID": waiting_id})
        _wait(url, lambda h: h["queued_requests"] == 1)
        cancel = httpx.post(url + f"/v1/chat/completions/{waiting_id}/cancel", headers=AUTH,
                            timeout=30)
        assert cancel.status_code == 200, cancel.text
        assert cancel.json()["cancelled"] is True
        ended = waiting.result(30)
        assert ended.status_code == 409, ended.text
        assert ended_error(ended.json()), ended.text
        httpx.post(url + f"/v1/chat/completions/{hog_id}/cancel", headers=AUTH, timeout=30)
        assert hog.result(60).status_code == 200
    _wait(url, lambda h: h["active_requests"] == 0 and h["queued_requests"] == 0)


def test_the_openai_client_does_not_retry_a_cancelled_request(strict: ServerProcess) -> None:
    """The SDK retries a 409 unless told not to: the cancelled request's answer says
    ``x-should-retry: false``, so ``embeddings.create`` raises the 409 at once. Before, the
    SDK sent the request again and it waited for its slot to be embedded after all."""
    url = strict.url
    hog_id, waiting_id = "hog-" + uuid.uuid4().hex, "emb-" + uuid.uuid4().hex
    chat = {"model": "demo", "max_tokens": 8000, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=2)
    with ThreadPoolExecutor(2) as pool:
        hog: Future[httpx.Response] = pool.submit(
            httpx.post, url + "/v1/chat/completions", json=chat, timeout=120,
            headers={**AUTH, "X-Request-ID": hog_id})
        try:
            _wait(url, lambda h: h["active_requests"] == 1)
            waiting = pool.submit(client.embeddings.create, model=MODEL, input="queued",
                                  extra_headers={"X-Request-ID": waiting_id})
            _wait(url, lambda h: h["queued_requests"] == 1)
            cancel = httpx.post(url + f"{EMBED}/{waiting_id}/cancel", headers=AUTH,
                                timeout=30)
            assert cancel.json()["cancelled"] is True, cancel.text
            with pytest.raises(openai.ConflictError) as ended:
                waiting.result(15)
            assert ended.value.code == "request_cancelled"
            assert ended.value.response.headers["x-should-retry"] == "false"
            assert _health(url)["queued_requests"] == 0
        finally:
            httpx.post(url + f"/v1/chat/completions/{hog_id}/cancel", headers=AUTH,
                       timeout=30)
            hog.result(60)
    _wait(url, lambda h: h["active_requests"] == 0 and h["queued_requests"] == 0)


def test_every_cancel_route_finds_every_live_request(strict: ServerProcess) -> None:
    """An id names one live request across every route, so each dialect's cancel route
    cancels whatever runs under it: Anthropic's and the Responses route cancel a queued
    embeddings request, and the embeddings route a chat stream. They answered 404 "No
    running request has the id" for a request that was running, and it went on."""
    url = strict.url
    hog_id = "hog-" + uuid.uuid4().hex
    chat = {"model": "demo", "max_tokens": 8000, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    with ThreadPoolExecutor(2) as pool:
        hog: Future[httpx.Response] = pool.submit(
            httpx.post, url + "/v1/chat/completions", json=chat, timeout=120,
            headers={**AUTH, "X-Request-ID": hog_id})
        _wait(url, lambda h: h["active_requests"] == 1)
        for route, answer in (("/v1/messages", {"type": "message_cancellation"}),
                              ("/v1/responses", {"object": "response.cancellation"})):
            waiting_id = "emb-" + uuid.uuid4().hex
            waiting = pool.submit(post, url, {"model": MODEL, "input": "queued"},
                                  headers={**AUTH, "X-Request-ID": waiting_id})
            _wait(url, lambda h: h["queued_requests"] == 1)
            cancel = httpx.post(url + f"{route}/{waiting_id}/cancel", headers=AUTH,
                                timeout=30)
            assert cancel.status_code == 200, (route, cancel.text)
            assert cancel.json() == {"id": waiting_id, "cancelled": True, **answer}
            ended = waiting.result(30)
            assert ended.status_code == 409, ended.text
            assert ended.json()["error"]["code"] == "request_cancelled"
        cancel = httpx.post(url + f"{EMBED}/{hog_id}/cancel", headers=AUTH, timeout=30)
        assert cancel.status_code == 200, cancel.text
        assert cancel.json() == {"id": hog_id, "object": "embedding.cancellation",
                                 "cancelled": True}
        stream = hog.result(30)
        assert stream.status_code == 200, stream.text
        last = json.loads(stream.text.split("data: [DONE]")[0].strip().rsplit("data: ", 1)[1])
        assert last["choices"][0]["finish_reason"] == "cancelled"
    _wait(url, lambda h: h["active_requests"] == 0 and h["queued_requests"] == 0)


def test_request_timeout_is_504(tmp_path: Path) -> None:
    """request_timeout bounds the whole request, the encoding included."""
    srv = start_server(tmp_path, config="[server]\nrequest_timeout = 0.001\n")
    try:
        deadline = time.monotonic() + 60
        while True:
            r = post(srv.url, {"model": MODEL, "input": ["x" * 200] * 8})
            if r.status_code != 503 or time.monotonic() > deadline:  # 503: still loading
                break
            time.sleep(0.2)
        assert r.status_code == 504, r.text
        validate("ErrorResponse", r.json())
        assert r.json()["error"]["code"] == "timeout"
    finally:
        srv.stop()


def test_a_batch_of_millions_of_texts_is_answered_by_its_deadline(tmp_path: Path) -> None:
    """Ollama's ``input`` has no count limit: two million one-letter texts (10 MB) took
    tens of seconds to tokenize at once, and the 504 came that long past
    ``request_timeout``; they are tokenized in parts, the deadline looked at between two.
    The embedding model is not held afterwards. (A width of one keeps that many vectors
    under the cap on a response's numbers.)"""
    srv = start_server(tmp_path, config="[server]\nrequest_timeout = 2\n")
    try:
        warm = httpx.post(srv.url + "/api/embed", json={"model": MODEL, "input": "warm"},
                          timeout=60)
        assert warm.status_code == 200, warm.text
        body = json.dumps({"model": MODEL, "input": ["a"] * 2_000_000,
                           "dimensions": 1}).encode()
        started = time.monotonic()
        r = httpx.post(srv.url + "/api/embed", content=body, timeout=120,
                       headers={"Content-Type": "application/json"})
        took = time.monotonic() - started
        assert r.status_code == 504, r.text[:300]
        assert "request_timeout" in r.json()["error"]
        # Past the deadline: the body's reading, which nothing interrupts, and the part
        # under way, both slower on a busy machine; tokenized at once it was tens of seconds.
        assert took < 2 + 8, took
        started = time.monotonic()
        after = httpx.post(srv.url + "/api/embed", json={"model": MODEL, "input": "after"},
                           timeout=60)
        assert after.status_code == 200 and time.monotonic() - started < 2, after.text
    finally:
        srv.stop()


def test_more_vectors_than_one_response_may_carry_is_a_400_naming_input(
    tmp_path: Path,
) -> None:
    """Ollama's ``input`` has no count limit, and a body of short texts holds millions:
    their vectors and then their JSON were held whole, gigabytes for one request. Past
    the cap on a response's numbers (inputs times the width) the request is refused before
    any tokenizing; a narrower ``dimensions`` lets more through."""
    srv = start_server(tmp_path)
    try:
        width = 64  # the demo embedding model's hidden size
        most = 2048 * 8192 // width
        started = time.monotonic()
        r = httpx.post(srv.url + "/api/embed", json={"model": MODEL, "input": ["a"] * (most + 1)},
                       timeout=60)
        assert r.status_code == 400, r.text[:300]
        assert f"at most {most} inputs" in r.json()["error"]
        assert time.monotonic() - started < 10
        r = httpx.post(srv.url + "/api/embed",
                       json={"model": MODEL, "input": ["a", "b"], "dimensions": 8}, timeout=60)
        assert r.status_code == 200 and len(r.json()["embeddings"][1]) == 8, r.text
    finally:
        srv.stop()
