"""afmd under sustained and hostile load: the memory soak and the slowloris rows.

Both are afmd's own scripts (``bench/soak.py``, ``bench/slowloris.py``), run here as
phases of the benchmark so their numbers sit in the same results document as the speed
rows, with the plan's sizes (``Plan.soak_*``, ``Plan.slowloris_*``). Each starts its own
afmd on the built-in demo model from the harness's model cache, because each needs a
configuration of its own (the soak bounds concurrency, the slowloris meets the connection
limit), and a failure is recorded as the row's reason without stopping the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import traceback
from typing import Any

from afmd.config.sections import ServerConfig
from bench import servers, slowloris, soak
from bench.plan import Ctx
from bench.results import Slowloris, Soak, null, stat

SOAK_SEED = 0


def _failed(ctx: Ctx, label: str, exc: Exception) -> str:
    ctx.log(f"  ! afmd {label} failed: {exc!r}")
    ctx.res.afmd.errors[label] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
    return f"failed: {type(exc).__name__}: {exc}".splitlines()[0]


async def bench_soak(ctx: Ctx) -> None:
    """Rounds of mixed requests; RSS after each, and the growth over the second half."""
    p = ctx.plan
    setup: dict[str, Any] = {"model": soak.MODEL, "rounds": p.soak_rounds,
                             "requests_per_round": p.soak_requests,
                             "concurrency": p.soak_concurrency, "settle_s": p.soak_settle_s,
                             "seed": SOAK_SEED}
    ctx.load_note("soak-start")
    try:
        (ctx.work / "soak").mkdir(parents=True, exist_ok=True)
        server = await asyncio.to_thread(
            soak.start_server, ctx.work / "soak", model=soak.MODEL,
            concurrency=p.soak_concurrency, settings={}, launcher=None, cache_dir=ctx.cache)
        try:
            if p.soak_footprint:
                await _footprint(ctx, server)
            rounds = await soak.soak(
                server, rounds=p.soak_rounds, requests=p.soak_requests,
                concurrency=p.soak_concurrency, seed=SOAK_SEED, max_seconds=p.soak_max_seconds,
                settle_s=p.soak_settle_s, log=lambda line: ctx.log("    " + line))
        except Exception as exc:
            if server.alive():
                raise
            # A crash is what the soak is for: say so, with the server's last words.
            raise RuntimeError(
                f"afmd exited with {server.proc.returncode if server.proc else '?'} "
                f"mid-soak ({type(exc).__name__}: {exc}):\n{server.log_tail(30)}") from exc
        finally:
            await asyncio.to_thread(server.stop)
    except Exception as exc:
        reason = _failed(ctx, "soak", exc)
        a = ctx.res.afmd.footprint
        if p.soak_footprint and a.rss_idle_demo_mb is None:
            a.cold_start_demo_s = a.rss_idle_demo_mb = null(reason)
        ctx.res.afmd.soak = Soak(growth_pct=null(reason, "%"), growth_mib=null(reason, "MiB"),
                                 setup=setup)
        return
    finally:
        ctx.load_note("soak-end")
    flat = soak.plateau(rounds)
    why = f"only {rounds[-1].round} round(s) ran: a plateau needs two"
    ctx.res.afmd.soak = Soak(
        growth_pct=stat([flat.growth_pct], "%") if flat else null(why, "%"),
        growth_mib=stat([flat.growth_mib], "MiB") if flat else null(why, "MiB"),
        rss_mib=[round(r.rss_mib, 1) for r in rounds],
        rounds=[dataclasses.asdict(r) for r in rounds],
        outcomes=soak.outcome_summary(rounds),
        setup={**setup, "plateau": dataclasses.asdict(flat) if flat else None},
    )
    ctx.log(f"  soak plateau: {flat.text() if flat else why}")


async def _footprint(ctx: Ctx, server: servers.Server) -> None:
    """The footprint phase's demo-model row, measured as ``footprint.idle_rss`` does, on
    the soak's server before its first request: a fresh afmd on the same model, so one
    start serves both (``Plan.soak_footprint``)."""
    a = ctx.res.afmd.footprint
    a.cold_start_demo_s = stat([server.ready_after], "s", reason="no ready time")
    await asyncio.sleep(0.5)
    a.rss_idle_demo_mb = stat([servers.rss_mb(server.pid)], "MiB", reason="/proc unavailable")


async def bench_slowloris(ctx: Ctx) -> None:
    """Legitimate clients' share of 200s while attackers hold and re-take the slots."""
    p = ctx.plan
    default = ServerConfig()
    max_connections = p.slowloris_max_connections
    setup: dict[str, Any] = {
        "attackers": p.slowloris_attackers, "legit_clients": p.slowloris_legit,
        "seconds": p.slowloris_seconds, "warmup_s": p.slowloris_warmup,
        "byte_interval_s": slowloris.BYTE_INTERVAL,
        "reconnect_delay_s": slowloris.RECONNECT_DELAY,
        "chat_every": slowloris.CHAT_EVERY,
        "max_connections": max_connections or default.max_connections,
        "max_connections_is_default": max_connections is None,
        "idle_timeout_s": default.idle_timeout,
    }
    ctx.load_note("slowloris-start")
    try:
        proc, port, _ = await asyncio.to_thread(
            slowloris.start_afmd, ctx.work / "slowloris", max_connections, cache_dir=ctx.cache)
        try:
            stats = await slowloris.attack(
                port, attackers=p.slowloris_attackers, legit_clients=p.slowloris_legit,
                seconds=p.slowloris_seconds, warmup=p.slowloris_warmup)
        finally:
            await asyncio.to_thread(slowloris.stop_afmd, proc)
    except Exception as exc:
        reason = _failed(ctx, "slowloris", exc)
        ctx.res.afmd.slowloris = Slowloris(legit_success_pct=null(reason, "%"), summary=setup)
        return
    finally:
        ctx.load_note("slowloris-end")
    counts = stats.summary()
    p95 = counts["latency_ms_p95"]
    ctx.res.afmd.slowloris = Slowloris(
        legit_success_pct=stat([counts["legit_success"]] if stats.tries else [], "%",
                               scale=100, reason="no legitimate request was sent"),
        latency_ms_p95=stat([p95], "ms", reason="no legitimate request was answered"),
        summary={**setup, **counts},
    )
    ctx.log(f"  slowloris: {stats.ok}/{stats.tries} legitimate requests answered 200 "
            f"against {p.slowloris_attackers} attackers ({counts['attack_connections']} "
            f"attack connections), p95 {p95} ms")
