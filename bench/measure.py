"""The measurements one server phase makes over HTTP, each returning its typed results.

Every system is driven by the same client and the same request bodies, so a difference
in a row is the server's; a measurement that fails keeps the first error it saw as the
reason of its null values.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from bench import client, servers, workload
from bench.plan import Ctx
from bench.results import Flood, Level, Prefix, SingleStream, Ttft, fmt, stat
from bench.sampler import RawSampler

HOST = servers.HOST


def first_error(results: list[client.StreamResult]) -> str | None:
    for r in results:
        if not r.ok:
            return r.error or f"HTTP {r.status}, no content"
    return None


@dataclass
class Batch:
    """Streams started together: aggregate rates, or the first error among them."""

    error: str | None = None
    agg_tps: float | None = None
    decode_agg_tps: float | None = None
    tokens: int = 0
    wall: float = 0.0
    ttft: float | None = None
    chunks_per_token: float | None = None
    results: list[client.StreamResult] = field(default_factory=list)


async def concurrent(port: int, bodies: list[dict[str, Any]], timeout: float) -> Batch:
    rs = await asyncio.gather(*(client.stream_chat(HOST, port, b, timeout=timeout)
                                for b in bodies))
    error = first_error(list(rs))
    if error:
        return Batch(error=error)
    wall = max(r.t_end for r in rs) - min(r.t_send for r in rs)
    tokens = sum(r.tokens for r in rs)
    # Decoding only: from the first stream's first token to the last stream's last one.
    span = max(r.t_last for r in rs) - min(r.t_first for r in rs)
    after_first = sum(max(r.tokens - 1, 0) for r in rs)
    return Batch(
        agg_tps=tokens / wall if wall > 0 else None,
        decode_agg_tps=after_first / span if span > 0 and after_first else None,
        tokens=tokens,
        wall=wall,
        ttft=statistics.median(r.ttft for r in rs),
        chunks_per_token=sum(r.chunks for r in rs) / tokens if tokens else None,
        results=list(rs),
    )


async def warm_up(port: int, tag: str, timeout: float) -> None:
    for i in range(2):
        await client.stream_chat(HOST, port, workload.chat_body(
            workload.messages(workload.prompt(f"{tag}-warm", i)), 16), timeout=timeout)
    await concurrent(port, [workload.chat_body(
        workload.messages(workload.prompt(f"{tag}-warmb", i)), 16) for i in range(4)], timeout)


async def m_single(ctx: Ctx, port: int, tag: str) -> SingleStream:
    p = ctx.plan
    rs = []
    for i in range(p.runs):
        body = workload.chat_body(workload.messages(workload.prompt(f"{tag}-single", i)),
                                  p.max_tokens)
        rs.append(await client.stream_chat(HOST, port, body, timeout=p.timeout))
    ok = [r for r in rs if r.ok]
    why = first_error(rs)
    return SingleStream(
        # Delivered rate: robust to a server that coalesces tokens into fewer chunks.
        tps=stat([r.stream_tps for r in ok], "tok/s", reason=why),
        decode_interval_tps=stat([r.decode_tps for r in ok], "tok/s", reason=why),
        e2e_tps=stat([r.e2e_tps for r in ok], "tok/s", reason=why),
        ttft_ms=stat([r.ttft for r in ok], "ms", scale=1000, reason=why),
        chunks_per_token=stat([r.chunks / r.tokens for r in ok if r.tokens],
                              "chunks/token", reason=why),
        reads_per_token=stat([r.reads / r.tokens for r in ok if r.tokens],
                             "reads/token", reason=why),
        tokens=[r.tokens for r in ok],
    )


async def m_ttft(ctx: Ctx, port: int, tag: str, *, afmd: bool = False) -> Ttft:
    """Short unique prompts one at a time; afmd is asked for its X-AFM-Profile event,
    which splits its TTFT into arrival → engine admission → first token."""
    p = ctx.plan
    rs = []
    paired: list[float | None] = []
    headers = {"X-AFM-Profile": "true"} if afmd else None
    raw = (ctx.sampler or await RawSampler.start(ctx)) if afmd else None
    try:
        for i in range(p.ttft_runs):
            text = workload.prompt(f"{tag}-ttft", i)
            body = workload.chat_body(workload.messages(text), p.ttft_max_tokens)
            rs.append(await client.stream_chat(HOST, port, body, timeout=p.timeout,
                                               headers=headers))
            if raw is not None:  # the server is idle now: one raw sample right after
                paired.append(await raw.ttft(text, p.ttft_max_tokens))
    finally:
        if raw is not None and ctx.plan.paired_reuse:
            ctx.sampler = raw  # the rounds in turns sample the same process
        elif raw is not None:
            await raw.stop()
    ok = [r for r in rs if r.ok]
    out = Ttft(ms=stat([r.ttft for r in ok], "ms", scale=1000, reason=first_error(rs)))
    if paired:
        pairs = [(r.ttft, x) for r, x in zip(rs, paired, strict=True) if r.ok and x]
        out.paired_raw_ms = stat([x for _, x in pairs], "ms", scale=1000)
        out.paired_diff_ms = stat([a - x for a, x in pairs], "ms", scale=1000)
    prof = [(r, r.profile) for r in ok if r.profile]
    if prof:
        # Server side: request parsed → engine admitted it (render, plan, queue, hand-off);
        # admitted → first token (engine: prefix lookup, prefill, first step); the rest of
        # the client's TTFT is HTTP in, the loop hand-off of the first token and HTTP out.
        out.server_queue_ms = stat([x["queue_ms"] for _, x in prof], "ms")
        out.server_engine_ms = stat([x["ttft_ms"] - x["queue_ms"] for _, x in prof], "ms")
        out.outside_server_ms = stat([r.ttft * 1000 - x["ttft_ms"] for r, x in prof], "ms")
    return out


async def m_levels(ctx: Ctx, port: int, tag: str, levels: tuple[int, ...]
                   ) -> dict[int, Level]:
    p = ctx.plan
    out: dict[int, Level] = {}
    for c in levels:
        runs = []
        for r in range(p.batch_runs):
            bodies = [workload.chat_body(
                workload.messages(workload.prompt(f"{tag}-c{c}-{r}", i)), p.max_tokens)
                for i in range(c)]
            runs.append(await concurrent(port, bodies, p.timeout))
        why = next((x.error for x in runs if x.error is not None), None)
        good = [x for x in runs if x.error is None]
        out[c] = Level(
            tps=stat([x.agg_tps for x in good], "tok/s", reason=why),
            ttft_ms=stat([x.ttft for x in good], "ms", scale=1000, reason=why),
            chunks_per_token=stat([x.chunks_per_token for x in good], "chunks/token",
                                  reason=why),
        )
        ctx.log(f"    c={c}: {fmt(out[c].tps)}")
    return out


async def m_prefix(ctx: Ctx, port: int, tag: str) -> Prefix:
    p = ctx.plan
    assert ctx.counter is not None
    firsts: list[float | None] = []
    seconds: list[float | None] = []
    ratios: list[float | None] = []
    cached: list[int | None] = []
    prompts: list[Any] = []
    why = None
    for i in range(p.prefix_runs):
        conv = workload.prefix_conversation(f"{tag}-prefix-{i}-{time.time_ns()}",
                                            p.prefix_tokens, ctx.counter)
        one = await client.stream_chat(HOST, port,
                                       workload.chat_body(conv, p.prefix_max_tokens),
                                       timeout=p.timeout)
        if not one.ok:
            why = why or one.error
            continue
        two = await client.stream_chat(
            HOST, port, workload.chat_body(workload.second_turn(conv, one.text),
                                           p.prefix_max_tokens), timeout=p.timeout)
        if not two.ok:
            why = why or two.error
            continue
        firsts.append(one.ttft)
        seconds.append(two.ttft)
        ratios.append(two.ttft / one.ttft)
        cached.append(two.cached_tokens)
        prompts.append([one.prompt_tokens, two.prompt_tokens])
    return Prefix(
        first_ms=stat(firsts, "ms", scale=1000, reason=why),
        second_ms=stat(seconds, "ms", scale=1000, reason=why),
        ratio_pct=stat(ratios, "%", scale=100, reason=why),
        cached_tokens=cached,
        prompt_tokens=prompts,
    )


async def m_rps(ctx: Ctx, port: int, paths: dict[str, str]) -> dict[str, Flood]:
    """Requests/s per path, keyed by the name the document stores it under."""
    p = ctx.plan
    out: dict[str, Flood] = {}
    for name, path in paths.items():
        runs = []
        for _ in range(p.rps_runs):
            runs.append(await client.hammer(HOST, port, path, connections=p.rps_connections,
                                            duration=p.rps_seconds))
        out[name] = Flood(rps=stat([r["rps"] if r["requests"] else None for r in runs],
                                   "req/s", reason="no successful response"),
                          detail=runs)
    return out
