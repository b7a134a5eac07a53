"""The GPU mode of the benchmarks (``bench/gpu.py``) runs end to end, here on the CPU.

The GPU machine is lent rarely and briefly: its run must not be the first to find the
script broken. This runs it at the smallest sizes on the demo model, with every kind of
system it can compare: afmd, afmd from a "baseline" checkout (this one, through the same
path another checkout takes), afmd with the GPU path forced (a server on that path end to
end), and mlx_lm.server. No timing is asserted, only that each row was measured.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from afmd.engine.demo import builtin as demo

from helpers.paths import REPO_ROOT

pytestmark = pytest.mark.slow  # four servers, each measured

ROOT = REPO_ROOT


def test_gpu_mode_runs_end_to_end(tmp_path: Path) -> None:
    model = demo.materialize("demo")
    out = tmp_path / "out"
    # 32 tokens a stream: long enough that the three streams still overlap on a busy
    # machine, so the step trace sees them batched (rows_mean > 1 below).
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), "--model", str(model),
         "--out", str(out), "--streams", "1,3", "--max-tokens", "32", "--rounds", "1",
         "--prefix-tokens", "150", "--spec-tokens", "24", "--baseline", str(ROOT),
         "--variant", "gpu-path:AFMD_BACKEND_LAYOUT=gpu", "--label", "test"],
        capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "gpu-bench.json").read_text())
    systems = doc["systems"]
    assert list(systems) == ["afmd", "afmd-base", "afmd-gpu-path", "mlx_lm_server"]
    for name, got in systems.items():
        # Every assertion names the system and what it measured: a failure on a busy CI
        # machine must say which row fell short without a rerun.
        assert not got.get("errors"), (name, got.get("errors"))
        assert got["ready_s"] > 0, (name, got["ready_s"])
        first = got["first_round"]
        assert first["ttft_ms"] > 0 and first["tps"] > 0 and first["c8_tps"] > 0, (name, first)
        medians = got["medians"]
        for key in ("c1_tps", "c1_ttft_ms", "c3_tps", "prefix_pct"):
            assert medians[key] > 0, (name, key, medians)
        if name.startswith("afmd"):
            assert first["server_queue_ms"] is not None, (name, first)
            assert medians.get("edit_ratio", 0) > 0, (name, medians)
            edits = {k: got.get(k) for k in ("edit_same_text", "edit_parted_at",
                                             "edit_accepted", "edit_tokens")}
            assert got["edit_same_text"] == [True], (name, edits)
            assert got["edit_accepted"][0] > 0, (name, edits)
            steps = got["steps"]
            assert {"first", "c1", "c3"} <= set(steps), (name, steps)
            assert steps["c3"]["rows_mean"] > 1 and steps["c1"]["rows_mean"] == 1, (name, steps)
    ratio = doc["ratios"]["afmd/mlx_lm_server"]
    assert ratio["c1_tps"]["median"] > 0 and ratio["c3_tps"]["median"] > 0
    table = (out / "gpu-bench.md").read_text()
    assert "| 3 concurrent streams, aggregate tok/s |" in table
    assert "afmd-gpu-path's generation thread" in table
