"""The frozen build (build/build.py) for tests/server/test_frozen_binary.py, started in the
background as soon as a session knows a selected test needs it, once per run.

The build is minutes of PyInstaller, mostly on one core, while the rest of the suite spends
much of its time waiting on sockets and child servers: run side by side, with the tests
that need the build scheduled last (tests/conftest.py does both), the build costs the suite
little wall time. A test that asks for it earlier just waits for it.

Everything lives in files under the run's folder (``helpers.session.run_dir``), shared by
pytest-xdist's workers: the first process to claim ``started`` builds, detached in its own
process group, and whichever worker runs the tests waits for the ``rc`` file. The process
that made the run's folder kills a build still running at the end and removes the folder.

A finished build is kept for later runs (``USER_CACHE/frozen``, as mypy's cache and the
agents' installs are), keyed by everything the build reads: afmd's and build/'s files, the
repository's top-level files, the interpreter and every installed distribution's version.
A run whose key is there (a fresh clone of what the last run built) takes that build, where
it paid PyInstaller's minutes of CPU again, for the same binary, beside the rest of the
suite on a small machine. Anything changed is another key, and a new build.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from helpers.paths import USER_CACHE

ROOT = Path(__file__).resolve().parent.parent.parent
BUILD_TIMEOUT_S = 900
#: Every test that takes the ``frozen`` fixture: what tells the conftest to start the build.
FIXTURE = "frozen"
#: Finished builds kept for later runs, by key; the newest KEPT_BUILDS stay.
BUILD_CACHE = USER_CACHE / "frozen"
KEPT_BUILDS = 2
#: What under afmd/ and build/ no build reads: caches, and build.py's default outputs.
_NOT_READ = ("__pycache__", ".mypy_cache", "dist", "work")

#: The builds this process started, kept so that their Popen objects are not collected
#: (with a warning) while they run.
_STARTED: list[subprocess.Popen[bytes]] = []

# Runs the build with its output in files and writes its exit code last, atomically, so
# that a process other than the one that started it can wait for it.
_WRAPPER = """
import os, subprocess, sys
out, err, rc, *cmd = sys.argv[1:]
with open(out, "w") as o, open(err, "w") as e:
    code = subprocess.run(cmd, stdout=o, stderr=e, stdin=subprocess.DEVNULL).returncode
with open(rc + ".tmp", "w") as f:
    f.write(str(code))
os.replace(rc + ".tmp", rc)
"""


@dataclass
class FrozenBuild:
    executable: Path
    summary: dict[str, Any] | None  # None for AFMD_FROZEN_BINARY
    wall_s: float


def build_skipped() -> bool:
    """``AFMD_SKIP_FROZEN=1`` skips the build locally, never where ``CI=true``."""
    in_ci = os.environ.get("CI", "").lower() in ("true", "1")
    return os.environ.get("AFMD_SKIP_FROZEN") == "1" and not in_ci


def build_key() -> str:
    """What a build is made from, hashed: the files it reads (afmd/, build/, the top-level
    files such as pyproject.toml and the config example it ships), the interpreter and
    the installed distributions it bundles."""
    digest = hashlib.sha256(f"{sys.version}\n{platform.platform()}\n".encode())
    for dist in sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()):
        digest.update(dist.encode() + b"\n")
    files = [p for p in ROOT.iterdir() if p.is_file()]
    for top in ("afmd", "build"):
        files += [p for p in (ROOT / top).rglob("*") if p.is_file()
                  and not set(p.relative_to(ROOT / top).parts) & set(_NOT_READ)]
    for path in sorted(files):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:32]


class BackgroundBuild:
    """The run's one build, in ``root``: started by :meth:`start`, awaited by :meth:`result`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started_file = root / "started"
        self.rc_file = root / "rc"

    def start(self) -> bool:
        """Start the build unless a process of this run already did; True if this one did."""
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.started_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        key = build_key()
        (self.root / "key").write_text(key)
        kept = BUILD_CACHE / key / "summary.json"
        if kept.is_file():  # the same build, made by an earlier run
            os.utime(kept.parent)  # the newest kept
            (self.root / "build.out").write_text(kept.read_text())
            (self.root / "build.err").write_text("")
            (self.root / "kept").write_text(str(kept.parent))
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": None, "started": time.time()}, f)
            (self.root / "rc.tmp").write_text("0")
            os.replace(self.root / "rc.tmp", self.rc_file)
            return True
        cmd = [sys.executable, str(ROOT / "build" / "build.py"), "--out",
               str(self.root / "dist"), "--work", str(self.root / "work"),
               "--install-build-deps", "--json"]
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRAPPER, str(self.root / "build.out"),
             str(self.root / "build.err"), str(self.rc_file), *cmd],
            cwd=str(ROOT), stdin=subprocess.DEVNULL, start_new_session=True,
        )
        _STARTED.append(proc)
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": proc.pid, "started": time.time()}, f)
        return True

    def result(self) -> FrozenBuild:
        """Wait for the build (within BUILD_TIMEOUT_S of its start) and read its summary."""
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        while not self.rc_file.exists():
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"the frozen build took over {BUILD_TIMEOUT_S} s")
            time.sleep(0.5)
        started = json.loads(self.started_file.read_text())["started"]
        wall = self.rc_file.stat().st_mtime - started
        out = (self.root / "build.out").read_text()
        err = (self.root / "build.err").read_text()
        assert self.rc_file.read_text() == "0", (out + err)[-6000:]
        summary = json.loads(out.strip().splitlines()[-1])
        if not (self.root / "kept").exists():
            self._keep(summary)
        return FrozenBuild(Path(summary["executable"]), summary, wall)

    def _keep(self, summary: dict[str, Any]) -> None:
        """Copy this run's build into :data:`BUILD_CACHE` under its key (once, whichever
        worker gets here first), its summary naming the kept files; drop the oldest."""
        key_file = self.root / "key"
        if not key_file.exists():
            return
        final = BUILD_CACHE / key_file.read_text()
        if final.exists():
            return
        dist = Path(summary["artifact"]).parent
        staging = BUILD_CACHE / f".{final.name}.{os.getpid()}"
        with contextlib.suppress(OSError):
            shutil.rmtree(staging, ignore_errors=True)
            shutil.copytree(dist, staging / "dist", symlinks=True)
            kept = {k: v.replace(str(dist), str(final / "dist")) if isinstance(v, str) else v
                    for k, v in summary.items()}
            (staging / "summary.json").write_text(json.dumps(kept) + "\n")
            staging.rename(final)
        shutil.rmtree(staging, ignore_errors=True)  # another worker kept it first
        builds = sorted((p for p in BUILD_CACHE.iterdir() if not p.name.startswith(".")),
                        key=lambda p: p.stat().st_mtime, reverse=True)
        for old in builds[KEPT_BUILDS:]:
            shutil.rmtree(old, ignore_errors=True)

    def kill(self) -> None:
        """Stop a build still running (its whole process group: the wrapper and PyInstaller)."""
        if not self.rc_file.exists():
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                pid = json.loads(self.started_file.read_text())["pid"]
                os.killpg(pid, signal.SIGKILL)
        for proc in _STARTED:
            proc.wait()
