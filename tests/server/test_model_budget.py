"""Several models within a memory budget, on a real server: loaded on demand, the least
recently used idle one unloaded for another, a busy one never, 503 ``model_unavailable``
when nothing can make room in time, a model larger than the budget refused before loading,
``keep_alive`` (server, model, request), ``preload``, and ``/health``'s per-model detail."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import ServerProcess, start_server
from helpers.openai_schemas import validate_error

CHAT = "/v1/chat/completions"
#: Greedy, this chat runs to max_tokens on the demo model (as in tests/server/test_engine.py).
LONG_STORY = {"max_tokens": 8000, "stream": True, "temperature": 0,
              "messages": [{"role": "system", "content": "You are terse."},
                           {"role": "user", "content": "Tell me a long story."}]}


def health(server: ServerProcess) -> dict[str, Any]:
    return httpx.get(server.url + "/health", timeout=10).json()


def details(server: ServerProcess) -> dict[str, dict[str, Any]]:
    return health(server)["model_details"]


def states(server: ServerProcess) -> dict[str, str]:
    return {model: d["state"] for model, d in details(server).items()}


def wait_for(server: ServerProcess, predicate: Callable[[dict[str, Any]], bool],
             timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        body = health(server)
        if predicate(body):
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.02)


def chat(server: ServerProcess, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}], **extra}
    return httpx.post(server.url + CHAT, json=body, timeout=60)


def load_failures(server: ServerProcess, model: str) -> dict[str, float]:
    """``afmd_model_load_failures_total`` and ``afmd_model_too_large_total`` of
    ``model`` (a series each: their one label is the model)."""
    found: dict[str, float] = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        for name, key in (("afmd_model_load_failures_total", "failed"),
                          ("afmd_model_too_large_total", "too_large")):
            if line.startswith(f'{name}{{model="{model}"}} '):
                found[key] = float(line.rsplit(" ", 1)[1])
    return found


def loaded_models(server: ServerProcess) -> list[str]:
    return sorted(m for m, state in states(server).items() if state == "loaded")


def test_models_load_on_demand_and_the_least_recently_used_idle_one_makes_room(
    tmp_path: Path,
) -> None:
    config = ('[models]\nmax_loaded = 2\n'
              '[[models.model]]\nid = "twin"\npath = "afmd:demo"\n')
    server = start_server(tmp_path, config=config)
    try:
        assert loaded_models(server) == ["demo"]  # the default model, preloaded
        first = health(server)
        # /health keeps its shape: the models map still says available / unavailable.
        assert first["status"] == "ok" and first["models"]["demo-32k"] == "available"
        assert details(server)["demo-32k"] == {
            "state": "available", "path": "afmd:demo-32k", "memory_bytes": None,
            "active": 0, "queued": 0, "idle_since": None, "expires_at": None,
            "kv_cache": None}

        assert chat(server, "demo-32k").status_code == 200  # loaded on demand
        assert loaded_models(server) == ["demo", "demo-32k"]
        assert chat(server, "demo").status_code == 200  # demo-32k is now the older
        assert chat(server, "twin").status_code == 200  # a third: one must go
        assert loaded_models(server) == ["demo", "twin"]
        assert chat(server, "demo-32k").status_code == 200  # and again: demo goes
        assert loaded_models(server) == ["demo-32k", "twin"]
        body = health(server)
        # The default model was unloaded when idle: the server is healthy all the same.
        assert body["status"] == "ok" and body["models"]["demo"] == "available"
        detail = body["model_details"]["demo-32k"]
        # Measured: the weights (16.7 MB of safetensors) and the KV caches.
        assert detail["memory_bytes"] > 16_000_000
        assert detail["idle_since"] <= time.time() and detail["expires_at"] > time.time()
        log = server.log_text()
        assert "model unloaded: demo-32k (making room for twin" in log
        assert "model unloaded: demo (making room for demo-32k" in log
    finally:
        assert server.stop() == 0


def test_a_busy_model_is_never_unloaded_a_request_waits_for_it_to_become_idle(
    tmp_path: Path,
) -> None:
    server = start_server(tmp_path, config="[models]\nmax_loaded = 1\n")
    hog_id = "hog-" + uuid.uuid4().hex
    try:
        with ThreadPoolExecutor(2) as pool:
            hog: Future[httpx.Response] = pool.submit(
                httpx.post, server.url + CHAT, json={"model": "demo", **LONG_STORY},
                headers={"X-Request-ID": hog_id}, timeout=120)
            wait_for(server, lambda h: h["model_details"]["demo"]["active"] == 1)
            waiting = pool.submit(chat, server, "demo-32k")
            body = wait_for(server, lambda h: h["model_details"]["demo-32k"]["queued"] == 1)
            assert body["model_details"]["demo-32k"]["state"] == "loading"
            time.sleep(0.5)
            assert not waiting.done()  # demo is busy: nothing can make room
            assert loaded_models(server) == ["demo"]
            assert health(server)["model_details"]["demo"]["idle_since"] is None
            cancelled_at = time.monotonic()
            httpx.post(server.url + f"{CHAT}/{hog_id}/cancel", timeout=30)
            answer = waiting.result(60)
            assert answer.status_code == 200, answer.text
            assert time.monotonic() >= cancelled_at
            assert hog.result(60).status_code == 200
        assert loaded_models(server) == ["demo-32k"]
    finally:
        assert server.stop() == 0


def test_a_model_in_steady_use_gives_way_to_a_request_for_another_that_came_first(
    tmp_path: Path,
) -> None:
    """``max_loaded = 1``, demo busy with a stream, a request for demo-32k waiting for
    room, then another request for demo. That one used to get demo at once, and so would
    every later one: a model in steady use never went idle, and the request for the other
    model waited out its whole request_timeout for a 503 ``model_unavailable`` while
    requests that came after it were served. Now it waits behind the earlier request
    (queued, not making demo busy): demo finishes its stream, is unloaded, demo-32k answers,
    and demo is loaded again for the later request."""
    server = start_server(tmp_path, config="[models]\nmax_loaded = 1\n")
    hog_id = "hog-" + uuid.uuid4().hex
    try:
        with ThreadPoolExecutor(3) as pool:
            hog: Future[httpx.Response] = pool.submit(
                httpx.post, server.url + CHAT, json={"model": "demo", **LONG_STORY},
                headers={"X-Request-ID": hog_id}, timeout=120)
            wait_for(server, lambda h: h["model_details"]["demo"]["active"] == 1)
            first = pool.submit(chat, server, "demo-32k")
            wait_for(server, lambda h: h["model_details"]["demo-32k"]["queued"] == 1)
            later = pool.submit(chat, server, "demo")
            body = wait_for(server, lambda h: h["model_details"]["demo"]["queued"] == 1)
            assert body["model_details"]["demo"]["active"] == 1  # the stream, still going
            time.sleep(0.5)
            assert not later.done() and not first.done()
            assert loaded_models(server) == ["demo"]  # never unloaded while busy
            httpx.post(server.url + f"{CHAT}/{hog_id}/cancel", timeout=30)
            answered = first.result(60)
            assert answered.status_code == 200, answered.text
            again = later.result(60)
            assert again.status_code == 200, again.text
            assert hog.result(60).status_code == 200
        log = server.log_text()
        switches = [line for line in log.splitlines()
                    if "model loaded: " in line or "model unloaded: " in line]
        assert [json.loads(line)["event"].split(" (")[0] for line in switches] == [
            "model loaded: demo", "model unloaded: demo", "model loaded: demo-32k",
            "model unloaded: demo-32k", "model loaded: demo"], switches
    finally:
        assert server.stop() == 0


def test_loads_waiting_for_room_take_it_in_turn(tmp_path: Path) -> None:
    """``max_loaded = 1``, three requests for each of four models at once. A load that
    unloaded an idle model for its room found the room taken, before it woke, by a load
    asked for after it, and then unloaded that one as soon as it was loaded, before its
    requests could hold it: the twelve requests took about sixty loads, each a model read
    from disk. Now the loads take the room in the order they were asked for, and each
    model's requests are served by one load of it (or a few, as requests arrive)."""
    server = start_server(tmp_path, config="[models]\nmax_loaded = 1\n")

    def ask(model: str) -> httpx.Response:
        if model == "demo-embedding":
            return httpx.post(server.url + "/api/embed", timeout=60,
                              json={"model": model, "input": "hi"})
        return chat(server, model, max_tokens=50)

    try:
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(ask, ["demo", "demo-32k", "demo-vision",
                                          "demo-embedding"] * 3))
        assert [r.status_code for r in answers] == [200] * 12, [r.text for r in answers]
        loads = server.log_text().count("model loaded: ")
        assert loads <= 8, loads
    finally:
        assert server.stop() == 0


def test_budget_too_large_model_keep_alive_and_preload(tmp_path: Path) -> None:
    """A 10 MB budget: demo-32k (16.7 MB of weights) is refused before loading, naming both
    sizes; the small models come and go by their keep-alive: the server's (1 s), a
    model's (-1: never) or a request's (0: right after it, or a duration)."""
    config = ('[models]\nmemory_budget_bytes = 10000000\nkeep_alive = 1\n'
              '[[models.model]]\nid = "demo"\npath = "afmd:demo"\npreload = false\n'
              '[[models.model]]\nid = "kept"\npath = "afmd:demo"\nkeep_alive = -1\n'
              '[[models.model]]\nid = "early"\npath = "afmd:demo-embedding"\n'
              'preload = true\nkeep_alive = -1\n')
    server = start_server(tmp_path, config=config)
    try:
        # preload: "early" was loaded at start, the default (preload = false) was not,
        # and the server is ready all the same.
        body = wait_for(server, lambda h: h["model_details"]["early"]["state"] == "loaded")
        assert body["status"] == "ok"
        assert states(server)["demo"] == "available"

        too_large = chat(server, "demo-32k")
        assert too_large.status_code == 400, too_large.text
        validate_error(too_large.json())
        error = too_large.json()["error"]
        assert (error["code"], error["param"]) == ("model_too_large", "model")
        assert "15.9 MiB" in error["message"] and "10000000 bytes" in error["message"]
        assert states(server)["demo-32k"].startswith("unavailable: larger than the memory")
        assert "model loaded: demo-32k" not in server.log_text()
        # Counted as a load that did not happen, and as too large (each retry again).
        assert load_failures(server, "demo-32k") == {"failed": 1, "too_large": 1}
        assert chat(server, "demo-32k").status_code == 400
        assert load_failures(server, "demo-32k") == {"failed": 2, "too_large": 2}

        # The server's keep_alive: 1 s after its request, demo is unloaded.
        assert chat(server, "demo").status_code == 200
        detail = details(server)["demo"]
        assert detail["expires_at"] - detail["idle_since"] == pytest.approx(1, abs=0.2)
        wait_for(server, lambda h: h["model_details"]["demo"]["state"] == "available", 10)

        # The model's keep_alive = -1: still loaded well past 1 s, no expiry.
        assert chat(server, "kept").status_code == 200
        time.sleep(1.5)
        assert details(server)["kept"]["state"] == "loaded"
        assert details(server)["kept"]["expires_at"] is None
        # A request's keep_alive overrides it: "1s", then unloaded.
        assert chat(server, "kept", keep_alive="1s").status_code == 200
        assert details(server)["kept"]["expires_at"] is not None
        wait_for(server, lambda h: h["model_details"]["kept"]["state"] == "available", 10)

        # keep_alive 0: unloaded right after the request (embeddings too).
        embedded = httpx.post(server.url + "/v1/embeddings",
                              json={"model": "early", "input": "x", "keep_alive": 0},
                              timeout=60)
        assert embedded.status_code == 200, embedded.text
        wait_for(server, lambda h: h["model_details"]["early"]["state"] == "available", 5)
    finally:
        assert server.stop() == 0


def test_keep_alive_in_every_dialect_and_its_errors(tmp_path: Path) -> None:
    server = start_server(tmp_path, config="[models]\nkeep_alive = -1\n")
    url = server.url
    message = [{"role": "user", "content": "hi"}]
    try:
        bodies = {
            CHAT: {"model": "demo", "messages": message, "max_tokens": 2},
            "/v1/completions": {"model": "demo", "prompt": "hi", "max_tokens": 2},
            "/v1/responses": {"model": "demo", "input": "hi", "max_output_tokens": 16,
                              "store": False},
            "/v1/messages": {"model": "demo", "messages": message, "max_tokens": 2},
            "/v1/embeddings": {"model": "demo-embedding", "input": "hi"},
        }
        for path, body in bodies.items():
            for keep_alive in ("5m", 300, -1, "1h30m", None):
                answer = httpx.post(url + path, json={**body, "keep_alive": keep_alive},
                                    timeout=60)
                assert answer.status_code == 200, (path, keep_alive, answer.text)
            for bad, code in ((True, "invalid_type"), ([], "invalid_type"),
                              ("soon", "invalid_value"), ("5 minutes", "invalid_value")):
                answer = httpx.post(url + path, json={**body, "keep_alive": bad}, timeout=60)
                assert answer.status_code == 400, (path, bad, answer.text)
                if path != "/v1/messages":  # Anthropic's envelope has no param or code
                    error = answer.json()["error"]
                    assert (error["param"], error["code"]) == ("keep_alive", code), error
                assert "keep_alive" in answer.text
        # A request's keep_alive of 0 unloads the model after it, whatever the server's.
        assert chat(server, "demo-32k", keep_alive=0).status_code == 200
        wait_for(server, lambda h: h["model_details"]["demo-32k"]["state"] == "available", 5)
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize(("path", "model", "body"), [
    ("/api/generate", "demo-32k", {}),
    ("/api/embed", "demo-embedding", {}),
])
def test_an_unload_sent_while_the_model_loads_unloads_it_once_its_requests_are_done(
    tmp_path: Path, path: str, model: str, body: dict[str, Any],
) -> None:
    """Ollama's unload body (``keep_alive: 0``, nothing to generate) for a model still
    loading for another client: it is unloaded once that client is done with it, as in
    Ollama. Before, the unload was answered ("unload") at once and the model, loaded a
    moment later, stayed for its keep-alive. The load is held waiting for room behind a
    busy model, so the unload surely comes while it loads."""
    server = start_server(tmp_path, config="[models]\nmax_loaded = 1\n")
    hog_id = "hog-" + uuid.uuid4().hex
    waiter_body: dict[str, Any] = (
        {"model": model, "input": "hi"} if model == "demo-embedding"
        else {"model": model, "messages": [{"role": "user", "content": "hi"}],
              "max_tokens": 2})
    waiter_path = "/v1/embeddings" if model == "demo-embedding" else CHAT
    try:
        with ThreadPoolExecutor(3) as pool:
            hog: Future[httpx.Response] = pool.submit(
                httpx.post, server.url + CHAT, json={"model": "demo", **LONG_STORY},
                headers={"X-Request-ID": hog_id}, timeout=120)
            wait_for(server, lambda h: h["model_details"]["demo"]["active"] == 1)
            waiting = pool.submit(httpx.post, server.url + waiter_path, json=waiter_body,
                                  timeout=60)
            wait_for(server, lambda h: h["model_details"][model]["state"] == "loading")
            unload = pool.submit(httpx.post, server.url + path,
                                 json={"model": model, "keep_alive": 0, **body}, timeout=60)
            time.sleep(0.3)
            assert details(server)[model]["state"] == "loading"
            httpx.post(server.url + f"{CHAT}/{hog_id}/cancel", timeout=30)
            assert waiting.result(60).status_code == 200
            answer = unload.result(60)
            assert answer.status_code == 200, answer.text
            if path == "/api/generate":
                assert answer.json()["done_reason"] == "unload"
            assert hog.result(60).status_code == 200
        wait_for(server, lambda h: h["model_details"][model]["state"] == "available", 10)
        deadline = time.monotonic() + 10  # logged once its memory is freed
        while f"model unloaded: {model} (keep_alive 0" not in server.log_text():
            assert time.monotonic() < deadline, server.log_text()[-3000:]
            time.sleep(0.02)
    finally:
        assert server.stop() == 0


def test_a_folder_that_cannot_load_fails_before_it_unloads_anything(tmp_path: Path) -> None:
    """A folder whose load cannot succeed (no config.json, one that does not parse, no
    weights, no tokenizer, an architecture mlx-lm has none of) unloaded the idle model
    serving beside it to make room, and only then failed: every retry cost that model a
    reload. Its folder says so before any unload now, with the same 500
    ``model_load_failed`` naming the folder and what is wrong."""
    import shutil

    from afmd.engine.demo import builtin

    demo = builtin.materialize("demo")
    config_text = (demo / "config.json").read_text()
    broken: dict[str, tuple[dict[str, str | None], str]] = {
        "no-config": ({"config.json": None}, "has no config.json"),
        "bad-config": ({"config.json": "{not json"}, "config.json cannot be read as JSON"),
        "no-weights": ({"model.safetensors": None}, "no weight files"),
        "no-tokenizer": ({"tokenizer.json": None, "tokenizer_config.json": None},
                         "its tokenizer is empty"),
        "odd-architecture": ({"config.json": json.dumps(
            {**json.loads(config_text), "model_type": "no_such_arch"})},
            "model_type 'no_such_arch' is not one mlx-lm supports"),
    }
    entries = ""
    for name, (changes, _) in broken.items():
        folder = tmp_path / name
        shutil.copytree(demo, folder)
        for file, text in changes.items():
            if text is None:
                (folder / file).unlink()
            else:
                (folder / file).write_text(text)
        entries += f'[[models.model]]\nid = "{name}"\npath = "{folder}"\n'
    server = start_server(tmp_path, config="[models]\nmax_loaded = 1\n" + entries)
    try:
        assert loaded_models(server) == ["demo"]
        for name, (_, problem) in broken.items():
            for _ in range(2):  # and its retry
                answer = chat(server, name)
                assert answer.status_code == 500, (name, answer.text)
                validate_error(answer.json())
                error = answer.json()["error"]
                assert (error["code"], error["param"]) == ("model_load_failed", "model")
                assert str(tmp_path / name) in error["message"], (name, error)
                assert problem in error["message"], (name, error)
            assert states(server)[name].startswith("unavailable: "), name
            assert loaded_models(server) == ["demo"], name
        assert "model unloaded" not in server.log_text()
        for name in broken:  # a load that failed, each time
            assert load_failures(server, name) == {"failed": 2, "too_large": 0}, name
        assert chat(server, "demo").status_code == 200
    finally:
        assert server.stop() == 0
