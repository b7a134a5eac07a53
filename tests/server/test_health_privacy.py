"""``/health`` to a stranger on a keyed listener other machines reach: the status alone.

Without the key, on a non-loopback connection, the answer says whether the server is up
and nothing about the machine (model folders, pids, the hosts of a group). Loopback
connections, the Unix socket and requests that carry the key get the details, and so do
``afmd doctor`` and ``afmd ps``, which send the config's key.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from afmd.cli import doctor

from conftest import ROOT, ServerProcess, start_server
from helpers.servers import run_afmd

pytestmark = pytest.mark.slow  # servers and CLI subprocesses

KEY = "sk-health-test"


def _outside_address() -> str | None:
    """An address of this machine that is not loopback (where a route exists)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent: only a route chosen
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("health-keyed")
    proc = start_server(folder, config=f'[server]\nhost = "0.0.0.0"\napi_key = "{KEY}"\n')
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def outside(keyed: ServerProcess) -> str:
    address = _outside_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address to connect from")
    return f"http://{address}:{keyed.port}"


def _describes_machine(text: str, server: ServerProcess) -> bool:
    return str(server.proc.pid) in text or "/" in text or "model_details" in text


def test_a_stranger_gets_the_status_alone(keyed: ServerProcess, outside: str) -> None:
    plain = httpx.get(outside + "/health")
    assert plain.status_code == 200
    assert plain.json() == {"status": "ok"}
    # A GET with a body goes through Sanic rather than the connection's own answer.
    sanic = httpx.request("GET", outside + "/health", content=b"{}",
                          headers={"Content-Type": "application/json"})
    assert sanic.status_code == 200 and sanic.json() == {"status": "ok"}
    wrong = httpx.get(outside + "/health", headers={"Authorization": "Bearer nope"})
    assert wrong.json() == {"status": "ok"}
    assert not _describes_machine(plain.text, keyed)


@pytest.mark.parametrize("headers", [{"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}],
                         ids=["bearer", "x-api-key"])
def test_the_key_shows_the_details(keyed: ServerProcess, outside: str,
                                   headers: dict[str, str]) -> None:
    for content in (None, b"{}"):
        body = httpx.request("GET", outside + "/health", headers={
            **headers, "Content-Type": "application/json"}, content=content).json()
        assert body["status"] == "ok" and "models" in body and "model_details" in body


def test_loopback_shows_the_details(keyed: ServerProcess) -> None:
    body = httpx.get(f"http://127.0.0.1:{keyed.port}/health").json()
    assert "model_details" in body and "models" in body


def _cli(*args: str, config: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFMD_")}
    env["HOMEBREW_PREFIX"] = "/nonexistent-afmd-test-prefix"
    return run_afmd([*args, "--config", str(config)], env=env, cwd=ROOT, timeout=60,
                    stdin=subprocess.DEVNULL)


def test_doctor_and_ps_send_the_key(keyed: ServerProcess, outside: str,
                                    tmp_path: Path) -> None:
    host = outside.split("//", 1)[1].rsplit(":", 1)[0]
    with_key = tmp_path / "with.toml"
    with_key.write_text(f'[server]\nhost = "{host}"\nport = {keyed.port}\n'
                        f'api_key = "{KEY}"\n')
    report = doctor.diagnose(config_flag=str(with_key), env={})
    assert report.server["afmd"] is True and not report.server.get("limited")
    assert "model_details" in report.server["health"]
    ps = _cli("ps", "--json", config=with_key)
    assert ps.returncode == 0, ps.stderr
    without = tmp_path / "without.toml"
    without.write_text(f'[server]\nhost = "{host}"\nport = {keyed.port}\n')
    limited = doctor.diagnose(config_flag=str(without), env={})
    assert limited.server["afmd"] is True and limited.server["limited"] is True
    assert any("API key" in p for p in limited.problems), limited.problems
    refused = _cli("ps", config=without)
    assert refused.returncode == 1 and "API key" in refused.stderr, refused.stderr
