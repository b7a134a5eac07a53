"""One folder per test run, shared by every process of the run (pytest-xdist's workers
included): the demo-model cache and the frozen build live there, so each is built once per
run rather than once per worker. The process that starts the run (the only one without
xdist, the controller with it) makes it before any worker exists, hands it down in the
environment, and removes it at the end.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "AFMD_TEST_RUN_DIR"


def run_dir() -> Path:
    """The run's shared folder (tests/conftest.py makes it in pytest_configure)."""
    value = os.environ.get(ENV)
    assert value, f"{ENV} is unset: tests/conftest.py's pytest_configure makes it"
    return Path(value)
