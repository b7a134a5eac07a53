"""The log-probabilities row: greedy decode with ``top_logprobs: 5`` against without.

afmd only (mlx_lm.server's logprobs are another implementation; raw mlx-lm computes them
for every row anyway). Each pair is two single-stream chat completions of the same prompt
(unique to the pair), one with ``logprobs: true, top_logprobs: 5`` and one without, the
second held to the tokens the first produced and the order alternating pair by pair, so
drift and unequal lengths hit both alike. Greedy, both write the same tokens, so prompt
lookup (which both use) verifies the same proposals on both sides; two prompts' outputs
loop differently and would gain unequally from it. The rate is the decode phase's (tokens
after the first over first → last delta): what asking for log-probabilities costs per
token; the second of a pair may find its prompt in the prefix cache, which only the
end-to-end ratio sees (for either side in turn). Each request's server CPU time per token
is kept too (``/proc``): on a shared machine it is disturbed less than wall-clock rates.

Alone (the row's measurement on its own afmd, ``demo-32k``, no other phase):

    .venv/bin/python bench/logprobs.py [--pairs 10] [--max-tokens 256] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from bench import client, servers, workload  # noqa: E402
from bench.measure import HOST, first_error  # noqa: E402
from bench.plan import Ctx  # noqa: E402
from bench.results import LogprobsRate, fmt, stat  # noqa: E402

TOP = 5


def _body(tag: str, i: int, max_tokens: int, logprobs: bool) -> dict[str, Any]:
    extra = {"logprobs": True, "top_logprobs": TOP} if logprobs else {}
    return workload.chat_body(workload.messages(workload.prompt(f"{tag}-lp", i)), max_tokens,
                              **extra)


async def m_logprobs(ctx: Ctx, port: int, tag: str, pid: int | None = None,
                     cpu: dict[bool, list[float]] | None = None) -> LogprobsRate:
    """``pid``: the server's, to record its CPU seconds per token into ``cpu``."""
    p = ctx.plan
    pairs = 2 * p.runs
    await client.stream_chat(HOST, port, _body(f"{tag}-warm", 0, 8, True), timeout=p.timeout)
    asked: list[client.StreamResult] = []
    plain: list[client.StreamResult] = []

    async def one(i: int, max_tokens: int, logprobs: bool) -> client.StreamResult:
        c0 = servers.cpu_seconds(pid) if pid else None
        done = await client.stream_chat(HOST, port, _body(tag, i, max_tokens, logprobs),
                                        timeout=p.timeout)
        c1 = servers.cpu_seconds(pid) if pid else None
        if cpu is not None and c0 is not None and c1 is not None and done.tokens:
            cpu[logprobs].append((c1 - c0) / done.tokens)
        return done

    for i in range(pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        first = await one(i, p.max_tokens, order[0])
        held = first.tokens if first.ok and first.tokens > 0 else p.max_tokens
        second = await one(i, held, order[1])
        with_, without = (first, second) if order[0] else (second, first)
        asked.append(with_)
        plain.append(without)
    why = first_error(asked) or first_error(plain)

    def ratio(attr: str) -> list[float | None]:
        out: list[float | None] = []
        for a, b in zip(asked, plain, strict=True):
            x, y = getattr(a, attr), getattr(b, attr)
            out.append(x / y if a.ok and b.ok and x and y else None)
        return out

    return LogprobsRate(
        with_tps=stat([r.decode_tps if r.ok else None for r in asked], "tok/s", reason=why),
        without_tps=stat([r.decode_tps if r.ok else None for r in plain], "tok/s",
                         reason=why),
        pct=stat(ratio("decode_tps"), "%", scale=100, reason=why),
        e2e_pct=stat(ratio("e2e_tps"), "%", scale=100, reason=why),
        tokens=[r.tokens for r in asked],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    from afmd.engine.demo import builtin as demo
    from bench.plan import Plan
    from bench.run import _parser

    plan = Plan.make(_parser().parse_args(["--quick"]))
    plan.runs, plan.max_tokens = max(1, args.pairs // 2), args.max_tokens
    work = Path(tempfile.mkdtemp(prefix="afmd-bench-logprobs-"))
    demo.materialize("demo-32k", work / "cache")
    ctx = Ctx(plan=plan, work=work, cache=work / "cache", folders={})
    srv = servers.afmd_server(work, "afmd-logprobs", cache_root=ctx.cache, default="demo-32k")
    cpu: dict[bool, list[float]] = {True: [], False: []}

    async def measure() -> LogprobsRate:
        srv.start()
        try:
            await srv.ready()
            return await m_logprobs(ctx, srv.port, "alone", srv.pid, cpu)
        finally:
            srv.stop()

    rate = asyncio.run(measure())
    cpu_ms = {k: statistics.median(v) * 1e3 if v else None for k, v in cpu.items()}
    summary = {**dict(rate.items()), "cpu_ms_per_token_with": cpu_ms[True],
               "cpu_ms_per_token_without": cpu_ms[False]}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{2 * plan.runs} pairs × {plan.max_tokens} tokens on demo-32k: decode with "
              f"top_logprobs {TOP} {fmt(rate.with_tps)}, without {fmt(rate.without_tps)}; "
              f"per-pair ratio {fmt(rate.pct)} (target ≥ 85%), end to end {fmt(rate.e2e_pct)}")
        if cpu_ms[True] and cpu_ms[False]:
            print(f"server CPU per token: {cpu_ms[True]:.2f} ms with, {cpu_ms[False]:.2f} ms "
                  f"without ({100 * cpu_ms[False] / cpu_ms[True]:.0f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
