"""POST /v1/completions end to end: the official client, the real server, the demo model.

Texts are compared with what the same model computes in this process (greedy tokens from
its own forward passes, text from its tokenizer's own ``decode``), log-probabilities with
its ``log_softmax``; every response and chunk is checked against OpenAI's published
schemas (tests/data/openai-completions-schemas.json), every error against ErrorResponse.
"""

from __future__ import annotations

import copy
import functools
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from afmd.engine.batch.detokenize import ExactDetokenizer
from afmd.engine.batch.tokens import token_table
from afmd.engine.demo import builtin as demo
from afmd.service import fim

from conftest import ServerProcess, parse_sse, start_server
from helpers.numerics import LOGPROB_TOLERANCE, greedy
from helpers.openai_schemas import _allow_nullable, validate_error
from helpers.paths import TESTS_DIR
from helpers.smoke import Running

COMPLETIONS = "/v1/completions"
_SCHEMAS = TESTS_DIR / "data" / "openai-completions-schemas.json"
TOLERANCE = LOGPROB_TOLERANCE  # the device's (tests/helpers/numerics.py)
LONG = 4000


# -- schemas ---------------------------------------------------------------------------


@functools.cache
def _validator() -> jsonschema.protocols.Validator:
    doc = json.loads(_SCHEMAS.read_text())
    components = _allow_nullable(copy.deepcopy(doc["components"]))
    schema = {"$ref": "#/components/schemas/CreateCompletionResponse",
              "components": components}
    return jsonschema.Draft202012Validator(schema)


def validate(obj: dict[str, Any], *, chunk: bool = False) -> None:
    """``obj`` against CreateCompletionResponse (a stream chunk too: both share it).

    Where the published schema is stricter than OpenAI's own wire: a chunk's
    ``finish_reason`` is null until its choice's last chunk, and an echoed prompt's first
    token has no log-probability (null in ``token_logprobs`` and ``top_logprobs``).
    """
    obj = copy.deepcopy(obj)
    for choice in obj.get("choices", []):
        if chunk and choice.get("finish_reason") is None:
            choice["finish_reason"] = "stop"
        if choice.get("finish_reason") == "cancelled":  # afmd's extension
            choice["finish_reason"] = "stop"
        lp = choice.get("logprobs")
        if lp and lp["token_logprobs"] and lp["token_logprobs"][0] is None:
            lp["token_logprobs"][0] = 0.0
            lp["top_logprobs"][0] = {}
    _validator().validate(obj)


# -- the model, in this process --------------------------------------------------------


@pytest.fixture(scope="module")
def lm() -> tuple[Any, Any]:
    """The demo model the server runs (same cache folder), loaded here by mlx-lm."""
    return mlx_lm.load(str(demo.materialize("demo")))


def log_softmax(lm: tuple[Any, Any], ids: list[int]) -> np.ndarray:
    logits = lm[0](mx.array([ids]))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def encode(lm: tuple[Any, Any], text: str) -> list[int]:
    return list(lm[1].encode(text, add_special_tokens=False))


# -- helpers ---------------------------------------------------------------------------


def post(url: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(url + COMPLETIONS, json=body, headers=headers, timeout=60)


def stream(url: str, body: dict[str, Any], **headers: str) -> list[Any]:
    r = post(url, {**body, "stream": True}, **headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    return events[:-1]


def texts_of(chunks: list[dict[str, Any]], prompts: int) -> list[str]:
    out = [""] * prompts
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            out[choice["index"]] += choice["text"]
    return out


def assert_error(r: httpx.Response, status: int, code: str, param: str | None) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    validate_error(body)
    assert body["error"]["code"] == code, body
    assert body["error"]["param"] == param, body


class Background:
    """One completions request on its own thread, streamed; events land in ``events``."""

    def __init__(self, url: str, body: dict[str, Any], request_id: str,
                 headers: dict[str, str] | None = None) -> None:
        self.headers = {"X-Request-ID": request_id, **(headers or {})}
        self.events: list[Any] = []
        self.status: int | None = None
        self.json: Any = None
        self.first = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._args = (url, body, request_id)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        url, body, _ = self._args
        try:
            with httpx.Client(timeout=120) as c, c.stream(
                    "POST", url + COMPLETIONS, json=body, headers=self.headers) as r:
                self.status = r.status_code
                if not r.headers.get("content-type", "").startswith("text/event-stream"):
                    self.json = json.loads(r.read())
                    return
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        payload = line[len("data: "):]
                        self.events.append(payload if payload == "[DONE]" else
                                           json.loads(payload))
                        self.first.set()
        except BaseException as exc:
            self.error = exc
        finally:
            self.first.set()
            self.done.set()

    def join(self, timeout: float = 60) -> Background:
        assert self.done.wait(timeout)
        if self.error is not None:
            raise self.error
        return self


def health(url: str) -> dict[str, Any]:
    return httpx.get(url + "/health", timeout=10).json()


def wait_for(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)


# -- text ------------------------------------------------------------------------------


def _space_first_prompt(lm: tuple[Any, Any]) -> tuple[str, list[int]]:
    """A prompt whose greedy continuation starts with a space (what chat would trim)."""
    for text in ("x =", "for i in range(10):", "if", "return", "print(", "a, b ="):
        ids = greedy(lm, encode(lm, text), 12)
        if lm[1].decode(ids[:1]).startswith(" "):
            return text, ids
    pytest.fail("no prompt whose first generated token starts with a space")


def test_text_is_the_tokenizers_decode(client, lm) -> None:
    prompt, ids = _space_first_prompt(lm)
    reply = client.completions.create(model="demo", prompt=prompt, max_tokens=12,
                                      temperature=0)
    body = reply.model_dump(exclude_unset=True)
    validate(body)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = reply.choices
    assert choice.text == lm[1].decode(ids)  # its leading space included
    assert choice.text.startswith(" ")
    assert choice.index == 0 and choice.logprobs is None
    assert choice.finish_reason == ("length" if len(ids) == 12 else "stop")
    assert reply.usage.prompt_tokens == len(encode(lm, prompt))
    assert reply.usage.completion_tokens == len(ids)


def test_default_max_tokens_is_16(http, lm) -> None:
    r = http.post(COMPLETIONS, json={"prompt": "import os\n", "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    validate(body)
    ids = greedy(lm, encode(lm, "import os\n"), 16)
    assert body["choices"][0]["text"] == lm[1].decode(ids)
    assert body["usage"]["completion_tokens"] == len(ids)


def test_stream_concatenates_to_the_whole_text(client, base_url, lm) -> None:
    prompt, ids = _space_first_prompt(lm)
    chunks = list(client.completions.create(
        model="demo", prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    for chunk in chunks:
        validate(chunk.model_dump(exclude_unset=True), chunk=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == lm[1].decode(ids)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishing[-1] in ("length", "stop") and all(f is None for f in finishing[:-1])
    # Raw: every chunk a text_completion, the stream's end [DONE].
    raw = stream(base_url, {"prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert all(e["object"] == "text_completion" for e in raw)
    assert texts_of(raw, 1) == [lm[1].decode(ids)]


def test_batched_prompts_one_choice_each_in_order(client, http, base_url, lm) -> None:
    prompts = ["def add(a, b):", "Hello there", "x = [1, 2,", "# TODO:"]
    expected = [lm[1].decode(greedy(lm, encode(lm, p), 10)) for p in prompts]
    reply = client.completions.create(model="demo", prompt=prompts, max_tokens=10,
                                      temperature=0)
    validate(reply.model_dump(exclude_unset=True))
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == expected
    assert reply.usage.prompt_tokens == sum(len(encode(lm, p)) for p in prompts)
    # Token-id prompts, one and several, are used as they are.
    ids = [encode(lm, p) for p in prompts]
    r = http.post(COMPLETIONS, json={"prompt": ids[2], "max_tokens": 10, "temperature": 0})
    assert r.json()["choices"][0]["text"] == expected[2]
    r = http.post(COMPLETIONS, json={"prompt": ids, "max_tokens": 10, "temperature": 0})
    body = r.json()
    validate(body)
    assert [c["text"] for c in body["choices"]] == expected
    # Streamed: each chunk names its choice; each choice ends once.
    chunks = stream(base_url, {"prompt": prompts, "max_tokens": 10, "temperature": 0})
    for chunk in chunks:
        validate(chunk, chunk=True)
    assert texts_of(chunks, 4) == expected
    ends = [c["index"] for ch in chunks for c in ch["choices"] if c["finish_reason"]]
    assert sorted(ends) == [0, 1, 2, 3]


def test_stop_sequence_ends_the_text_and_its_tokens(http, lm) -> None:
    prompt = "class Point:"
    ids = greedy(lm, encode(lm, prompt), 24)
    text = lm[1].decode(ids)
    table = token_table(lm[1])
    pieces = [table.text_of(t) for t in ids]
    assert "".join(pieces) == text, "an ASCII continuation, one character per byte"

    def stop_at(k: int) -> tuple[int, str]:
        # A stop string that starts inside token k and ends in the next one.
        start = len("".join(pieces[:k])) + 1
        return start, text[start:start + len(pieces[k])]

    k = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) > 1 and pieces[i + 1]
             and text.find(stop_at(i)[1]) == stop_at(i)[0])
    start, stop = stop_at(k)
    r = http.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                     "stop": [stop], "logprobs": 0})
    body = r.json()
    validate(body)
    (choice,) = body["choices"]
    assert choice["text"] == text[:start]
    assert choice["finish_reason"] == "stop"
    # Tokens whose text the stop swallowed have no log-probability.
    assert choice["logprobs"]["tokens"] == pieces[:k]
    # The answer is counted through token k + 1, which completed the stop, though the
    # engine decodes on until the stop found on the event loop reaches it.
    assert body["usage"]["completion_tokens"] == k + 2
    for _ in range(3):
        for extra in ({}, {"logprobs": 0}):
            again = http.post(COMPLETIONS, json={
                "prompt": prompt, "max_tokens": 400, "temperature": 0, "stop": stop, **extra})
            assert again.json()["usage"]["completion_tokens"] == k + 2, extra


# -- log-probabilities -----------------------------------------------------------------


def test_echo_logprobs_max_tokens_0_scores_the_prompt(client, lm) -> None:
    prompt = "The capital of France is Paris. It is 100 km² ∑ big."
    ids = encode(lm, prompt)
    reply = client.completions.create(model="demo", prompt=prompt, max_tokens=0, echo=True,
                                      logprobs=3)
    body = reply.model_dump(exclude_unset=True)
    validate(body)
    (choice,) = reply.choices
    assert choice.text == prompt
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    table = token_table(lm[1])
    assert lp.tokens == [table.text_of(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = log_softmax(lm, ids)
    for i, token in enumerate(ids):
        if i == 0:
            continue
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, token]), abs=TOLERANCE)
        top = np.argsort(-ref[i - 1], kind="stable")[:3]
        expected = {table.text_of(int(t)): float(ref[i - 1, t]) for t in top}
        expected.setdefault(lp.tokens[i], float(ref[i - 1, token]))
        assert lp.top_logprobs[i] == pytest.approx(expected, abs=TOLERANCE)
    # Offsets index the echoed text: each token's text starts where it says (a token
    # holding part of a character starts with that character).
    for i, token in enumerate(ids):
        raw = table.bytes_of(token).decode(errors="ignore")
        if raw:
            assert prompt[lp.text_offset[i]:].startswith(raw)


def test_generated_logprobs_equal_mlx_lm(http, lm) -> None:
    prompt = "def fibonacci(n):\n"
    ids = encode(lm, prompt)
    out = greedy(lm, ids, 10)
    r = http.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 10, "temperature": 0,
                                     "logprobs": 5})
    body = r.json()
    validate(body)
    lp = body["choices"][0]["logprobs"]
    table = token_table(lm[1])
    assert lp["tokens"] == [table.text_of(t) for t in out]
    assert b"".join(table.bytes_of(t) for t in out).decode() == body["choices"][0]["text"]
    ref = log_softmax(lm, ids + out)
    detokenizer = ExactDetokenizer(lm[1])
    offset = 0
    for i, token in enumerate(out):
        row = ref[len(ids) - 1 + i]
        assert lp["token_logprobs"][i] == pytest.approx(float(row[token]), abs=TOLERANCE)
        top = {table.text_of(int(t)): float(row[t]) for t in np.argsort(-row)[:5]}
        assert lp["top_logprobs"][i] == pytest.approx(top, abs=TOLERANCE)  # greedy: in top
        assert lp["text_offset"][i] == offset  # where the text released with it starts
        detokenizer.add_token(token)
        offset += len(detokenizer.last_segment)


def test_echo_and_logprobs_streamed(base_url, lm) -> None:
    prompt = "for i in range(3):\n"
    chunks = stream(base_url, {"prompt": prompt, "echo": True, "logprobs": 2,
                               "max_tokens": 6, "temperature": 0})
    for chunk in chunks:
        validate(chunk, chunk=True)
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(prompt)
    ids = encode(lm, prompt)
    out = greedy(lm, ids, 6)
    (text,) = texts_of(chunks, 1)
    assert text == prompt + lm[1].decode(out)
    tokens = [t for c in chunks for ch in c["choices"] if ch["logprobs"]
              for t in ch["logprobs"]["tokens"]]
    offsets = [o for c in chunks for ch in c["choices"] if ch["logprobs"]
               for o in ch["logprobs"]["text_offset"]]
    assert len(tokens) == len(ids) + len(out)
    for token, offset in zip(tokens, offsets, strict=True):
        assert text[offset:offset + len(token)] == token


# -- fill in the middle ----------------------------------------------------------------


def test_suffix_builds_the_families_fim_prompt(client, lm) -> None:
    prefix, suffix = "def area(r):\n    return ", "\n\nprint(area(2))\n"
    plan = fim.plan_for(lm[1], None)
    assert plan is not None and plan.format.family == "qwen"
    ids = fim.build_prompt(lm[1], plan, prefix, suffix)
    assert lm[1].decode(ids) == f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
    out = greedy(lm, ids, 12, plan.end_ids)
    reply = client.completions.create(model="demo", prompt=prefix, suffix=suffix,
                                      max_tokens=12, temperature=0)
    validate(reply.model_dump(exclude_unset=True))
    assert reply.choices[0].text == lm[1].decode(out)
    assert reply.usage.prompt_tokens == len(ids)


FIM_PREFIX, FIM_SUFFIX = "import os\n", "\nos.exit()"


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory: pytest.TempPathFactory, lm) -> Iterator[tuple[ServerProcess,
                                                                               list[int], int]]:
    """``coder``: the demo model whose fim setting ends the middle at a token it writes;
    ``plain``: the demo model with a tokenizer that has no FIM tokens."""
    tmp = tmp_path_factory.mktemp("fim")
    prefix, suffix = FIM_PREFIX, FIM_SUFFIX
    plan = fim.plan_for(lm[1], None)
    assert plan is not None
    free = greedy(lm, fim.build_prompt(lm[1], plan, prefix, suffix), 16, plan.end_ids)
    cut = next(i for i in range(2, len(free)) if free[i] not in free[:i]
               and lm[1].encode(lm[1].decode([free[i]]), add_special_tokens=False) == [free[i]])
    end = lm[1].decode([free[cut]])
    plain = tmp / "plain"
    shutil.copytree(demo.materialize("demo"), plain)
    spec = json.loads((plain / "tokenizer.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if "fim" not in t["content"]]
    (plain / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {k: v for k, v in config["added_tokens_decoder"].items()
                                      if "fim" not in v["content"]}
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    proc = start_server(tmp, config=(
        f'[[models.model]]\nid = "coder"\npath = "afmd:demo"\n'
        f'fim = {{ prefix = "<|fim_prefix|>", suffix = "<|fim_suffix|>", '
        f'middle = "<|fim_middle|>", stop = [{json.dumps(end)}] }}\n'
        f'[[models.model]]\nid = "plain"\npath = "{plain}"\n'))
    yield proc, free, cut
    proc.stop()


@pytest.mark.slow
def test_fim_stops_at_the_end_marker_unseen(fim_server, lm) -> None:
    proc, free, cut = fim_server
    r = post(proc.url, {"model": "coder", "prompt": FIM_PREFIX, "suffix": FIM_SUFFIX,
                        "max_tokens": 16, "temperature": 0, "logprobs": 0})
    body = r.json()
    validate(body)
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == lm[1].decode(free[:cut])
    assert len(choice["logprobs"]["tokens"]) == cut
    assert body["usage"]["completion_tokens"] == cut


@pytest.mark.slow
def test_model_without_fim_format(fim_server) -> None:
    proc, _, _ = fim_server
    r = post(proc.url, {"model": "plain", "prompt": "def f(", "suffix": ")\n"})
    assert_error(r, 400, "fim_not_supported", "suffix")
    assert "plain" in r.json()["error"]["message"]
    ok = post(proc.url, {"model": "plain", "prompt": "def f(", "max_tokens": 2})
    assert ok.status_code == 200
    # An empty suffix (completing at the end of a file) asks nothing a plain completion
    # does not: the same answer, where it was the 400 for every such request.
    greedy = {"model": "plain", "prompt": "def f(", "max_tokens": 4, "temperature": 0}
    at_end = post(proc.url, {**greedy, "suffix": ""})
    assert at_end.status_code == 200, at_end.text
    assert at_end.json()["choices"][0]["text"] == \
        post(proc.url, greedy).json()["choices"][0]["text"]


# -- bad input -------------------------------------------------------------------------


BAD = [
    ({}, 400, "missing_required_parameter", "prompt"),
    ({"prompt": None}, 400, "missing_required_parameter", "prompt"),
    ({"prompt": 12}, 400, "invalid_type", "prompt"),
    ({"prompt": {"text": "hi"}}, 400, "invalid_type", "prompt"),
    ({"prompt": []}, 400, "invalid_value", "prompt"),
    ({"prompt": ["a", 1]}, 400, "invalid_type", "prompt[1]"),
    ({"prompt": [[1, 2], "a"]}, 400, "invalid_type", "prompt[1]"),
    ({"prompt": [[1, 2], []]}, 400, "invalid_value", "prompt[1]"),
    ({"prompt": [1, "a"]}, 400, "invalid_type", "prompt[1]"),
    ({"prompt": [[1, 2], [3, -4]]}, 400, "invalid_value", "prompt[1][1]"),
    ({"prompt": [1, 2, 10**7]}, 400, "invalid_value", "prompt[2]"),
    ({"prompt": [[5], [1, 10**7]]}, 400, "invalid_value", "prompt[1][1]"),
    ({"prompt": [True]}, 400, "invalid_type", "prompt[0]"),
    ({"prompt": ["x"] * 65}, 400, "invalid_value", "prompt"),
    ({"prompt": ""}, 400, "invalid_value", "prompt"),
    ({"prompt": ["a", ""]}, 400, "invalid_value", "prompt[1]"),
    ({"prompt": "hi", "max_tokens": -1}, 400, "invalid_value", "max_tokens"),
    ({"prompt": "hi", "max_tokens": "8"}, 400, "invalid_type", "max_tokens"),
    ({"prompt": "hi", "max_tokens": 140000}, 400, "context_length_exceeded", "prompt"),
    ({"prompt": ["hi", "x " * 140000], "max_tokens": 8}, 400, "context_length_exceeded",
     "prompt[1]"),
    ({"prompt": "hi", "n": 9}, 400, "invalid_value", "n"),
    ({"prompt": "hi", "best_of": 3}, 400, "invalid_value", "best_of"),
    ({"prompt": "hi", "n": 2, "best_of": 1}, 400, "invalid_value", "best_of"),
    ({"prompt": "hi", "best_of": 2, "stream": True}, 400, "invalid_value", "best_of"),
    ({"prompt": "hi", "user": 5}, 400, "invalid_type", "user"),
    ({"prompt": "hi", "logprobs": 6}, 400, "invalid_value", "logprobs"),
    ({"prompt": "hi", "logprobs": -1}, 400, "invalid_value", "logprobs"),
    ({"prompt": "hi", "logprobs": True}, 400, "invalid_type", "logprobs"),
    ({"prompt": "hi", "echo": "yes"}, 400, "invalid_type", "echo"),
    ({"prompt": "hi", "echo": True, "suffix": "x"}, 400, "invalid_value", "echo"),
    ({"prompt": "hi", "suffix": 3}, 400, "invalid_type", "suffix"),
    ({"prompt": "hi", "temperature": 3}, 400, "invalid_value", "temperature"),
    ({"prompt": "hi", "top_p": -0.1}, 400, "invalid_value", "top_p"),
    ({"prompt": "hi", "seed": "7"}, 400, "invalid_type", "seed"),
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, 400, "invalid_value", "stop"),
    ({"prompt": "hi", "stop": ["a", 5]}, 400, "invalid_type", "stop[1]"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "invalid_value",
     "stream_options"),
    ({"prompt": "hi", "stream": True, "stream_options": {"x": 1}}, 400, "unknown_parameter",
     "stream_options.x"),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_obfuscation": 1}}, 400,
     "invalid_type", "stream_options.include_obfuscation"),
    ({"prompt": "hi", "model": "nope"}, 404, "model_not_found", "model"),
    ({"prompt": "hi", "model": "demo-embedding"}, 400, "invalid_model_kind", "model"),
    # Apple's model takes no raw prompt on any machine: a 400 where it cannot answer too
    # (it was the 503 model_unavailable, which clients retry).
    ({"prompt": "hi", "model": "system"}, 400, "invalid_model_kind", "model"),
]


@pytest.mark.parametrize(("body", "status", "code", "param"), BAD,
                         ids=[f"{b[2]}-{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input(base_url, body: dict[str, Any], status: int, code: str,
                   param: str | None) -> None:
    assert_error(post(base_url, body), status, code, param)


def test_bad_json_method_and_request_id(base_url) -> None:
    r = httpx.post(base_url + COMPLETIONS, content=b"{", timeout=10,
                   headers={"Content-Type": "application/json"})
    assert_error(r, 400, "invalid_json", None)
    r = httpx.get(base_url + COMPLETIONS, timeout=10)
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    r = post(base_url, {"prompt": "hi", "max_tokens": 1}, **{"X-Request-ID": "bad id!"})
    assert_error(r, 400, "invalid_value", "X-Request-ID")
    r = httpx.post(base_url + "/completions", json={"prompt": "hi", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 200 and r.json()["object"] == "text_completion"


# -- queue, cancel, deadline, profile --------------------------------------------------


def test_cancel_by_request_id_ends_every_choice(server: ServerProcess) -> None:
    rid = f"cmpl-cancel-{time.monotonic_ns()}"
    # Greedy: the demo model runs every prompt to max_tokens, so none can end on its own
    # (a sampled one could draw the end token) before the cancel arrives.
    run = Background(server.url, {"prompt": ["a", "b", "c"], "max_tokens": LONG,
                                  "temperature": 0, "stream": True}, rid)
    run.first.wait(30)
    r = httpx.post(f"{server.url}{COMPLETIONS}/{rid}/cancel", timeout=10)
    assert r.status_code == 200 and r.json()["cancelled"] is True
    run.join()
    assert run.events[-1] == "[DONE]"
    ends = {c["index"]: c["finish_reason"] for ch in run.events[:-1] for c in ch["choices"]
            if c["finish_reason"]}
    assert ends == {0: "cancelled", 1: "cancelled", 2: "cancelled"}


def test_a_scored_prompt_runs_beside_the_batch_and_ends_on_cancel(
        server: ServerProcess) -> None:
    """``echo`` with ``logprobs`` runs the prompt once more for every position's numbers.
    Run whole at its admission, a long prompt held up every stream in the batch for as
    long as it took (minutes, on a long prompt), and neither a cancel by its X-Request-ID
    nor its deadline could end it; it is now run a chunk per step, as a joining prompt is,
    in turns with other prompts being scored."""
    rid = f"cmpl-score-{time.monotonic_ns()}"
    long = f"{rid} " + "the weather in Rome is mild today. " * 1500
    scoring = Running(server.url, lambda: httpx.post(
        f"{server.url}{COMPLETIONS}", timeout=300, headers={"X-Request-ID": rid},
        json={"prompt": long, "echo": True, "logprobs": 5, "max_tokens": 0})).under_way()
    beside = httpx.post(f"{server.url}{COMPLETIONS}", timeout=120,
                        json={"prompt": "a", "max_tokens": 2, "temperature": 0})
    assert beside.json()["usage"]["completion_tokens"] == 2, beside.text
    # Prompts scored together take turns: a short one is not held up by the long one.
    short = httpx.post(f"{server.url}{COMPLETIONS}", timeout=120, json={
        "prompt": "one two three", "echo": True, "logprobs": 1, "max_tokens": 0})
    assert short.json()["choices"][0]["logprobs"]["token_logprobs"][0] is None, short.text
    cancelled = httpx.post(f"{server.url}{COMPLETIONS}/{rid}/cancel", timeout=10)
    asked = time.monotonic()
    answer = scoring.answer()
    assert cancelled.json()["cancelled"] is True, "the scoring ended before its cancel"
    assert time.monotonic() - asked < 30
    choice = answer.json()["choices"][0]
    assert choice["finish_reason"] == "cancelled", choice


def test_scored_prompt_then_tokens_equal_the_tokens_alone(server: ServerProcess) -> None:
    """A row that writes tokens after its prompt was scored resumes from the scoring
    pass instead of running the prompt again: its tokens and their numbers are those of
    the same request without ``echo``."""
    body = {"prompt": "The quick brown fox jumps over the lazy dog " * 12,
            "max_tokens": 12, "temperature": 0, "logprobs": 3}
    alone = httpx.post(f"{server.url}{COMPLETIONS}", json=body, timeout=60).json()
    echoed = httpx.post(f"{server.url}{COMPLETIONS}", json={**body, "echo": True},
                        timeout=60).json()
    a, e = alone["choices"][0], echoed["choices"][0]
    prompt_tokens = alone["usage"]["prompt_tokens"]
    assert e["text"] == body["prompt"] + a["text"]
    assert e["logprobs"]["tokens"][prompt_tokens:] == a["logprobs"]["tokens"]
    assert e["logprobs"]["token_logprobs"][0] is None
    for got, want in zip(e["logprobs"]["token_logprobs"][prompt_tokens:],
                         a["logprobs"]["token_logprobs"], strict=True):
        assert abs(got - want) <= LOGPROB_TOLERANCE
    assert echoed["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_profile_event_before_done(base_url) -> None:
    events = stream(base_url, {"prompt": ["a", "b"], "max_tokens": 5, "temperature": 0,
                               "stream_options": {"include_usage": True}},
                    **{"X-AFM-Profile": "true"})
    profile = events[-1]["afm_profile"]
    usage = events[-2]["usage"]
    assert events[-2]["choices"] == []
    assert profile["prompt_tokens"] == usage["prompt_tokens"]
    assert profile["completion_tokens"] == usage["completion_tokens"] > 0


KEY = "completions-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Screening on (key, origins, a body limit); one slot, one queue place, a short
    request timeout: short enough to wait out (the queue test's four prompts decode at
    full speed until it passes), long enough that, on a loaded machine, the queue test's
    first steps all fit before the first request's deadline (they take a fraction of a
    second with every core busy, the model's load included)."""
    proc = start_server(
        tmp_path_factory.mktemp("tight"),
        config=(
            f'[server]\napi_key = "{KEY}"\nrequest_timeout = 5.0\n'
            "max_request_body_bytes = 65536\n"
            'allowed_origins = ["http://good.example"]\n'
            "[queue]\nmax_concurrent_requests = 1\nmax_queued_requests = 1\n"
        ),
        ready=False,
    )
    wait_for(lambda: httpx.get(proc.url + "/health", timeout=5).status_code == 200, 60)
    yield proc
    proc.stop()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("headers", "content", "status", "code"),
    [
        ({}, None, 401, "invalid_api_key"),
        ({**AUTH, "Host": "evil.example"}, None, 421, "invalid_host"),
        ({**AUTH, "Origin": "http://evil.example"}, None, 403, "origin_not_allowed"),
        ({**AUTH, "Content-Type": "text/plain"}, b'{"prompt": "x"}', 415,
         "unsupported_media_type"),
        (AUTH, b'{"prompt": "' + b"x" * 70000 + b'"}', 413, "malformed_request"),
    ],
)
def test_screening(tight: ServerProcess, headers: dict[str, str], content: bytes | None,
                   status: int, code: str) -> None:
    body = content if content is not None else json.dumps({"prompt": "x", "max_tokens": 1})
    headers = {"Content-Type": "application/json", **headers}
    r = httpx.post(tight.url + COMPLETIONS, content=body, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    validate_error(r.json())
    assert r.json()["error"]["code"] == code


@pytest.mark.slow
def test_four_prompts_take_one_slot_then_429_and_504(tight: ServerProcess) -> None:
    url = tight.url
    # Greedy: these four run to max_tokens, past the deadline (a sampled prompt can end
    # early, and four ended early would free the slot for the queued request).
    hog = Background(url, {"prompt": ["a", "b", "c", "d"], "max_tokens": LONG,
                           "temperature": 0, "stream": True}, "hog", AUTH)
    hog.first.wait(30)
    assert hog.status == 200, hog.json
    h = health(url)
    assert (h["active_requests"], h["queued_requests"]) == (1, 0)  # one entry, not four
    waiting = Background(url, {"prompt": "queued", "max_tokens": LONG}, "waiting", AUTH)
    wait_for(lambda: health(url)["queued_requests"] == 1)
    r = post(url, {"prompt": "one too many", "max_tokens": 2}, **AUTH)
    assert_error(r, 429, "rate_limited", None)
    assert "retry-after" in r.headers
    # request_timeout covers the queue wait: the queued request is a 504; the hog's stream,
    # past its own deadline, ends with an error event.
    waiting.join(30)
    assert waiting.status == 504
    validate_error(waiting.json)
    assert waiting.json["error"]["code"] == "timeout"
    hog.join(30)
    assert hog.events[-1] == "[DONE]"
    assert hog.events[-2]["error"]["code"] == "timeout"
    wait_for(lambda: health(url)["active_requests"] == 0)


# -- transient failures and shutdown ---------------------------------------------------


@pytest.mark.slow
def test_transient_failures_are_retried_then_generation_failed(tmp_path: Path, lm) -> None:
    """A decode step failing before anything reached the client is retried (every prompt
    anew); past ``[engine] retries`` the request is a 500 ``generation_failed``."""
    proc = start_server(tmp_path, config="[engine]\nretries = 2\nretry_backoff = 0.01\n",
                        env={"AFMD_INJECT_FAILURES": "2"})
    try:
        prompts = ["def add(a, b):", "Hello there"]
        r = post(proc.url, {"prompt": prompts, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == [
            lm[1].decode(greedy(lm, encode(lm, p), 6)) for p in prompts]
    finally:
        proc.stop()
    proc = start_server(tmp_path, config="[engine]\nretries = 1\nretry_backoff = 0.01\n",
                        env={"AFMD_INJECT_FAILURES": "1000"})
    try:
        r = post(proc.url, {"prompt": ["a", "b"], "max_tokens": 6})
        assert_error(r, 500, "generation_failed", None)
    finally:
        proc.stop()


@pytest.mark.slow
def test_shutdown_ends_a_running_stream_with_an_error_event(tmp_path: Path) -> None:
    proc = start_server(tmp_path, config="[server]\nshutdown_grace = 0.5\n")
    run = Background(proc.url, {"prompt": ["a", "b"], "max_tokens": LONG, "temperature": 0,
                                "stream": True}, "shutdown")  # greedy: runs past the grace
    run.first.wait(30)
    assert proc.stop() == 0
    run.join(30)
    assert run.status == 200
    assert run.events[-1] == "[DONE]"
    assert run.events[-2]["error"]["code"] == "server_shutting_down"
