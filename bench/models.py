"""The model rows: time to first token when the model has to be loaded first, and
switching between two models on alternating requests, within the memory budget and over it.

afmd only. Every model id points at the built-in ``demo-32k`` (16.7 MB of weights, a
32k-token vocabulary: a load reads, lays out and starts a real model), so the cases differ
only in what afmd has to do:

- **cold**: the first request for a model this afmd process has not loaded yet (the
  server's default ``demo`` is loaded, so imports are paid already). The weight files were
  just built, so the OS page cache holds them: a model read from a cold disk is slower.
- **warm**: the same model again after an unload (``keep_alive: 0`` on the request before).
- **loaded**: the same request with the model in memory, the baseline.
- **within / over**: requests alternating between models ``a`` and ``b``; within the budget
  (``max_loaded = 3``) both stay loaded, over it (``max_loaded = 1``) each request unloads
  the other model and loads its own.

Each case's value is the median time from the request sent to its first content delta
(short unique prompts, greedy, 8 tokens); the loads each case caused are counted from the
server's log. Alone:

    .venv/bin/python bench/models.py [--runs 5] [--cold 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from bench import client, servers, workload  # noqa: E402
from bench.measure import HOST  # noqa: E402
from bench.plan import Ctx  # noqa: E402
from bench.results import ModelSwitch, fmt, null, stat  # noqa: E402

VARIANT = "afmd:demo-32k"
MAX_TOKENS = 8
LOADED = "model loaded: "


def _models(max_loaded: int, ids: tuple[str, ...]) -> str:
    """The [models] keys and tables the case's server gets (after ``default``)."""
    tables = "".join(f'[[models.model]]\nid = "{i}"\npath = "{VARIANT}"\n' for i in ids)
    return f"max_loaded = {max_loaded}\nkeep_alive = -1\n{tables}"


def _loads(srv: servers.Server) -> int:
    try:
        text = srv.log_path.read_text(errors="replace")
    except OSError:
        return 0
    return text.count(LOADED)


class _Client:
    """Short unique streamed requests to one server; each answer's time to first token."""

    def __init__(self, port: int, tag: str, timeout: float) -> None:
        self.port, self.tag, self.timeout, self.n = port, tag, timeout, 0

    async def ttft(self, model: str, **extra: Any) -> float:
        self.n += 1
        body = workload.chat_body(workload.messages(workload.prompt(self.tag, self.n)),
                                  MAX_TOKENS, model=model, **extra)
        done = await client.stream_chat(HOST, self.port, body, timeout=self.timeout)
        if not done.ok:
            raise RuntimeError(f"{model}: status {done.status}, {done.error}")
        return done.t_first - done.t_send


async def _with_server(ctx: Ctx, name: str, max_loaded: int, ids: tuple[str, ...],
                       run: Callable[[_Client, servers.Server], Awaitable[None]]) -> None:
    srv = servers.afmd_server(ctx.work / "models", name, cache_root=ctx.cache,
                              default="demo", max_concurrent=4,
                              extra_models=_models(max_loaded, ids))
    srv.start()
    try:
        await srv.ready()
        await run(_Client(srv.port, name, ctx.plan.timeout), srv)
    finally:
        srv.stop()


async def m_models(ctx: Ctx, cold_runs: int) -> ModelSwitch:
    """The four cases; ``cold_runs`` fresh servers for the cold loads (one each)."""
    runs = ctx.plan.runs
    cold: list[float | None] = []
    warm: list[float | None] = []
    loaded: list[float | None] = []
    within: list[float | None] = []
    over: list[float | None] = []
    loads: dict[str, int] = {}

    async def within_budget(c: _Client, srv: servers.Server) -> None:
        cold.append(await c.ttft("a"))
        for _ in range(runs):
            loaded.append(await c.ttft("a"))
        for _ in range(runs):
            await c.ttft("a", keep_alive=0)  # unloaded right after this one
            await _unloaded(c.port, "a", c.timeout)
            warm.append(await c.ttft("a"))
        await c.ttft("b")  # both loaded from here on
        before = _loads(srv)
        for i in range(2 * runs):
            within.append(await c.ttft("ab"[i % 2]))
        loads["within"] = _loads(srv) - before

    async def over_budget(c: _Client, srv: servers.Server) -> None:
        if len(cold) < cold_runs:
            cold.append(await c.ttft("a"))
        await c.ttft("a")
        before = _loads(srv)
        for i in range(2 * runs):
            over.append(await c.ttft("ba"[i % 2]))
        loads["over"] = _loads(srv) - before

    async def cold_only(c: _Client, srv: servers.Server) -> None:
        cold.append(await c.ttft("a"))

    await _with_server(ctx, "models-within", 3, ("a", "b"), within_budget)
    await _with_server(ctx, "models-over", 1, ("a", "b"), over_budget)
    for i in range(cold_runs - len(cold)):
        await _with_server(ctx, f"models-cold-{i}", 3, ("a",), cold_only)
    return ModelSwitch(
        cold_ttft_ms=stat(cold, "ms", scale=1000),
        warm_ttft_ms=stat(warm, "ms", scale=1000),
        loaded_ttft_ms=stat(loaded, "ms", scale=1000),
        within_ttft_ms=stat(within, "ms", scale=1000),
        over_ttft_ms=stat(over, "ms", scale=1000),
        loads=loads,
        setup={"variant": VARIANT, "max_tokens": MAX_TOKENS, "runs": runs,
               "cold_runs": cold_runs, "alternating_requests": 2 * runs,
               "within_max_loaded": 3, "over_max_loaded": 1},
    )


async def _unloaded(port: int, model: str, timeout: float) -> None:
    """Until /health says ``model`` is no longer loaded (its unload ran)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, body = await client.request(HOST, port, "GET", "/health")
        if body["model_details"][model]["state"] != "loaded":
            return
        await asyncio.sleep(0.01)
    raise RuntimeError(f"{model} was not unloaded within {timeout:g} s")


async def bench_models(ctx: Ctx) -> None:
    """The phase in the main benchmark: one cold server in quick mode, three in full."""
    cold_runs = 1 if ctx.plan.quick else 3
    ctx.load_note("models-start")
    try:
        ctx.res.afmd.models = await m_models(ctx, cold_runs)
    except Exception as exc:
        ctx.log(f"  ! afmd models failed: {exc!r}")
        ctx.res.afmd.errors["models"] = f"{type(exc).__name__}: {exc}"
        reason = f"failed: {type(exc).__name__}: {exc}".splitlines()[0]
        ctx.res.afmd.models = ModelSwitch(cold_ttft_ms=null(reason, "ms"))
        return
    finally:
        ctx.load_note("models-end")
    m = ctx.res.afmd.models
    ctx.log(f"  load + first token: cold {fmt(m.cold_ttft_ms)}, warm {fmt(m.warm_ttft_ms)}, "
            f"loaded {fmt(m.loaded_ttft_ms)}; alternating: within {fmt(m.within_ttft_ms)}, "
            f"over {fmt(m.over_ttft_ms)} (loads {m.loads})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5,
                    help="warm loads, loaded requests and alternating pairs (default 5)")
    ap.add_argument("--cold", type=int, default=3, help="cold loads, a fresh server each")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    from afmd.engine.demo import builtin as demo
    from bench.plan import Plan
    from bench.run import _parser

    plan = Plan.make(_parser().parse_args(["--quick"]))
    plan.runs = max(1, args.runs)
    work = Path(tempfile.mkdtemp(prefix="afmd-bench-models-"))
    for variant in ("demo", "demo-32k"):
        demo.materialize(variant, work / "cache")
    ctx = Ctx(plan=plan, work=work, cache=work / "cache", folders={}, log=lambda _: None)
    result = asyncio.run(m_models(ctx, max(1, args.cold)))
    if args.json:
        print(json.dumps(dict(result.items())))
        return 0
    print(f"time to first token on demo-32k ({MAX_TOKENS}-token answers, medians): model not "
          f"loaded yet {fmt(result.cold_ttft_ms)}; after an unload {fmt(result.warm_ttft_ms)}; "
          f"already loaded {fmt(result.loaded_ttft_ms)}")
    print(f"two models on alternating requests: within the budget "
          f"{fmt(result.within_ttft_ms)} ({(result.loads or {}).get('within')} loads), over "
          f"it {fmt(result.over_ttft_ms)} ({(result.loads or {}).get('over')} loads) over "
          f"{2 * plan.runs} requests each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
