"""Predicted outputs through the server: ``prediction`` on every endpoint that takes it,
OpenAI's usage counts and the profile's, 400s naming the part of a malformed one, stop
strings and seeds under speculation, and a draft model refused at load.

The engine side (every token the same with and without speculation) is
tests/unit/engine/test_speculative.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import mlx_lm
import pytest

from afmd.engine.demo import builtin as demo

from conftest import ServerProcess, parse_sse, start_server


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return mlx_lm.load(str(demo.materialize("demo", tmp_path_factory.mktemp("po-cache"))))[1]


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("spec-server")
    config = ('[[models.model]]\nid = "drafted"\npath = "afmd:demo-32k"\ndraft = "demo"\n')
    proc = start_server(tmp, config=config)
    yield proc
    proc.stop()


def _chat(http: httpx.Client, content: str, **extra: Any) -> httpx.Response:
    body = {"model": "demo", "messages": [{"role": "user", "content": content}],
            "max_tokens": 150, "temperature": 0, **extra}
    return http.post("/v1/chat/completions", json=body)


def test_chat_prediction_usage_and_profile(spec_server: ServerProcess, tokenizer: Any
                                           ) -> None:
    with httpx.Client(base_url=spec_server.url, timeout=60) as http:
        plain_answer = _chat(http, "usage please").json()
        text = plain_answer["choices"][0]["message"]["content"]
        details = plain_answer["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] == details["rejected_prediction_tokens"] == 0
        response = _chat(http, "usage please",
                         prediction={"type": "content", "content": [{"type": "text",
                                                                     "text": text}]})
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["choices"][0]["message"]["content"] == text
        details = answer["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] > 0
        # Every token of the prediction counted once, accepted or not.
        predicted = len(tokenizer.encode(text, add_special_tokens=False))
        assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] \
            == predicted
        streamed = http.post(
            "/v1/chat/completions",
            json={"model": "demo", "messages": [{"role": "user", "content": "usage please"}],
                  "max_tokens": 150, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True},
                  "prediction": {"type": "content", "content": text}},
            headers={"X-AFM-Profile": "true"},
        )
        events = [e for e in parse_sse(streamed.text) if e != "[DONE]"]
        profile = next(e["afm_profile"] for e in events if "afm_profile" in e)
        usage = next(e["usage"] for e in events if e.get("usage"))
        streamed_text = "".join(c["choices"][0]["delta"].get("content") or ""
                                for c in events if c.get("choices"))
        assert streamed_text == text
        counts = usage["completion_tokens_details"]
        assert profile["accepted_prediction_tokens"] == counts["accepted_prediction_tokens"]
        assert profile["rejected_prediction_tokens"] == counts["rejected_prediction_tokens"]
        assert profile["speculation"]["prediction"]["accepted"] > 0


def test_stop_sequences_and_seeds_hold_under_speculation(spec_server: ServerProcess) -> None:
    """A stop string inside what a proposal wrote still ends the answer there (never
    leaked), and a seeded sampled answer is the one it is without a prediction."""
    with httpx.Client(base_url=spec_server.url, timeout=60) as http:
        full = _chat(http, "stop here").json()["choices"][0]["message"]["content"]
        stop = full[len(full) // 2 : len(full) // 2 + 4]
        assert stop.strip() and full.count(stop) >= 1
        want = _chat(http, "stop here", stop=[stop]).json()["choices"][0]
        got = _chat(http, "stop here", stop=[stop],
                    prediction={"type": "content", "content": full}).json()["choices"][0]
        assert got == want
        assert got["finish_reason"] == "stop" and stop not in got["message"]["content"]
        sampled = {"temperature": 0.9, "seed": 7}
        first = _chat(http, "sample", **sampled).json()["choices"][0]["message"]["content"]
        again = _chat(http, "sample", **sampled,
                      prediction={"type": "content", "content": first}).json()
        assert again["choices"][0]["message"]["content"] == first
        assert again["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0


def test_penalized_requests_speculate_and_answer_the_same(spec_server: ServerProcess) -> None:
    """Penalties and biases read the tokens before each position: the pass replays them
    there, so such a request takes the prediction and answers as it does without one."""
    settings = {"frequency_penalty": 0.7, "presence_penalty": 0.3, "logit_bias": {"30": 3}}
    with httpx.Client(base_url=spec_server.url, timeout=60) as http:
        plain = _chat(http, "usage please").json()["choices"][0]["message"]["content"]
        want = _chat(http, "usage please", **settings).json()["choices"][0]["message"]
        assert want["content"] != plain
        got = _chat(http, "usage please", **settings,
                    prediction={"type": "content", "content": want["content"]}).json()
        assert got["choices"][0]["message"] == want
        assert got["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 20
        streamed = http.post("/v1/chat/completions", headers={"X-AFM-Profile": "true"}, json={
            "model": "demo", "messages": [{"role": "user", "content": "usage please"}],
            "max_tokens": 150, "temperature": 0, "stream": True, **settings,
            "prediction": {"type": "content", "content": want["content"]}})
        events = [e for e in parse_sse(streamed.text) if e != "[DONE]"]
        assert "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in events if c.get("choices")) == want["content"]
        # Verified by passes, not only counted against the output.
        profile = next(e["afm_profile"] for e in events if "afm_profile" in e)
        assert profile["speculation"]["prediction"]["accepted"] > 20


@pytest.mark.parametrize(("value", "param"), [
    ("text", "prediction"),
    ({"type": "text", "content": "x"}, "prediction.type"),
    ({"type": "content"}, "prediction.content"),
    ({"type": "content", "content": 5}, "prediction.content"),
    ({"type": "content", "content": [{"type": "image", "text": "x"}]},
     "prediction.content[0].type"),
    ({"type": "content", "content": [{"type": "text"}]}, "prediction.content[0].text"),
    ({"type": "content", "content": "x", "extra": 1}, "prediction.extra"),
])
def test_a_malformed_prediction_is_a_400_naming_it(
    spec_server: ServerProcess, value: Any, param: str
) -> None:
    with httpx.Client(base_url=spec_server.url, timeout=60) as http:
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
            ("/v1/completions", {"prompt": "x"}),
            ("/v1/responses", {"input": "x"}),
        ):
            response = http.post(path, json={"model": "demo", "prediction": value, **body})
            assert response.status_code == 400, (path, response.text)
            assert response.json()["error"]["param"] == param, (path, response.text)


def test_completions_and_responses_take_a_prediction(spec_server: ServerProcess) -> None:
    with httpx.Client(base_url=spec_server.url, timeout=60) as http:
        body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 100,
                "temperature": 0}
        text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        answer = http.post("/v1/completions", json={
            **body, "prediction": {"type": "content", "content": text}}).json()
        assert answer["choices"][0]["text"] == text
        assert answer["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
        body = {"model": "demo", "input": "hello there", "max_output_tokens": 100,
                "temperature": 0}
        first = http.post("/v1/responses", json=body).json()
        said = first["output"][-1]["content"][0]["text"]
        again = http.post("/v1/responses", json={
            **body, "prediction": {"type": "content", "content": said}}).json()
        assert again["output"][-1]["content"][0]["text"] == said


def test_a_draft_with_another_tokenizer_fails_the_load(spec_server: ServerProcess) -> None:
    """demo-32k with demo as its draft is refused at load (another tokenizer), with the
    reason in the error and in /health; the default model serves on."""
    with httpx.Client(base_url=spec_server.url, timeout=60) as http:
        response = _chat(http, "hello", model="drafted")
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert error["code"] == "model_load_failed" and error["param"] == "model"
        assert "does not share the tokenizer of 'drafted'" in error["message"]
        detail = http.get("/health").json()["model_details"]["drafted"]
        assert "does not share the tokenizer" in json.dumps(detail)
        assert _chat(http, "hello").status_code == 200
