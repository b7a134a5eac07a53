"""The test servers forked from a warm interpreter (tests/helpers/zygote.py) are what a
fresh ``afmd serve`` is, where the tests look: a process of its own with its exit code and
log, and a plain start wherever the environment would differ at
import time."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, afmd_command, start_server
from helpers import zygote

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the zygote is Linux only")


def _env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != "AFMD_CONFIG"}, **extra}


def test_a_forked_server_is_a_process_of_its_own(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    assert isinstance(server.proc, zygote.ForkedServer)
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    parent = int(next(line for line in status.splitlines()
                      if line.startswith("PPid:")).split()[1])
    assert parent not in (os.getpid(), server.proc.pid)  # the zygote's child
    assert server.stop(signal.SIGTERM) == 0
    assert server.proc.returncode == 0
    assert [e["addresses"] for e in server.events if e.get("event") == "listening"] == [
        [server.url]]


def test_exit_codes_and_stderr_are_the_childs(tmp_path: Path) -> None:
    proc = zygote.spawn(["serve", "--config", str(tmp_path / "missing.toml"), "--port", "0"],
                        _env(), str(tmp_path))
    assert proc is not None
    assert proc.wait(60) == 2
    assert "missing.toml" in proc.stderr.read()
    killed = zygote.spawn(["serve", "--port", "0"], _env(), str(tmp_path))
    assert killed is not None
    killed.kill()
    assert killed.wait(30) == -signal.SIGKILL


def test_an_environment_read_at_import_starts_plainly(tmp_path: Path) -> None:
    assert zygote.spawn(["serve"], _env(HF_HOME=str(tmp_path)), str(tmp_path)) is None
    assert zygote.spawn(["serve"], _env(TRANSFORMERS_VERBOSITY="info"), str(tmp_path)) is None
    server = start_server(tmp_path, env={"HF_HOME": str(tmp_path / "hf")})
    try:
        assert not isinstance(server.proc, zygote.ForkedServer)
    finally:
        server.stop()
    server = start_server(tmp_path, env={"AFMD_LOG_LEVEL": "debug"})  # read when it runs
    try:
        assert isinstance(server.proc, zygote.ForkedServer)
    finally:
        server.stop()



@pytest.mark.parametrize(("args", "input"), [
    (["version"], None), (["--bogus"], None), (["list", "--json"], None),
    (["check-config", "config.example.toml"], None), (["check-config", "missing.toml"], None),
    (["rm", "test-org/not-pulled"], "n\n"),
])
def test_a_forked_cli_command_is_a_fresh_one(args: list[str], input: str | None) -> None:
    """Exit code, stdout and stderr (stdin piped) as ``python -m afmd`` gives them."""
    env = _env(HF_HOME="/nonexistent-hf-home", HOMEBREW_PREFIX="/nonexistent-prefix")
    forked = zygote.run(args, env=env, cwd=str(ROOT), timeout=60, input=input)
    assert forked is not None
    fresh = subprocess.run([*afmd_command(), *args], capture_output=True, text=True,
                           timeout=60, env=env, cwd=str(ROOT), input=input)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode, fresh.stdout, fresh.stderr)


def test_cli_zygotes_follow_what_is_read_at_import(tmp_path: Path) -> None:
    """One zygote per environment as read at import; HF_* and AFMD_* are read later."""
    env = _env(PYTHONPATH=str(ROOT))
    zygote.run(["version"], env=env, cwd=str(tmp_path), timeout=60)
    count = len(zygote._CLI_ZYGOTES)
    for extra in ({"HF_HOME": str(tmp_path)}, {"AFMD_LOG_LEVEL": "debug"}):
        done = zygote.run(["version"], env={**env, **extra}, cwd=str(tmp_path), timeout=60)
        assert done is not None and done.returncode == 0
    assert len(zygote._CLI_ZYGOTES) == count
    zygote.run(["version"], env={**env, "PYTHONWARNINGS": "error"}, cwd=str(tmp_path),
               timeout=60)
    assert len(zygote._CLI_ZYGOTES) == count + 1


def test_a_cli_child_past_its_timeout_is_killed() -> None:
    """As subprocess.run does: TimeoutExpired, the child killed (its pipes closed)."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            zygote.run(["ps", "--url", url, "--timeout", "30"], env=_env(), cwd=str(ROOT),
                       timeout=1)
        assert time.monotonic() - started < 20
