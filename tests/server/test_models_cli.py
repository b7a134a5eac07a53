"""``afmd serve --model REPO`` pulling first, ``afmd list``, ``ps``, ``rm`` and ``show``, and the
per-model detail ``/health`` gives them: a real server on the demo model served by the hub
stand-in on loopback (tests/helpers/hub.py), the real CLI in subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from afmd.engine.demo import builtin as demo
from afmd.ports import free_ports

from conftest import ROOT, ServerProcess, start_server
from helpers.hub import FakeHub, safetensors_bytes
from helpers.keyed import KEY, keyed_afmd
from helpers.servers import afmd_command, run_afmd

pytestmark = pytest.mark.slow  # the hub stand-in, CLI subprocesses and a server

REPO = "test-org/demo"
EMBED = "test-org/embed"
PS_KEYS = {"id", "state", "memory_bytes", "active", "queued", "idle_s", "expires_in_s",
           "kv_cache"}
LIST_KEYS = {"id", "repo", "path", "size_bytes", "configured", "loaded"}


@pytest.fixture(scope="module")
def demo_folder() -> Path:
    from afmd.engine.demo import builtin as demo

    return demo.materialize("demo")


@pytest.fixture(scope="module")
def hub(demo_folder: Path) -> Iterator[FakeHub]:
    with FakeHub() as running:
        running.add_folder(REPO, demo_folder)
        files = {p.name: p.read_bytes() for p in demo_folder.iterdir() if p.is_file()}
        config = json.loads(files["config.json"])
        config["afmd_embedding"] = {"pooling": "last", "normalize": True}
        running.add_repo(EMBED, {**files, "config.json": json.dumps(config).encode()})
        yield running


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, hub: FakeHub) -> dict[str, str]:
    """The stand-in hub, a private HF cache, and a default port nothing listens on."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("AFMD_", "HF_", "HUGGINGFACE_"))}
    return {**base, "HF_ENDPOINT": hub.url,
            "HF_HOME": str(tmp_path_factory.mktemp("hf")),
            "HF_HUB_DISABLE_TELEMETRY": "1", "AFMD_CACHE_DIR": os.environ["AFMD_CACHE_DIR"],
            "AFMD_SERVER_PORT": str(free_ports()), "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str],
           hub: FakeHub) -> Iterator[tuple[ServerProcess, str]]:
    """``afmd serve --model REPO`` with an empty cache: it pulls first, then serves (one
    generation slot, so a second request queues). Also listens on a Unix socket."""
    tmp = tmp_path_factory.mktemp("served")
    sock = str(tmp / "afmd.sock")
    assert not (Path(env["HF_HOME"]) / "hub" / "models--test-org--demo").exists()
    server_env = {**env}
    server_env.pop("AFMD_SERVER_PORT")
    proc = start_server(
        tmp, config="[server]\nrequest_timeout = 30\n[queue]\nmax_concurrent_requests = 1\n"
                    "[models]\nkeep_alive = -1\n",  # loaded for good: no expiry
        args=["--model", REPO, "--unix-socket", sock], env=server_env)
    yield proc, sock
    proc.stop()


def afmd(env: dict[str, str], *args: str, stdin: str | None = None
         ) -> subprocess.CompletedProcess[str]:
    return run_afmd(args, env=env, input=stdin, timeout=120, cwd=ROOT)


def as_json(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def wait_for(check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.05)


# ---------------------------------------------------------------------------- serve, ps


def test_serve_pulls_a_missing_model_first_then_serves(served: tuple[ServerProcess, str]
                                                       ) -> None:
    server, _ = served
    log = server.log_text()
    assert f"pulling {REPO}@main" in log
    assert "  model.safetensors: " in log and "(100%)" in log  # progress lines (not a tty)
    assert "verified 4 files" in log
    assert log.index("verified 4 files") < log.index('"listening"')
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": REPO, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert reply.status_code == 200, reply.text


def settled_health(server: ServerProcess) -> dict[str, Any]:
    """``/health`` once the previous test's request has wound down: its lease is released
    and its prefix cached just after its response was sent, so two answers in a row may
    differ for a moment. They settle only if every field is an instant, not a duration."""
    deadline = time.monotonic() + 10
    body = httpx.get(server.url + "/health", timeout=10).json()
    while True:
        again = httpx.get(server.url + "/health", timeout=10).json()
        if again == body:
            return body
        assert time.monotonic() < deadline, (body, again)
        body = again
        time.sleep(0.05)


def test_health_keeps_its_shape_and_adds_model_details(served: tuple[ServerProcess, str]
                                                       ) -> None:
    server, _ = served
    body = settled_health(server)
    assert body["status"] == "ok"
    assert body["models"][REPO] == "available" and body["models"]["demo"] == "available"
    assert isinstance(body["active_requests"], int) and isinstance(body["queued_requests"], int)
    detail = body["model_details"][REPO]
    assert detail["state"] == "loaded" and detail["path"] == REPO
    assert detail["memory_bytes"] > 1_000_000  # the demo's float32 weights alone
    assert detail["expires_at"] is None  # keep_alive -1: loaded until the server stops
    assert time.time() - 600 < detail["idle_since"] <= time.time()
    assert body["model_details"]["demo-32k"] == {
        "state": "available", "path": "afmd:demo-32k", "memory_bytes": None, "active": 0,
        "queued": 0, "idle_since": None, "expires_at": None, "kv_cache": None}
    # Instants, not durations: asked again with nothing in between, the same answer.
    assert httpx.get(server.url + "/health", timeout=10).json() == body


def test_ps_shows_memory_requests_and_idle_time(served: tuple[ServerProcess, str],
                                               env: dict[str, str]) -> None:
    server, _ = served
    first = as_json(afmd(env, "ps", "--json", "--url", server.url))
    assert first.keys() == {"models"}
    row = next(m for m in first["models"] if m["id"] == REPO)
    assert row.keys() == PS_KEYS
    assert row["state"] == "loaded" and row["memory_bytes"] > 1_000_000
    assert (row["active"], row["queued"], row["expires_in_s"]) == (0, 0, None)
    assert row["idle_s"] >= 0
    # The KV cache's tiers, and whether its disk tier writes.
    assert row["kv_cache"].keys() == {"ram_bytes", "disk_bytes", "disk_writing"}
    assert all(m["state"] in ("loaded", "loading") for m in first["models"])

    # One slot: a long stream runs, a second request waits; ps sees both, then neither.
    # The schema keeps the random-weight demo from ending early: no end token is allowed
    # before a string longer than max_tokens can write.
    long = {"type": "json_schema", "json_schema": {"name": "long", "schema": {
        "type": "object", "properties": {"text": {"type": "string", "minLength": 20000}},
        "required": ["text"]}}}

    def stream(request_id: str) -> None:
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                          headers={"X-Request-ID": request_id},
                          json={"model": REPO, "stream": True, "max_tokens": 4000,
                                "response_format": long,
                                "messages": [{"role": "user", "content": "go on"}]}) as r:
            for _ in r.iter_bytes():
                pass

    threads = [threading.Thread(target=stream, args=(f"ps-{i}",), daemon=True)
               for i in range(2)]
    threads[0].start()

    def detail() -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(server.url + "/health", timeout=10).json()
        return body["model_details"][REPO]

    wait_for(lambda: detail()["active"] == 1)
    threads[1].start()
    wait_for(lambda: detail()["queued"] == 1)
    busy = next(m for m in as_json(afmd(env, "ps", "--json", "--url", server.url))["models"]
                if m["id"] == REPO)
    assert (busy["active"], busy["queued"], busy["idle_s"]) == (1, 1, 0)
    table = afmd(env, "ps", "--url", server.url)
    assert table.returncode == 0 and table.stdout.splitlines()[0].split() == [
        "ID", "STATE", "MEMORY", "KV-RAM", "KV-DISK", "ACTIVE", "QUEUED", "IDLE", "EXPIRES"]
    assert any(line.split()[:2] == [REPO, "loaded"] and line.split()[-1] == "never"
               for line in table.stdout.splitlines()), table.stdout
    cancelled_at = time.time()
    for i in (1, 0):
        httpx.post(f"{server.url}/v1/chat/completions/ps-{i}/cancel", timeout=10)
    for thread in threads:
        thread.join(30)
    wait_for(lambda: (detail()["active"], detail()["queued"]) == (0, 0))
    released = detail()["idle_since"]
    assert released >= cancelled_at - 0.001  # the release of the last request, not its start
    time.sleep(1.1)
    idle = next(m for m in as_json(afmd(env, "ps", "--json", "--url", server.url))["models"]
                if m["id"] == REPO)
    assert idle["idle_s"] >= 1.0


def test_ps_finds_the_server_as_doctor_does(served: tuple[ServerProcess, str],
                                            env: dict[str, str], tmp_path: Path) -> None:
    server, sock = served
    config = tmp_path / "socket.toml"
    config.write_text(f'[server]\nhost = ""\nunix_socket = "{sock}"\n')
    by_config = as_json(afmd(env, "ps", "--json", "--config", str(config)))
    assert REPO in {m["id"] for m in by_config["models"]}
    by_port = as_json(afmd({**env, "AFMD_SERVER_PORT": str(server.port)}, "ps", "--json"))
    assert by_port == by_config or REPO in {m["id"] for m in by_port["models"]}
    by_url = as_json(afmd(env, "ps", "--json", "--url", f"unix:{sock}"))
    assert REPO in {m["id"] for m in by_url["models"]}


def test_no_server_is_a_clear_message(env: dict[str, str]) -> None:
    port = env["AFMD_SERVER_PORT"]
    for args, where in ((("ps",), f"http://127.0.0.1:{port}"),
                        (("ps", "--url", "unix:/nonexistent/afmd.sock"), "unix:/nonexistent")):
        result = afmd(env, *args)
        assert result.returncode == 1, result
        assert f"no afmd server is running at {where}" in result.stderr
        assert "Traceback" not in result.stderr
        # --url is suggested only to whoever did not pass one.
        assert ("pass --url" in result.stderr) is ("--url" not in args), result.stderr
    bad = afmd(env, "ps", "--url", "ftp://x")
    assert bad.returncode == 2 and "--url must be" in bad.stderr
    # An empty --url is a malformed one too, not "--url not given" (the config's endpoint).
    empty = afmd(env, "ps", "--url", "")
    assert empty.returncode == 2 and "--url must be" in empty.stderr, empty.stderr
    assert "''" in empty.stderr and "no afmd server" not in empty.stderr, empty.stderr
    # No socket path, and port 0, were dialled: "no afmd server is running at unix:
    # (Invalid argument)", and "at http://h:80" for `http://h:0`.
    for url in ("http://127.0.0.1:99999", "http://127.0.0.1:port", "unix:",
                "http://127.0.0.1:0"):
        bad = afmd(env, "ps", "--url", url)
        assert bad.returncode == 2 and "--url" in bad.stderr and url in bad.stderr, bad.stderr


def test_a_keyed_server_is_told_where_the_key_is_read(env: dict[str, str],
                                                      tmp_path: Path) -> None:
    """Without the key, ps sees /health's status alone and cache clear a 401 (a keyed
    server reached from another machine's side); each says where the command reads the
    key, and a key it sent that is wrong is said to be wrong."""
    with keyed_afmd(tmp_path) as (host, port):
        url = f"http://{host}:{port}"
        for verb in (("ps",), ("cache", "clear")):
            missing = afmd(env, *verb, "--url", url)
            assert missing.returncode == 1, missing
            assert "AFMD_SERVER_API_KEY" in missing.stderr, missing.stderr
            assert "[server] api_key" in missing.stderr, missing.stderr
            wrong = afmd({**env, "AFMD_SERVER_API_KEY": "not-it"}, *verb, "--url", url)
            assert wrong.returncode == 1, wrong
            assert "the API key this command sent is not the server's" in wrong.stderr, (
                wrong.stderr)
            right = afmd({**env, "AFMD_SERVER_API_KEY": KEY}, *verb, "--url", url)
            assert right.returncode == 0, right.stderr


# ---------------------------------------------------------------------------- list, rm


def test_cache_clear_of_a_model_the_server_serves_unconfigured(
        served: tuple[ServerProcess, str], env: dict[str, str]) -> None:
    """`afmd serve --model REPO`, then `afmd cache clear --model REPO`: refused, exit 2,
    "not a configured model or alias", by the command's own config, which does not list
    what the server was started with (nor a download it serves under its repo id); the
    server, asked, clears it. A name it does not know is the server's refusal."""
    server, _ = served
    cleared = afmd(env, "cache", "clear", "--model", f"hf.co/{REPO}", "--url", server.url,
                   "--json")
    answer = as_json(cleared)
    assert answer["model"] == REPO and answer["where"] == f"the server at {server.url}"
    unknown = afmd(env, "cache", "clear", "--model", "test-org/not-pulled", "--url",
                   server.url)
    assert unknown.returncode == 1 and "HTTP 404" in unknown.stderr, unknown.stderr
    typo = afmd(env, "cache", "clear", "--model", "no such model", "--url", server.url)
    assert typo.returncode == 2 and "is neither a configured model" in typo.stderr


def test_list_shows_disk_config_and_loaded_state(served: tuple[ServerProcess, str],
                                                 env: dict[str, str], tmp_path: Path) -> None:
    server, _ = served
    listed = as_json(afmd(env, "list", "--json", "--url", server.url))
    assert listed.keys() == {"models"}
    assert all(m.keys() == LIST_KEYS for m in listed["models"])
    rows = {m["id"]: m for m in listed["models"]}
    demo = rows[REPO]
    assert demo["repo"] == REPO and demo["configured"] is False and demo["loaded"] is True
    assert Path(demo["path"]).parent.parent.name == "models--test-org--demo"
    assert demo["size_bytes"] == sum(p.stat().st_size for p in Path(demo["path"]).iterdir())
    assert rows["demo-32k"]["configured"] is True and rows["demo-32k"]["loaded"] is False

    config = tmp_path / "configured.toml"
    config.write_text(f'[[models.model]]\nid = "mine"\npath = "{REPO}"\n'
                      '[[models.model]]\nid = "later"\npath = "test-org/not-pulled"\n')
    configured = {m["id"]: m for m in as_json(afmd(
        env, "list", "--json", "--config", str(config), "--url", server.url))["models"]}
    assert REPO not in configured  # listed once, under its configured id
    assert configured["mine"]["configured"] and configured["mine"]["loaded"]
    assert configured["later"] == {"id": "later", "repo": "test-org/not-pulled", "path": None,
                                   "size_bytes": 0, "configured": True, "loaded": False}

    table = afmd(env, "list", "--url", server.url)
    assert table.stdout.splitlines()[0].split() == ["ID", "SIZE", "QUANTIZATION", "CONTEXT",
                                                     "CONFIGURED", "LOADED"]
    line = next(x for x in table.stdout.splitlines() if x.startswith(REPO))
    assert line.split()[-4:] == ["fp32", "131072", "-", "yes"]
    without = afmd(env, "list")  # no server: listed anyway, the loaded state said unknown
    assert without.returncode == 0 and "loaded state unknown: no afmd server" in without.stderr


def test_list_shows_the_servers_own_models_too(env: dict[str, str], tmp_path: Path) -> None:
    """``afmd serve --model ~/folder`` serves a model no config names: ``afmd list`` lists
    it (``ps`` did, ``list`` did not), as clients can ask for it."""
    folder = tmp_path / "my-folder-model"
    shutil.copytree(demo.materialize("demo"), folder)
    server = start_server(tmp_path, args=["--model", str(folder)])
    try:
        rows = {m["id"]: m for m in as_json(afmd(
            env, "list", "--json", "--url", server.url))["models"]}
        mine = rows["my-folder-model"]
        assert mine.keys() == LIST_KEYS
        assert (mine["path"], mine["configured"], mine["loaded"]) == (str(folder), True, True)
        assert mine["size_bytes"] == sum(f.stat().st_size for f in folder.iterdir())
        assert len(rows) == len(set(rows))  # the built-ins once each
        table = afmd(env, "list", "--url", server.url).stdout.splitlines()
        assert any(line.split()[0] == "my-folder-model" for line in table[1:]), table
    finally:
        assert server.stop() == 0


def test_list_says_loaded_by_id_when_two_models_share_a_path(env: dict[str, str],
                                                              tmp_path: Path) -> None:
    """Two ids on one path (a repo served with two context lengths) are two models: only the
    one loaded is listed loaded. By path, the other was listed loaded too."""
    config = ('[models]\ndefault = "one"\n'
              '[[models.model]]\nid = "one"\npath = "afmd:demo"\n'
              '[[models.model]]\nid = "two"\npath = "afmd:demo"\ncontext_length = 512\n')
    server = start_server(tmp_path, config=config)
    try:
        (tmp_path / "same.toml").write_text(config)
        listed = {m["id"]: m["loaded"] for m in as_json(afmd(
            env, "list", "--json", "--config", str(tmp_path / "same.toml"),
            "--url", server.url))["models"]}
        assert (listed["one"], listed["two"], listed["demo"]) == (True, False, False)
    finally:
        assert server.stop() == 0


def test_rm_asks_refuses_a_loaded_model_and_deletes(served: tuple[ServerProcess, str],
                                                     env: dict[str, str]) -> None:
    server, _ = served
    refused = afmd(env, "rm", REPO, "--yes", "--url", server.url)
    assert refused.returncode == 1
    assert f"{REPO} is loaded by the running server (as model '{REPO}')" in refused.stderr
    assert REPO in {m["id"] for m in as_json(afmd(env, "list", "--json"))["models"]}

    assert afmd(env, "pull", EMBED).returncode == 0
    folder = Path(env["HF_HOME"]) / "hub" / "models--test-org--embed"
    kept = afmd(env, "rm", EMBED, "--url", server.url, stdin="n\n")
    assert kept.returncode == 1 and "nothing deleted" in kept.stdout
    assert f"Delete {EMBED} (1.3 MB) from {folder}? [y/N]" in kept.stdout
    assert folder.is_dir()
    gone = afmd(env, "rm", EMBED, "--url", server.url, stdin="y\n")
    assert gone.returncode == 0 and f"deleted {EMBED} (1.3 MB freed)" in gone.stdout
    # By the server, which refuses a model in use in the same step as it deletes.
    assert server.wait_event("request", path="/api/delete", status=200)
    assert not folder.exists()
    assert not (folder.parent / ".locks" / folder.name).exists()
    assert EMBED not in {m["id"] for m in as_json(afmd(env, "list", "--json"))["models"]}

    missing = afmd(env, "rm", EMBED, "--yes")
    assert missing.returncode == 1 and f"{EMBED} is not in the Hugging Face cache" in \
        missing.stderr
    assert afmd(env, "rm", "not-a-repo", "--yes").returncode == 2

    # Several at once, as `ollama rm a b`: the one that cannot go is said, the rest go.
    assert afmd(env, "pull", EMBED).returncode == 0
    several = afmd(env, "rm", "--yes", "test-org/absent", EMBED, "--url", server.url)
    assert several.returncode == 1, several.stderr
    assert "test-org/absent is not in the Hugging Face cache" in several.stderr
    assert f"deleted {EMBED} (1.3 MB freed)" in several.stdout
    assert not folder.exists()


def test_a_download_loaded_by_its_repo_id_is_shown_and_kept(
        served: tuple[ServerProcess, str], env: dict[str, str]) -> None:
    """A download a client loaded by naming its repo (not configured) is the server's
    model as much as a configured one: ``/health``'s detail listed configured models only,
    so ``afmd ps`` did not show it and ``afmd rm --yes`` deleted its files from under the
    server."""
    server, _ = served
    assert afmd(env, "pull", EMBED).returncode == 0
    folder = Path(env["HF_HOME"]) / "hub" / "models--test-org--embed"
    loaded = httpx.post(server.url + "/v1/embeddings", json={"model": EMBED, "input": "x"},
                        timeout=60)
    assert loaded.status_code == 200, loaded.text
    try:
        rows = {r["id"]: r for r in as_json(afmd(env, "ps", "--json", "--url",
                                                 server.url))["models"]}
        assert rows[EMBED]["state"] == "loaded", rows
        refused = afmd(env, "rm", EMBED, "--yes", "--url", server.url)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert f"{EMBED} is loaded by the running server (as model '{EMBED}')" in \
            refused.stderr
        assert folder.is_dir()
    finally:
        httpx.post(server.url + "/api/embed", json={"model": EMBED, "keep_alive": 0},
                   timeout=60)


def test_rm_looks_again_once_it_is_answered(served: tuple[ServerProcess, str],
                                            env: dict[str, str]) -> None:
    """``afmd rm`` asked the server once, before its question: a model loaded while the
    question waited for its answer had its files deleted from under it. Once answered,
    the server deletes it, and refuses: the model is in use."""
    server, _ = served
    assert afmd(env, "pull", EMBED).returncode == 0
    folder = Path(env["HF_HOME"]) / "hub" / "models--test-org--embed"
    rm = subprocess.Popen([*afmd_command(), "rm", EMBED, "--url", server.url], env=env,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    try:
        assert rm.stdout is not None
        asked = ""
        while "[y/N]" not in asked:  # the question is written without a newline
            piece = rm.stdout.read(1)
            assert piece, asked
            asked += piece
        loaded = httpx.post(server.url + "/v1/embeddings", json={"model": EMBED, "input": "x"},
                            timeout=60)
        assert loaded.status_code == 200, loaded.text
        out, err = rm.communicate("y\n", timeout=60)
    finally:
        rm.kill()
    assert rm.returncode == 1, out + err
    assert f"{EMBED} is in use by the running server: model '{EMBED}' is loaded" in err
    assert folder.is_dir()
    unloaded = httpx.post(server.url + "/api/embed", json={"model": EMBED, "keep_alive": 0},
                          timeout=60)
    assert unloaded.status_code == 200, unloaded.text


# ---------------------------------------------------------------------------- show


def test_show_describes_a_model_without_loading_it(served: tuple[ServerProcess, str],
                                                   env: dict[str, str]) -> None:
    info = as_json(afmd(env, "show", REPO, "--json"))
    assert {"architecture", "context_length", "tool_format", "reasoning_format", "fim",
            "kind"} <= info.keys()
    assert info["architecture"] == "Qwen2ForCausalLM"
    assert info["context_length"] == 131072
    assert info["tool_format"] == "json_tools"  # mlx-lm's own detection
    assert info["reasoning_format"] == "<think>…</think>"
    assert info["fim"] == "qwen"  # afmd.service.fim's detection: Qwen's four FIM tokens
    assert info["kind"] == "chat"
    assert info["chat_template"] == "chatml"
    assert info["quantization"] == "fp32"
    assert info["parameters"] > 0 and info["repo"] == REPO

    assert afmd(env, "pull", EMBED).returncode == 0
    assert as_json(afmd(env, "show", EMBED, "--json"))["kind"] == "embedding"
    by_id = as_json(afmd(env, "show", "demo", "--json"))  # a configured id: the built-in
    assert by_id["id"] == "demo" and by_id["parameters"] == info["parameters"]

    table = afmd(env, "show", REPO)
    assert "tool format       json_tools" in table.stdout
    absent = afmd(env, "show", "test-org/not-pulled")
    assert absent.returncode == 1
    assert "test-org/not-pulled is not downloaded: `afmd pull test-org/not-pulled`" in \
        absent.stderr
    # A name longer than the OS takes was an OSError traceback (Path.is_dir raises for it).
    too_long = afmd(env, "show", "m" * 300)
    assert too_long.returncode == 1 and "Traceback" not in too_long.stderr
    assert "is neither a configured model, a model folder nor" in too_long.stderr


def test_show_of_a_missing_folder_or_no_name(env: dict[str, str], tmp_path: Path) -> None:
    """A configured folder that is not there was told to `afmd pull` its path, which is no
    repo; an empty name was read as the working directory ("." has no config.json)."""
    config = tmp_path / "folder.toml"
    config.write_text('[[models.model]]\nid = "gone"\npath = "/nonexistent/model"\n')
    gone = afmd(env, "show", "gone", "--config", str(config))
    assert gone.returncode == 1, gone.stderr
    assert "model 'gone': its folder /nonexistent/model does not exist" in gone.stderr
    assert "afmd pull" not in gone.stderr
    empty = afmd(env, "show", "")
    assert empty.returncode == 1 and "Traceback" not in empty.stderr
    assert "'' is neither a configured model, a model folder nor" in empty.stderr


def test_ollamas_names_are_the_models_they_name(env: dict[str, str], tmp_path: Path) -> None:
    """`hf.co/OWNER/NAME` and the `:latest` tag, as Ollama's users write names and as every
    route of the server takes them: `afmd pull` refused the tag, `show` and `rm` both
    forms, and `cache clear --model demo:latest` said demo was not a configured model."""
    own = {**env, "HF_HOME": str(tmp_path / "hf"), "AFMD_CACHE_DISK_DIR": str(tmp_path / "kv")}
    folder = tmp_path / "hf" / "hub" / "models--test-org--embed"
    pulled = afmd(own, "pull", f"hf.co/{EMBED}:latest")
    assert pulled.returncode == 0, pulled.stderr
    assert f"{EMBED} is ready" in pulled.stderr and folder.is_dir()
    for name in (f"hf.co/{EMBED}", f"{EMBED}:latest", f"HF.co/{EMBED}:latest"):
        assert as_json(afmd(own, "show", name, "--json"))["repo"] == EMBED, name
    assert as_json(afmd(own, "show", "demo:latest", "--json"))["id"] == "demo"
    cleared = afmd(own, "cache", "clear", "--model", "demo:latest", "--json")
    assert as_json(cleared)["model"] == "demo"
    gone = afmd(own, "rm", "--yes", f"hf.co/{EMBED}:latest")
    assert gone.returncode == 0 and f"deleted {EMBED}" in gone.stdout, gone.stderr
    assert not folder.exists()
    # Another tag names no MLX repo: told so, as a usage error.
    tagged = afmd(own, "rm", "--yes", f"{EMBED}:Q4_K_M")
    assert tagged.returncode == 2 and f"'{EMBED}:Q4_K_M' is not a Hugging Face repo id" in \
        tagged.stderr


def test_show_json_has_the_same_keys_for_every_model(env: dict[str, str]) -> None:
    """A tool reading `size_bytes` or `quantization` of each model `afmd list --json` names
    met a KeyError at Apple's model, whose object had keys of its own only."""
    ids = [m["id"] for m in as_json(afmd(env, "list", "--json"))["models"]]
    assert "system" in ids and "demo" in ids
    mlx = as_json(afmd(env, "show", "demo", "--json"))
    apple = as_json(afmd(env, "show", "system", "--json"))
    assert list(mlx) == ["id", "path", "repo", "architecture", "model_type", "parameters",
                         "quantization", "context_length", "kind", "chat_template",
                         "tool_format", "reasoning_format", "fim", "vocab_size", "size_bytes"]
    assert list(apple)[:len(mlx)] == list(mlx)
    assert apple["size_bytes"] is None and apple["repo"] is None
    assert apple["context_length"] and apple["availability"]


def test_parameters_and_quantization_from_weight_headers(tmp_path: Path) -> None:
    from afmd.engine.models.describe import count_parameters, quantization_of, safetensors_headers

    # A 4-bit matrix of 256 x 512 packs 8 values per uint32 (256 x 64), with one scale and
    # one bias per group of 64; the norm is an ordinary vector.
    (tmp_path / "model.safetensors").write_bytes(safetensors_bytes({
        "layer.weight": ("U32", [256, 64]), "layer.scales": ("F16", [256, 8]),
        "layer.biases": ("F16", [256, 8]), "norm.weight": ("F16", [512])}))
    tensors = safetensors_headers(tmp_path)
    config = {"quantization": {"group_size": 64, "bits": 4}}
    assert count_parameters(tensors, config["quantization"]) == 256 * 512 + 512
    assert quantization_of(config, tensors) == "4-bit (group 64)"
    eight = {"group_size": 64, "bits": 4, "layer": {"bits": 8, "group_size": 64}}
    assert count_parameters(tensors, eight) == 256 * 256 + 512  # a per-layer override


def test_ps_turns_instants_into_durations() -> None:
    from afmd.cli.model_commands import ps_row

    now = 1_000_000.0
    idle = ps_row("m", {"state": "loaded", "memory_bytes": 5, "active": 0, "queued": 0,
                        "idle_since": now - 12.34, "expires_at": now + 287.66,
                        "kv_cache": {"ram_bytes": 3, "disk_bytes": 4}}, now)
    assert idle == {"id": "m", "state": "loaded", "memory_bytes": 5, "active": 0,
                    "queued": 0, "idle_s": 12.3, "expires_in_s": 287.7,
                    "kv_cache": {"ram_bytes": 3, "disk_bytes": 4}}
    busy = ps_row("m", {"state": "loaded", "memory_bytes": 5, "active": 1, "queued": 2,
                        "idle_since": None, "expires_at": None}, now)
    assert (busy["idle_s"], busy["expires_in_s"]) == (0.0, None)
    loading = ps_row("m", {"state": "loading", "memory_bytes": None, "active": 0,
                           "queued": 1, "idle_since": None, "expires_at": None}, now)
    assert (loading["idle_s"], loading["queued"]) == (None, 1)
