"""The frozen ``afmd`` (build/build.py + build/afmd.spec), built once per test session and put
through the same end-to-end checks as the source tree (tests/helpers/smoke.py).

It runs in the normal ``pytest`` run (marked slow). The build takes about 1–3 minutes on a
2-core machine; it starts in the background during collection and the tests that need it
run last, so it overlaps the rest of the suite (tests/helpers/frozen.py).
``AFMD_SKIP_FROZEN=1`` skips it locally, but never where ``CI=true``. ``AFMD_FROZEN_BINARY``
points the checks at an already built executable instead of building one (the macOS
release workflow runs them on the signed build that way).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import ModuleType

import httpx
import pytest

import afmd

from conftest import ROOT
from helpers.frozen import BUILD_TIMEOUT_S, BackgroundBuild, FrozenBuild, build_skipped
from helpers.session import run_dir
from helpers.smoke import process_tree, run_smoke_checks, start_command, vm_rss_kib, wait_healthy

needs_build = pytest.mark.skipif(build_skipped(), reason="AFMD_SKIP_FROZEN=1 (outside CI)")


def _load_build_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("afmd_build_script", ROOT / "build" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_script = _load_build_script()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFMD_")}
    env["HOMEBREW_PREFIX"] = "/nonexistent-afmd-test-prefix"
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def frozen() -> FrozenBuild:
    prebuilt = os.environ.get("AFMD_FROZEN_BINARY")
    if prebuilt:
        path = Path(prebuilt).resolve()
        assert path.is_file(), f"AFMD_FROZEN_BINARY={prebuilt} is not a file"
        return FrozenBuild(path, None, 0.0)
    # Started in the background during collection (tests/conftest.py); start() only
    # starts it where that did not (AFMD_SKIP_FROZEN=1, and a test asks for it all the same).
    build = BackgroundBuild(run_dir() / "frozen")
    build.start()
    result = build.result()
    assert result.summary is not None
    print(f"\nfrozen build: {result.wall_s:.0f} s, "
          f"{result.summary['artifact_bytes'] / 1e6:.1f} MB tarball, "
          f"{result.summary['installed_bytes'] / 1e6:.1f} MB unpacked")
    return result


def _run(frozen: FrozenBuild, *args: str, cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 60) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    result = subprocess.run(
        [str(frozen.executable), *args], capture_output=True, text=True, timeout=timeout,
        cwd=str(cwd), env=_env() if env is None else env, stdin=subprocess.DEVNULL,
    )
    return result, time.monotonic() - started


# ---------------------------------------------------------------------------- the artifact


@pytest.mark.slow
@needs_build
@pytest.mark.timeout(BUILD_TIMEOUT_S + 60)
def test_artifact_is_named_and_checksummed(frozen: FrozenBuild) -> None:
    if frozen.summary is None:
        pytest.skip("prebuilt binary given (AFMD_FROZEN_BINARY)")
    summary = frozen.summary
    os_name, arch = build_script.platform_tag()
    name = f"afmd-{afmd.__version__}-{os_name}-{arch}"
    tarball = Path(summary["artifact"])
    assert summary["name"] == name and tarball.name == f"{name}.tar.gz"
    sidecar = tarball.with_name(tarball.name + ".sha256")
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    assert sidecar.read_text() == f"{digest}  {tarball.name}\n"
    assert summary["sha256"] == digest
    with tarfile.open(tarball) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert {n.split("/", 1)[0] for n in members} == {name}
    exe = members[f"{name}/afmd"]
    assert exe.isfile() and exe.mode & 0o111
    assert f"{name}/config.example.toml" in members
    assert any(n.startswith(f"{name}/_internal/") for n in members)
    # The unpacked copy next to it is what the checks below run.
    assert frozen.executable == tarball.parent / name / "afmd"


@pytest.mark.slow
@needs_build
@pytest.mark.timeout(BUILD_TIMEOUT_S + 60)
def test_light_commands(frozen: FrozenBuild, tmp_path: Path) -> None:
    version, version_s = _run(frozen, "version", cwd=tmp_path)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"afmd {afmd.__version__}"
    print(f"\nfrozen `afmd version`: {version_s:.2f} s")
    # Launch cost is what onedir buys: no unpacking of the payload on every start.
    assert version_s < 3.0, f"`afmd version` took {version_s:.1f} s"

    helped, _ = _run(frozen, "--help", cwd=tmp_path)
    assert helped.returncode == 0
    for word in ("serve", "check-config", "doctor", "exit codes"):
        assert word in helped.stdout

    checked, _ = _run(frozen, "check-config", str(ROOT / "config.example.toml"), cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert "OK" in checked.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nport = 'x'\n")
    refused, _ = _run(frozen, "check-config", str(bad), cwd=tmp_path)
    assert refused.returncode == 2
    assert "server.port" in refused.stderr and "Traceback" not in refused.stderr
    assert list(tmp_path.iterdir()) == [bad]


# ---------------------------------------------------------------------------- serving


def _grammar_checks(url: str) -> None:
    """A grammar through the compile worker, which the frozen binary runs as itself (it
    has no ``-c``): a schema answered, and the schema llguidance dies on refused with the
    server alive."""
    hi = [{"role": "user", "content": "hi"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    shaped = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": hi, "max_tokens": 20, "temperature": 0, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert shaped.status_code == 200, shaped.text
    assert set(json.loads(shaped.json()["choices"][0]["message"]["content"])) == {"a"}
    refused = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": hi, "max_tokens": 8, "response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "schema": {"enum": [-(2**63)]}}}})
    assert refused.status_code == 400, refused.text
    assert httpx.get(url + "/health", timeout=30).status_code == 200


@pytest.mark.slow
@needs_build
@pytest.mark.timeout(BUILD_TIMEOUT_S + 180)
def test_frozen_server_end_to_end(frozen: FrozenBuild, tmp_path: Path) -> None:
    """Cold start on a fresh cache, the shared smoke checks, doctor, SIGTERM → exit 0,
    and nothing written to the working directory."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    cache = tmp_path / "cache"
    env = _env(AFMD_CACHE_DIR=str(cache))
    started = time.monotonic()
    server = start_command(
        [str(frozen.executable), "serve", "--port", "0", "--log-format", "json"],
        cwd=cwd, env=env,
    )
    try:
        healthy_at = wait_healthy(server.url, server.proc)
        cold_start_s = healthy_at - started
        time.sleep(1.0)
        pids = process_tree(server.proc.pid) if Path("/proc").is_dir() else []
        idle_rss = {pid: vm_rss_kib(pid) for pid in pids}

        run_smoke_checks(server.url)
        _grammar_checks(server.url)

        report, _ = _run(frozen, "doctor", "--json", cwd=cwd,
                         env=_env(AFMD_SERVER_PORT=str(server.port), AFMD_CACHE_DIR=str(cache)))
        assert report.returncode == 0, report.stdout + report.stderr
        data = json.loads(report.stdout)
        assert data["frozen"] is True
        assert data["server"]["afmd"] is True and data["server"]["http_status"] == 200
        if pids:
            assert [o["pid"] for o in data["port"]["owners"]] == [pids[-1]], data["port"]
        assert data["models"][0]["cache"].startswith("built at " + str(cache))
    finally:
        code = server.stop(signal.SIGTERM)
    assert code == 0, server.log_text()[-3000:]
    stopped = server.wait_event("stopped", timeout=5)
    assert stopped["exit_code"] == 0
    assert list(cwd.iterdir()) == [], "the binary wrote into its working directory"
    assert re.search(r'"event": ?"listening"', server.log_text())

    rss = ", ".join(f"pid {pid}: {kib / 1024:.0f} MiB" for pid, kib in idle_rss.items())
    print(f"\nfrozen cold start to /health 200: {cold_start_s:.2f} s (fresh demo cache); "
          f"idle VmRSS {rss}")
    assert cold_start_s < 60


@pytest.mark.slow
@needs_build
@pytest.mark.timeout(BUILD_TIMEOUT_S + 240)
def test_frozen_launch_serves_over_two_ranks(frozen: FrozenBuild, tmp_path: Path) -> None:
    """`afmd launch` from the binary alone: MLX's launcher runs through the binary's hidden
    verb and starts the binary twice; SIGTERM stops both ranks with exit 0."""
    config = tmp_path / "group.toml"
    config.write_text('[models]\ndefault = "demo-32k"\n')
    group = start_command(
        [str(frozen.executable), "launch", "-n", "2", "--", "serve", "--config", str(config),
         "--port", "0", "--log-format", "json"],
        cwd=tmp_path, env=_env(AFMD_CACHE_DIR=str(tmp_path / "cache")),
    )
    try:
        wait_healthy(group.url, group.proc)
        health = httpx.get(group.url + "/health", timeout=5).json()
        assert [r["rank"] for r in health["distributed"]["ranks"]] == [0, 1]
        answer = httpx.post(group.url + "/v1/chat/completions", timeout=60, json={
            "model": "demo-32k", "max_tokens": 8,
            "messages": [{"role": "user", "content": "hello"}]})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] > 0
    finally:
        code = group.stop(signal.SIGTERM, timeout=60)
    assert code == 0, group.log_text()[-3000:]


def _png_url(seed: int) -> str:
    import base64
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.slow
@pytest.mark.timeout(BUILD_TIMEOUT_S + 180)
def test_frozen_server_answers_images(frozen: FrozenBuild, tmp_path: Path) -> None:
    """mlx-vlm and Pillow made it into the binary (what it excludes of their dependencies
    is not needed): demo-vision is built and answers images, a corrupt one is a 400."""
    import httpx

    env = _env(AFMD_CACHE_DIR=str(tmp_path / "cache"))
    server = start_command([str(frozen.executable), "serve", "--port", "0", "--log-format",
                            "json"], cwd=tmp_path, env=env)
    try:
        wait_healthy(server.url, server.proc)

        def ask(url: str) -> httpx.Response:
            return httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
                "model": "demo-vision", "temperature": 0, "max_tokens": 8,
                "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": url}}]}]})

        first, second = ask(_png_url(1)), ask(_png_url(2))
        assert first.status_code == 200, first.text
        assert second.status_code == 200, second.text
        assert (first.json()["choices"][0]["message"]["content"]
                != second.json()["choices"][0]["message"]["content"])
        corrupt = ask("data:image/png;base64,iVBORw0KGgoAAAAAAAAAAA==")
        assert corrupt.status_code == 400
        assert corrupt.json()["error"]["code"] == "invalid_image"
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log_text()[-3000:]


# ---------------------------------------------------------------------------- build scripts


@pytest.mark.parametrize(
    ("system", "machine", "expected"),
    [("darwin", "arm64", "afmd-1.2.3-macos-arm64"),
     ("linux", "x86_64", "afmd-1.2.3-linux-x86_64"),
     ("linux", "aarch64", "afmd-1.2.3-linux-arm64"),
     ("linux", "AMD64", "afmd-1.2.3-linux-x86_64")],
)
def test_artifact_names(system: str, machine: str, expected: str) -> None:
    assert build_script.artifact_name("1.2.3", system, machine) == expected


def test_version_is_read_without_importing(tmp_path: Path) -> None:
    assert build_script.afmd_version() == afmd.__version__


def test_sha256_sidecar_format(tmp_path: Path) -> None:
    artifact = tmp_path / "afmd-0.1.0-linux-x86_64.tar.gz"
    artifact.write_bytes(b"payload")
    sidecar, digest = build_script.write_sha256(artifact)
    assert digest == hashlib.sha256(b"payload").hexdigest()
    assert sidecar.name == "afmd-0.1.0-linux-x86_64.tar.gz.sha256"
    assert sidecar.read_text() == f"{digest}  {artifact.name}\n"
    tool = shutil.which("sha256sum")
    if tool is not None:  # the format the release notes tell users to check with
        check = subprocess.run([tool, "-c", sidecar.name], cwd=tmp_path,
                               capture_output=True, text=True, check=False)
        assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the refusal off macOS")
def test_sign_script_refuses_off_macos(tmp_path: Path) -> None:
    result = subprocess.run(["bash", str(ROOT / "build" / "sign.sh"), str(tmp_path)],
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2
    assert "macOS" in result.stderr and "codesign" in result.stderr


def test_spec_and_scripts_are_consistent() -> None:
    spec = (ROOT / "build" / "afmd.spec").read_text()
    for needed in ('collect_data_files("sanic")', 'collect_data_files("tracerite")',
                   '"mlx_lm.models"', '"mlx_lm.tool_parsers"', '"mlx_lm.chat_templates"',
                   '"llguidance"', 'includes=["data/*.json", "data/ui/*"]', "mlx.metallib",
                   '"torch"'):
        assert needed in spec, needed
    sign = (ROOT / "build" / "sign.sh").read_text()
    for needed in ("--options runtime", "--timestamp", "codesign --verify --strict", "spctl",
                   "xcrun notarytool", "entitlements.plist"):
        assert needed in sign, needed
    syntax = subprocess.run(["bash", "-n", str(ROOT / "build" / "sign.sh")],
                            capture_output=True, text=True, check=False)
    assert syntax.returncode == 0, syntax.stderr
