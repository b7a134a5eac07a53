"""afmd under py-spy and both servers under strace, while they serve known work.

The profile explains a row rather than being one: where afmd's threads spend their time
at one stream, eight, eight constrained and a /health flood, and how many syscalls each
streamed token costs each server. Missing tools give a ``skipped`` reason, not a failure.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from bench import client, profile, servers, workload
from bench.measure import HOST, concurrent
from bench.plan import Ctx

perf = time.perf_counter


async def m_strace(ctx: Ctx, srv: servers.Server, tag: str, streams: int) -> dict[str, Any]:
    """Syscalls per streamed token while ``streams`` streams run (strace -c -f)."""
    out = ctx.work / f"strace-{srv.name}-{streams}.txt"
    proc = await profile.strace_start(srv.pid, out)
    if proc is None:
        return {"skipped": "strace not installed"}
    try:
        bodies = [workload.chat_body(workload.messages(workload.prompt(f"{tag}-strace", i)),
                                     min(ctx.plan.max_tokens, 128)) for i in range(streams)]
        res = await concurrent(srv.port, bodies, ctx.plan.timeout * 4)
    finally:
        await profile.strace_stop(proc)
    calls = profile.parse_strace(out)
    if res.error is not None or not calls:
        return {"skipped": res.error or "strace produced no counts (ptrace denied?)"}
    tokens = res.tokens
    top = sorted(calls.items(), key=lambda kv: -kv[1])[:12]
    return {"streams": streams, "tokens": tokens,
            "per_token": {name: round(n / tokens, 2) for name, n in top},
            "total_per_token": round(sum(calls.values()) / tokens, 2)}


async def strace_both(ctx: Ctx, srv: servers.Server, system: str) -> dict[str, Any]:
    return {"1": await m_strace(ctx, srv, system, 1),
            "8": await m_strace(ctx, srv, system, 8)}


async def profile_afmd(ctx: Ctx, srv: servers.Server) -> dict[str, Any]:
    """py-spy while afmd serves one stream, eight, eight constrained, then /health."""
    p = ctx.plan
    rate = 200

    def streams(n: int, kind: str = "unconstrained") -> Callable[[int], list[dict[str, Any]]]:
        def bodies(i: int) -> list[dict[str, Any]]:
            return [workload.grammar_bodies(workload.prompt(f"prof-{n}-{kind}-{i}", j),
                                            p.max_tokens)[kind] for j in range(n)]
        return bodies

    scenarios: list[tuple[str, Callable[[int], list[dict[str, Any]]] | None]] = [
        ("1", streams(1)), ("8", streams(8)), ("8-json_schema", streams(8, "json_schema")),
        ("health", None),
    ]
    results: dict[str, Any] = {}
    for label, make in scenarios:
        out = ctx.work / f"pyspy-afmd-{label}.txt"
        proc = await profile.pyspy_record(srv.pid, p.profile_seconds, out, rate)
        if proc is None:
            return {"skipped": "py-spy not installed (pip install py-spy)"}
        await asyncio.sleep(0.5)
        t0 = perf()
        tokens = 0
        requests = 0
        if make is None:
            res = await client.hammer(HOST, srv.port, "/health",
                                      connections=p.rps_connections,
                                      duration=p.profile_seconds)
            requests = res["requests"]
        else:
            i = 0
            while perf() - t0 < p.profile_seconds and proc.returncode is None:
                tokens += (await concurrent(srv.port, make(i), p.timeout)).tokens
                i += 1
        seconds = perf() - t0
        _, err = await proc.communicate()
        if not out.exists():
            results[label] = {"skipped": f"py-spy failed: {err.decode()[-300:]}"}
            continue
        summary = profile.summarize_pyspy(out, rate, p.profile_seconds)
        what = (f"{requests} /health requests" if make is None else None)
        results[label] = {
            "seconds": round(seconds, 1), "tokens": tokens, "requests": requests,
            "tok_per_s_under_profiler": round(tokens / seconds, 1) if tokens else None,
            "threads": summary, "raw_file": out.name,
            "text": profile.describe(summary, f"{label} stream(s)" if make else "/health",
                                     tokens or None, p.profile_seconds)
            + (f"\n  ({what})" if what else ""),
        }
    return results
