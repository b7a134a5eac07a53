"""Apple's model where Apple's framework does not exist: this Linux machine, as it is.

No stand-in here: ``import apple_fm_sdk`` fails as on Linux, Intel Macs and macOS before
26, and ``system`` is ``unavailable: device_not_eligible`` everywhere it shows: /health
(503 with the reason when it is the default), /v1/models (listed all the same), requests
(503 ``model_unavailable`` with ``Retry-After`` and the reason, in every dialect),
``afmd show`` and ``afmd doctor``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from afmd.engine.apple import framework

from conftest import ServerProcess, start_server


def test_the_framework_is_not_here() -> None:
    assert framework.sdk() is None
    found = framework.availability()
    assert found.reason == "device_not_eligible"
    assert found.status == "unavailable: device_not_eligible"
    assert "does not exist on linux" in found.detail


@pytest.fixture(scope="module")
def system_default(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("system"), args=["--model", "system"],
                          ready=False)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def demo_default(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("demo"),
                          config='[models.aliases]\n"gpt-4o-mini" = "system"\n')
    yield server
    server.stop()


def test_health_is_503_with_the_reason_when_system_is_the_default(
        system_default: ServerProcess) -> None:
    health = httpx.get(system_default.url + "/health")
    assert health.status_code == 503
    body = health.json()
    assert (body["status"], body["reason"]) == ("unavailable", "device_not_eligible")
    assert body["models"]["system"] == "unavailable: device_not_eligible"
    assert body["model_details"]["system"]["state"] == "unavailable: device_not_eligible"
    assert body["models"]["demo"] == "available"  # the others still serve
    log = system_default.log_text()
    assert "model unavailable" in log
    assert "random weights" not in log  # the demo models' warning: this one is real


def test_requests_are_503_model_unavailable_in_every_dialect(
        system_default: ServerProcess) -> None:
    url = system_default.url
    chat = httpx.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}]})  # the default model
    assert chat.status_code == 503
    assert chat.headers["retry-after"] == "2"
    error = chat.json()["error"]
    assert (error["code"], error["param"]) == ("model_unavailable", "model")
    assert "device_not_eligible" in error["message"]
    responses = httpx.post(url + "/v1/responses", json={"model": "system", "input": "hi"})
    assert responses.status_code == 503
    assert responses.json()["error"]["code"] == "model_unavailable"
    messages = httpx.post(url + "/v1/messages", json={
        "model": "system", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
    assert messages.status_code == 529  # Anthropic's overloaded_error, as afmd's every 503
    assert "device_not_eligible" in messages.json()["error"]["message"]
    # Another model still answers.
    demo = httpx.post(url + "/v1/chat/completions", json={
        "model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert demo.status_code == 200


def test_models_lists_system_and_health_stays_200_when_it_is_not_the_default(
        demo_default: ServerProcess) -> None:
    models = httpx.get(demo_default.url + "/v1/models").json()["data"]
    listed = {m["id"]: m for m in models}
    assert listed["system"]["kind"] == "chat"
    assert listed["gpt-4o-mini"]["parent"] == "system"
    health = httpx.get(demo_default.url + "/health")
    assert health.status_code == 200
    assert health.json()["models"]["system"] == "unavailable: device_not_eligible"
    aliased = httpx.post(demo_default.url + "/v1/chat/completions", json={
        "model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]})
    assert aliased.status_code == 503
    assert aliased.json()["error"]["code"] == "model_unavailable"


def test_the_dashboard_shows_it_and_cannot_load_it(demo_default: ServerProcess) -> None:
    models = httpx.get(demo_default.url + "/ui/api/models").json()["models"]
    (row,) = [m for m in models if m["id"] == "system"]
    assert (row["state"], row["reason"]) == ("unavailable", "device_not_eligible")
    load = httpx.post(demo_default.url + "/ui/api/load", json={"model": "system"})
    assert load.status_code == 503 and load.json()["error"]["code"] == "model_unavailable"


def _afmd(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "afmd", *args], capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(home)})


def test_show_and_list_describe_it_here(tmp_path: Path) -> None:
    run = _afmd("show", "system", home=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "availability      unavailable: device_not_eligible" in run.stdout
    assert "context length    4096" in run.stdout
    info = json.loads(_afmd("show", "system", "--json", home=tmp_path).stdout)
    assert info["availability"] == "unavailable: device_not_eligible"
    listed = _afmd("list", "--url", "http://127.0.0.1:1", home=tmp_path)
    (row,) = [line.split() for line in listed.stdout.splitlines() if line.startswith("system")]
    assert row[1:4] == ["on-device", "-", "4096"]


def test_doctor_describes_it_and_a_problem_only_as_the_default(tmp_path: Path) -> None:
    config = tmp_path / "afmd.toml"
    config.write_text('[server]\nport = 1\n')
    report = json.loads(_afmd("doctor", "--json", "--config", str(config), home=tmp_path).stdout)
    (system,) = [m for m in report["models"] if m["id"] == "system"]
    assert system["kind"] == "Apple on-device model"
    assert system["cache"].startswith("unavailable: device_not_eligible")
    assert not any("system" in p for p in report["problems"])
    config.write_text('[server]\nport = 1\n[models]\ndefault = "system"\n')
    report = json.loads(_afmd("doctor", "--json", "--config", str(config), home=tmp_path).stdout)
    assert any("'system'" in p and "device_not_eligible" in p for p in report["problems"])
