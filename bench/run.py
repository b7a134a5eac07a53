"""One command: how much of the raw engine speed afmd delivers, against mlx_lm.server.

    python bench/run.py             # full run (about 15-25 minutes on 2 cores)
    python bench/run.py --quick     # under 2 minutes; what CI runs
    python bench/run.py --help

Builds the tiny random models itself (``afmd.engine.demo.builtin.materialize``), starts afmd and
``mlx_lm.server`` on the same model, one at a time, each on a free port, drives both with
the same asyncio client, measures raw in-process mlx-lm as the ceiling, and writes
``<out>/<date>-<host>.json``, ``.md`` and ``.png``. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import document, servers, workload  # noqa: E402
from bench.distributed import bench_distributed  # noqa: E402
from bench.footprint import bench_footprint, bench_mlx_demo_rss, find_binary  # noqa: E402
from bench.models import bench_models  # noqa: E402
from bench.phases import bench_access_log, bench_big, bench_http, bench_raw  # noqa: E402
from bench.plan import SYSTEMS, Ctx, Plan  # noqa: E402
from bench.resilience import bench_slowloris, bench_soak  # noqa: E402
from bench.turns import bench_paired  # noqa: E402
from bench.vision import bench_vision  # noqa: E402

perf = time.perf_counter


def materialize(ctx_cache: Path, big: bool) -> dict[str, str | None]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "raw_engine.py"), "materialize",
         str(ctx_cache), *(["--big"] if big else [])],
        capture_output=True, text=True, timeout=600, cwd=str(ROOT),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building the models failed: {proc.stderr[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


async def run_all(ctx: Ctx, binary: Path | None, systems: set[str]) -> None:
    """The phases in order: afmd's, mlx_lm.server's, raw's, then the rounds in turns."""
    try:
        await _phases(ctx, binary, systems)
    finally:  # what the phases kept up for rounds in turns that did not take it
        for srv in ctx.kept.values():
            srv.stop()
        ctx.kept.clear()
        if ctx.sampler is not None:
            await ctx.sampler.stop()
            ctx.sampler = None


async def _phases(ctx: Ctx, binary: Path | None, systems: set[str]) -> None:
    p = ctx.plan
    for s in SYSTEMS:
        if s not in systems:
            ctx.res[s].fatal = "skipped (--systems)"
    if "afmd" in systems:
        ctx.log("afmd (demo-32k):")
        afmd = servers.afmd_server(ctx.work, "afmd", cache_root=ctx.cache,
                                   default="demo-32k")
        await bench_http(ctx, "afmd", afmd, grammar=True)
        if p.access_log:
            ctx.log("afmd with access_log = true:")
            try:
                await bench_access_log(ctx)
            except Exception as exc:
                ctx.log(f"  ! access-log run failed: {exc}")
        ctx.log("afmd footprint (demo model, no model, frozen binary):")
        await bench_footprint(ctx, binary)
        ctx.log(f"afmd memory soak ({p.soak_rounds} rounds × {p.soak_requests} requests):")
        await bench_soak(ctx)
        ctx.log(f"afmd under a slowloris ({p.slowloris_attackers} attackers):")
        await bench_slowloris(ctx)
        ctx.log("afmd loading and switching models (demo-32k):")
        await bench_models(ctx)
        ctx.log("afmd text streams beside a vision request (demo-32k, demo-vision):")
        await bench_vision(ctx)
    if "mlx_lm_server" in systems:
        ctx.log("mlx_lm.server (demo-32k):")
        mlx = servers.mlx_server(ctx.work, "mlx_lm_server", Path(ctx.folders["demo-32k"] or ""))
        await bench_http(ctx, "mlx_lm_server", mlx, grammar=False)
        if not p.quick:
            await bench_mlx_demo_rss(ctx)
    if "raw" in systems:
        ctx.log("raw mlx-lm in-process:")
        await asyncio.to_thread(bench_raw, ctx)
    if {"afmd", "mlx_lm_server", "raw"} <= systems:
        ctx.log("taking turns (afmd, mlx_lm.server, raw mlx-lm):")
        await bench_paired(ctx)
    if p.big and ctx.folders.get("big"):
        ctx.log("compute-bound model (hidden 512 × 8 layers):")
        await bench_big(ctx, systems)
        if "afmd" in systems:
            ctx.log("afmd over 2 ranks (tensor, pipeline) against 1, compute-bound model:")
            await bench_distributed(ctx)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bench/run.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="fewer runs, tokens and concurrency levels (under 2 minutes; CI)")
    ap.add_argument("--out", metavar="DIR", help="where results go (default bench/results)")
    ap.add_argument("--cache-dir", metavar="DIR",
                    help="where the models are built (default: a fresh temporary folder)")
    ap.add_argument("--binary", metavar="PATH",
                    help="frozen afmd binary (default: build/dist/afmd-*/afmd if present)")
    ap.add_argument("--runs", type=int, help="repeats per measurement (default 5; quick 2)")
    ap.add_argument("--max-tokens", type=int, help="tokens per stream (default 256; quick 32)")
    ap.add_argument("--no-big", action="store_true", help="skip the compute-bound model rows")
    ap.add_argument("--no-profile", action="store_true", help="skip py-spy and strace")
    ap.add_argument("--systems", default="afmd,mlx_lm_server,raw",
                    help="comma-separated subset of afmd,mlx_lm_server,raw to run "
                         "(the others' rows are null)")
    ap.add_argument("--keep-work", action="store_true",
                    help="keep server logs, configs and raw profiles next to the results")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    plan = Plan.make(args)
    started = perf()
    out_dir = Path(args.out) if args.out else ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname().split(".")[0] or "host"
    today = datetime.date.today().isoformat()
    stem = f"{today}-{host}" + ("-quick" if plan.quick else "")
    tmp = Path(tempfile.mkdtemp(prefix="afmd-bench-"))
    work = out_dir / f"{stem}-work" if args.keep_work else tmp / "work"
    work.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache_dir) if args.cache_dir else tmp / "cache"

    def log(msg: str) -> None:
        print(f"[{perf() - started:6.1f}s] {msg}", flush=True)

    load_start = [round(x, 2) for x in os.getloadavg()]
    log(f"bench: {'quick' if plan.quick else 'full'} run, load average {load_start}, "
        f"{os.cpu_count()} CPUs; models in {cache}")
    exit_code = 0
    try:
        folders = materialize(cache, plan.big)
        ctx = Ctx(plan=plan, work=work, cache=cache, folders=folders, log=log)
        ctx.counter = workload.TokenCounter(Path(folders["demo-32k"] or ""))
        ctx.loads["start"] = load_start
        binary = find_binary(args.binary)
        systems = {s.strip() for s in args.systems.split(",") if s.strip()}
        unknown = systems - set(SYSTEMS)
        if unknown:
            raise SystemExit(f"unknown --systems {sorted(unknown)}; choose from {SYSTEMS}")
        asyncio.run(run_all(ctx, binary, systems))
        ctx.loads["end"] = [round(x, 2) for x in os.getloadavg()]
        if ctx.res.afmd.fatal is not None and "afmd" in systems:
            exit_code = 1  # afmd itself could not be benchmarked: that must not pass CI
        doc = document.build(ctx, args, today, host, perf() - started, binary)
        document.write(doc, out_dir, stem, log)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the models; --keep-work's files are in out
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
