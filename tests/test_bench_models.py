"""bench/models.py runs end to end at a tiny scale (its figures are not judged here, only
that each case measured and caused the loads it stands for)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow  # a benchmark run


def test_models_bench_runs_and_counts_its_loads() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/models.py", "--runs", "1", "--cold", "1", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for case in ("cold", "warm", "loaded", "within", "over"):
        assert result[f"models_{case}_ttft_ms"]["median"] > 0, case
    # Within the budget both models stay loaded; over it every request loads its model.
    assert result["models_loads"] == {"within": 0, "over": 2}
    assert result["models_setup"]["alternating_requests"] == 2
