"""``GET /metrics`` on the real server, read back with prometheus_client's own parser.

Each test scrapes before and after what it sends and checks that the counters moved by
exactly that: requests by endpoint, dialect and status (the gate's refusals and the
connection's direct answers included), tokens in and out per model equal to the usage the
clients were told, the prefix cache's hits and tokens equal to the ``cached_tokens`` they
were told, one time-to-first-token and one decode-speed observation per generation. State
(queue, active generations, loads, memory, listeners) is read as it is. Screening follows
``/health``'s rule for the listener: open on loopback and the Unix socket, behind a
configured API key on any other interface.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from afmd.http.routes.metrics import CONTENT_TYPE, TTFT_BUCKETS, Buckets

from conftest import ServerProcess, parse_sse, start_server

pytestmark = pytest.mark.slow  # a server per test, each with its own counters

KEY = "sk-metrics-test"
BEARER = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Count to three."}]

Labels = tuple[tuple[str, str], ...]


class Scrape:
    """One ``/metrics`` answer as ``{sample name: {labels: value}}``."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.types: dict[str, str] = {}
        self.samples: dict[str, dict[Labels, float]] = {}
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for sample in family.samples:
                labels = tuple(sorted(sample.labels.items()))
                self.samples.setdefault(sample.name, {})[labels] = sample.value

    def value(self, name: str, **labels: str) -> float:
        return self.samples[name][tuple(sorted(labels.items()))]

    def get(self, name: str, **labels: str) -> float:
        return self.samples.get(name, {}).get(tuple(sorted(labels.items())), 0.0)

    def moved(self, before: Scrape, name: str) -> dict[Labels, float]:
        """The series of ``name`` whose value changed since ``before``, by how much."""
        old = before.samples.get(name, {})
        return {labels: value - old.get(labels, 0.0)
                for labels, value in self.samples.get(name, {}).items()
                if value != old.get(labels, 0.0)}


def scrape(url: str, headers: dict[str, str] | None = None) -> Scrape:
    response = httpx.get(url + "/metrics", headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == CONTENT_TYPE
    return Scrape(response.text)


def _key(endpoint: str, dialect: str, status: int) -> Labels:
    return (("dialect", dialect), ("endpoint", endpoint), ("status", str(status)))


def _wait_loaded(url: str, path: str, body: dict[str, Any],
                 headers: dict[str, str] | None = None) -> None:
    """A model loads on first use; until it is ready its requests get 503 busy."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if httpx.post(url + path, json=body, headers=headers, timeout=60).status_code != 503:
            return
        time.sleep(0.1)
    raise AssertionError(f"{body.get('model')} never loaded")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("metrics"),
                        config='[models.aliases]\n"small" = "demo"\n')
    _wait_loaded(proc.url, "/v1/embeddings", {"model": "demo-embedding", "input": "warm"})
    yield proc
    proc.stop()


def test_counters_move_by_exactly_what_was_sent(served: ServerProcess) -> None:
    url = served.url
    before = scrape(url)

    plain = httpx.post(url + CHAT, json={"model": "demo", "messages": MESSAGES,
                                         "max_tokens": 8}, timeout=60)
    assert plain.status_code == 200, plain.text
    streamed = httpx.post(url + CHAT, json={
        "model": "small", "messages": MESSAGES, "max_tokens": 8, "stream": True,
        "stream_options": {"include_usage": True}}, timeout=60)
    assert streamed.status_code == 200, streamed.text
    chunks = [c for c in parse_sse(streamed.text) if c != "[DONE]"]
    refused = httpx.post(url + CHAT, json={"model": "demo", "max_tokens": 8}, timeout=60)
    assert refused.status_code == 400, refused.text
    embedded = httpx.post(url + "/v1/embeddings",
                          json={"model": "demo-embedding", "input": ["one", "two words"]},
                          timeout=60)
    assert embedded.status_code == 200, embedded.text
    message = httpx.post(url + "/v1/messages", json={
        "model": "demo", "max_tokens": 8, "messages": MESSAGES},
        headers={"anthropic-version": "2023-06-01"}, timeout=60)
    assert message.status_code == 200, message.text

    after = scrape(url)
    assert after.types["afmd_http_requests"] == "counter"
    assert after.moved(before, "afmd_http_requests_total") == {
        _key(CHAT, "openai_chat", 200): 2,
        _key(CHAT, "openai_chat", 400): 1,
        _key("/v1/embeddings", "openai_embeddings", 200): 1,
        _key("/v1/messages", "anthropic_messages", 200): 1,
        _key("/metrics", "none", 200): 1,  # the first scrape; a scrape is counted once done
    }

    # Tokens in and out per model: what each client was told, aliases counted as the model.
    usages = [plain.json()["usage"], chunks[-1]["usage"]]
    anthropic = message.json()["usage"]
    prompt = sum(u["prompt_tokens"] for u in usages) + (
        anthropic["input_tokens"] + anthropic["cache_read_input_tokens"])
    completion = sum(u["completion_tokens"] for u in usages) + anthropic["output_tokens"]
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages) + (
        anthropic["cache_read_input_tokens"])
    assert after.moved(before, "afmd_prompt_tokens_total") == {
        (("model", "demo"),): prompt,
        (("model", "demo-embedding"),): embedded.json()["usage"]["prompt_tokens"],
    }
    assert after.moved(before, "afmd_completion_tokens_total") == {
        (("model", "demo"),): completion}
    assert completion > 0

    # The prefix cache: the same conversation three times, so the later ones hit it.
    hits = sum(1 for u in usages if u["prompt_tokens_details"]["cached_tokens"]) + (
        1 if anthropic["cache_read_input_tokens"] else 0)
    assert hits >= 1
    assert after.moved(before, "afmd_prefix_cache_lookups_total") == {(("model", "demo"),): 3}
    assert after.moved(before, "afmd_prefix_cache_hits_total") == {(("model", "demo"),): hits}
    assert after.moved(before, "afmd_cached_prompt_tokens_total") == {
        (("model", "demo"),): cached}

    # One time to first token per generation that made a token; one decode speed per
    # generation that made two (the speed is measured after the first).
    outs = [u["completion_tokens"] for u in usages] + [anthropic["output_tokens"]]
    demo = (("model", "demo"),)
    assert after.moved(before, "afmd_time_to_first_token_seconds_count") == {
        demo: sum(1 for n in outs if n > 0)}
    assert after.moved(before, "afmd_decode_tokens_per_second_count") == {
        demo: sum(1 for n in outs if n > 1)}
    assert after.value("afmd_time_to_first_token_seconds_sum", model="demo") > 0
    assert after.value("afmd_decode_tokens_per_second_sum", model="demo") > 0
    for name in ("afmd_time_to_first_token_seconds", "afmd_decode_tokens_per_second"):
        assert after.types[name] == "histogram"
        buckets = sorted(((float(dict(labels)["le"]), value) for labels, value
                          in after.samples[name + "_bucket"].items()
                          if dict(labels)["model"] == "demo"))
        counts = [value for _, value in buckets]
        assert counts == sorted(counts), buckets  # cumulative
        assert buckets[-1] == (float("inf"), after.value(name + "_count", model="demo"))


def test_a_background_response_counts_its_tokens_and_timings(served: ServerProcess) -> None:
    """A background response runs after its POST was answered, so the POST's count has no
    usage to give: its tokens, prefix cache lookup and timings are the run's, counted when
    it ends (they were never counted, and the token totals fell short of the usage the
    stored responses told)."""
    url = served.url
    before = scrape(url)
    made = httpx.post(url + "/v1/responses", json={
        "model": "demo", "input": "Count to three.", "max_output_tokens": 16,
        "background": True}, timeout=60)
    assert made.status_code == 200, made.text
    response_id = made.json()["id"]
    deadline = time.monotonic() + 60
    while (done := httpx.get(f"{url}/v1/responses/{response_id}", timeout=30).json()
           )["status"] in ("queued", "in_progress"):
        assert time.monotonic() < deadline, done
        time.sleep(0.05)
    assert done["status"] in ("completed", "incomplete"), done
    while not [e for e in served.events if e.get("method") == "BACKGROUND"
               and e.get("path", "").endswith(response_id)]:
        assert time.monotonic() < deadline, "no access log line for the background run"
        time.sleep(0.05)
    after = scrape(url)
    usage = done["usage"]
    demo = (("model", "demo"),)
    assert usage["output_tokens"] > 1
    assert after.moved(before, "afmd_prompt_tokens_total") == {demo: usage["input_tokens"]}
    assert after.moved(before, "afmd_completion_tokens_total") == {
        demo: usage["output_tokens"]}
    assert after.moved(before, "afmd_prefix_cache_lookups_total") == {demo: 1}
    assert after.moved(before, "afmd_time_to_first_token_seconds_count") == {demo: 1}
    assert after.moved(before, "afmd_decode_tokens_per_second_count") == {demo: 1}


def test_a_model_named_by_its_tag_counts_as_the_model(served: ServerProcess) -> None:
    """Ollama's clients name ``demo-embedding:latest``; the tokens count under the
    model's id, as docs/metrics.md says of every ``model`` label, not under a series named
    by what the client sent."""
    url = served.url
    before = scrape(url)
    told = 0
    for path, body in (("/api/embed", {"model": "demo-embedding:latest", "input": "one"}),
                       ("/v1/embeddings", {"model": "demo-embedding:latest", "input": "two"})):
        response = httpx.post(url + path, json=body, timeout=60)
        assert response.status_code == 200, response.text
        answer = response.json()
        told += answer.get("prompt_eval_count") or answer.get("usage", {}).get(
            "prompt_tokens", 0)
    after = scrape(url)
    assert told > 0
    assert after.moved(before, "afmd_prompt_tokens_total") == {
        (("model", "demo-embedding"),): told}
    assert not [labels for series in after.samples.values() for labels in series
                if any(":latest" in value for _, value in labels)]


def test_state_is_read_at_scrape_time(served: ServerProcess) -> None:
    now = scrape(served.url)
    assert now.value("afmd_queue_depth") == 0
    assert now.value("afmd_active_generations") == 0
    assert now.types["afmd_queue_depth"] == "gauge"
    for model in ("demo", "demo-embedding"):  # the default preloaded, the other on first use
        assert now.value("afmd_model_loaded", model=model) == 1
        assert now.value("afmd_model_loads_total", model=model) == 1
        assert now.value("afmd_model_load_seconds_total", model=model) > 0
        assert now.value("afmd_model_load_failures_total", model=model) == 0
        assert now.value("afmd_model_too_large_total", model=model) == 0
        assert now.value("afmd_model_unloads_total", model=model) == 0
        assert now.value("afmd_model_memory_bytes", model=model) > 0
    assert now.value("afmd_model_loaded", model="demo-32k") == 0
    assert now.value("afmd_model_loads_total", model="demo-32k") == 0
    assert ("model", "demo-32k") not in {
        label for labels in now.samples["afmd_model_memory_bytes"] for label in labels}
    assert now.samples["afmd_listener_restarts_total"] == {(("listener", served.url),): 0}
    assert now.samples["afmd_listener_up"] == {(("listener", served.url),): 1}


def test_every_family_served_is_on_the_metrics_page(served: ServerProcess) -> None:
    """docs/metrics.md's table names every family a scrape shows (a counter by its
    ``_total`` name), with its type: a metric added without its row fails here."""
    import re

    from helpers.paths import REPO_ROOT

    page = (REPO_ROOT / "docs" / "metrics.md").read_text()
    rows = dict(re.findall(r"^\| `(afmd_\w+)` \| (\w+) \|", page, flags=re.M))
    # Ollama's routes too, so that every dialect label has a series to be read from.
    for path, body in (("/api/chat", {"messages": MESSAGES}), ("/api/generate", {"prompt": "1"}),
                       ("/api/embed", {"model": "demo-embedding", "input": "one"})):
        answer = httpx.post(served.url + path, json={
            "model": "demo", "stream": False, "options": {"num_predict": 1}, **body}, timeout=60)
        assert answer.status_code == 200, answer.text
    now = scrape(served.url)
    assert "afmd_kv_cache_disk_writing" in now.types  # the disk tier's, with a model loaded
    for family, kind in now.types.items():
        name = f"{family}_total" if kind == "counter" else family
        assert rows.get(name) == kind, f"{name} ({kind}) is not in docs/metrics.md's table"
    dialects = {value for labels in now.samples["afmd_http_requests_total"]
                for label, value in labels if label == "dialect"}
    assert {"ollama", "ollama_chat", "ollama_generate"} <= dialects
    for dialect in dialects:
        assert f"`{dialect}`" in page, f"dialect {dialect} is not named in docs/metrics.md"


def test_unloads_and_reloads_are_counted(tmp_path: Path) -> None:
    """``keep_alive: 0`` unloads the model right after its request; the next one loads it
    again. The counts outlive the unload; memory is reported while it is loaded."""
    proc = start_server(tmp_path)
    model = (("model", "demo-embedding"),)
    try:
        once = {"model": "demo-embedding", "input": "hello", "keep_alive": 0}
        _wait_loaded(proc.url, "/v1/embeddings", once)
        deadline = time.monotonic() + 30
        while (now := scrape(proc.url)).get("afmd_model_unloads_total",
                                            model="demo-embedding") != 1:
            assert time.monotonic() < deadline, now.text
            time.sleep(0.05)
        assert now.value("afmd_model_loaded", model="demo-embedding") == 0
        assert model not in now.samples["afmd_model_memory_bytes"]
        assert now.value("afmd_model_loads_total", model="demo-embedding") == 1
        first_load = now.value("afmd_model_load_seconds_total", model="demo-embedding")
        assert first_load > 0

        again = httpx.post(proc.url + "/v1/embeddings",
                           json={**once, "keep_alive": -1}, timeout=60)
        assert again.status_code == 200, again.text
        now = scrape(proc.url)
        assert now.value("afmd_model_loads_total", model="demo-embedding") == 2
        assert now.value("afmd_model_unloads_total", model="demo-embedding") == 1
        assert now.value("afmd_model_load_seconds_total", model="demo-embedding") > first_load
        assert now.value("afmd_model_loaded", model="demo-embedding") == 1
        assert now.value("afmd_model_memory_bytes", model="demo-embedding") > 0
    finally:
        proc.stop()


def test_kv_cache_counters_never_go_back_across_an_unload(tmp_path: Path) -> None:
    """The block KV cache's counters live in the loaded model; unloaded, its series went
    away and came back at 0 with the next load, a reset no counter may have. They are
    counted from the server's start, as the load counts are."""
    proc = start_server(tmp_path)
    series = (("model", "demo"), ("tier", "ram"))
    names = ("afmd_kv_cache_hits_total", "afmd_kv_cache_misses_total")
    prompt = [{"role": "user", "content": "A prompt long enough to fill a block. " * 60}]
    try:
        for keep_alive in (-1, 0):  # the same prompt twice: a hit; then unloaded
            reply = httpx.post(proc.url + CHAT, timeout=60, json={
                "model": "demo", "messages": prompt, "max_tokens": 2,
                "keep_alive": keep_alive})
            assert reply.status_code == 200, reply.text
        deadline = time.monotonic() + 30
        while (unloaded := scrape(proc.url)).get("afmd_model_unloads_total",
                                                 model="demo") != 1:
            assert time.monotonic() < deadline, unloaded.text
            time.sleep(0.05)
        before = {name: unloaded.samples[name][series] for name in names}
        assert before["afmd_kv_cache_hits_total"] > 0, unloaded.text

        reply = httpx.post(proc.url + CHAT, timeout=60, json={
            "model": "demo", "messages": prompt, "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        reloaded = scrape(proc.url)
        assert reloaded.value("afmd_model_loads_total", model="demo") == 2
        for name in names:
            assert reloaded.samples[name][series] >= before[name], name
        assert reloaded.samples["afmd_kv_cache_misses_total"][series] > before[
            "afmd_kv_cache_misses_total"]  # the new load's RAM tier is empty: a miss
    finally:
        proc.stop()


#: A stream that holds the one slot far longer than a test (8000 greedy tokens, as in
#: test_direct_answers), cancelled by its id at the end.
HOG = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 8000,
       "temperature": 0, "stream": True}


@contextlib.contextmanager
def a_request_queued(proc: ServerProcess, waiter: threading.Thread) -> Iterator[Scrape]:
    """The one slot held by :data:`HOG` (id ``hog``) and ``waiter``'s request queued
    behind it; the scrape that shows it queued. The stream is cancelled as the block ends."""
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", proc.url + CHAT, json=HOG, headers={"X-Request-ID": "hog"}) as first:
        assert first.status_code == 200
        chunks = first.iter_bytes()  # kept: a dropped iterator closes the response
        next(chunks)  # it holds the slot now
        waiter.start()
        deadline = time.monotonic() + 30
        while (now := scrape(proc.url)).value("afmd_queue_depth") != 1:
            assert time.monotonic() < deadline, now.text
            time.sleep(0.05)
        yield now
        assert httpx.post(proc.url + CHAT + "/hog/cancel").json()["cancelled"] is True


def test_gauges_count_running_and_queued_requests(tmp_path: Path) -> None:
    """One slot: a long stream holds it, a second request waits in the queue."""
    proc = start_server(tmp_path, config="[queue]\nmax_concurrent_requests = 1\n")
    waiter = threading.Thread(target=lambda: httpx.post(
        proc.url + CHAT, json={**HOG, "max_tokens": 2}, timeout=60))
    try:
        with a_request_queued(proc, waiter) as now:
            assert now.value("afmd_active_generations") == 1
        waiter.join(60)
        now = scrape(proc.url)
        assert (now.value("afmd_queue_depth"), now.value("afmd_active_generations")) == (0, 0)
    finally:
        proc.stop()


def test_a_request_cancelled_in_the_queue_looked_nothing_up(tmp_path: Path) -> None:
    """A request cancelled while it waits for a slot never reaches the model, so it never
    looks its prompt up in the prefix cache: counted as a lookup, it lowered the hit ratio
    (hits over lookups) by a request the cache never saw. Its usage (the prompt it was
    told of, no tokens out) still counts, as what the client was told."""
    proc = start_server(tmp_path, config="[queue]\nmax_concurrent_requests = 1\n")
    told: dict[str, Any] = {}

    def wait_in_queue() -> None:
        told.update(httpx.post(proc.url + CHAT, headers={"X-Request-ID": "waiter"}, timeout=60,
                               json={**HOG, "stream": False, "max_tokens": 2}).json())

    waiter = threading.Thread(target=wait_in_queue)
    try:
        with a_request_queued(proc, waiter) as before:
            assert httpx.post(proc.url + CHAT + "/waiter/cancel").json()["cancelled"] is True
            waiter.join(60)
            assert told["choices"][0]["finish_reason"] == "cancelled", told
            after = scrape(proc.url)
        demo = (("model", "demo"),)
        assert after.moved(before, "afmd_prompt_tokens_total") == {
            demo: told["usage"]["prompt_tokens"]}
        assert after.moved(before, "afmd_prefix_cache_lookups_total") == {}
        assert after.moved(before, "afmd_time_to_first_token_seconds_count") == {}
    finally:
        proc.stop()


def test_a_stream_cut_off_after_its_first_token_has_its_time_to_first_token(
        tmp_path: Path) -> None:
    """A stream whose client leaves, or that runs into request_timeout, after its first
    token generated one: its time to first token is observed (and logged), though its
    engine timings come with its end, after the request is counted. It told no usage, so
    no tokens are counted for it."""
    proc = start_server(tmp_path, config="[server]\nrequest_timeout = 3.0\n")
    long = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 8000,
            "temperature": 0, "stream": True}
    try:
        before = scrape(proc.url)
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", proc.url + CHAT, json=long,
                               headers={"X-Request-ID": "left"}) as left:
                assert left.status_code == 200
                next(left.iter_bytes())  # then the client goes
            timed_out = client.post(proc.url + CHAT, json=long,
                                    headers={"X-Request-ID": "timed-out"})
        assert timed_out.status_code == 200
        assert parse_sse(timed_out.text)[-2]["error"]["code"] == "timeout"
        deadline = time.monotonic() + 30
        while not (lines := [e for e in proc.events if e.get("event") == "request"
                             and e.get("request_id") in ("left", "timed-out")])[1:]:
            assert time.monotonic() < deadline, lines
            time.sleep(0.05)
        after = scrape(proc.url)
        demo = (("model", "demo"),)
        assert after.moved(before, "afmd_http_requests_total") == {
            _key(CHAT, "openai_chat", 200): 2, _key("/metrics", "none", 200): 1}
        assert after.moved(before, "afmd_time_to_first_token_seconds_count") == {demo: 2}
        assert after.moved(before, "afmd_time_to_first_token_seconds_sum")[demo] > 0
        assert after.moved(before, "afmd_completion_tokens_total") == {}
        assert {e["request_id"]: e.get("disconnected", e.get("stream_error")) for e in lines} == {
            "left": True, "timed-out": "timeout"}
        assert all(e["ttft_ms"] > 0 for e in lines), lines
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A key set, on a listener other machines reach (0.0.0.0)."""
    proc = start_server(tmp_path_factory.mktemp("keyed"),
                        config=f'[server]\nhost = "0.0.0.0"\napi_key = "{KEY}"\n')
    yield proc
    proc.stop()


def test_gate_refusals_and_direct_answers_are_counted(keyed: ServerProcess) -> None:
    """The gate answers 401, 404 and 405 itself; the connection answers ``/health``. A
    405 is counted under the route's template (the path is served, with other methods),
    a 404 under ``other``."""
    url = f"http://127.0.0.1:{keyed.port}"
    before = scrape(url, BEARER)
    assert httpx.post(url + CHAT, json={"messages": MESSAGES}).status_code == 401
    assert httpx.post(url + "/v1/messages", json={}).status_code == 401
    assert httpx.get(url + "/nowhere", headers=BEARER).status_code == 404
    assert httpx.put(url + "/health").status_code == 405
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/v1/models", headers=BEARER).status_code == 200
    after = scrape(url, BEARER)
    assert after.moved(before, "afmd_http_requests_total") == {
        _key(CHAT, "openai_chat", 401): 1,
        _key("/v1/messages", "anthropic_messages", 401): 1,
        _key("other", "none", 404): 1,
        _key("/health", "none", 405): 1,  # a route's path: its template, another method
        _key("/health", "none", 200): 1,
        _key("/v1/models", "none", 200): 1,
        _key("/metrics", "none", 200): 1,
    }


def test_metrics_need_the_key_on_a_listener_other_machines_reach(keyed: ServerProcess) -> None:
    url = f"http://127.0.0.1:{keyed.port}"
    refused = httpx.get(url + "/metrics")
    assert refused.status_code == 401, refused.text
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert refused.headers["www-authenticate"] == "Bearer"
    assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer wrong"}
                     ).status_code == 401
    assert httpx.get(url + "/metrics", headers={"x-api-key": KEY}).status_code == 200
    scrape(url, BEARER)
    assert httpx.get(url + "/health").status_code == 200  # the health check stays open
    # HEAD is what /health answers too: GET only.
    head = httpx.head(url + "/metrics", headers=BEARER)
    assert head.status_code == httpx.head(url + "/health").status_code == 405
    assert head.headers["allow"] == "GET"


@pytest.fixture()
def sock_dir() -> Iterator[Path]:
    """A short directory for Unix sockets (sun_path is ~104 bytes; tmp_path can be long)."""
    path = Path(f"/tmp/afmd-m-{os.getpid()}-{time.monotonic_ns() % 10**8}")
    path.mkdir()
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def _get_unix(path: str, target: str) -> tuple[int, str]:
    with httpx.Client(transport=httpx.HTTPTransport(uds=path), timeout=30) as client:
        response = client.get("http://localhost" + target)
        return response.status_code, response.text


def test_open_on_loopback_and_unix_socket_and_restarts_counted(
    tmp_path: Path, sock_dir: Path
) -> None:
    """With a key set, loopback TCP and the Unix socket still serve metrics without it;
    a Unix listener whose file is removed is recreated, and the restart is counted."""
    path = str(sock_dir / "afmd.sock")
    proc = start_server(tmp_path, config=f'[server]\napi_key = "{KEY}"\n',
                        args=["--unix-socket", path])
    try:
        assert httpx.get(proc.url + "/v1/models").status_code == 401  # the key is on
        first = scrape(proc.url)
        status, text = _get_unix(path, "/metrics")
        assert status == 200, text
        unix = f"unix:{path}"
        assert first.value("afmd_listener_restarts_total", listener=unix) == 0
        assert first.value("afmd_listener_restarts_total", listener=proc.url) == 0
        os.unlink(path)
        proc.wait_event("listener_state", timeout=10, state="running", attempt=1)
        now = scrape(proc.url)
        assert now.value("afmd_listener_restarts_total", listener=unix) == 1
        assert now.value("afmd_listener_restarts_total", listener=proc.url) == 0
        assert now.value("afmd_listener_up", listener=unix) == 1
        assert _get_unix(path, "/metrics")[0] == 200
    finally:
        assert proc.stop() == 0, proc.log_text()[-4000:]


def test_buckets_count_a_value_on_a_bound_in_that_bucket() -> None:
    buckets = Buckets(TTFT_BUCKETS)
    for value in (0.0, TTFT_BUCKETS[0], TTFT_BUCKETS[0] + 1e-9, 1e9):
        buckets.observe(TTFT_BUCKETS, value)
    cumulative = dict(buckets.cumulative(TTFT_BUCKETS))
    assert cumulative[repr(TTFT_BUCKETS[0])] == 2
    assert cumulative[repr(TTFT_BUCKETS[1])] == 3
    assert cumulative["+Inf"] == 4
    assert buckets.total == pytest.approx(1e9 + 2 * TTFT_BUCKETS[0])


def test_prometheus_client_is_not_imported_until_the_first_scrape() -> None:
    """It pulls in its HTTP servers: a server nobody scrapes should not pay for that."""
    import subprocess
    import sys

    script = ("import sys, afmd.server, afmd.cli.main\n"
              "print(json.dumps(sorted(m for m in sys.modules if m.startswith('prometheus'))))")
    out = subprocess.run([sys.executable, "-c", "import json\n" + script],
                         capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == []
