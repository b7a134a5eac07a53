"""The ``afmd`` command: help, version, config errors and exit codes, signals, bind failures."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import afmd

from conftest import ROOT, afmd_command, start_server
from helpers.servers import run_afmd

pytestmark = pytest.mark.slow  # a CLI subprocess per test, servers stopped by signals

SERVE_FLAGS = ("--config", "--host", "--port", "--unix-socket", "--model")


def _env() -> dict[str, str]:
    """The caller's environment minus afmd settings, so a developer's shell cannot leak in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFMD_")}
    if "AFMD_CACHE_DIR" in os.environ:
        env["AFMD_CACHE_DIR"] = os.environ["AFMD_CACHE_DIR"]
    # No Homebrew prefix with an etc/afmd/config.toml can be picked up either.
    env["HOMEBREW_PREFIX"] = "/nonexistent-afmd-test-prefix"
    return env


def afmd_run(*args: str, cwd: Path = ROOT, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return run_afmd(args, env=_env(), cwd=cwd, timeout=timeout, stdin=subprocess.DEVNULL)


# ---------------------------------------------------------------------------- help, version


def test_help() -> None:
    result = afmd_run("--help")
    assert result.returncode == 0, result.stderr
    for word in ("serve", "check-config", "version", "exit codes"):
        assert word in result.stdout
    assert result.stderr == ""


def test_serve_help_lists_every_flag() -> None:
    result = afmd_run("serve", "--help")
    assert result.returncode == 0, result.stderr
    for flag in (*SERVE_FLAGS, "--log-level", "--log-format"):
        assert flag in result.stdout, flag


def test_check_config_help() -> None:
    result = afmd_run("check-config", "--help")
    assert result.returncode == 0
    assert "FILE" in result.stdout


def test_version() -> None:
    result = afmd_run("version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"afmd {afmd.__version__}"
    flag = afmd_run("--version")
    assert flag.returncode == 0
    assert flag.stdout.strip() == f"afmd {afmd.__version__}"


def test_no_command_is_a_usage_error() -> None:
    """Exit 2 with the help on stderr, as argparse answers any usage error: docker and
    ollama print their help to stderr too, git exits non-zero."""
    result = afmd_run()
    assert result.returncode == 2
    assert "serve" in result.stderr and "exit codes" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    "args",
    [("frobnicate",), ("serve", "--bogus"), ("serve", "--port", "abc"),
     ("serve", "--log-level", "loud"), ("check-config",),
     # A wait the socket layer cannot take (and 0, which reads a live server as absent).
     *[(verb, "--timeout", t) for verb in ("ps", "list", "doctor")
       for t in ("-1", "0", "nan", "inf", "1e308", "soon")]],
)
def test_usage_errors_exit_2(args: tuple[str, ...]) -> None:
    result = afmd_run(*args)
    assert result.returncode == 2, result
    assert "usage:" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("n", "port"), [("2", "70000"), ("2", "65535"), ("1", "0")])
def test_launch_refuses_a_ring_port_that_does_not_exist(n: str, port: str) -> None:
    result = afmd_run("launch", "-n", n, "--starting-port", port, "--", "serve")
    assert result.returncode == 2, result
    assert "--starting-port must be between 1 and" in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        ("['version']", "afmd "),
        ("['--help']", "usage: afmd"),
        ("['serve', '--help']", "--unix-socket"),
        ("['check-config', 'config.example.toml']", "OK"),
    ],
)
def test_light_commands_do_not_import_the_heavy_stack(argv: str, expect: str) -> None:
    code = (
        "import contextlib, sys, afmd.cli.main\n"
        "with contextlib.suppress(SystemExit):\n"
        f"    afmd.cli.main.main({argv})\n"
        "print('mlx' in sys.modules, 'mlx_lm' in sys.modules, 'sanic' in sys.modules,"
        " 'structlog' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env=_env(), cwd=str(ROOT),
    )
    assert result.returncode == 0, result.stderr
    assert expect in result.stdout
    assert result.stdout.rstrip().splitlines()[-1] == "False False False False", result.stdout


def test_version_does_not_import_mlx_or_sanic() -> None:
    code = ("import sys, afmd.cli.main; afmd.cli.main.main(['version']); "
            "print('mlx' in sys.modules, 'sanic' in sys.modules)")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env=_env(), cwd=str(ROOT),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith("False False"), result.stdout


# ---------------------------------------------------------------------------- output


def _written_to(stdout: int, *args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**_env(), "HF_HOME": str(tmp_path / "hf"), "AFMD_SERVER_PORT": "1"}
    return subprocess.run([*afmd_command(), *args], stdout=stdout, stderr=subprocess.PIPE,
                          stdin=subprocess.DEVNULL, text=True, env=env, cwd=ROOT, timeout=60)


REPORTING = [("version",), ("check-config", str(ROOT / "config.example.toml")), ("list",),
             ("show", "system"), ("doctor", "--json")]


@pytest.mark.parametrize("args", REPORTING, ids=lambda a: a[0])
def test_output_to_a_closed_pipe_is_no_failure(args: tuple[str, ...], tmp_path: Path) -> None:
    """`afmd version | head -c0`: the reader took what it wanted, as `ls | head` has it.
    `version` and `check-config` ended in a BrokenPipeError traceback, exit 1."""
    read, write = os.pipe()
    os.close(read)
    try:
        result = _written_to(write, *args, tmp_path=tmp_path)
    finally:
        os.close(write)
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr, result.stderr
    assert result.returncode in (0, 1) if args[0] == "doctor" else result.returncode == 0


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full (Linux only)")
@pytest.mark.parametrize("args", REPORTING, ids=lambda a: a[0])
def test_output_to_a_full_disk_is_one_line_and_exit_1(args: tuple[str, ...],
                                                      tmp_path: Path) -> None:
    """`afmd list > /Volumes/full/models.txt` printed a traceback of the `print` that met
    ENOSPC (and exit code 1 for whatever reason): the user is told the output was lost."""
    with open("/dev/full", "w") as full:
        result = _written_to(full.fileno(), *args, tmp_path=tmp_path)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == (f"afmd {args[0]}: cannot write the output: No space "
                                     "left on device"), result.stderr


# ---------------------------------------------------------------------------- check-config


def test_check_config_example() -> None:
    result = afmd_run("check-config", "config.example.toml")
    assert result.returncode == 0, result.stderr
    assert "config.example.toml: OK" in result.stdout
    assert "demo" in result.stdout


def test_check_config_minimal(tmp_path: Path) -> None:
    path = tmp_path / "ok.toml"
    path.write_text('[server]\nport = 8080\n[models.aliases]\nsmall = "demo"\n')
    result = afmd_run("check-config", str(path))
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout


BAD_CONFIGS = [
    pytest.param("[server]\nprot = 1\n", ("server.prot", "port"), id="unknown-key"),
    pytest.param('[server]\nport = "abc"\n', ("server.port", "integer"), id="wrong-type"),
    pytest.param("[server]\nport = true\n", ("server.port", "integer"), id="bool-not-int"),
    pytest.param("[server\nport = 1\n", ("invalid TOML",), id="toml-syntax"),
    pytest.param("[server]\nport = 1\nport = 2\n", ("invalid TOML",), id="duplicate-key"),
    pytest.param("[sever]\nport = 1\n", ("sever", "server"), id="unknown-section"),
    pytest.param("[server]\nport = 70000\n", ("server.port", "65535"), id="out-of-range"),
    pytest.param('[log]\nlevel = "loud"\n', ("log.level",), id="bad-choice"),
    pytest.param('[models]\ndefault = "nope"\n', ("models.default", "nope"), id="bad-default"),
    pytest.param("[log]\naccess_log = 1\n", ("log.access_log", "boolean"), id="int-not-bool"),
    pytest.param('[server]\nhost = "http://127.0.0.1"\n', ("server.host", "not a URL"),
                 id="host-is-a-url"),
]


@pytest.mark.parametrize(("text", "needles"), BAD_CONFIGS)
def test_serve_with_bad_config_exits_2(
    tmp_path: Path, text: str, needles: tuple[str, ...]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    started = time.monotonic()
    # No --port flag: it would override (and so excuse) a bad port in the file.
    result = afmd_run("serve", "--config", str(path), timeout=20)
    elapsed = time.monotonic() - started
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert elapsed < 10, elapsed  # rejected before anything heavy is loaded
    assert result.stderr.startswith("afmd: configuration error: "), result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_unknown_key_suggests_the_right_one(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[server]\nprot = 1\n")
    result = afmd_run("serve", "--config", str(path))
    assert result.returncode == 2
    assert "server.prot" in result.stderr
    assert "did you mean 'port'?" in result.stderr


@pytest.mark.parametrize(("text", "needles"), BAD_CONFIGS)
def test_check_config_bad_file_exits_2(
    tmp_path: Path, text: str, needles: tuple[str, ...]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    result = afmd_run("check-config", str(path))
    assert result.returncode == 2, result
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)
    assert "Traceback" not in result.stderr
    assert "OK" not in result.stdout


def test_check_config_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    result = afmd_run("check-config", str(missing))
    assert result.returncode == 2
    assert str(missing) in result.stderr and "not found" in result.stderr


def test_serve_missing_config_file(tmp_path: Path) -> None:
    result = afmd_run("serve", "--config", str(tmp_path / "missing.toml"))
    assert result.returncode == 2
    assert "not found" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_bad_flag_value_is_a_config_error() -> None:
    result = afmd_run("serve", "--port", "70000")
    assert result.returncode == 2
    assert "server.port" in result.stderr
    assert "command line" in result.stderr  # says where the bad value came from


def test_serve_bad_env_value_is_a_config_error() -> None:
    env = {**_env(), "AFMD_SERVER_PORT": "eighty"}
    result = subprocess.run(
        [*afmd_command(), "serve"], capture_output=True, text=True, timeout=30, env=env,
        cwd=str(ROOT), stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2
    assert "AFMD_SERVER_PORT" in result.stderr
    assert "Traceback" not in result.stderr


def test_afmd_config_env_is_read(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[server]\nprot = 1\n")
    env = {**_env(), "AFMD_CONFIG": str(path)}
    result = subprocess.run(
        [*afmd_command(), "serve"], capture_output=True, text=True, timeout=30, env=env,
        cwd=str(ROOT), stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2
    assert "server.prot" in result.stderr


# ---------------------------------------------------------------------------- signals, binding


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_stops_cleanly(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGHUP too: an ``afmd serve`` in a terminal that closes drains as on SIGTERM (the
    default action killed it: no drain, no ``stopped`` line, its socket file left)."""
    server = start_server(tmp_path)
    code = server.stop(sig, timeout=30)
    assert code == 0, server.log_text()[-4000:]
    server.wait_event("stopping", timeout=5, reason=sig.name)
    server.wait_event("stopped", timeout=5, exit_code=0)
    assert "Traceback" not in server.log_text()


def test_sigterm_stops_even_when_the_log_reader_is_gone(tmp_path: Path) -> None:
    """A closed stderr pipe (the log collector died) must not break shutdown."""
    proc = subprocess.Popen(
        [*afmd_command(), "serve", "--log-format", "json", "--port", "0"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env=_env(), cwd=str(tmp_path),
    )
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        while b"model ready" not in proc.stderr.readline():
            assert time.monotonic() < deadline and proc.poll() is None
        proc.stderr.close()
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0


def test_unix_socket_removed_on_stop(tmp_path: Path) -> None:
    sock = tmp_path / "afmd.sock"
    server = start_server(tmp_path, args=["--unix-socket", str(sock)])
    assert sock.exists()
    assert oct(sock.stat().st_mode & 0o777) == oct(0o600)
    code = server.stop()
    assert code == 0, server.log_text()[-4000:]
    assert not sock.exists()


def test_port_in_use_exits_1(tmp_path: Path) -> None:
    """The holder is named: another afmd (started by exec, so that its command line is
    afmd's, not a test zygote's)."""
    first = start_server(tmp_path, ready=False, fork=False)
    try:
        started = time.monotonic()
        result = subprocess.run(
            [*afmd_command(), "serve", "--log-format", "json", "--port", str(first.port)],
            capture_output=True, text=True, timeout=60, env=_env(), cwd=str(tmp_path),
            stdin=subprocess.DEVNULL,
        )
        elapsed = time.monotonic() - started
    finally:
        first.stop()
    assert result.returncode == 1, result.stderr
    assert elapsed < 30
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    failures = [e for e in events if e.get("event") == "startup failed"]
    assert len(failures) == 1, result.stderr
    error = failures[0]["error"]
    assert str(first.port) in error
    assert f"already in use by another afmd, pid {first.proc.pid} (" in error, error
    assert "is another afmd running?" not in error
    assert failures[0]["level"] == "error"
    assert "Traceback" not in result.stderr
    assert not any(e.get("event") == "listening" for e in events)
    # The log's last word on the run agrees with the exit code launchd sees.
    stopped = [e for e in events if e.get("event") == "stopped"]
    assert all(e["exit_code"] == 1 for e in stopped), result.stderr


def _startup_error(result: subprocess.CompletedProcess[str]) -> str:
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    failures = [e for e in events if e.get("event") == "startup failed"]
    assert len(failures) == 1, result.stderr
    error: str = failures[0]["error"]
    return error


def test_an_ipv6_bind_error_brackets_the_address(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET6) as holder:
        holder.bind(("::1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        result = afmd_run("serve", "--log-format", "json", "--host", "::1", "--port", str(port),
                          cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    error = _startup_error(result)
    assert f"cannot listen on [::1]:{port}: the port is already in use" in error, error
    # The holder is this test's process, not an afmd: named, and no afmd is asked about.
    assert f"in use by pid {os.getpid()} (" in error, error
    assert "afmd running" not in error and "another afmd" not in error, error


def test_unix_socket_path_taken_by_a_file_exits_1(tmp_path: Path) -> None:
    path = tmp_path / "not-a-socket"
    path.write_text("keep me")
    result = afmd_run("serve", "--log-format", "json", "--host", "", "--unix-socket", str(path),
                      cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "startup failed" in result.stderr
    assert "not a socket" in result.stderr
    assert path.read_text() == "keep me"
