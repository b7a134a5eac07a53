"""Models that cannot be loaded are reported clearly, never as a crash or a hang."""

from __future__ import annotations

import time

import httpx
import pytest

from conftest import start_server
from helpers.openai_schemas import validate_error

pytestmark = pytest.mark.slow  # servers that fail to load their model


def test_unreachable_hugging_face_model_is_named(tmp_path) -> None:
    repo = "mlx-community/Qwen2.5-0.5B-Instruct-4bit"
    server = start_server(
        tmp_path, args=["--model", repo], env={"HF_HUB_OFFLINE": "1"}, ready=False
    )
    try:
        failed = None
        for _ in range(200):
            health = httpx.get(server.url + "/health", timeout=5)
            body = health.json()
            if body["models"][repo].startswith("unavailable: '"):
                failed = health
                break
            time.sleep(0.05)
        assert failed is not None, body
        assert failed.status_code == 503
        assert body["status"] == "unavailable"
        assert body["reason"] == "model_load_failed"
        assert repo in body["models"][repo]
        assert "Hugging Face" in body["models"][repo]
        assert body["models"]["demo"] == "available"

        chat = httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            timeout=30,
        )
        assert chat.status_code == 500
        err = chat.json()
        validate_error(err)
        assert err["error"]["code"] == "model_load_failed"
        assert err["error"]["param"] == "model"
        assert repo in err["error"]["message"]

        # The other models still serve.
        ok = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 2},
            timeout=30,
        )
        assert ok.status_code == 200
    finally:
        assert server.stop() == 0


def test_missing_local_folder_is_reported(tmp_path) -> None:
    missing = tmp_path / "no-such-model"
    config = f'[[models.model]]\nid = "local"\npath = "{missing}"\n'
    server = start_server(tmp_path, config=config)
    try:
        chat = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "local", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert chat.status_code == 500
        err = chat.json()["error"]
        assert err["code"] == "model_load_failed"
        assert str(missing) in err["message"] and "does not exist" in err["message"]
    finally:
        server.stop()


def test_a_path_the_os_refuses_to_look_at_is_named_not_a_500(tmp_path) -> None:
    """A name longer than the OS takes (ENAMETOOLONG; a protected folder's EPERM under
    launchd is the same case) made every listing and request a 500 `internal_error`, since
    ``Path.is_dir`` raises for it where it says False for a missing path."""
    unreadable = tmp_path / ("m" * 300)
    config = f'[[models.model]]\nid = "long"\npath = "{unreadable}"\n'
    server = start_server(tmp_path, config=config)
    try:
        listed = httpx.get(server.url + "/v1/models", timeout=30)
        assert listed.status_code == 200
        assert "long" in [m["id"] for m in listed.json()["data"]]
        tags = httpx.get(server.url + "/api/tags", timeout=30)
        assert tags.status_code == 200 and "long:latest" in [m["name"] for m in
                                                             tags.json()["models"]]
        assert httpx.post(server.url + "/api/show", json={"model": "long"},
                          timeout=30).status_code == 200
        chat = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "long", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert chat.status_code == 500
        validate_error(chat.json())
        err = chat.json()["error"]
        assert err["code"] == "model_load_failed" and err["param"] == "model"
        assert err["message"].endswith("cannot be read: File name too long")
        health = httpx.get(server.url + "/health", timeout=30).json()
        assert health["models"]["long"].endswith("cannot be read: File name too long")
        assert "unhandled error" not in server.log_text()
    finally:
        server.stop()


def test_sigterm_during_the_first_load_stops_cleanly(tmp_path) -> None:
    """SIGTERM while the default model's first load is still importing mlx-lm and
    transformers on its thread: the shutdown's KV cache flush imported them too, from
    another thread, and transformers' half-initialised package failed that import, so the
    server exited 1 with a traceback. Fresh interpreters (not the zygote, which has
    imported them already), stopped at several points of that import."""
    from helpers.servers import DIAGNOSE

    for delay in (0.1, 0.3, 0.5):
        server = start_server(tmp_path, ready=False, fork=False, env=DIAGNOSE)
        time.sleep(delay)
        assert server.stop() == 0, server.log_text()[-3000:]
        assert "Traceback" not in server.log_text(), server.log_text()[-3000:]


def test_a_folder_without_a_tokenizer_fails_its_load_for_every_waiter_and_is_retried(
    tmp_path,
) -> None:
    """A model folder with its weights and config but no tokenizer files: transformers
    builds an empty tokenizer for it, and the model "loaded"; every request then got a
    400 blaming it (the chat template "could not render these messages", the prompt "is
    empty") while /health said loaded. Now the load fails, every request waiting for it
    in any dialect gets the same 500 ``model_load_failed`` naming the tokenizer, nothing
    stays loading, and once the files are there the next request loads it."""
    import json
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    from afmd.engine.demo import builtin

    demo = builtin.materialize("demo")
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    shutil.copy(demo / "model.safetensors", folder)
    config = json.loads((demo / "config.json").read_text())
    config.pop("afmd_demo", None)
    (folder / "config.json").write_text(json.dumps(config))
    server = start_server(tmp_path, config=(
        f'[[models.model]]\nid = "bare"\npath = "{folder}"\n'))
    message = [{"role": "user", "content": "hi"}]
    requests = [
        ("/v1/chat/completions", {"messages": message, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": message, "max_tokens": 2, "stream": True}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 16}),
        ("/api/chat", {"messages": message}),
        ("/api/generate", {}),  # Ollama's load body
    ]
    try:
        with ThreadPoolExecutor(len(requests)) as pool:
            answers = list(pool.map(
                lambda sent: httpx.post(server.url + sent[0], json={"model": "bare", **sent[1]},
                                        timeout=60), requests))
        for (path, _), answer in zip(requests, answers, strict=True):
            assert answer.status_code == 500, (path, answer.text)
            assert "tokenizer is empty" in answer.text and str(folder) in answer.text, path
            if not path.startswith("/api/"):
                validate_error(answer.json())
                assert answer.json()["error"]["code"] == "model_load_failed"
        health = httpx.get(server.url + "/health", timeout=10).json()
        assert health["models"]["bare"].startswith("unavailable: ValueError: its tokenizer")
        assert health["model_details"]["bare"]["state"] != "loading"
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(demo / name, folder)
        again = httpx.post(server.url + "/v1/chat/completions",
                           json={"model": "bare", "messages": message, "max_tokens": 2},
                           timeout=60)
        assert again.status_code == 200, again.text
        assert httpx.get(server.url + "/health", timeout=10).json()["models"]["bare"] == \
            "available"
    finally:
        assert server.stop() == 0


#: ``afmd serve`` whose loads take a long while (a large model's), as a script.
SLOW_LOAD_SERVE = """
import sys, time
import afmd.engine.models.model_registry as registry
def load_sync(entry, config):
    print('{"event": "slow load"}', file=sys.stderr, flush=True)
    time.sleep(20)
    raise RuntimeError("never reached in the test")
registry.load_sync = load_sync
from afmd.cli.main import main
sys.exit(main())
"""


def test_sigterm_during_a_long_load_stops_at_once(tmp_path) -> None:
    """The load ran on the loop's default executor, whose threads ``asyncio.run`` waits
    for at exit: a SIGTERM during a load waited for the whole load (a large model's
    minute, past launchd's time to stop before it kills the service). The load cannot be
    stopped and nothing of it needs to finish; the server now exits without it."""
    import os
    import subprocess
    import sys
    import threading

    from helpers.servers import DIAGNOSE, ServerProcess

    env = {**os.environ, **DIAGNOSE}
    env.pop("AFMD_CONFIG", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_LOAD_SERVE, "serve", "--log-format", "json",
         "--port", "0"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, env=env, cwd=str(tmp_path))
    server = ServerProcess(proc)
    threading.Thread(target=server._reader, daemon=True).start()
    server.wait_event("slow load", timeout=60)
    started = time.monotonic()
    assert server.stop(timeout=15) == 0, server.log_text()[-3000:]
    assert time.monotonic() - started < 5
    assert "Traceback" not in server.log_text()
