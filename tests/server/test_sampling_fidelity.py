"""Every sampling field a client sends is honoured: ``logit_bias``, ``presence_penalty``,
``frequency_penalty`` (compared with mlx-lm's own processors run here on the same model),
``n`` choices (each the single request with its derived seed), ``top_k`` and ``min_p`` on
chat; none of them is listed in ``X-AFM-Ignored-Fields``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import (
    make_frequency_penalty,
    make_logits_processors,
    make_presence_penalty,
)

from afmd.engine.demo import builtin as demo

from conftest import parse_sse

PROMPT = "def area(r):\n    return"
Processor = Callable[[mx.array, mx.array], mx.array]


@pytest.fixture(scope="module")
def lm() -> tuple[Any, Any]:
    """The demo model the server runs (same cache folder), loaded here by mlx-lm."""
    return mlx_lm.load(str(demo.materialize("demo")))


def reference(lm: tuple[Any, Any], ids: list[int], n: int, *, bias: dict[int, float] | None = None,
              presence: float = 0.0, frequency: float = 0.0) -> list[int]:
    """Greedy decoding of ``ids`` through mlx-lm's processors: its logit bias, and its
    presence and frequency penalties over the tokens generated so far (OpenAI's meaning:
    the whole output, never the prompt)."""
    model, tokenizer = lm
    bias_procs = make_logits_processors(logit_bias=bias) if bias else []
    penalties: list[Processor] = []
    if presence:
        penalties.append(make_presence_penalty(presence, n))
    if frequency:
        penalties.append(make_frequency_penalty(frequency, n))
    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)[:, -1, :]
    out: list[int] = []
    while len(out) < n:
        for proc in bias_procs:
            logits = proc(mx.array(ids + out), logits)
        if out:
            for proc in penalties:
                logits = proc(mx.array(out), logits)
        token = int(mx.argmax(logits, axis=-1).item())
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
    return out


def complete(http: httpx.Client, ids: list[int], n: int, **fields: Any) -> httpx.Response:
    return http.post("/v1/completions", json={"model": "demo", "prompt": ids, "max_tokens": n,
                                              "temperature": 0, **fields})


def prompt_ids(lm: tuple[Any, Any]) -> list[int]:
    return list(lm[1].encode(PROMPT))


# -- logit_bias and the penalties, against mlx-lm --------------------------------------


def test_greedy_with_a_bias_is_mlx_lms(http: httpx.Client, lm: tuple[Any, Any]) -> None:
    ids = prompt_ids(lm)
    plain = reference(lm, ids, 12)
    # Ban the greedy first token and favour another one a little: the answer changes.
    bias = {plain[0]: -100.0, 64: 2.5, plain[1]: -1.0}
    want = reference(lm, ids, 12, bias=bias)
    assert want != plain
    response = complete(http, ids, 12, logit_bias={str(k): v for k, v in bias.items()})
    assert response.status_code == 200, response.text
    assert "X-AFM-Ignored-Fields" not in response.headers
    assert response.json()["choices"][0]["text"] == lm[1].decode(want)


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 0.8), (-0.5, 1.2)])
def test_greedy_with_penalties_is_mlx_lms(http: httpx.Client, lm: tuple[Any, Any],
                                          presence: float, frequency: float) -> None:
    ids = prompt_ids(lm)
    want = reference(lm, ids, 24, presence=presence, frequency=frequency)
    assert want != reference(lm, ids, 24)  # the penalty changes this answer
    response = complete(http, ids, 24, presence_penalty=presence,
                        frequency_penalty=frequency)
    assert response.status_code == 200, response.text
    assert "X-AFM-Ignored-Fields" not in response.headers
    assert response.json()["choices"][0]["text"] == lm[1].decode(want)


def test_chat_honours_bias_and_penalties(http: httpx.Client, lm: tuple[Any, Any]) -> None:
    """A +100 bias forces its token at every step; a penalty changes a greedy answer."""
    body = {"model": "demo", "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": 6, "temperature": 0}
    token = lm[1].encode(" called")[0]
    forced = http.post("/v1/chat/completions", json={**body, "logit_bias": {str(token): 100}})
    assert forced.status_code == 200, forced.text
    assert "X-AFM-Ignored-Fields" not in forced.headers
    assert forced.json()["usage"]["completion_tokens"] == 6
    assert forced.json()["choices"][0]["message"]["content"] == lm[1].decode([token] * 6).strip()
    plain = http.post("/v1/chat/completions", json={**body, "max_tokens": 16}).json()
    penalised = http.post("/v1/chat/completions",
                          json={**body, "max_tokens": 16, "frequency_penalty": 2.0}).json()
    assert (plain["choices"][0]["message"]["content"]
            != penalised["choices"][0]["message"]["content"])


@pytest.mark.parametrize(("field", "value", "param"), [
    ("logit_bias", {"12x": 1}, "logit_bias.12x"),
    ("logit_bias", {"5": 100.5}, "logit_bias.5"),
    ("logit_bias", {"5": "high"}, "logit_bias.5"),
    ("logit_bias", [5], "logit_bias"),
    ("logit_bias", {"99999999": 1}, "logit_bias.99999999"),  # past the vocabulary
    ("presence_penalty", 2.5, "presence_penalty"),
    ("frequency_penalty", -3, "frequency_penalty"),
    ("n", 9, "n"),
    ("n", 0, "n"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_bad_values_are_400s_naming_them(http: httpx.Client, path: str, field: str,
                                         value: Any, param: str) -> None:
    body: dict[str, Any] = {"model": "demo", "max_tokens": 2, field: value}
    if path == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# -- n choices -----------------------------------------------------------------------


CHAT = {"model": "demo", "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 10, "temperature": 1.0}


def test_chat_choices_are_the_single_requests_of_their_seeds(http: httpx.Client) -> None:
    many = http.post("/v1/chat/completions", json={**CHAT, "n": 3, "seed": 41}).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    singles = [http.post("/v1/chat/completions", json={**CHAT, "seed": 41 + i}).json()
               for i in range(3)]
    for choice, single in zip(many["choices"], singles, strict=True):
        assert choice["message"] == single["choices"][0]["message"]
        assert choice["finish_reason"] == single["choices"][0]["finish_reason"]
    texts = {c["message"]["content"] for c in many["choices"]}
    assert len(texts) > 1, "different seeds, different choices"
    usage = many["usage"]
    assert usage["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]  # counted once
    assert usage["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
    again = http.post("/v1/chat/completions", json={**CHAT, "n": 3, "seed": 41}).json()
    assert [c["message"] for c in again["choices"]] == [c["message"] for c in many["choices"]]


def test_streamed_choices_carry_their_index(http: httpx.Client) -> None:
    body = {**CHAT, "n": 2, "seed": 7, "stream": True,
            "stream_options": {"include_usage": True}}
    events = parse_sse(http.post("/v1/chat/completions", json=body).text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    text = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        text[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = choice["finish_reason"]
    assert sorted(finishes) == [0, 1]
    whole = http.post("/v1/chat/completions", json={**CHAT, "n": 2, "seed": 7}).json()
    assert [text[0], text[1]] == [c["message"]["content"] for c in whole["choices"]]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


def test_completion_choices_per_prompt_in_order(http: httpx.Client) -> None:
    body = {"model": "demo", "prompt": ["one", "two"], "max_tokens": 6, "n": 2, "seed": 3}
    many = http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2, 3]
    for p, prompt in enumerate(("one", "two")):
        for j in range(2):
            single = http.post("/v1/completions", json={
                "model": "demo", "prompt": prompt, "max_tokens": 6, "seed": 3 + j}).json()
            assert many["choices"][2 * p + j]["text"] == single["choices"][0]["text"]
    prompts = sum(http.post("/v1/completions", json={
        "model": "demo", "prompt": p, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
        for p in ("one", "two"))
    assert many["usage"]["prompt_tokens"] == prompts  # each prompt once


def test_too_many_completions_in_all(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"model": "demo", "prompt": ["a"] * 10,
                                                   "n": 8, "max_tokens": 1})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "n"


# -- top_k and min_p on chat -----------------------------------------------------------


def test_top_k_and_min_p_on_chat(http: httpx.Client) -> None:
    """Both cut the sampled distribution to its best token here: the greedy answer."""
    greedy = http.post("/v1/chat/completions", json={**CHAT, "temperature": 0}).json()
    want = greedy["choices"][0]["message"]["content"]
    for cut in ({"top_k": 1}, {"min_p": 1.0}):
        response = http.post("/v1/chat/completions", json={**CHAT, "seed": 5, **cut})
        assert response.status_code == 200, response.text
        assert "X-AFM-Ignored-Fields" not in response.headers
        assert response.json()["choices"][0]["message"]["content"] == want
    sampled = http.post("/v1/chat/completions", json={**CHAT, "seed": 5}).json()
    assert sampled["choices"][0]["message"]["content"] != want


def _answer(http: httpx.Client, path: str, **fields: Any) -> str:
    """The text of a 10-token answer to "Tell me a story." in ``path``'s dialect."""
    messages = CHAT["messages"]
    if path == "/api/chat":
        body = {"model": "demo", "messages": messages, "stream": False,
                "options": {"num_predict": 10, **fields}}
    else:
        body = {"model": "demo", "messages": messages, "max_tokens": 10, **fields}
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    if path == "/v1/chat/completions":
        return str(data["choices"][0]["message"]["content"])
    if path == "/v1/messages":
        return "".join(block["text"] for block in data["content"])
    return str(data["message"]["content"])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/api/chat"])
def test_top_p_zero_keeps_the_likeliest_token(http: httpx.Client, path: str) -> None:
    """A nucleus of mass 0 holds the likeliest token alone (OpenAI's reading, llama.cpp's
    for Ollama): the greedy answer whatever the seed, not a draw from every token."""
    want = _answer(http, path, temperature=0)
    for seed in (5, 6):
        assert _answer(http, path, temperature=1, top_p=0, seed=seed) == want
    # float32 rounds these to no mass too: mlx-lm's filter then cut past the last token,
    # and every step drew token 0 ("!!!!").
    for top_p in (1e-300, 1e-50):
        assert _answer(http, path, temperature=1, top_p=top_p, seed=5) == want, top_p
    assert _answer(http, path, temperature=1, seed=5) != want


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/api/chat"])
def test_a_vanishing_temperature_is_greedy(http: httpx.Client, path: str) -> None:
    """Sampling tends to greedy decoding as the temperature goes to 0; a temperature whose
    inverse overflows float32 drew token 0 at every step ("!!!!")."""
    want = _answer(http, path, temperature=0)
    for temperature in (1e-300, 5e-324, 1e-40):
        assert _answer(http, path, temperature=temperature, seed=3) == want, temperature


# -- stop sequences ------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2, "stop": ["\n", "s" * 4097]}, "stop[1]"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": "s" * 4097}, "stop[0]"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                      "stop_sequences": ["s" * 4097]}, "stop_sequences[0]"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "stream": False,
                   "options": {"num_predict": 2, "stop": ["s" * 4097]}}, "options.stop[0]"),
])
def test_a_stop_sequence_past_its_length_is_a_400_naming_it(http: httpx.Client, path: str,
                                                            body: dict[str, Any],
                                                            param: str) -> None:
    """Each stop is followed over the whole output: its length is bounded like its count."""
    response = http.post(path, json={"model": "demo", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    # Anthropic and Ollama name the field at the start of the message.
    message = error if isinstance(error, str) else error["message"]
    if isinstance(error, dict) and "param" in error:
        assert error["param"] == param, error
    else:
        assert message.startswith(param), message
    assert "4096" in message, message
    fitting = http.post(path, json={"model": "demo", **body} | _longest_stop(body))
    assert fitting.status_code == 200, fitting.text


def _longest_stop(body: dict[str, Any]) -> dict[str, Any]:
    """``body``'s stops, each at the longest length allowed."""
    if "options" in body:
        return {"options": {**body["options"], "stop": ["s" * 4096]}}
    key = "stop_sequences" if "stop_sequences" in body else "stop"
    return {key: ["s" * 4096]}


# -- log-probabilities ------------------------------------------------------------------


@pytest.mark.parametrize(("value", "status"), [(21, 400), (-1, 400), ("3", 400), (20, 200),
                                               (None, 200)])
def test_responses_top_logprobs_is_held_to_openais_bounds(http: httpx.Client, value: Any,
                                                          status: int) -> None:
    """Responses' ``top_logprobs`` changes nothing here, but a value OpenAI refuses (0-20,
    an integer) is refused as OpenAI refuses it, naming the field, not taken silently."""
    response = http.post("/v1/responses", json={"model": "demo", "input": "hi",
                                                "max_output_tokens": 16,
                                                "top_logprobs": value})
    assert response.status_code == status, response.text
    if status == 400:
        assert response.json()["error"]["param"] == "top_logprobs"
