"""The rounds taken in turns, which the single-stream, TTFT and 8-stream verdicts use.

The per-system phases run minutes apart, and this kind of shared VM has slow phases
(30-70% slower, raw mlx-lm included) about as long as a phase, so a ratio of two
phases can be off by more than the margin it tests. Here both servers are up (an idle
one costs 0.2% of a core) and one works at a time; each round's ratio compares
neighbours in time, and the order rotates round by round.
"""

from __future__ import annotations

from pathlib import Path

from bench import client, servers, workload
from bench.measure import HOST, concurrent, warm_up
from bench.plan import SYSTEMS, Ctx
from bench.results import fmt, null, stat
from bench.sampler import RawSampler


async def bench_paired(ctx: Ctx) -> None:
    """afmd, mlx_lm.server and raw mlx-lm taking turns, request by request."""
    p = ctx.plan
    folder = ctx.folders.get("demo-32k")
    assert folder
    # Those the phases kept (Plan.paired_reuse) are taken as they are: one that has exited
    # since fails its ready() with its log, where a fresh start would hide the crash.
    kept = (ctx.kept.pop("afmd", None), ctx.kept.pop("mlx_lm_server", None))
    afmd = kept[0] or servers.afmd_server(ctx.work, "afmd-paired", cache_root=ctx.cache,
                                          default="demo-32k")
    mlx = kept[1] or servers.mlx_server(ctx.work, "mlx-paired", Path(folder))
    raw, ctx.sampler = ctx.sampler, None
    ctx.load_note("paired-start")
    try:
        for srv, old in zip((afmd, mlx), kept, strict=True):
            if old is None:
                srv.start()
        await afmd.ready()
        await mlx.ready()
        raw = raw or await RawSampler.start(ctx)
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
                                                       p.timeout)).agg_tps)
    except Exception as exc:
        ctx.log(f"  ! paired runs failed: {exc}")
        ctx.res.afmd.paired.single_vs_mlx = null(f"failed: {exc}")
        return
    finally:
        if raw is not None:
            await raw.stop()
        afmd.stop()
        mlx.stop()
        ctx.load_note("paired-end")
    for system in SYSTEMS:
        ctx.res[system].paired.single_tps = stat(single[system], "tok/s")
    for system in ports:
        ctx.res[system].paired.agg_tps_c8 = stat(batch[system], "tok/s")
    for system in SYSTEMS:
        ctx.res[system].paired.ttft_ms = stat(ttft[system], "ms", scale=1000)
    a = ctx.res.afmd.paired
    a.single_vs_mlx = stat(_ratios(single["afmd"], single["mlx_lm_server"]), "×")
    a.single_vs_raw = stat(_ratios(single["afmd"], single["raw"]), "×")
    a.c8_vs_mlx = stat(_ratios(batch["afmd"], batch["mlx_lm_server"]), "×")
    a.ttft_minus_raw_ms = stat(_diffs(ttft["afmd"], ttft["raw"]), "ms", scale=1000)
    a.ttft_minus_mlx_ms = stat(_diffs(ttft["afmd"], ttft["mlx_lm_server"]), "ms", scale=1000)
    ctx.log(f"  single stream {fmt(a.single_vs_mlx)} mlx, "
            f"{fmt(a.single_vs_raw)} raw; 8 streams {fmt(a.c8_vs_mlx)} "
            f"mlx; ttft afmd − raw {fmt(a.ttft_minus_raw_ms)}, afmd − mlx "
            f"{fmt(a.ttft_minus_mlx_ms)}")


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
    """Per round a / b; a round where either failed has none."""
    return [x / y if x and y else None for x, y in zip(a, b, strict=True)]


def _diffs(a: list[float | None], b: list[float | None]) -> list[float | None]:
    """Per round a − b; a round where either failed has none."""
    return [x - y if x and y else None for x, y in zip(a, b, strict=True)]
