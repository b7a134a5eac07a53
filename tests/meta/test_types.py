"""afmd/ type-checks clean under mypy, as configured in pyproject.toml's ``[tool.mypy]``.

Run as a subprocess of this interpreter (the venv's mypy, which sees the same installed
mlx, mlx-lm, Sanic... stubs as the code does), from the repository root so the config and
its ``files`` apply. A cold check reads every module and every stub afmd imports, a large
share of a small machine's CPU during the suite, so its cache lives beside the agents'
installs, outside the checkout: mypy checks each cached module against
its file's content hash, so a fresh clone, or another venv, reuses what has not changed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.paths import USER_CACHE

#: The checkout: where pyproject.toml (and so [tool.mypy]) is, wherever this file sits.
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())

pytestmark = pytest.mark.slow


def test_mypy_clean() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(USER_CACHE / "mypy")],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # The config's `files` must still reach the package: a check of nothing passes too.
    checked = re.search(r"no issues found in (\d+) source files", output)
    assert checked is not None and int(checked.group(1)) > 100, output
