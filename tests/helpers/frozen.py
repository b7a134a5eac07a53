"""The frozen build (build/build.py) for tests/test_frozen_binary.py, started in the
background as soon as the session knows a selected test needs it.

The build is minutes of PyInstaller, mostly on one core, while the rest of the suite spends
much of its time waiting on sockets and child servers: run side by side, with the tests that
need the build moved to the end of the run (tests/conftest.py does both), the build costs
the suite little wall time. A test that asks for it earlier just waits for it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
BUILD_TIMEOUT_S = 900
#: Every test that takes the ``frozen`` fixture: what tells the conftest to start the build.
FIXTURE = "frozen"


@dataclass
class FrozenBuild:
    executable: Path
    summary: dict[str, Any] | None  # None for AFMD_FROZEN_BINARY
    wall_s: float


def build_skipped() -> bool:
    """``AFMD_SKIP_FROZEN=1`` skips the build locally, never where ``CI=true``."""
    in_ci = os.environ.get("CI", "").lower() in ("true", "1")
    return os.environ.get("AFMD_SKIP_FROZEN") == "1" and not in_ci


class BackgroundBuild:
    """``build/build.py --json`` running in its own temporary folder from construction on."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="afmd-frozen-"))
        self._stdout = (self.root / "build.out").open("w+")
        self._stderr = (self.root / "build.err").open("w+")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "build" / "build.py"), "--out", str(self.root / "dist"),
             "--work", str(self.root / "work"), "--install-build-deps", "--json"],
            stdout=self._stdout, stderr=self._stderr, text=True, cwd=str(ROOT),
            stdin=subprocess.DEVNULL,
        )
        self._result: FrozenBuild | None = None

    def result(self) -> FrozenBuild:
        """Wait for the build (within BUILD_TIMEOUT_S of its start) and read its summary."""
        if self._result is not None:
            return self._result
        left = BUILD_TIMEOUT_S - (time.monotonic() - self.started)
        try:
            code = self.proc.wait(max(left, 1.0))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the frozen build took over {BUILD_TIMEOUT_S} s") from None
        wall = time.monotonic() - self.started
        self._stdout.seek(0)
        self._stderr.seek(0)
        out, err = self._stdout.read(), self._stderr.read()
        assert code == 0, (out + err)[-6000:]
        summary = json.loads(out.strip().splitlines()[-1])
        self._result = FrozenBuild(Path(summary["executable"]), summary, wall)
        return self._result

    def close(self) -> None:
        """Stop a build nobody waited for, and remove the folder."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._stdout.close()
        self._stderr.close()
        shutil.rmtree(self.root, ignore_errors=True)
