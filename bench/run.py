"""One command: how much of the raw engine speed afmd delivers, against mlx_lm.server.

    python bench/run.py             # full run (about 10-15 minutes on 2 cores)
    python bench/run.py --quick     # under 2 minutes; what CI runs
    python bench/run.py --help

Builds the tiny random models itself (``afmd.engine.demo.materialize``), starts afmd and
``mlx_lm.server`` on the same model, one at a time, each on a free port, drives both with
the same asyncio client, measures raw in-process mlx-lm as the ceiling, and writes
``<out>/<date>-<host>.json``, ``.md`` and ``.png``. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import client, profile, report, servers, workload  # noqa: E402

HOST = servers.HOST
perf = time.perf_counter
SYSTEMS = ("afmd", "mlx_lm_server", "raw")
LEVELS = (1, 2, 4, 8, 16)
GRAMMAR_KINDS = ("json_schema", "tool_required")
BIG_MAX_TOKENS = 64


@dataclass
class Plan:
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
    rps_seconds: float
    rps_runs: int
    rps_connections: int
    big: bool
    access_log: bool
    profile: bool
    profile_seconds: float
    timeout: float  # per streamed request

    @classmethod
    def make(cls, args: argparse.Namespace) -> Plan:
        if args.quick:
            plan = cls(quick=True, runs=2, batch_runs=2, max_tokens=32, levels=(1, 8),
                       ttft_runs=3, ttft_max_tokens=4, prefix_tokens=1000, prefix_runs=1,
                       prefix_max_tokens=8, grammar_runs=1, grammar_max_tokens=32,
                       grammar_batch=8, grammar_alone=1, paired_runs=1, paired_batch_runs=1,
                       paired_ttft_runs=3,
                       rps_seconds=0.5, rps_runs=1,
                       rps_connections=32, big=False,
                       access_log=False, profile=False, profile_seconds=0.0, timeout=120.0)
        else:
            plan = cls(quick=False, runs=5, batch_runs=3, max_tokens=256, levels=LEVELS,
                       ttft_runs=25, ttft_max_tokens=4, prefix_tokens=2000, prefix_runs=5,
                       prefix_max_tokens=32, grammar_runs=8, grammar_max_tokens=256,
                       grammar_batch=8, grammar_alone=4, paired_runs=9, paired_batch_runs=4,
                       paired_ttft_runs=30,
                       rps_seconds=3.0, rps_runs=3, rps_connections=32, big=True,
                       access_log=True, profile=True, profile_seconds=8.0, timeout=300.0)
        if args.runs:
            plan.runs = plan.batch_runs = plan.prefix_runs = plan.grammar_runs = args.runs
        if args.max_tokens:
            plan.max_tokens = plan.grammar_max_tokens = args.max_tokens
        if args.no_big:
            plan.big = False
        if args.no_profile:
            plan.profile = False
        return plan


# -- statistics --------------------------------------------------------------------------


def stat(values: list[float | None], unit: str, *, scale: float = 1.0,
         reason: str | None = None) -> dict[str, Any]:
    vals = [v * scale for v in values if v is not None]
    if not vals:
        return null(reason or "no successful run", unit)
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
        "runs": [round(v, 4) for v in vals],
        "unit": unit,
    }


def null(reason: str, unit: str = "", *, na: bool = False) -> dict[str, Any]:
    """No value, and why; ``na`` marks a row that does not apply to the system."""
    out: dict[str, Any] = {"median": None, "reason": reason, "unit": unit}
    if na:
        out["not_applicable"] = True
    return out


def med(v: dict[str, Any] | None) -> float | None:
    return None if not v else v.get("median")


def _first_error(results: list[client.StreamResult]) -> str | None:
    for r in results:
        if not r.ok:
            return r.error or f"HTTP {r.status}, no content"
    return None


# -- measurements over HTTP --------------------------------------------------------------


@dataclass
class Ctx:
    plan: Plan
    work: Path
    cache: Path
    folders: dict[str, str | None]
    m: dict[str, dict[str, Any]] = field(default_factory=lambda: {s: {} for s in SYSTEMS})
    extra: dict[str, Any] = field(default_factory=dict)
    loads: dict[str, list[float]] = field(default_factory=dict)
    counter: workload.TokenCounter | None = None
    log: Callable[[str], None] = print


async def concurrent(port: int, bodies: list[dict[str, Any]], timeout: float
                     ) -> dict[str, Any]:
    rs = await asyncio.gather(*(client.stream_chat(HOST, port, b, timeout=timeout)
                                for b in bodies))
    error = _first_error(list(rs))
    if error:
        return {"error": error}
    wall = max(r.t_end for r in rs) - min(r.t_send for r in rs)
    tokens = sum(r.tokens for r in rs)
    # Decoding only: from the first stream's first token to the last stream's last one.
    span = max(r.t_last for r in rs) - min(r.t_first for r in rs)
    after_first = sum(max(r.tokens - 1, 0) for r in rs)
    return {
        "agg_tps": tokens / wall if wall > 0 else None,
        "decode_agg_tps": after_first / span if span > 0 and after_first else None,
        "tokens": tokens,
        "wall": wall,
        "ttft": statistics.median(r.ttft for r in rs),
        "chunks_per_token": sum(r.chunks for r in rs) / tokens if tokens else None,
        "results": rs,
    }


async def warm_up(port: int, tag: str, timeout: float) -> None:
    for i in range(2):
        await client.stream_chat(HOST, port, workload.chat_body(
            workload.messages(workload.prompt(f"{tag}-warm", i)), 16), timeout=timeout)
    await concurrent(port, [workload.chat_body(
        workload.messages(workload.prompt(f"{tag}-warmb", i)), 16) for i in range(4)], timeout)


async def m_single(ctx: Ctx, port: int, tag: str) -> dict[str, Any]:
    p = ctx.plan
    rs = []
    for i in range(p.runs):
        body = workload.chat_body(workload.messages(workload.prompt(f"{tag}-single", i)),
                                  p.max_tokens)
        rs.append(await client.stream_chat(HOST, port, body, timeout=p.timeout))
    ok = [r for r in rs if r.ok]
    why = _first_error(rs)
    return {
        # Delivered rate: robust to a server that coalesces tokens into fewer chunks.
        "single_tps": stat([r.stream_tps for r in ok], "tok/s", reason=why),
        "single_decode_interval_tps": stat([r.decode_tps for r in ok], "tok/s", reason=why),
        "single_e2e_tps": stat([r.e2e_tps for r in ok], "tok/s", reason=why),
        "single_ttft_ms": stat([r.ttft for r in ok], "ms", scale=1000, reason=why),
        "single_chunks_per_token": stat([r.chunks / r.tokens for r in ok if r.tokens],
                                        "chunks/token", reason=why),
        "single_reads_per_token": stat([r.reads / r.tokens for r in ok if r.tokens],
                                       "reads/token", reason=why),
        "single_tokens": [r.tokens for r in ok],
    }


class RawSampler:
    """A raw mlx-lm process (bench/raw_engine.py sample-server) sampled between requests."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, ctx: Ctx) -> RawSampler | None:
        folder = ctx.folders.get("demo-32k")
        if not folder:
            return None
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(ROOT / "bench" / "raw_engine.py"), "sample-server", folder,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, cwd=str(ROOT))
        assert proc.stdout is not None
        try:
            async with asyncio.timeout(120):
                while (await proc.stdout.readline()).strip() != b"ready":
                    if proc.stdout.at_eof():
                        raise RuntimeError("raw sample-server exited")
        except (TimeoutError, RuntimeError) as exc:
            ctx.log(f"  ! paired raw samples unavailable: {exc}")
            proc.kill()
            return None
        return cls(proc)

    async def sample(self, prompt: str, max_tokens: int, *, stop_after: int | None = None
                     ) -> dict[str, Any] | None:
        """One generation's timings: ttft, stream_tps, decode_tps, tokens."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens,
                                          "stop_after": stop_after}).encode() + b"\n")
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        return json.loads(line) if line else None

    async def ttft(self, prompt: str, max_tokens: int) -> float | None:
        res = await self.sample(prompt, max_tokens, stop_after=1)
        return res["ttft"] if res else None

    async def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                await self.proc.wait()
                return
        self.proc.kill()


async def m_ttft(ctx: Ctx, port: int, tag: str, *, afmd: bool = False) -> dict[str, Any]:
    """Short unique prompts one at a time; afmd is asked for its X-AFM-Profile event,
    which splits its TTFT into arrival → engine admission → first token."""
    p = ctx.plan
    rs = []
    paired: list[float | None] = []
    headers = {"X-AFM-Profile": "true"} if afmd else None
    raw = await RawSampler.start(ctx) if afmd else None
    try:
        for i in range(p.ttft_runs):
            text = workload.prompt(f"{tag}-ttft", i)
            body = workload.chat_body(workload.messages(text), p.ttft_max_tokens)
            rs.append(await client.stream_chat(HOST, port, body, timeout=p.timeout,
                                               headers=headers))
            if raw is not None:  # the server is idle now: one raw sample right after
                paired.append(await raw.ttft(text, p.ttft_max_tokens))
    finally:
        if raw is not None:
            await raw.stop()
    ok = [r for r in rs if r.ok]
    out = {"ttft_ms": stat([r.ttft for r in ok], "ms", scale=1000, reason=_first_error(rs))}
    if paired:
        pairs = [(r.ttft, x) for r, x in zip(rs, paired, strict=True) if r.ok and x]
        out["ttft_paired_raw_ms"] = stat([x for _, x in pairs], "ms", scale=1000)
        out["ttft_paired_diff_ms"] = stat([a - x for a, x in pairs], "ms", scale=1000)
    prof = [(r, r.profile) for r in ok if r.profile]
    if prof:
        # Server side: request parsed → engine admitted it (render, plan, queue, hand-off);
        # admitted → first token (engine: prefix lookup, prefill, first step); the rest of
        # the client's TTFT is HTTP in, the loop hand-off of the first token and HTTP out.
        out["ttft_server_queue_ms"] = stat([x["queue_ms"] for _, x in prof], "ms")
        out["ttft_server_engine_ms"] = stat([x["ttft_ms"] - x["queue_ms"] for _, x in prof],
                                            "ms")
        out["ttft_outside_server_ms"] = stat([r.ttft * 1000 - x["ttft_ms"] for r, x in prof],
                                             "ms")
    return out


async def m_levels(ctx: Ctx, port: int, tag: str, levels: tuple[int, ...]
                   ) -> dict[str, Any]:
    p = ctx.plan
    out: dict[str, Any] = {}
    for c in levels:
        runs = []
        for r in range(p.batch_runs):
            bodies = [workload.chat_body(
                workload.messages(workload.prompt(f"{tag}-c{c}-{r}", i)), p.max_tokens)
                for i in range(c)]
            runs.append(await concurrent(port, bodies, p.timeout))
        why = next((x["error"] for x in runs if "error" in x), None)
        good = [x for x in runs if "error" not in x]
        out[f"agg_tps_c{c}"] = stat([x["agg_tps"] for x in good], "tok/s", reason=why)
        out[f"agg_ttft_ms_c{c}"] = stat([x["ttft"] for x in good], "ms", scale=1000,
                                        reason=why)
        out[f"agg_chunks_per_token_c{c}"] = stat([x["chunks_per_token"] for x in good],
                                                 "chunks/token", reason=why)
        ctx.log(f"    c={c}: {fmt(out[f'agg_tps_c{c}'])}")
    return out


async def m_prefix(ctx: Ctx, port: int, tag: str) -> dict[str, Any]:
    p = ctx.plan
    assert ctx.counter is not None
    firsts, seconds, ratios, cached, prompts = [], [], [], [], []
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
    return {
        "prefix_first_ms": stat(firsts, "ms", scale=1000, reason=why),
        "prefix_second_ms": stat(seconds, "ms", scale=1000, reason=why),
        "prefix_ratio_pct": stat(ratios, "%", scale=100, reason=why),
        "prefix_cached_tokens": cached,
        "prefix_prompt_tokens": prompts,
    }


async def m_grammar(ctx: Ctx, port: int, tag: str) -> dict[str, Any]:
    """Each constrained request, then its unconstrained twin held to the same length.

    A grammar ends its output when the value is complete (a json_schema record here is
    100-256 tokens), while free text runs to max_tokens; a batch whose rows finish early
    decodes its tail with fewer rows, so unequal lengths alone made a constrained batch
    look ~10% slower. Each twin (for tools, the tool block as text) gets, row
    by row, max_tokens = the tokens its constrained request produced, and a prompt of its
    own (see ``_bodies``). The order of the two grammar kinds alternates run by run so
    drift hits both alike.
    """
    p = ctx.plan
    mt = p.grammar_max_tokens
    kinds = ("unconstrained", "tools_as_text", *GRAMMAR_KINDS)
    # Warm-up: the first constrained request builds llguidance's tokenizer view.
    for k in kinds:
        await client.stream_chat(HOST, port, workload.grammar_bodies(
            workload.prompt(f"{tag}-gwarm"), 16)[k], timeout=p.timeout)
    alone: dict[str, list[client.StreamResult]] = {k: [] for k in kinds}
    batch: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for r in range(p.grammar_runs):
        order = GRAMMAR_KINDS if r % 2 == 0 else GRAMMAR_KINDS[::-1]
        for a in range(p.grammar_alone):
            for k in order:
                i = r * p.grammar_alone + a
                twin = workload.GRAMMAR_BASELINE[k]
                body = _bodies(tag, "g", k, i, mt)[k]
                done = await client.stream_chat(HOST, port, body, timeout=p.timeout)
                alone[k].append(done)
                body = _held_to(_bodies(tag, "u", k, i, mt)[twin], done, mt)
                alone[twin].append(await client.stream_chat(HOST, port, body,
                                                            timeout=p.timeout))
        for k in order:
            twin = workload.GRAMMAR_BASELINE[k]
            n = p.grammar_batch
            done_batch = await concurrent(
                port, [_bodies(tag, f"gb{r}", k, i, mt)[k] for i in range(n)], p.timeout)
            batch[k].append(done_batch)
            rows = done_batch.get("results") or [None] * n
            batch[twin].append(await concurrent(
                port, [_held_to(_bodies(tag, f"ub{r}", k, i, mt)[twin], d, mt)
                       for i, d in enumerate(rows)], p.timeout))
    out: dict[str, Any] = {}
    for k in kinds:
        why = _first_error(alone[k])
        out[f"grammar_{k}_alone_tps"] = stat(
            [r.e2e_tps if r.ok else None for r in alone[k]], "tok/s", reason=why)
        out[f"grammar_{k}_alone_decode_tps"] = stat(
            [r.decode_tps if r.ok else None for r in alone[k]], "tok/s", reason=why)
        out[f"grammar_{k}_prompt_tokens"] = [r.prompt_tokens for r in alone[k]]
        out[f"grammar_{k}_alone_tokens"] = [r.tokens for r in alone[k]]
        out[f"grammar_{k}_alone_finish"] = [r.finish_reason for r in alone[k]]
        bwhy = next((x["error"] for x in batch[k] if "error" in x), None)
        out[f"grammar_{k}_batch_tps"] = stat(
            [x.get("agg_tps") for x in batch[k]], "tok/s", reason=bwhy)
        out[f"grammar_{k}_batch_decode_tps"] = stat(
            [x.get("decode_agg_tps") for x in batch[k]], "tok/s", reason=bwhy)
        if k not in GRAMMAR_KINDS:
            continue
        # Against the same prompt without a grammar (workload.GRAMMAR_BASELINE): end to
        # end, the verdict, and the decode phase alone (prefill excluded), for the detail.
        base_alone = alone[workload.GRAMMAR_BASELINE[k]]
        base_batch = batch[workload.GRAMMAR_BASELINE[k]]
        for suffix, attr in (("", "e2e_tps"), ("_decode", "decode_tps")):
            pairs = [(getattr(c, attr), getattr(u, attr))
                     for c, u in zip(alone[k], base_alone, strict=True) if c.ok and u.ok]
            out[f"grammar_{k}_alone{suffix}_pct"] = stat(
                [c / u for c, u in pairs if c and u], "%", scale=100,
                reason=why or _first_error(base_alone))
            field = "agg_tps" if attr == "e2e_tps" else "decode_agg_tps"
            bpairs = [(c.get(field), u.get(field)) for c, u in
                      zip(batch[k], base_batch, strict=True)]
            out[f"grammar_{k}_batch{suffix}_pct"] = stat(
                [c / u for c, u in bpairs if c and u], "%", scale=100, reason=bwhy)
        if k == "json_schema":
            out["grammar_json_valid"] = [_valid_json(r) for r in alone[k] if r.ok]
    return out


def _bodies(tag: str, group: str, kind: str, i: int, max_tokens: int
            ) -> dict[str, dict[str, Any]]:
    """``workload.grammar_bodies`` for a prompt unique to (group, kind, i).

    A constrained request and its twin get different prompts of the same length: with
    one prompt, the twin (sent second) would be a full prefix-cache hit.
    """
    return workload.grammar_bodies(workload.prompt(f"{tag}-{group}-{kind}", i), max_tokens)


def _held_to(body: dict[str, Any], done: client.StreamResult | None, default: int
             ) -> dict[str, Any]:
    """``body`` limited to as many tokens as ``done`` (its constrained twin) produced."""
    n = done.tokens if done is not None and done.ok and done.tokens > 0 else default
    return {**body, "max_tokens": n}


def _valid_json(r: client.StreamResult) -> bool | None:
    if r.finish_reason != "stop":
        return None  # cut by max_tokens: incomplete by design
    try:
        json.loads(r.text)
    except ValueError:
        return False
    return True


async def m_rps(ctx: Ctx, port: int, paths: dict[str, str]) -> dict[str, Any]:
    p = ctx.plan
    out: dict[str, Any] = {}
    for key, path in paths.items():
        runs = []
        for _ in range(p.rps_runs):
            runs.append(await client.hammer(HOST, port, path, connections=p.rps_connections,
                                            duration=p.rps_seconds))
        out[key] = stat([r["rps"] if r["requests"] else None for r in runs], "req/s",
                        reason="no successful response")
        out[key + "_detail"] = runs
    return out


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
    if "error" in res or not calls:
        return {"skipped": res.get("error") or "strace produced no counts (ptrace denied?)"}
    tokens = res["tokens"]
    top = sorted(calls.items(), key=lambda kv: -kv[1])[:12]
    return {"streams": streams, "tokens": tokens,
            "per_token": {name: round(n / tokens, 2) for name, n in top},
            "total_per_token": round(sum(calls.values()) / tokens, 2)}


# -- one server at a time ----------------------------------------------------------------


async def guarded(ctx: Ctx, system: str, label: str, coro: Awaitable[dict[str, Any]]
                  ) -> None:
    t0 = perf()
    try:
        ctx.m[system].update(await coro)
    except Exception as exc:
        ctx.log(f"  ! {system} {label} failed: {exc!r}")
        ctx.m[system].setdefault("_errors", {})[label] = (
            f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
        )
    else:
        ctx.log(f"  {system} {label}: {perf() - t0:.1f} s")


def load_note(ctx: Ctx, label: str) -> None:
    ctx.loads[label] = [round(x, 2) for x in os.getloadavg()]


async def bench_http(ctx: Ctx, system: str, srv: servers.Server, *, grammar: bool) -> None:
    p = ctx.plan
    load_note(ctx, f"{system}-start")
    srv.start()
    try:
        ready = await srv.ready()
        ctx.m[system]["cold_start_s"] = stat([ready], "s")
        await asyncio.sleep(0.3)
        ctx.m[system]["rss_idle_32k_mb"] = stat([servers.rss_mb(srv.pid)], "MiB")
        idle_s = 1.0 if p.quick else 5.0
        c0 = servers.cpu_seconds(srv.pid)
        await asyncio.sleep(idle_s)
        c1 = servers.cpu_seconds(srv.pid)
        ctx.m[system]["idle_cpu_pct"] = stat(
            [None if c0 is None or c1 is None else (c1 - c0) / idle_s], "% of a core",
            scale=100, reason="/proc unavailable")
        ctx.log(f"  {system} ready in {ready:.1f} s (pid {srv.pid}, port {srv.port})")
        await warm_up(srv.port, system, p.timeout)
        await guarded(ctx, system, "single-stream", m_single(ctx, srv.port, system))
        ctx.log(f"    single stream {fmt(ctx.m[system].get('single_tps'))}")
        await guarded(ctx, system, "ttft", m_ttft(ctx, srv.port, system,
                                                  afmd=system == "afmd"))
        ctx.log(f"    ttft {fmt(ctx.m[system].get('ttft_ms'))}")
        await guarded(ctx, system, "concurrency", m_levels(ctx, srv.port, system, p.levels))
        await guarded(ctx, system, "prefix", m_prefix(ctx, srv.port, system))
        ctx.log(f"    prefix ratio {fmt(ctx.m[system].get('prefix_ratio_pct'))}")
        if grammar:
            await guarded(ctx, system, "grammar", m_grammar(ctx, srv.port, system))
        await guarded(ctx, system, "requests/s", m_rps(
            ctx, srv.port, {"health_rps": "/health", "models_rps": "/v1/models"}))
        ctx.log(f"    /health {fmt(ctx.m[system].get('health_rps'))}")
        ctx.m[system]["rss_after_bench_mb"] = stat([servers.rss_mb(srv.pid)], "MiB")
        if p.profile:
            await guarded(ctx, system, "strace", _strace_both(ctx, srv, system))
            if system == "afmd":
                await guarded(ctx, system, "py-spy", profile_afmd(ctx, srv))
    except Exception as exc:
        ctx.log(f"  ! {system} failed: {exc}")
        ctx.m[system]["_fatal"] = f"{type(exc).__name__}: {exc}"
    finally:
        srv.stop()
        load_note(ctx, f"{system}-end")


async def _strace_both(ctx: Ctx, srv: servers.Server, system: str) -> dict[str, Any]:
    return {"strace": {"1": await m_strace(ctx, srv, system, 1),
                       "8": await m_strace(ctx, srv, system, 8)}}


async def profile_afmd(ctx: Ctx, srv: servers.Server) -> dict[str, Any]:
    """py-spy while afmd serves one stream, eight, eight constrained, then /health."""
    p = ctx.plan
    rate = 200

    def streams(n: int, kind: str = "unconstrained") -> Callable[[int], dict[str, Any]]:
        def bodies(i: int) -> Any:
            return [workload.grammar_bodies(workload.prompt(f"prof-{n}-{kind}-{i}", j),
                                            p.max_tokens)[kind] for j in range(n)]
        return bodies

    scenarios: list[tuple[str, Any]] = [
        ("1", streams(1)), ("8", streams(8)), ("8-json_schema", streams(8, "json_schema")),
        ("health", None),
    ]
    results: dict[str, Any] = {}
    for label, make in scenarios:
        out = ctx.work / f"pyspy-afmd-{label}.txt"
        proc = await profile.pyspy_record(srv.pid, p.profile_seconds, out, rate)
        if proc is None:
            return {"pyspy": {"skipped": "py-spy not installed (pip install py-spy)"}}
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
                res = await concurrent(srv.port, make(i), p.timeout)
                tokens += res.get("tokens", 0)
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
    return {"pyspy": results}


async def bench_access_log(ctx: Ctx) -> None:
    srv = servers.afmd_server(ctx.work, "afmd-access-log", cache_root=ctx.cache,
                              default="demo-32k", access_log=True)
    srv.start()
    try:
        await srv.ready()
        await warm_up(srv.port, "alog", ctx.plan.timeout)
        single = await m_single(ctx, srv.port, "alog")
        c8 = await m_levels(ctx, srv.port, "alog", (8,))
        ctx.m["afmd"]["access_log_single_tps"] = single["single_tps"]
        ctx.m["afmd"]["access_log_agg_tps_c8"] = c8["agg_tps_c8"]
    finally:
        srv.stop()


async def idle_rss(ctx: Ctx, name: str, *, binary: Path | None = None,
                   no_model: bool = False) -> dict[str, Any]:
    """Cold start to /health and idle RSS of a fresh afmd (demo model, or none)."""
    extra = ""
    default = "demo"
    if no_model:
        extra = ('\n[[models.model]]\nid = "absent"\n'
                 'path = "/nonexistent/afmd-bench-no-model"\n')
        default = "absent"
    srv = servers.afmd_server(ctx.work, name, cache_root=ctx.cache, binary=binary,
                              default=default, extra_models=extra)
    srv.env["HF_HUB_OFFLINE"] = "1"
    srv.start()
    try:
        if no_model:
            seconds = await srv.ready(want_status=503, reason="model_load_failed")
        else:
            seconds = await srv.ready()
        await asyncio.sleep(0.5)
        return {"cold_start_s": seconds, "rss_mb": servers.rss_mb(srv.pid)}
    finally:
        srv.stop()


def find_binary(explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit)
    # build/build.py writes build/dist/afmd-<version>-<platform>/afmd (the onedir bundle).
    candidates = sorted((ROOT / "build" / "dist").glob("afmd-*/afmd"), reverse=True)
    candidates += [ROOT / "build/dist/afmd/afmd", ROOT / "dist/afmd/afmd"]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


async def bench_footprint(ctx: Ctx, binary: Path | None) -> None:
    a = ctx.m["afmd"]
    try:
        demo = await idle_rss(ctx, "afmd-demo")
        a["rss_idle_demo_mb"] = stat([demo["rss_mb"]], "MiB")
        a["cold_start_demo_s"] = stat([demo["cold_start_s"]], "s")
        if ctx.plan.quick:
            a["rss_no_model_mb"] = null("skipped in --quick")
        else:
            none = await idle_rss(ctx, "afmd-no-model", no_model=True)
            a["rss_no_model_mb"] = stat([none["rss_mb"]], "MiB")
    except Exception as exc:
        ctx.log(f"  ! afmd footprint failed: {exc}")
        for k in ("rss_idle_demo_mb", "cold_start_demo_s", "rss_no_model_mb"):
            a.setdefault(k, null(f"failed: {exc}"))
    if binary is None:
        for k in ("frozen_cold_start_s", "frozen_rss_demo_mb", "frozen_rss_no_model_mb"):
            a[k] = null("not built (no build/dist/afmd-*/afmd: run build/build.py, "
                        "or pass --binary PATH)")
        return
    try:
        demo = await idle_rss(ctx, "afmd-frozen-demo", binary=binary)
        a["frozen_cold_start_s"] = stat([demo["cold_start_s"]], "s")
        a["frozen_rss_demo_mb"] = stat([demo["rss_mb"]], "MiB")
        none = await idle_rss(ctx, "afmd-frozen-no-model", binary=binary, no_model=True)
        a["frozen_rss_no_model_mb"] = stat([none["rss_mb"]], "MiB")
    except Exception as exc:
        ctx.log(f"  ! frozen binary failed: {exc}")
        for k in ("frozen_cold_start_s", "frozen_rss_demo_mb", "frozen_rss_no_model_mb"):
            a.setdefault(k, null(f"{binary}: {exc}"))


async def bench_mlx_demo_rss(ctx: Ctx) -> None:
    folder = ctx.folders.get("demo")
    if not folder:
        return
    srv = servers.mlx_server(ctx.work, "mlx-demo", Path(folder))
    srv.start()
    try:
        seconds = await srv.ready()
        await asyncio.sleep(0.5)
        ctx.m["mlx_lm_server"]["rss_idle_demo_mb"] = stat([servers.rss_mb(srv.pid)], "MiB")
        ctx.m["mlx_lm_server"]["cold_start_demo_s"] = stat([seconds], "s")
    except Exception as exc:
        ctx.m["mlx_lm_server"]["rss_idle_demo_mb"] = null(f"failed: {exc}")
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
        srv.start()
        try:
            await srv.ready()
            await warm_up(srv.port, f"{system}-big", ctx.plan.timeout)
            single = await m_single(bctx, srv.port, f"{system}-big")
            c8 = await m_levels(bctx, srv.port, f"{system}-big", (8,))
            ctx.m[system]["big_single_tps"] = single["single_tps"]
            ctx.m[system]["big_agg_tps_c8"] = c8["agg_tps_c8"]
            ctx.log(f"  {system} big: single {fmt(single['single_tps'])}, "
                    f"c8 {fmt(c8['agg_tps_c8'])}")
        except Exception as exc:
            ctx.log(f"  ! {system} big failed: {exc}")
            ctx.m[system]["big_single_tps"] = null(f"failed: {exc}")
        finally:
            srv.stop()


# -- taking turns ------------------------------------------------------------------------


async def bench_paired(ctx: Ctx) -> None:
    """afmd, mlx_lm.server and raw mlx-lm taking turns, request by request.

    The per-system phases run minutes apart, and this kind of shared VM has slow phases
    (30-70% slower, raw mlx-lm included) about as long as a phase, so a ratio of two
    phases can be off by more than the margin it tests. Here both servers are up (an
    idle one costs 0.2% of a core) and one works at a time; each round's ratio compares
    neighbours in time, and the order rotates round by round.
    """
    p = ctx.plan
    folder = ctx.folders.get("demo-32k")
    assert folder
    afmd = servers.afmd_server(ctx.work, "afmd-paired", cache_root=ctx.cache,
                               default="demo-32k")
    mlx = servers.mlx_server(ctx.work, "mlx-paired", Path(folder))
    raw: RawSampler | None = None
    load_note(ctx, "paired-start")
    try:
        afmd.start()
        mlx.start()
        await afmd.ready()
        await mlx.ready()
        raw = await RawSampler.start(ctx)
        if raw is None:
            raise RuntimeError("the raw sampler did not start")
        ports = {"afmd": afmd.port, "mlx_lm_server": mlx.port}
        for system, port in ports.items():
            await warm_up(port, f"{system}-paired", p.timeout)
        single = await _in_turns(raw, ports, "paired-single", p.paired_runs, p.max_tokens,
                                 p.timeout, first_token=False)
        ttft = await _in_turns(raw, ports, "paired-ttft", p.paired_ttft_runs,
                               p.ttft_max_tokens, p.timeout, first_token=True)
        batch: dict[str, list[float | None]] = {s: [] for s in ports}
        for r in range(p.paired_batch_runs):
            bodies = [workload.chat_body(workload.messages(
                workload.prompt(f"paired-c8-{r}", i)), p.max_tokens) for i in range(8)]
            for system in (("afmd", "mlx_lm_server") if r % 2 == 0
                           else ("mlx_lm_server", "afmd")):
                batch[system].append((await concurrent(ports[system], bodies,
                                                       p.timeout)).get("agg_tps"))
    except Exception as exc:
        ctx.log(f"  ! paired runs failed: {exc}")
        ctx.m["afmd"]["paired_single_vs_mlx"] = null(f"failed: {exc}")
        return
    finally:
        if raw is not None:
            await raw.stop()
        afmd.stop()
        mlx.stop()
        load_note(ctx, "paired-end")
    for system in SYSTEMS:
        ctx.m[system]["paired_single_tps"] = stat(single[system], "tok/s")
    for system in ports:
        ctx.m[system]["paired_agg_tps_c8"] = stat(batch[system], "tok/s")
    for system in SYSTEMS:
        ctx.m[system]["paired_ttft_ms"] = stat(ttft[system], "ms", scale=1000)
    a = ctx.m["afmd"]
    a["paired_single_vs_mlx"] = stat(_ratios(single["afmd"], single["mlx_lm_server"]), "×")
    a["paired_single_vs_raw"] = stat(_ratios(single["afmd"], single["raw"]), "×")
    a["paired_c8_vs_mlx"] = stat(_ratios(batch["afmd"], batch["mlx_lm_server"]), "×")
    for other, key in (("raw", "paired_ttft_minus_raw_ms"),
                       ("mlx_lm_server", "paired_ttft_minus_mlx_ms")):
        a[key] = stat([x - y if x and y else None
                       for x, y in zip(ttft["afmd"], ttft[other], strict=True)], "ms",
                      scale=1000)
    ctx.log(f"  single stream {fmt(a['paired_single_vs_mlx'])} mlx, "
            f"{fmt(a['paired_single_vs_raw'])} raw; 8 streams {fmt(a['paired_c8_vs_mlx'])} "
            f"mlx; ttft afmd − raw {fmt(a['paired_ttft_minus_raw_ms'])}, afmd − mlx "
            f"{fmt(a['paired_ttft_minus_mlx_ms'])}")


async def _in_turns(raw: RawSampler, ports: dict[str, int], tag: str, runs: int,
                    max_tokens: int, timeout: float, *, first_token: bool
                    ) -> dict[str, list[float | None]]:
    """Per system, one value a round: each round's prompt (new to each of the three) goes
    to afmd, mlx_lm.server and raw mlx-lm, the order rotating round by round; the value
    is the time to first token (s) or the streamed rate (tok/s)."""
    out: dict[str, list[float | None]] = {s: [] for s in SYSTEMS}
    for i in range(runs):
        text = workload.prompt(tag, i)
        for system in SYSTEMS[i % 3:] + SYSTEMS[:i % 3]:
            if system == "raw":
                res = await raw.sample(text, max_tokens, stop_after=1 if first_token else None)
                out[system].append(res["ttft" if first_token else "stream_tps"] if res else None)
                continue
            r = await client.stream_chat(HOST, ports[system], workload.chat_body(
                workload.messages(text), max_tokens), timeout=timeout)
            out[system].append((r.ttft if first_token else r.stream_tps) if r.ok else None)
    return out


def _ratios(a: list[float | None], b: list[float | None]) -> list[float | None]:
    return [x / y if x and y else None for x, y in zip(a, b, strict=True)]


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
    return json.loads(out_path.read_text())


def bench_raw(ctx: Ctx) -> None:
    p = ctx.plan
    r = ctx.m["raw"]
    load_note(ctx, "raw-start")
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
        r["_fatal"] = str(exc)
        return
    r["single_tps"] = stat(out["single"]["stream_tps"], "tok/s")
    r["single_decode_interval_tps"] = stat(out["single"]["decode_tps"], "tok/s")
    r["single_e2e_tps"] = stat(out["single"]["e2e_tps"], "tok/s")
    r["single_tokens"] = out["single"]["tokens"]
    r["ttft_ms"] = stat(out["ttft"]["ttft"], "ms", scale=1000)
    r["ttft_from_tokens_ms"] = stat(out["ttft"]["ttft_from_tokens"], "ms", scale=1000)
    for c, v in out["batch"].items():
        r[f"agg_tps_c{c}"] = stat(v["agg_tps"], "tok/s")
        r[f"agg_ttft_ms_c{c}"] = stat(v["ttft"], "ms", scale=1000)
    pre = out.get("prefix") or {}
    if pre:
        r["prefix_first_ms"] = stat(pre["first_ttft"], "ms", scale=1000)
        r["prefix_second_ms"] = stat(pre["second_ttft"], "ms", scale=1000)
        r["prefix_ratio_pct"] = stat([b / a for a, b in zip(pre["first_ttft"],
                                                            pre["second_ttft"], strict=True)],
                                     "%", scale=100)
        r["prefix_shared_tokens"] = pre["shared_tokens"]
        r["prefix_prompt_tokens"] = pre["prompt_tokens"]
    ctx.log(f"  raw: single stream {fmt(r['single_tps'])}, ttft {fmt(r['ttft_ms'])}")
    if ctx.folders.get("big"):
        try:
            big = run_raw(ctx, ctx.folders["big"] or "", {
                "runs": 3,
                "single": {"max_tokens": BIG_MAX_TOKENS},
                "batch": {"max_tokens": BIG_MAX_TOKENS, "levels": [8], "runs": 2},
            }, "big")
            r["big_single_tps"] = stat(big["single"]["stream_tps"], "tok/s")
            r["big_agg_tps_c8"] = stat(big["batch"]["8"]["agg_tps"], "tok/s")
        except Exception as exc:
            r["big_single_tps"] = null(f"failed: {exc}")
    load_note(ctx, "raw-end")


# -- rows --------------------------------------------------------------------------------


def fmt(v: dict[str, Any] | None) -> str:
    return report.fmt_value(v)


def _get(ctx: Ctx, system: str, key: str, default_reason: str) -> dict[str, Any]:
    m = ctx.m[system]
    if key in m and isinstance(m[key], dict):
        return m[key]
    fatal = m.get("_fatal")
    errors = m.get("_errors") or {}
    reason = fatal and f"server failed: {fatal.splitlines()[0]}"
    if not reason and errors:
        reason = "measurement failed: " + next(iter(errors.values())).splitlines()[0]
    return null(reason or default_reason)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def build_rows(ctx: Ctx) -> list[dict[str, Any]]:
    p = ctx.plan
    rows: list[dict[str, Any]] = []
    no_mlx_grammar = "mlx_lm.server has no response_format/json_schema or tool_choice grammar"
    no_raw = "not applicable to in-process generation"
    no_raw_grammar = "raw mlx-lm has no grammar; afmd is compared with itself"
    no_mlx_model = "mlx_lm.server cannot run without a model"
    not_applicable = {no_mlx_grammar, no_raw, no_raw_grammar, no_mlx_model, "n/a"}

    def row(rid: str, title: str, target: str, keys: dict[str, str | None],
            check: dict[str, Any] | None = None, note: str | None = None,
            reasons: dict[str, str] | None = None) -> dict[str, Any]:
        values = {}
        for system in SYSTEMS:
            key = keys.get(system)
            if key is None:
                why = (reasons or {}).get(system, "not measured")
                values[system] = null(why, na=why in not_applicable)
            else:
                values[system] = _get(ctx, system, key, "not measured")
        r = {"id": rid, "title": title, "target": target, "values": values,
             "check": check or {"pass": None}, "note": note}
        rows.append(r)
        return r

    def all3(key: str) -> dict[str, str | None]:
        return {s: key for s in SYSTEMS}

    # single-stream decode
    a, m, r = (med(_get(ctx, s, "single_tps", "")) for s in SYSTEMS)
    sep_m, sep_r = _ratio(a, m), _ratio(a, r)
    # Verdict on the rounds taken in turns (bench_paired) when there are some.
    pair_m = med(_get(ctx, "afmd", "paired_single_vs_mlx", ""))
    pair_r = med(_get(ctx, "afmd", "paired_single_vs_raw", ""))
    vs_m = pair_m if pair_m is not None else sep_m
    vs_r = pair_r if pair_r is not None else sep_r
    ok = None if vs_m is None or vs_r is None else (vs_m >= 1.4 and vs_r >= 0.9)
    row("single_stream_decode_tps", f"single-stream tok/s, streamed ({p.max_tokens} tokens)",
        "afmd ≥ 1.4× mlx_lm.server and ≥ 0.9× raw", all3("single_tps"),
        {"pass": ok, "afmd_vs_mlx": vs_m, "afmd_vs_raw": vs_r,
         "separate_phases": {"afmd_vs_mlx": sep_m, "afmd_vs_raw": sep_r},
         "detail": _paired_detail(_join(_x(vs_m, "mlx"), _x(vs_r, "raw")),
                                  _join(_x(sep_m, "mlx"), _x(sep_r, "raw")),
                                  pair_m is not None)},
        note="completion_tokens (usage chunk) / (last delta − request sent); raw: tokens / "
             "(last token − message list). The verdict uses the median of per-round "
             "ratios from rounds taken in turns (afmd, mlx_lm.server, raw, one request "
             "each, same prompt); the columns and the ratios in brackets are the separate "
             "phases. The first-to-last-delta rate is in "
             "measurements.*.single_decode_interval_tps (it overstates a server that "
             "coalesces tokens)")

    # TTFT
    a, m, r = (med(_get(ctx, s, "ttft_ms", "")) for s in SYSTEMS)
    # A few milliseconds are compared, and noise on a shared machine comes in bursts: the
    # verdict uses per-round differences from the rounds taken in turns (bench_paired),
    # else afmd's phase with a raw sample after each request (RawSampler), else phases.
    turn_raw = med(_get(ctx, "afmd", "paired_ttft_minus_raw_ms", ""))
    turn_mlx = med(_get(ctx, "afmd", "paired_ttft_minus_mlx_ms", ""))
    diff = med(_get(ctx, "afmd", "ttft_paired_diff_ms", ""))
    paired_raw = med(_get(ctx, "afmd", "ttft_paired_raw_ms", ""))
    if diff is None and None not in (a, r):
        diff = a - r  # type: ignore[operator]
    vs_mlx = None if None in (a, m) else a - m  # type: ignore[operator]
    in_turns = turn_raw is not None and turn_mlx is not None
    d_raw, d_mlx = (turn_raw, turn_mlx) if in_turns else (diff, vs_mlx)
    ok = None if None in (d_raw, d_mlx) else (d_raw <= 3.0 and d_mlx < 0)  # type: ignore[operator]
    detail = ""
    if ok is not None:
        detail = f"afmd − raw = {d_raw:+.1f} ms, afmd − mlx = {d_mlx:+.1f} ms"
        if in_turns:
            detail = "in turns " + detail + " (afmd's phase: afmd − raw = " + (
                f"{diff:+.1f} ms" if diff is not None else "n/a") + (
                f" against raw {paired_raw:.1f} ms sampled between its requests"
                if paired_raw is not None else "") + ")"
    row("ttft_short_ms", "time to first token, short prompt (ms)",
        "afmd ≤ raw + 3 ms and < mlx_lm.server", all3("ttft_ms"),
        {"pass": ok, "afmd_minus_raw_ms": d_raw, "afmd_minus_mlx_ms": d_mlx,
         "detail": detail},
        note="request sent → first content delta; raw: message list → first token "
             "(template + tokenise + prefill + first step). The verdict uses the medians "
             "of per-round differences from short-prompt rounds taken in turns (afmd, "
             "mlx_lm.server, raw; same prompt); the columns are the separate phases, and "
             "in afmd's phase a raw sample follows each of its requests. afmd's own split "
             "(X-AFM-Profile): " + _ttft_split(ctx))

    # aggregate per level
    for c in LEVELS:
        measured = c in p.levels
        keys = all3(f"agg_tps_c{c}") if measured else {}
        reasons = {s: "skipped in --quick" for s in SYSTEMS} if not measured else None
        check: dict[str, Any] = {"pass": None}
        target = "report"
        note = None
        if c == 8:
            target = "afmd ≥ 1.5× mlx_lm.server"
            a, m = med(_get(ctx, "afmd", "agg_tps_c8", "")), med(
                _get(ctx, "mlx_lm_server", "agg_tps_c8", ""))
            sep = _ratio(a, m)
            pair = med(_get(ctx, "afmd", "paired_c8_vs_mlx", ""))
            vs = pair if pair is not None else sep
            check = {"pass": None if vs is None else vs >= 1.5, "afmd_vs_mlx": vs,
                     "separate_phases": {"afmd_vs_mlx": sep},
                     "detail": _paired_detail(
                         _x(vs, "mlx"),
                         _join(_x(sep, "mlx"), _x(
                             _ratio(a, med(_get(ctx, "raw", "agg_tps_c8", ""))), "raw")),
                         pair is not None)}
            note = ("the verdict uses the median of per-round ratios from rounds of 8 "
                    "streams taken in turns (afmd, mlx_lm.server; same prompts); the "
                    "columns and the ratios in brackets are the separate phases")
        row(f"aggregate_tps_c{c}", f"aggregate tok/s, {c} concurrent stream(s)", target,
            keys, check, reasons=reasons, note=note)

    # prefix cache
    vals = {s: med(_get(ctx, s, "prefix_ratio_pct", "")) for s in SYSTEMS}
    a = vals["afmd"]
    row("prefix_second_turn_ttft",
        f"second-turn TTFT, ~{p.prefix_tokens}-token shared prefix (% of first turn)",
        "afmd ≤ 15%", all3("prefix_ratio_pct"),
        {"pass": None if a is None else a <= 15.0,
         "first_turn_ms": {s: med(_get(ctx, s, "prefix_first_ms", "")) for s in SYSTEMS},
         "second_turn_ms": {s: med(_get(ctx, s, "prefix_second_ms", "")) for s in SYSTEMS},
         "detail": "" if a is None else "; ".join(
             f"{s}: {_ms(ctx, s, 'prefix_first_ms')} → {_ms(ctx, s, 'prefix_second_ms')}"
             for s in SYSTEMS)},
        note=f"~{p.prefix_tokens}-token conversation, then + assistant reply + new user "
             "message; raw = first turn's KV cache trimmed to the shared prefix")

    # grammar
    for kind, label in (("json_schema", "response_format json_schema"),
                        ("tool_required", 'tool_choice "required"')):
        base = workload.GRAMMAR_BASELINE[kind]
        for where, key in (("alone", "alone"), (f"batch of {p.grammar_batch}", "batch")):
            v = med(_get(ctx, "afmd", f"grammar_{kind}_{key}_pct", ""))
            decode = med(_get(ctx, "afmd", f"grammar_{kind}_{key}_decode_pct", ""))
            row(f"grammar_{kind}_{key}", f"grammar decode, {label}, {where} "
                "(% of unconstrained)", "afmd ≥ 90%",
                {"afmd": f"grammar_{kind}_{key}_pct"},
                {"pass": None if v is None else v >= 90.0,
                 "constrained_tps": med(_get(ctx, "afmd", f"grammar_{kind}_{key}_tps", "")),
                 "unconstrained_tps": med(_get(ctx, "afmd", f"grammar_{base}_{key}_tps", "")),
                 "decode_pct": decode,
                 "detail": "" if v is None else (
                     f"{_num(ctx, 'afmd', f'grammar_{kind}_{key}_tps')} vs "
                     f"{_num(ctx, 'afmd', f'grammar_{base}_{key}_tps')} tok/s, prompt "
                     f"{_prompt(ctx, kind)} vs {_prompt(ctx, base)} tokens; decode phase "
                     f"{_pct(decode)}")},
                reasons={"mlx_lm_server": no_mlx_grammar, "raw": no_raw_grammar},
                note="completion_tokens / (end − send), against the same prompt without a "
                     "grammar (for tools: the tool definitions as a system message), each "
                     "unconstrained row held to the tokens its constrained twin produced "
                     "(a grammar ends early; free text runs to max_tokens). Decode phase: "
                     "tokens after the first / (last delta − first delta); in a batch "
                     "Σ(tokens − 1) / (last delta of any − first delta of any)")

    # requests/s
    mh = med(_get(ctx, "mlx_lm_server", "health_rps", ""))
    for key, label in (("health_rps", "/health"), ("models_rps", "/v1/models")):
        a = med(_get(ctx, "afmd", key, ""))
        vs = _ratio(a, mh)
        row(key.replace("_rps", "_requests_per_s"),
            f"{label} requests/s ({p.rps_connections} keep-alive connections)",
            "afmd ≥ 3× mlx_lm.server /health", {"afmd": key, "mlx_lm_server": key},
            {"pass": None if vs is None else vs >= 3.0, "afmd_vs_mlx_health": vs,
             "detail": _x(vs, "mlx /health")},
            reasons={"raw": no_raw},
            note="mlx_lm.server speaks HTTP/1.0 and closes every connection, so its "
                 "client reconnects per request" if key == "health_rps" else None)

    # footprint
    row("idle_rss_demo_mb", "idle RSS, demo model loaded (MiB)", "report",
        {"afmd": "rss_idle_demo_mb", "mlx_lm_server": "rss_idle_demo_mb"},
        reasons={"raw": no_raw, "mlx_lm_server": "skipped in --quick"})
    row("idle_rss_32k_mb", "idle RSS, demo-32k loaded, before any request (MiB)", "report",
        {"afmd": "rss_idle_32k_mb", "mlx_lm_server": "rss_idle_32k_mb"},
        reasons={"raw": no_raw})
    row("idle_cpu_pct", "idle CPU, model loaded, no requests (% of one core)", "report",
        {"afmd": "idle_cpu_pct", "mlx_lm_server": "idle_cpu_pct"}, reasons={"raw": no_raw},
        note="/proc/<pid>/stat utime+stime over an idle interval right after /health ok")
    v = med(_get(ctx, "afmd", "rss_no_model_mb", ""))
    row("rss_no_model_mb", "afmd RSS without a model (MiB)", "≤ 80 MB",
        {"afmd": "rss_no_model_mb"}, {"pass": None if v is None else v <= 80.0 * 1e6 / 2**20},
        reasons={"mlx_lm_server": no_mlx_model, "raw": no_raw},
        note="default model's path missing, so the load fails after the serving stack "
             "(MLX included) is imported")
    row("cold_start_s", "cold start to /health ok, demo model (s, python -m)", "report",
        {"afmd": "cold_start_demo_s", "mlx_lm_server": "cold_start_demo_s"},
        reasons={"raw": no_raw, "mlx_lm_server": "skipped in --quick"})
    v = med(_get(ctx, "afmd", "frozen_cold_start_s", ""))
    row("frozen_cold_start_s", "frozen binary cold start to /health ok (s)", "≤ 3 s",
        {"afmd": "frozen_cold_start_s"}, {"pass": None if v is None else v <= 3.0},
        reasons={"mlx_lm_server": no_raw, "raw": no_raw})
    row("frozen_rss_demo_mb", "frozen binary idle RSS, demo model (MiB)", "report",
        {"afmd": "frozen_rss_demo_mb"}, reasons={"mlx_lm_server": no_raw, "raw": no_raw})
    v = med(_get(ctx, "afmd", "frozen_rss_no_model_mb", ""))
    row("frozen_rss_no_model_mb", "frozen binary RSS without a model (MiB)", "≤ 80 MB",
        {"afmd": "frozen_rss_no_model_mb"},
        {"pass": None if v is None else v <= 80.0 * 1e6 / 2**20},
        reasons={"mlx_lm_server": no_raw, "raw": no_raw})

    # extras
    skip = "skipped in --quick" if p.quick else "not measured"
    row("access_log_single_tps", "single-stream tok/s, access_log = true",
        "report", {"afmd": "access_log_single_tps"},
        reasons={"afmd": skip, "mlx_lm_server": "n/a", "raw": "n/a"})
    row("access_log_aggregate_tps_c8", "aggregate tok/s at 8, access_log = true", "report",
        {"afmd": "access_log_agg_tps_c8"},
        reasons={"afmd": skip, "mlx_lm_server": "n/a", "raw": "n/a"})
    big = "skipped (--quick or --no-big)"
    a, m, r = (med(_get(ctx, s, "big_single_tps", "")) for s in SYSTEMS)
    row("big_single_stream_tps",
        f"compute-bound (h512×8L): single-stream tok/s ({BIG_MAX_TOKENS} tokens)",
        "report", all3("big_single_tps") if p.big else {},
        {"pass": None, "detail": _join(_x(_ratio(a, m), "mlx"), _x(_ratio(a, r), "raw"))},
        reasons={s: big for s in SYSTEMS})
    a, m, r = (med(_get(ctx, s, "big_agg_tps_c8", "")) for s in SYSTEMS)
    row("big_aggregate_tps_c8",
        f"compute-bound (h512×8L): aggregate tok/s at 8 ({BIG_MAX_TOKENS} tokens each)",
        "report",
        all3("big_agg_tps_c8") if p.big else {},
        {"pass": None, "detail": _join(_x(_ratio(a, m), "mlx"), _x(_ratio(a, r), "raw"))},
        reasons={s: big for s in SYSTEMS})
    return rows


def _x(v: float | None, what: str) -> str:
    return f"{v:.2f}× {what}" if v is not None else ""


def _paired_detail(verdict: str, separate: str, paired: bool) -> str:
    if not paired:
        return separate
    return f"in turns {verdict}" + (f" (separate phases: {separate})" if separate else "")


def _ttft_split(ctx: Ctx) -> str:
    q, e, o = (med(_get(ctx, "afmd", k, "")) for k in (
        "ttft_server_queue_ms", "ttft_server_engine_ms", "ttft_outside_server_ms"))
    if None in (q, e, o):
        return "n/a"
    return (f"arrival → engine admission {q:.1f} ms, admission → first token {e:.1f} ms, "
            f"outside those (HTTP in/out, first-token hand-off) {o:.1f} ms")


def _join(*parts: str) -> str:
    return ", ".join(p for p in parts if p)


def _ms(ctx: Ctx, system: str, key: str) -> str:
    v = med(_get(ctx, system, key, ""))
    return "?" if v is None else f"{v:.0f} ms"


def _pct(v: float | None) -> str:
    return "?" if v is None else f"{v:.0f}%"


def _prompt(ctx: Ctx, kind: str) -> str:
    """A grammar request's prompt tokens as afmd counted them (the longest run's)."""
    seen = [n for n in ctx.m["afmd"].get(f"grammar_{kind}_prompt_tokens") or () if n]
    return str(max(seen)) if seen else "?"


def _num(ctx: Ctx, system: str, key: str) -> str:
    v = med(_get(ctx, system, key, ""))
    return "?" if v is None else f"{v:.0f}"


# -- main --------------------------------------------------------------------------------


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    from importlib import metadata

    for name in ("afmd", "mlx-lm", "mlx", "sanic"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def materialize(ctx_cache: Path, big: bool) -> dict[str, str | None]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "raw_engine.py"), "materialize",
         str(ctx_cache), *(["--big"] if big else [])],
        capture_output=True, text=True, timeout=600, cwd=str(ROOT),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building the models failed: {proc.stderr[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


async def run_all(ctx: Ctx, binary: Path | None, systems: set[str]) -> None:
    p = ctx.plan
    for s in SYSTEMS:
        if s not in systems:
            ctx.m[s]["_fatal"] = "skipped (--systems)"
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
        if "_fatal" in ctx.m["afmd"] and "afmd" in systems:
            exit_code = 1  # afmd itself could not be benchmarked: that must not pass CI
        doc = _document(ctx, args, today, host, perf() - started, binary)
        json_path = out_dir / f"{stem}.json"
        png_path = out_dir / f"{stem}.png"
        skipped = report.plot(doc, png_path)
        if skipped:
            doc["plot_skipped"] = skipped
            log(f"plot skipped: {skipped}")
        else:
            doc["plot"] = str(png_path)
        tmp_json = json_path.with_suffix(".json.tmp")
        tmp_json.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        tmp_json.replace(json_path)
        md = report.markdown(doc)
        (out_dir / f"{stem}.md").write_text(md)
        print()
        print(md)
        log(f"wrote {json_path}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the models; --keep-work's files are in out
    return exit_code


def _document(ctx: Ctx, args: argparse.Namespace, today: str, host: str, seconds: float,
              binary: Path | None) -> dict[str, Any]:
    plan = ctx.plan
    versions = _versions()
    cpus = os.cpu_count() or 1
    load = ctx.loads
    busiest = max((v[0] for v in load.values()), default=0.0)
    rows = build_rows(ctx)
    prof = ctx.m["afmd"].get("pyspy") or {}
    text = "\n\n".join(v.get("text", "") for v in prof.values() if isinstance(v, dict))
    straces = {s: ctx.m[s].get("strace") for s in ("afmd", "mlx_lm_server")
               if ctx.m[s].get("strace")}
    if straces:
        lines = []
        for s, by in straces.items():
            for n, v in by.items():
                if "per_token" in v:
                    top = ", ".join(f"{k} {x}" for k, x in list(v["per_token"].items())[:6])
                    lines.append(f"[{s}, {n} stream(s)] syscalls/token "
                                 f"{v['total_per_token']}: {top}")
        text = (text + "\n\nstrace -c -f:\n" + "\n".join(lines)).strip()
    return {
        "meta": {
            "date": today,
            "host": host,
            "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "seconds": round(seconds, 1),
            "quick": plan.quick,
            "cpus": cpus,
            "platform": platform.platform(),
            "python": platform.python_version(),
            "afmd_version": versions["afmd"],
            "mlx_lm_version": versions["mlx-lm"],
            "mlx_version": versions["mlx"],
            "sanic_version": versions["sanic"],
            "model": "demo-32k (Qwen2, hidden 64 × 2 layers, 32k vocab, random weights)",
            "runs": plan.runs,
            "max_tokens": plan.max_tokens,
            "plan": asdict(plan),
            "loadavg": {"start": load.get("start"), "end": load.get("end"), "by_phase": load},
            "provisional": busiest > 0.5 * cpus,
            "provisional_reason": (
                f"load average reached {busiest:.1f} on {cpus} CPUs: other work shared the "
                "machine, numbers are provisional" if busiest > 0.5 * cpus else None),
            "binary": str(binary) if binary else None,
            "argv": sys.argv[1:] if args else [],
        },
        "rows": rows,
        "series": {"aggregate_tps": {
            s: {str(c): ctx.m[s].get(f"agg_tps_c{c}") for c in plan.levels} for s in SYSTEMS
        }},
        "measurements": ctx.m,
        "profile": {"pyspy": prof, "strace": straces, "summary_text": text},
    }


if __name__ == "__main__":
    sys.exit(main())
