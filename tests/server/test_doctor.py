"""``afmd doctor``: config location, endpoint, running server, port owner, model caches."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from afmd.cli import doctor, doctor_report, port_owners
from afmd.config.load import BREW_PREFIXES
from afmd.ports import free_ports

from conftest import ROOT, ServerProcess, start_server
from helpers.keyed import KEY, keyed_afmd
from helpers.servers import run_afmd

pytestmark = pytest.mark.slow  # CLI subprocesses and servers


def _env(**extra: str) -> dict[str, str]:
    """The test environment without afmd settings (the cache dir excepted)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFMD_")}
    if "AFMD_CACHE_DIR" in os.environ:
        env["AFMD_CACHE_DIR"] = os.environ["AFMD_CACHE_DIR"]
    env["HOMEBREW_PREFIX"] = "/nonexistent-afmd-test-prefix"
    env.update(extra)
    return env


def _doctor_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run_afmd(["doctor", *args], env=env, cwd=ROOT, timeout=60, stdin=subprocess.DEVNULL)


def _no_brew_config() -> bool:
    return not any((Path(p) / "etc" / "afmd" / "config.toml").is_file() for p in BREW_PREFIXES)


@pytest.fixture()
def plain_http() -> Iterator[int]:
    """An HTTP server that is not afmd (answers 404 to /health)."""
    httpd = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02},
                              daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


# ---------------------------------------------------------------------------- nothing running


@pytest.mark.skipif(not _no_brew_config(), reason="a Homebrew afmd config exists on this machine")
def test_nothing_running_free_port() -> None:
    port = free_ports()
    report = doctor.diagnose(env=_env(AFMD_SERVER_PORT=str(port)))
    assert report.config_path is None
    assert "built-in defaults" in report.config_source
    assert report.endpoint == f"http://127.0.0.1:{port}/v1"
    assert report.server["answering"] is False
    assert report.port == {"host": "127.0.0.1", "port": port, "in_use": False,
                           "owners": [], "found_with": ""}
    assert report.problems == [] and report.exit_code == 0
    ids = [m["id"] for m in report.models]
    assert ids == ["demo", "demo-32k", "demo-embedding", "demo-vision", "system"]
    assert report.models[0]["default"] is True and report.models[0]["kind"] == "built-in"


def test_cli_text_and_json(tmp_path: Path) -> None:
    port = free_ports()
    config = tmp_path / "afmd.toml"
    config.write_text(f'[server]\nport = {port}\n[models.aliases]\n"gpt-4o-mini" = "demo"\n')
    text = _doctor_cli("--config", str(config), env=_env())
    assert text.returncode == 0, text.stdout + text.stderr
    out = text.stdout
    assert f"config     {config}" in out and "from: --config" in out and "valid" in out
    assert f"endpoint   http://127.0.0.1:{port}/v1" in out
    assert f"port       127.0.0.1:{port} is free" in out
    assert "aliases: gpt-4o-mini" in out
    assert "no problems found" in out

    as_json = _doctor_cli("--config", str(config), "--json", env=_env())
    assert as_json.returncode == 0
    data = json.loads(as_json.stdout)
    assert data["config"] == {"path": str(config), "source": "--config", "error": None}
    assert data["exit_code"] == 0


def test_invalid_config_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[server]\nprot = 1\n")
    result = _doctor_cli("--config", str(config), env=_env())
    assert result.returncode == 2, result.stdout
    assert "INVALID: server.prot" in result.stdout
    assert "did you mean 'port'" in result.stdout
    # The rest of the report still comes, from the defaults.
    assert "endpoint   http://127.0.0.1:9999/v1" in result.stdout


def test_an_invalid_config_still_reads_the_environment(tmp_path: Path) -> None:
    """The rest of the report came from bare defaults: a server started with
    ``AFMD_SERVER_PORT`` was looked for on 9999 and reported as not running."""
    config = tmp_path / "bad.toml"
    config.write_text("[server]\nprot = 1\n")
    port = free_ports()
    report = doctor.diagnose(str(config), env=_env(AFMD_SERVER_PORT=str(port)))
    assert report.config_error is not None and "server.prot" in report.config_error
    assert report.endpoint == f"http://127.0.0.1:{port}/v1"
    assert report.port is not None and report.port["port"] == port
    # An environment that is itself invalid leaves the bare defaults.
    report = doctor.diagnose(str(config), env=_env(AFMD_SERVER_PORT="many"))
    assert report.endpoint == "http://127.0.0.1:9999/v1"


def test_doctor_stays_light() -> None:
    code = ("import contextlib, io, sys, afmd.cli.main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    afmd.cli.main.main(['doctor', '--timeout', '0.2'])\n"
            "print('mlx' in sys.modules, 'mlx_lm' in sys.modules, 'sanic' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, env=_env(), cwd=str(ROOT))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("False False False"), result.stdout


# ---------------------------------------------------------------------------- something running


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server of its own, started by exec as a user's is: the doctor reads the command
    line of the process that holds the port (a forked test server has its zygote's)."""
    proc = start_server(tmp_path_factory.mktemp("doctor"), fork=False)
    yield proc
    proc.stop()


def test_running_afmd_is_reported_with_its_pid(server: ServerProcess) -> None:
    report = doctor.diagnose(env=_env(AFMD_SERVER_PORT=str(server.port)))
    assert report.server["afmd"] is True
    assert report.server["http_status"] == 200
    assert report.server["health"]["status"] == "ok"
    assert report.port["in_use"] is True
    owners = report.port["owners"]
    assert [o["pid"] for o in owners] == [server.proc.pid], owners
    assert "afmd" in owners[0]["command"] and "serve" in owners[0]["command"]
    assert report.models[0]["server_status"] == "available"
    assert report.exit_code == 0, report.problems
    text = doctor_report.render(report)
    assert f"is in use by pid {server.proc.pid}" in text
    assert "server     running:" in text


def test_running_afmd_with_other_models_is_a_note(server: ServerProcess, tmp_path: Path) -> None:
    config = tmp_path / "other.toml"
    config.write_text(f'[server]\nport = {server.port}\n[[models.model]]\nid = "extra"\n'
                      f'path = "{tmp_path}"\n')
    (tmp_path / "config.json").write_text("{}")
    report = doctor.diagnose(str(config), env=_env())
    assert report.exit_code == 0
    assert any("started with other settings" in note for note in report.notes), report.notes


def test_a_keyed_server_seen_without_its_key(tmp_path: Path) -> None:
    """/health's status alone (a keyed server reached from another machine's side): the
    screen says so (not "active None"), and the problem says where doctor reads the key,
    or that the key it sent is not the server's."""
    with keyed_afmd(tmp_path) as (host, number):
        port = str(number)
        for key, says in (("", "AFMD_SERVER_API_KEY, else [server] api_key"),
                          ("not-it", "the API key this command sent is not the server's")):
            report = doctor.diagnose(env=_env(AFMD_SERVER_HOST=host, AFMD_SERVER_PORT=port,
                                              AFMD_SERVER_API_KEY=key))
            assert report.exit_code == 1
            assert any(says in p for p in report.problems), report.problems
            text = doctor_report.render(report)
            server_line = next(line for line in text.splitlines() if line.startswith("server"))
            assert "None" not in server_line, server_line
            assert "details only with its API key" in server_line, server_line
        report = doctor.diagnose(env=_env(AFMD_SERVER_HOST=host, AFMD_SERVER_PORT=port,
                                          AFMD_SERVER_API_KEY=KEY))
        assert report.exit_code == 0, report.problems


def test_a_keyed_server_reached_over_loopback_needs_its_key(tmp_path: Path) -> None:
    """/health answers a loopback client in full without the key, so a doctor whose config
    sets none said "(no API key needed)" and "no problems found" of a server that answers
    every API request without its key with 401: the endpoint it tells clients to use."""
    with keyed_afmd(tmp_path) as (_, number):
        port = str(number)
        for key, says in (("", "AFMD_SERVER_API_KEY, else [server] api_key"),
                          ("not-it", "the API key this command sent is not the server's")):
            env = _env(AFMD_SERVER_PORT=port, AFMD_SERVER_API_KEY=key)
            result = _doctor_cli("--json", env=env)
            assert result.returncode == 1, result.stderr
            report = json.loads(result.stdout)
            assert report["api_key_required"] is True
            assert any("refuses API requests without its API key" in p and says in p
                       for p in report["problems"]), report["problems"]
            text = _doctor_cli(env=env).stdout
            assert "(needs Authorization: Bearer <server.api_key>)" in text, text
        keyed = _doctor_cli("--json", env=_env(AFMD_SERVER_PORT=port, AFMD_SERVER_API_KEY=KEY))
        assert keyed.returncode == 0, keyed.stdout
        assert json.loads(keyed.stdout)["problems"] == []


def test_port_held_by_a_silent_listener(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        report = doctor.diagnose(env=_env(AFMD_SERVER_PORT=str(port)), timeout=0.3)
    assert report.server["answering"] is False
    assert report.port["in_use"] is True
    assert [o["pid"] for o in report.port["owners"]] == [os.getpid()]
    assert report.exit_code == 1
    assert any(f"port {port} is taken by pid {os.getpid()}" in p for p in report.problems)


def test_an_ipv6_address_is_written_in_brackets_beside_its_port() -> None:
    """``::1:18091`` reads as an address of its own: every host and port of the text and
    every address string of ``--json`` bracket an IPv6 host, as a URL does."""
    with socket.socket(socket.AF_INET6) as holder:
        holder.bind(("::1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        report = doctor.diagnose(env=_env(AFMD_SERVER_HOST="::1", AFMD_SERVER_PORT=str(port)),
                                 timeout=0.3)
    assert report.port["in_use"] is True
    text = doctor_report.render(report)
    assert f"port       [::1]:{port} is in use" in text, text
    assert f"::1:{port}" not in text.replace(f"[::1]:{port}", ""), text
    data = report.as_dict()
    assert data["endpoint"] == f"http://[::1]:{port}/v1"
    assert data["server"]["url"] == f"http://[::1]:{port}/health"
    assert f"::1:{port}" not in json.dumps(data).replace(f"[::1]:{port}", "")


def test_port_held_by_another_http_server(plain_http: int) -> None:
    report = doctor.diagnose(env=_env(AFMD_SERVER_PORT=str(plain_http)))
    assert report.server["answering"] is True and report.server["afmd"] is False
    assert report.exit_code == 1
    assert any("not afmd" in p for p in report.problems), report.problems


@pytest.mark.parametrize(("command", "afmd"), [
    ("/opt/homebrew/bin/afmd serve", True), ("afmd serve --port 9", True),
    ("/x/.venv/bin/python /x/.venv/bin/afmd serve", True), ("python3 -m afmd serve", True),
    ("python -m http.server 9999", False), ("ollama serve", False), ("", False),
    ("/usr/bin/python3 /srv/afmd-tools/proxy.py", False),
])
def test_an_afmd_is_told_by_its_command_line(command: str, afmd: bool) -> None:
    assert port_owners.is_afmd(command) is afmd


@pytest.mark.skipif(port_owners.find_lsof() is None, reason="lsof is not installed")
def test_lsof_finds_the_owner_too() -> None:
    """The macOS path (no /proc): lsof names the pid and the full command."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        owners = port_owners.lsof_owners(holder.getsockname()[1])
    assert [o["pid"] for o in owners] == [os.getpid()]
    assert "python" in owners[0]["command"].lower() or "pytest" in owners[0]["command"]


def test_unix_socket_server(tmp_path: Path) -> None:
    path = f"/tmp/afmd-doctor-{os.getpid()}.sock"
    config = f'[server]\nhost = ""\nunix_socket = "{path}"\n'
    proc = start_server(tmp_path, config=config, port=False, ready=False)
    try:
        config_file = next(tmp_path.glob("config-*.toml"))
        deadline = time.monotonic() + 60
        report = doctor.diagnose(str(config_file), env=_env())
        while report.server.get("http_status") != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
            report = doctor.diagnose(str(config_file), env=_env())
        assert report.endpoint is None and report.unix_socket == path
        assert report.server["afmd"] is True and report.server["http_status"] == 200
        assert report.port == {}
        assert report.exit_code == 0, report.problems
        assert "(no TCP listener)" in doctor_report.render(report)
    finally:
        assert proc.stop() == 0


# ---------------------------------------------------------------------------- models and paths


def test_model_cache_states(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf_home = tmp_path / "hf"
    snapshot = hf_home / "hub" / "models--org--cached" / "snapshots" / ("c" * 40)
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (snapshot / name).write_text("{}")
    # An interrupted download: a folder, but no config.json yet (afmd pull fetches it last).
    (hf_home / "hub" / "models--org--partial" / "snapshots" / ("d" * 40)).mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    cache = tmp_path / "afmd-cache"
    demo = cache / "models" / "demo-0123456789ab"
    demo.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (demo / name).write_text("{}")
    monkeypatch.setenv("AFMD_CACHE_DIR", str(cache))
    local = tmp_path / "local-model"
    local.mkdir()
    (local / "config.json").write_text("{}")
    config = tmp_path / "models.toml"
    config.write_text(
        f'[server]\nport = {free_ports()}\n'
        '[[models.model]]\nid = "cached"\npath = "org/cached"\n'
        '[[models.model]]\nid = "remote"\npath = "org/not-yet"\n'
        '[[models.model]]\nid = "partial"\npath = "org/partial"\n'
        f'[[models.model]]\nid = "here"\npath = "{local}"\n'
        f'[[models.model]]\nid = "gone"\npath = "{tmp_path / "missing"}"\n'
    )
    report = doctor.diagnose(str(config), env=_env())
    by_id = {m["id"]: m for m in report.models}
    assert by_id["cached"]["kind"] == "Hugging Face repo"
    assert by_id["cached"]["cache"].startswith("downloaded")
    assert by_id["remote"]["cache"].startswith("not downloaded yet")
    assert by_id["partial"]["cache"].startswith("partly downloaded")
    assert by_id["here"] == {**by_id["here"], "kind": "local folder", "cache": "present"}
    assert by_id["gone"]["missing"] is True
    assert by_id["demo"]["cache"] == f"built at {demo}"
    assert by_id["demo-32k"]["cache"].startswith("not built yet")
    assert report.exit_code == 1
    assert report.problems == [f"model 'gone': missing: {tmp_path / 'missing'}"]
    assert report.paths["cache"] == str(cache)
    assert report.paths["huggingface_cache"] == str(hf_home / "hub")


def test_homebrew_config_and_log_are_found(tmp_path: Path) -> None:
    prefix = tmp_path / "brew"
    (prefix / "etc" / "afmd").mkdir(parents=True)
    (prefix / "var" / "log").mkdir(parents=True)
    config = prefix / "etc" / "afmd" / "config.toml"
    config.write_text(f"[server]\nport = {free_ports()}\n")
    (prefix / "var" / "log" / "afmd.log").write_text("")
    report = doctor.diagnose(env=_env(HOMEBREW_PREFIX=str(prefix)))
    assert report.config_path == str(config)
    assert report.config_source == "Homebrew prefix"
    assert report.paths["log"] == str(prefix / "var" / "log" / "afmd.log")

    explicit = doctor.diagnose(env=_env(HOMEBREW_PREFIX=str(prefix), AFMD_CONFIG=str(config)))
    assert explicit.config_source == "$AFMD_CONFIG"
