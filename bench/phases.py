"""The per-system phases: one server at a time, then raw mlx-lm in its own process.

One server runs at a time so they never share the CPU; a measurement that raises is
recorded (``errors``) and the phase goes on, so one broken row never hides the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

from bench import servers
from bench.grammar import m_grammar
from bench.logprobs import m_logprobs
from bench.measure import m_levels, m_prefix, m_rps, m_single, m_ttft, warm_up
from bench.plan import BIG_MAX_TOKENS, ROOT, Ctx
from bench.profiled import profile_afmd, strace_both
from bench.results import Level, Prefix, SingleStream, Ttft, fmt, null, stat

T = TypeVar("T")
perf = time.perf_counter


async def guarded(ctx: Ctx, system: str, label: str, coro: Awaitable[T]) -> T | None:
    """``coro``'s result, or None with the failure recorded under ``label``."""
    t0 = perf()
    try:
        out = await coro
    except Exception as exc:
        ctx.log(f"  ! {system} {label} failed: {exc!r}")
        ctx.res[system].errors[label] = (
            f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
        )
        return None
    ctx.log(f"  {system} {label}: {perf() - t0:.1f} s")
    return out


async def bench_http(ctx: Ctx, system: str, srv: servers.Server, *, grammar: bool) -> None:
    p = ctx.plan
    r = ctx.res[system]
    ctx.load_note(f"{system}-start")
    srv.start()
    try:
        ready = await srv.ready()
        r.footprint.cold_start_s = stat([ready], "s")
        await asyncio.sleep(0.3)
        r.footprint.rss_idle_32k_mb = stat([servers.rss_mb(srv.pid)], "MiB")
        idle_s = 1.0 if p.quick else 5.0
        c0 = servers.cpu_seconds(srv.pid)
        await asyncio.sleep(idle_s)
        c1 = servers.cpu_seconds(srv.pid)
        r.footprint.idle_cpu_pct = stat(
            [None if c0 is None or c1 is None else (c1 - c0) / idle_s], "% of a core",
            scale=100, reason="/proc unavailable")
        ctx.log(f"  {system} ready in {ready:.1f} s (pid {srv.pid}, port {srv.port})")
        await warm_up(srv.port, system, p.timeout)
        r.single = await guarded(ctx, system, "single-stream",
                                 m_single(ctx, srv.port, system)) or r.single
        ctx.log(f"    single stream {fmt(r.single.tps)}")
        r.ttft = await guarded(ctx, system, "ttft", m_ttft(
            ctx, srv.port, system, afmd=system == "afmd")) or r.ttft
        ctx.log(f"    ttft {fmt(r.ttft.ms)}")
        r.levels.update(await guarded(ctx, system, "concurrency",
                                      m_levels(ctx, srv.port, system, p.levels)) or {})
        r.prefix = await guarded(ctx, system, "prefix",
                                 m_prefix(ctx, srv.port, system)) or r.prefix
        ctx.log(f"    prefix ratio {fmt(r.prefix.ratio_pct)}")
        if grammar:
            r.grammar = await guarded(ctx, system, "grammar",
                                      m_grammar(ctx, srv.port, system)) or r.grammar
            r.logprobs = await guarded(ctx, system, "logprobs",
                                       m_logprobs(ctx, srv.port, system)) or r.logprobs
            ctx.log(f"    top_logprobs 5 decode {fmt(r.logprobs.pct)} of without")
        r.floods.update(await guarded(ctx, system, "requests/s", m_rps(
            ctx, srv.port, {"health": "/health", "models": "/v1/models"})) or {})
        health = r.flood("health")
        ctx.log(f"    /health {fmt(health.rps if health is not None else None)}")
        r.footprint.rss_after_bench_mb = stat([servers.rss_mb(srv.pid)], "MiB")
        if p.profile:
            r.strace = await guarded(ctx, system, "strace",
                                     strace_both(ctx, srv, system)) or r.strace
            if system == "afmd":
                r.pyspy = await guarded(ctx, system, "py-spy",
                                        profile_afmd(ctx, srv)) or r.pyspy
    except Exception as exc:
        ctx.log(f"  ! {system} failed: {exc}")
        r.fatal = f"{type(exc).__name__}: {exc}"
    finally:
        if p.paired_reuse and r.fatal is None and srv.alive():
            ctx.kept[system] = srv  # idle until the rounds in turns take it
        else:
            srv.stop()
        ctx.load_note(f"{system}-end")


async def bench_access_log(ctx: Ctx) -> None:
    srv = servers.afmd_server(ctx.work, "afmd-access-log", cache_root=ctx.cache,
                              default="demo-32k", access_log=True)
    srv.start()
    try:
        await srv.ready()
        await warm_up(srv.port, "alog", ctx.plan.timeout)
        single = await m_single(ctx, srv.port, "alog")
        c8 = await m_levels(ctx, srv.port, "alog", (8,))
        ctx.res.afmd.extras.access_log_single_tps = single.tps
        ctx.res.afmd.extras.access_log_agg_tps_c8 = c8[8].tps
    finally:
        srv.stop()


async def bench_big(ctx: Ctx, systems: set[str]) -> None:
    folder = ctx.folders.get("big")
    if not folder:
        return
    extra = f'\n[[models.model]]\nid = "big"\npath = "{folder}"\n'
    # A compute-bound model is ~50× slower per token: fewer tokens and runs.
    bctx = dataclasses.replace(ctx, plan=dataclasses.replace(
        ctx.plan, max_tokens=BIG_MAX_TOKENS, runs=3, batch_runs=2))
    for system, srv in (
        ("afmd", servers.afmd_server(ctx.work, "afmd-big", cache_root=ctx.cache,
                                     default="big", extra_models=extra)),
        ("mlx_lm_server", servers.mlx_server(ctx.work, "mlx-big", Path(folder))),
    ):
        if system not in systems:
            continue
        x = ctx.res[system].extras
        srv.start()
        try:
            await srv.ready()
            await warm_up(srv.port, f"{system}-big", ctx.plan.timeout)
            single = await m_single(bctx, srv.port, f"{system}-big")
            c8 = await m_levels(bctx, srv.port, f"{system}-big", (8,))
            x.big_single_tps = single.tps
            x.big_agg_tps_c8 = c8[8].tps
            ctx.log(f"  {system} big: single {fmt(single.tps)}, c8 {fmt(c8[8].tps)}")
        except Exception as exc:
            ctx.log(f"  ! {system} big failed: {exc}")
            x.big_single_tps = null(f"failed: {exc}")
        finally:
            srv.stop()


# -- raw in-process ----------------------------------------------------------------------


def run_raw(ctx: Ctx, folder: str, spec_extra: dict[str, Any], label: str
            ) -> dict[str, Any]:
    spec = {"folder": folder, "runs": ctx.plan.runs, "tag": f"raw-{label}", **spec_extra}
    spec_path = ctx.work / f"raw-{label}-spec.json"
    out_path = ctx.work / f"raw-{label}-out.json"
    spec_path.write_text(json.dumps(spec))
    timeout = 300 if ctx.plan.quick else 1800
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "raw_engine.py"), "measure", str(spec_path),
         str(out_path)],
        capture_output=True, text=True, timeout=timeout, cwd=str(ROOT),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"raw engine exited {proc.returncode}: {proc.stderr[-800:]}")
    return json.loads(out_path.read_text())  # type: ignore[no-any-return]


def bench_raw(ctx: Ctx) -> None:
    p = ctx.plan
    r = ctx.res.raw
    ctx.load_note("raw-start")
    folder = ctx.folders["demo-32k"]
    assert folder
    try:
        out = run_raw(ctx, folder, {
            "single": {"max_tokens": p.max_tokens},
            "ttft": {"runs": p.ttft_runs, "max_tokens": p.ttft_max_tokens},
            "batch": {"max_tokens": p.max_tokens, "levels": list(p.levels),
                      "runs": p.batch_runs},
            "prefix": {"tokens": p.prefix_tokens, "max_tokens": p.prefix_max_tokens,
                       "runs": p.prefix_runs},
        }, "32k")
    except Exception as exc:
        ctx.log(f"  ! raw failed: {exc}")
        r.fatal = str(exc)
        return
    single = out["single"]
    r.single = SingleStream(tps=stat(single["stream_tps"], "tok/s"),
                            decode_interval_tps=stat(single["decode_tps"], "tok/s"),
                            e2e_tps=stat(single["e2e_tps"], "tok/s"),
                            tokens=single["tokens"])
    r.ttft = Ttft(ms=stat(out["ttft"]["ttft"], "ms", scale=1000),
                  from_tokens_ms=stat(out["ttft"]["ttft_from_tokens"], "ms", scale=1000))
    for c, v in out["batch"].items():
        r.levels[int(c)] = Level(tps=stat(v["agg_tps"], "tok/s"),
                                 ttft_ms=stat(v["ttft"], "ms", scale=1000))
    pre = out.get("prefix") or {}
    if pre:
        r.prefix = Prefix(
            first_ms=stat(pre["first_ttft"], "ms", scale=1000),
            second_ms=stat(pre["second_ttft"], "ms", scale=1000),
            ratio_pct=stat([b / a for a, b in zip(pre["first_ttft"], pre["second_ttft"],
                                                  strict=True)], "%", scale=100),
            shared_tokens=pre["shared_tokens"],
            prompt_tokens=pre["prompt_tokens"],
        )
    ctx.log(f"  raw: single stream {fmt(r.single.tps)}, ttft {fmt(r.ttft.ms)}")
    if ctx.folders.get("big"):
        try:
            big = run_raw(ctx, ctx.folders["big"] or "", {
                "runs": 3,
                "single": {"max_tokens": BIG_MAX_TOKENS},
                "batch": {"max_tokens": BIG_MAX_TOKENS, "levels": [8], "runs": 2},
            }, "big")
            r.extras.big_single_tps = stat(big["single"]["stream_tps"], "tok/s")
            r.extras.big_agg_tps_c8 = stat(big["batch"]["8"]["agg_tps"], "tok/s")
        except Exception as exc:
            r.extras.big_single_tps = null(f"failed: {exc}")
    ctx.load_note("raw-end")
