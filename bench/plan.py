"""How much to measure (the plan, full or quick) and what every phase shares (the context).

The plan's numbers are part of what makes a run comparable with earlier ones: the
results document records them (``meta.plan``), and changing one changes the benchmark.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bench import workload
from bench.results import SYSTEMS, Measurements

if TYPE_CHECKING:
    from bench.sampler import RawSampler
    from bench.servers import Server

ROOT = Path(__file__).resolve().parent.parent

LEVELS = (1, 2, 4, 8, 16)
GRAMMAR_KINDS = ("json_schema", "tool_required")
BIG_MAX_TOKENS = 64

__all__ = ["BIG_MAX_TOKENS", "GRAMMAR_KINDS", "LEVELS", "ROOT", "SYSTEMS", "Ctx", "Plan"]


@dataclass
class Plan:
    """Repeats, token counts and levels; ``--quick`` trades precision for CI's minutes."""

    quick: bool
    runs: int  # repeats of each streamed measurement
    batch_runs: int  # repeats of each concurrency level
    max_tokens: int
    levels: tuple[int, ...]
    ttft_runs: int
    ttft_max_tokens: int
    prefix_tokens: int
    prefix_runs: int
    prefix_max_tokens: int
    grammar_runs: int
    grammar_max_tokens: int
    grammar_batch: int
    grammar_alone: int  # single-stream samples per kind per run (they are short and noisy)
    paired_runs: int  # single-stream rounds taking turns: afmd, mlx_lm.server, raw
    paired_batch_runs: int  # rounds of 8 streams taking turns: afmd, mlx_lm.server
    paired_ttft_runs: int  # short-prompt rounds taking turns: afmd, mlx_lm.server, raw
    paired_reuse: bool  # the rounds in turns take the phases' servers, kept up, not fresh ones
    rps_seconds: float
    rps_runs: int
    rps_connections: int
    big: bool
    access_log: bool
    profile: bool
    profile_seconds: float
    timeout: float  # per streamed request
    soak_rounds: int  # memory soak: rounds of mixed requests, RSS read after each
    soak_requests: int  # per round
    soak_concurrency: int  # requests in flight (and the soak server's max_concurrent)
    soak_settle_s: float  # idle before each RSS reading
    soak_max_seconds: float  # no new round after this
    soak_footprint: bool  # the demo model's cold start and idle RSS from the soak's server
    slowloris_attackers: int
    slowloris_legit: int  # legitimate clients, each one request at a time
    slowloris_seconds: float  # how long the legitimate clients run
    slowloris_warmup: float  # attack alone first, so it holds the slots
    slowloris_max_connections: int | None  # None: afmd's default

    @classmethod
    def make(cls, args: argparse.Namespace) -> Plan:
        if args.quick:
            plan = cls(quick=True, runs=2, batch_runs=2, max_tokens=32, levels=(1, 8),
                       ttft_runs=3, ttft_max_tokens=4, prefix_tokens=1000, prefix_runs=1,
                       prefix_max_tokens=8, grammar_runs=1, grammar_max_tokens=32,
                       grammar_batch=8, grammar_alone=1, paired_runs=1, paired_batch_runs=1,
                       paired_ttft_runs=3, paired_reuse=True,
                       rps_seconds=0.25, rps_runs=1,
                       rps_connections=32, big=False,
                       access_log=False, profile=False, profile_seconds=0.0, timeout=120.0,
                       soak_rounds=2, soak_requests=10, soak_concurrency=4,
                       soak_settle_s=0.2, soak_max_seconds=60.0, soak_footprint=True,
                       slowloris_attackers=40, slowloris_legit=2, slowloris_seconds=1.5,
                       slowloris_warmup=0.5, slowloris_max_connections=16)
        else:
            plan = cls(quick=False, runs=5, batch_runs=3, max_tokens=256, levels=LEVELS,
                       ttft_runs=25, ttft_max_tokens=4, prefix_tokens=2000, prefix_runs=5,
                       prefix_max_tokens=32, grammar_runs=8, grammar_max_tokens=256,
                       grammar_batch=8, grammar_alone=4, paired_runs=9, paired_batch_runs=4,
                       paired_ttft_runs=30, paired_reuse=False,
                       rps_seconds=3.0, rps_runs=3, rps_connections=32, big=True,
                       access_log=True, profile=True, profile_seconds=8.0, timeout=300.0,
                       soak_rounds=6, soak_requests=300, soak_concurrency=4,
                       soak_settle_s=1.0, soak_max_seconds=900.0, soak_footprint=False,
                       slowloris_attackers=150, slowloris_legit=4, slowloris_seconds=20.0,
                       slowloris_warmup=2.0, slowloris_max_connections=None)
        if args.runs:
            plan.runs = plan.batch_runs = plan.prefix_runs = plan.grammar_runs = args.runs
        if args.max_tokens:
            plan.max_tokens = plan.grammar_max_tokens = args.max_tokens
        if args.no_big:
            plan.big = False
        if args.no_profile:
            plan.profile = False
        return plan


@dataclass
class Ctx:
    """What every phase reads (plan, folders) and writes (results, load averages, log)."""

    plan: Plan
    work: Path
    cache: Path
    folders: dict[str, str | None]
    res: Measurements = field(default_factory=Measurements)
    loads: dict[str, list[float]] = field(default_factory=dict)
    counter: workload.TokenCounter | None = None
    log: Callable[[str], None] = print
    #: With ``Plan.paired_reuse``: the servers and the raw sampler the per-system phases
    #: leave up for the rounds in turns, which stop them (``run.run_all`` if those never run).
    kept: dict[str, Server] = field(default_factory=dict)
    sampler: RawSampler | None = None

    def load_note(self, label: str) -> None:
        """The load average around a phase: the document flags a busy machine."""
        self.loads[label] = [round(x, 2) for x in os.getloadavg()]
