"""The code base stays ruff-clean (the style contract of the project)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from helpers.paths import REPO_ROOT

ROOT = REPO_ROOT


def test_ruff_clean() -> None:
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    paths = [p for p in ("afmd", "tests", "build", "bench", "homebrew") if (ROOT / p).exists()]
    result = subprocess.run(
        [ruff, "check", *paths],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
