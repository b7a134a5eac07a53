"""The Homebrew formula (homebrew/afmd.rb), the script that fills it from a release tarball,
and the default paths a ``brew services`` daemon relies on.

The Ruby checks need ``ruby`` (Debian's package is enough; .ci/run installs it) and skip only
when it is absent; the path checks need nothing but afmd.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import ROOT, afmd_command
from helpers.smoke import start_command

pytestmark = pytest.mark.slow  # ruby and a server run as launchd would

FORMULA = ROOT / "homebrew" / "afmd.rb"
HARNESS = ROOT / "homebrew" / "test" / "formula_harness.rb"
UPDATE = ROOT / "homebrew" / "update_formula.py"
RUBY = shutil.which("ruby")
needs_ruby = pytest.mark.skipif(RUBY is None, reason="ruby is not installed")


def _harness(formula: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    assert RUBY is not None
    result = subprocess.run([RUBY, str(HARNESS), str(formula), *args], capture_output=True,
                            text=True, timeout=120, check=False)
    lines = result.stdout.strip().splitlines()
    assert lines, result.stderr
    return result.returncode, json.loads(lines[-1]), result.stderr


def _fake_tarball(folder: Path, version: str = "0.1.0", platform: str = "macos-arm64") -> Path:
    name = f"afmd-{version}-{platform}"
    src = folder / name
    (src / "_internal").mkdir(parents=True)
    (src / "afmd").write_text("#!/bin/sh\n")
    shutil.copy(ROOT / "config.example.toml", src / "config.example.toml")
    tarball = folder / f"{name}.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(src, arcname=name)
    return tarball


def _update(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(UPDATE), *args], capture_output=True, text=True,
                          timeout=60, check=False)


# ---------------------------------------------------------------------------- formula


@needs_ruby
def test_ruby_syntax() -> None:
    for path in (FORMULA, HARNESS):
        result = subprocess.run([RUBY, "-c", str(path)], capture_output=True, text=True,
                                check=False)
        assert result.returncode == 0 and "Syntax OK" in result.stdout, result.stderr


@needs_ruby
def test_checked_in_formula_passes_the_harness() -> None:
    code, facts, stderr = _harness(FORMULA)
    assert code == 0, stderr
    assert facts["failures"] == []
    assert facts["version"] == __import__("afmd").__version__
    assert facts["url"].endswith(f"/v{facts['version']}/afmd-{facts['version']}-macos-arm64.tar.gz")
    assert facts["placeholder_sha256"] is True  # filled by the release workflow
    assert facts["depends_on"] == ["{:arch=>:arm64}", ":macos"]
    service = facts["service"]
    assert service["run"][1:3] == ["serve", "--config"]
    assert service["run"][0].endswith("/opt/afmd/bin/afmd")
    assert service["run"][3].endswith("/etc/afmd/config.toml")
    assert service["keep_alive"] == "true"
    assert service["log_path"].endswith("/var/log/afmd.log")
    assert service["working_dir"].endswith("/var/afmd")
    assert facts["config_kept_on_upgrade"] is True
    assert facts["test_block"] == "passed"
    assert "version" in facts["test_calls"]
    assert any(call.startswith("check-config ") for call in facts["test_calls"])
    assert "http://127.0.0.1:9999/v1" in facts["caveats"]


@needs_ruby
@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("keep_alive true", "keep_alive false", "keep_alive is not true"),
        ("  depends_on arch: :arm64\n", "", "depends_on arch: :arm64"),
        ('"serve", "--config"', '"serve"', "service run is"),
        ("cp pkgshare/\"config.example.toml\", config unless config.exist?",
         "cp pkgshare/\"config.example.toml\", config", "overwrote the user's edited config"),
        ('shell_output("#{bin}/afmd version")', '"afmd #{version}"', "does not run `afmd version`"),
        ("http://127.0.0.1:9999/v1", "http://localhost/", "caveats do not name the endpoint"),
    ],
)
def test_harness_catches_a_broken_formula(tmp_path: Path, old: str, new: str,
                                          message: str) -> None:
    text = FORMULA.read_text()
    assert old in text
    broken = tmp_path / "afmd.rb"
    broken.write_text(text.replace(old, new))
    code, facts, _ = _harness(broken)
    assert code == 1
    assert any(message in failure for failure in facts["failures"]), facts["failures"]


# ---------------------------------------------------------------------------- filling it


@needs_ruby
def test_update_formula_fills_url_version_and_sha256(tmp_path: Path) -> None:
    tarball = _fake_tarball(tmp_path, version="1.2.3")
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    (tarball.parent / (tarball.name + ".sha256")).write_text(f"{digest}  {tarball.name}\n")
    filled = tmp_path / "afmd.rb"
    result = _update(str(tarball), "--repo", "someone/afmd", "--output", str(filled))
    assert result.returncode == 0, result.stderr
    url = "https://github.com/someone/afmd/releases/download/v1.2.3/afmd-1.2.3-macos-arm64.tar.gz"
    code, facts, stderr = _harness(filled, "--require-filled", "--expect-url", url,
                                   "--expect-sha256", digest, "--expect-version", "1.2.3")
    assert code == 0, stderr
    assert facts["homepage"] == "https://github.com/someone/afmd"
    assert FORMULA.read_text() != filled.read_text()  # the checked-in formula is untouched
    # Filling again (e.g. a re-run release) is idempotent.
    again = _update(str(tarball), "--repo", "someone/afmd", "--formula", str(filled))
    assert again.returncode == 0 and filled.read_text().count(digest) == 1


def test_update_formula_refuses_bad_input(tmp_path: Path) -> None:
    linux = _fake_tarball(tmp_path / "a", platform="linux-x86_64")
    refused = _update(str(linux), "--url", "https://example.com/x.tar.gz",
                      "--output", str(tmp_path / "out.rb"))
    assert refused.returncode == 2 and "macos-arm64" in refused.stderr

    mac = _fake_tarball(tmp_path / "b")
    (mac.parent / (mac.name + ".sha256")).write_text("0" * 64 + f"  {mac.name}\n")
    mismatch = _update(str(mac), "--repo", "o/n", "--output", str(tmp_path / "out.rb"))
    assert mismatch.returncode == 2 and "sha256" in mismatch.stderr
    assert not (tmp_path / "out.rb").exists()

    renamed = tmp_path / "c" / "afmd.tar.gz"
    renamed.parent.mkdir()
    renamed.write_bytes(b"x")
    unnamed = _update(str(renamed), "--repo", "o/n", "--output", str(tmp_path / "out.rb"))
    assert unnamed.returncode == 2 and "afmd-<version>-<os>-<arch>" in unnamed.stderr


def test_release_workflow_uses_the_scripts() -> None:
    workflow = (ROOT / ".github" / "workflows" / "release.yml").read_text()
    for needed in ("macos-15", ".[test,system]", "build/build.py", "--sign",
                   "homebrew/update_formula.py", "tests/server/test_frozen_binary.py",
                   "AFMD_FROZEN_BINARY", "AFMD_SIGN_IDENTITY", ".tar.gz.sha256"):
        assert needed in workflow, needed


# ---------------------------------------------------------------------------- daemon paths


def test_brew_services_defaults(tmp_path: Path) -> None:
    """As launchd runs it: no --config, a Homebrew prefix holding etc/afmd/config.toml, an
    unrelated working directory. The config comes from the prefix, the model cache goes to
    the user's cache folder, and nothing is written to the working directory."""
    prefix = tmp_path / "brew"
    (prefix / "etc" / "afmd").mkdir(parents=True)
    config = prefix / "etc" / "afmd" / "config.toml"
    config.write_text('[server]\nport = 0\n[models.aliases]\n"gpt-4o-mini" = "demo"\n')
    home = tmp_path / "home"
    home.mkdir()
    cwd = tmp_path / "unrelated-cwd"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AFMD_", "XDG_", "HF_"))}
    env.update(HOME=str(home), HOMEBREW_PREFIX=str(prefix))
    server = start_command([*afmd_command(), "serve", "--log-format", "json"], cwd=cwd, env=env)
    try:
        listening = server.wait_event("listening")
        assert listening["config"] == str(config)
        server.wait_ready()
        reply = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4})
        assert reply.status_code == 200, reply.text
    finally:
        assert server.stop() == 0
    assert list(cwd.iterdir()) == [], "afmd wrote into its working directory"
    cache = (home / "Library" / "Caches" / "afmd" if sys.platform == "darwin"
             else home / ".cache" / "afmd")
    assert any(p.name.startswith("demo-") for p in (cache / "models").iterdir())
