"""bench/embeddings.py runs end to end at a tiny scale (its figures are not judged here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow  # a benchmark run


def test_embeddings_bench_runs_and_agrees_with_in_process() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/embeddings.py", "--requests", "4", "--inputs", "2",
         "--rounds", "1", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode in (0, 1), proc.stderr  # 1: below target at this scale
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["requests"] == 4 and result["inputs"] == 2 and result["tokens"] > 8
    assert result["max_abs_difference"] < 1e-5  # afmd's vectors are mlx-lm's
    for key in ("median_afmd_inputs_per_s", "median_in_process_inputs_per_s",
                "median_in_process_one_call_inputs_per_s"):
        assert result[key] > 0, key
    assert result["passed"] == (result["ratio"] >= result["target"])
