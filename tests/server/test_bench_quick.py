"""The benchmark harness keeps working: ``bench/run.py --quick`` runs end to end.

No timing is asserted (CI machines are shared and noisy); only that the harness exits 0
and writes a results document in which every row is present, each value either a number
or an explicit null with a reason; and that the phases measured what they stand for (the
turns, the soak's rounds and the ending of each kind of request, the slowloris, the loads
of the model-switching cases: bench/models.py and bench/soak.py run as these phases, so
they have no run of their own here).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.paths import REPO_ROOT

pytestmark = pytest.mark.slow  # the benchmark's quick mode

ROOT = REPO_ROOT

ROWS = {
    "single_stream_decode_tps",
    "ttft_short_ms",
    "aggregate_tps_c1",
    "aggregate_tps_c2",
    "aggregate_tps_c4",
    "aggregate_tps_c8",
    "aggregate_tps_c16",
    "prefix_second_turn_ttft",
    "grammar_json_schema_alone",
    "grammar_json_schema_batch",
    "grammar_tool_required_alone",
    "grammar_tool_required_batch",
    "logprobs_top5_decode",
    "health_requests_per_s",
    "models_requests_per_s",
    "idle_rss_demo_mb",
    "idle_rss_32k_mb",
    "idle_cpu_pct",
    "rss_no_model_mb",
    "cold_start_s",
    "frozen_cold_start_s",
    "frozen_rss_demo_mb",
    "frozen_rss_no_model_mb",
    "memory_soak_rss_growth",
    "slowloris_legit_success",
    "model_load_cold_ttft_ms",
    "model_load_warm_ttft_ms",
    "model_switch_within_ttft_ms",
    "model_switch_over_ttft_ms",
    "vision_beside_text_aggregate",
    "access_log_single_tps",
    "access_log_aggregate_tps_c8",
    "big_single_stream_tps",
    "big_aggregate_tps_c8",
}
SYSTEMS = ("afmd", "mlx_lm_server", "raw")
#: bench/soak.py's request kinds (its KINDS) and how each may end (the error kind: a 400).
SOAK_KINDS = ("plain", "stream", "cancel", "drop", "error", "tools", "json_schema",
              "second_turn")
SOAK_ENDINGS = {
    "plain": {"200"}, "stream": {"stop", "length"}, "cancel": {"cancelled"},
    "drop": {"dropped"}, "tools": {"tool_calls", "length"}, "json_schema": {"200", "stop"},
    "second_turn": {"200 cached", "200 first turn"},
}


@pytest.mark.timeout(900)
def test_quick_bench_writes_every_row(tmp_path: Path) -> None:
    out = tmp_path / "results"
    # Shorter streams than --quick's: every phase and row runs the same, and what the test
    # asserts does not depend on how long a stream is, but the phases that stream (single,
    # concurrent, grammar, in turns) were most of the run's own work.
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--max-tokens", "8",
         "--out", str(out)],
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    docs = sorted(out.glob("*.json"))
    assert len(docs) == 1, list(out.iterdir())
    doc = json.loads(docs[0].read_text())
    assert (out / docs[0].with_suffix(".md").name).is_file()

    meta = doc["meta"]
    assert meta["quick"] is True
    assert len(meta["loadavg"]["start"]) == 3

    rows = {row["id"]: row for row in doc["rows"]}
    assert rows.keys() >= ROWS, sorted(ROWS - rows.keys())
    for rid, row in rows.items():
        assert set(SYSTEMS) <= row["values"].keys(), rid
        for system in SYSTEMS:
            value = row["values"][system]
            median = value["median"]
            if median is None:
                assert isinstance(value.get("reason"), str) and value["reason"], (rid, system)
            else:
                assert isinstance(median, int | float) and math.isfinite(median), (rid, system)

    # The rows afmd must always produce in quick mode, whatever the machine's load.
    for rid in ("single_stream_decode_tps", "ttft_short_ms", "aggregate_tps_c1",
                "aggregate_tps_c8", "prefix_second_turn_ttft", "health_requests_per_s",
                "memory_soak_rss_growth", "slowloris_legit_success"):
        assert rows[rid]["values"]["afmd"]["median"] is not None, (
            rid, rows[rid]["values"]["afmd"])

    # The rounds taken in turns ran, and the verdicts they feed say so.
    afmd = doc["measurements"]["afmd"]
    for key in ("paired_single_vs_mlx", "paired_single_vs_raw", "paired_c8_vs_mlx"):
        assert afmd[key]["median"] is not None and afmd[key]["median"] > 0, (key, afmd[key])
    for key in ("paired_ttft_minus_raw_ms", "paired_ttft_minus_mlx_ms"):
        assert afmd[key]["median"] is not None, (key, afmd[key])
    for rid in ("single_stream_decode_tps", "aggregate_tps_c8", "ttft_short_ms"):
        assert rows[rid]["check"]["detail"].startswith("in turns "), rows[rid]["check"]

    # The memory soak ran its quick rounds (RSS before any request, then after each), and
    # two warm-up rounds are reported, never judged.
    plan = meta["plan"]
    assert len(afmd["soak_rss_mib"]) == plan["soak_rounds"] + 1, afmd["soak_rss_mib"]
    assert sum(afmd["soak_outcomes"].values()) == plan["soak_rounds"] * plan["soak_requests"]
    # Every kind of request the soak sends ran, and each ended the way it should.
    kinds = {outcome.split(":")[0] for outcome in afmd["soak_outcomes"]}
    assert kinds == set(SOAK_KINDS), afmd["soak_outcomes"]
    for outcome in afmd["soak_outcomes"]:
        kind, result = outcome.split(":", 1)
        if kind == "error":
            assert result.startswith("400 "), outcome
        else:
            assert result in SOAK_ENDINGS[kind], outcome
    soak = rows["memory_soak_rss_growth"]["check"]
    assert soak["pass"] is None and soak["judged"] is False, soak
    assert soak["detail"].startswith("not judged"), soak
    # The scaled-down slowloris: legitimate clients were answered while attackers, shed
    # to make room for them, kept coming back.
    attack = afmd["slowloris_summary"]
    assert attack["legit_tries"] > 0 and attack["attack_connections"] > attack["attackers"]
    assert rows["slowloris_legit_success"]["check"]["pass"] in (True, False)
    # Loading and switching models (bench/models.py's cases): each case measured, and
    # caused the loads it stands for: within the budget both models stay loaded; over it
    # every request of the alternation loads its model.
    for case in ("cold", "warm", "loaded", "within", "over"):
        assert afmd[f"models_{case}_ttft_ms"]["median"] > 0, case
    alternating = afmd["models_setup"]["alternating_requests"]
    assert alternating == 2 * plan["runs"]
    assert afmd["models_loads"] == {"within": 0, "over": alternating}
