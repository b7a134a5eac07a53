"""The distributed rows: one model over two ranks (tensor, pipeline) against one process.

afmd only. Three servers of the compute-bound bench model (``bench/raw_engine.py``'s
hidden 512 × 8 layers, demo-32k's tokenizer) come up side by side: a plain ``afmd serve``
and two ``afmd launch -n 2 -- serve`` groups (MLX's ring backend over loopback), one
``[distributed] strategy = "tensor"``, one ``"pipeline"``. They take turns, one working
at a time while the others are stopped (SIGSTOP: nothing of theirs, a group's launcher
and ranks included, takes CPU from the one measured): each round sends the same new greedy prompt to
each, one stream at a time, then the same ``STREAMS`` prompts at once, the order rotating
round by round. A group's rate is the median of its per-round ratios to the one process.

On a machine with fewer cores than ranks × the threads a rank computes with, the two
ranks share the cores the one process had alone, so a ratio under 1 is what this
measures honestly here: what the split costs in synchronisation and traffic, not what a
second machine's cores would add.

Network bytes per generated token: the payload the group's processes received from each
other over TCP while generating (their sockets' kernel counters: the ring's collectives,
the step plans, the control channel's heartbeats), over the completion tokens (a
prompt's prefill crosses too: over the positions the forward passes computed, prompt
tokens not cached included, it is a figure of the model's shape alone); and, as a
cross-check, loopback's own byte counter, headers included, which also counts the
benchmark's HTTP (the one process's loopback bytes per token are that baseline, shown
beside) and anything else on the host.

Alone (13-14 minutes on this shared 2-core VM at load 5-11, where the one process ran at
a quarter of its quiet-machine rate; each group takes 10-40 s to come up):

    .venv/bin/python bench/distributed.py [--rounds 3] [--max-tokens 32] [--json]
    .venv/bin/python bench/distributed.py --model demo-32k --strategies tensor --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from bench import client, servers, traffic, workload  # noqa: E402
from bench.measure import HOST, concurrent  # noqa: E402
from bench.plan import Ctx  # noqa: E402
from bench.results import Distributed, fmt, null, stat  # noqa: E402

STRATEGIES = ("tensor", "pipeline")
ONE = "one"  # the single process, the baseline
ROUNDS = 3
MAX_TOKENS = 32
STREAMS = 8
RANKS = 2
BIG = "big"  # the compute-bound model's id in the servers' config
BIG_TITLE = "compute-bound (h512×8L)"
START_TIMEOUT = 240.0
IDLE_SECONDS = 3.0


@dataclass(frozen=True)
class Setup:
    """What to measure: the model (``path``: a folder, or ``afmd:<variant>``)."""

    model: str
    path: str
    strategies: tuple[str, ...] = STRATEGIES
    rounds: int = ROUNDS
    max_tokens: int = MAX_TOKENS
    streams: int = STREAMS
    timeout: float = 300.0
    idle_seconds: float = IDLE_SECONDS  # each system's idle CPU is read over this long


def config_text(setup: Setup, strategy: str | None) -> str:
    """Every system's config; a group's ranks all read the same file. The heartbeat and
    step limits are out of reach: a paused group must not find itself lost on resuming."""
    group = (f'\n[distributed]\nstrategy = "{strategy}"\nheartbeat_timeout = 3600.0\n'
             "step_timeout = 3600.0\n") if strategy else ""
    table = ("" if setup.path == f"afmd:{setup.model}"  # a built-in demo: no table
             else f'[[models.model]]\nid = "{setup.model}"\npath = "{setup.path}"\n')
    return f"""\
[server]
host = "{HOST}"
max_connections = 256
request_timeout = {setup.timeout}

[queue]
max_concurrent_requests = 16
max_queued_requests = 256

[models]
default = "{setup.model}"
keep_alive = -1
{table}
[log]
level = "info"
format = "json"
access_log = false
{group}"""


@dataclass
class System:
    """One server under test: a process, or a group (its supervisor, MLX's launcher and
    the ranks), and every pid below it, to pause and to count traffic between."""

    name: str
    server: servers.Server
    pids: list[int] = field(default_factory=list)

    def pause(self) -> None:
        traffic.pause(self.pids)

    def resume(self) -> None:
        traffic.resume(self.pids)

    def cpu(self) -> float:
        return sum(servers.cpu_seconds(p) or 0.0 for p in self.pids)

    def stop(self) -> None:
        """Drain and stop; whatever is left of a group is killed (a killed supervisor
        would leave MLX's launcher and the ranks running)."""
        pids = self.pids or traffic.process_tree(self.server.pid)
        traffic.resume(pids)
        self.server.stop(timeout=30.0)
        traffic.signal_all(pids, signal.SIGKILL)


def start(work: Path, setup: Setup, name: str, strategy: str | None,
          env: dict[str, str]) -> System:
    cfg = work / f"{name}.toml"
    cfg.write_text(config_text(setup, strategy))
    afmd = [sys.executable, "-m", "afmd"]
    launch = ["launch", "-n", str(RANKS), "--"] if strategy else []
    server = servers.Server(
        name=name, cmd=[*afmd, *launch, "serve", "--config", str(cfg), "--port", "0",
                        "--log-format", "json"],
        port=0, log_path=work / f"{name}.log", env=env)
    return System(name, server.start())


async def ready(system: System) -> None:
    """Until its log names the port (``--port 0``) and ``/health`` answers 200."""
    srv = system.server
    deadline = time.monotonic() + START_TIMEOUT
    while not srv.port:
        if not srv.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{srv.name} never listened:\n{srv.log_tail()}")
        srv.port = _listening_port(srv.log_path)
        await asyncio.sleep(0.1)
    await srv.ready(max(1.0, deadline - time.monotonic()))
    system.pids = traffic.process_tree(srv.pid)


def _listening_port(log: Path) -> int:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return 0
    for line in lines:
        if '"listening"' not in line:
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        for address in event.get("addresses", []):
            if address.startswith("http://"):
                return int(address.rsplit(":", 1)[1])
    return 0


@dataclass
class Sample:
    """One measurement of one system: its rate, tokens and the bytes it moved."""

    tps: float | None = None
    tokens: int = 0
    positions: int = 0  # the forward pass's: prompt tokens not cached, and generated ones
    rank_bytes: int | None = None
    lo_bytes: int | None = None
    error: str | None = None


async def measure(system: System, bodies: list[dict[str, Any]], timeout: float) -> Sample:
    """One stream (its delivered rate) or several at once (their aggregate rate)."""
    port = system.server.port
    ranks0, lo0 = traffic.rank_bytes(system.pids), traffic.loopback_bytes()
    if len(bodies) == 1:
        one = await client.stream_chat(HOST, port, bodies[0], timeout=timeout)
        out = Sample(one.stream_tps if one.ok else None, one.tokens if one.ok else 0,
                     error=None if one.ok else (one.error or f"HTTP {one.status}"))
        done = [one] if one.ok else []
    else:
        batch = await concurrent(port, bodies, timeout)
        out = Sample(batch.agg_tps, batch.tokens, error=batch.error)
        done = batch.results
    out.positions = sum((r.prompt_tokens or 0) - (r.cached_tokens or 0) + r.tokens
                        for r in done)
    ranks1, lo1 = traffic.rank_bytes(system.pids), traffic.loopback_bytes()
    out.rank_bytes = None if ranks0 is None or ranks1 is None else ranks1 - ranks0
    out.lo_bytes = None if lo0 is None or lo1 is None else lo1 - lo0
    return out


def _bodies(tag: str, n: int, max_tokens: int) -> list[dict[str, Any]]:
    return [workload.chat_body(workload.messages(workload.prompt(tag, i)), max_tokens)
            for i in range(n)]


async def _idle_cpu(system: System, seconds: float) -> float | None:
    """% of one core the whole system takes while serving nothing (alone, the others
    paused)."""
    await asyncio.sleep(0.5)
    before, t0 = system.cpu(), time.monotonic()
    await asyncio.sleep(seconds)
    return 100 * (system.cpu() - before) / (time.monotonic() - t0)


async def m_distributed(setup: Setup, work: Path, env: dict[str, str],
                        log: Callable[[str], None] = print) -> Distributed:
    """Start the systems, warm each, then the rounds in turns; every system stopped."""
    work.mkdir(parents=True, exist_ok=True)
    names = (ONE, *setup.strategies)
    systems: dict[str, System] = {}
    load_start = [round(x, 2) for x in os.getloadavg()]
    try:
        for name in names:
            systems[name] = start(work, setup, name, None if name == ONE else name, env)
        for name in names:
            await ready(systems[name])
            log(f"  {name}: ready on port {systems[name].server.port}")
        idle: dict[str, float | None] = {}
        for name in names:
            for other in names:
                systems[other].pause()
            s = systems[name]
            s.resume()
            warm = _bodies(f"dist-warm-{name}", setup.streams, 4)
            await measure(s, warm[:1], setup.timeout)
            await measure(s, warm, setup.timeout)
            idle[name] = await _idle_cpu(s, setup.idle_seconds)
            s.pause()
        samples: dict[tuple[str, str], list[Sample]] = {
            (n, k): [] for n in names for k in ("single", "agg")}
        for r in range(setup.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for kind, n in (("single", 1), ("agg", setup.streams)):
                bodies = _bodies(f"dist-{kind}-{r}", n, setup.max_tokens)
                for name in order:
                    systems[name].resume()
                    await asyncio.sleep(0.2)
                    samples[(name, kind)].append(
                        await measure(systems[name], bodies, setup.timeout))
                    systems[name].pause()
            log(f"  round {r + 1}/{setup.rounds}: " + ", ".join(
                f"{n} {_num(samples[(n, 'single')][-1].tps)}/"
                f"{_num(samples[(n, 'agg')][-1].tps)}" for n in names) + " tok/s")
    finally:
        for s in systems.values():
            s.stop()
    return summarize(setup, samples, idle, load_start)


def _num(v: float | None) -> str:
    return "?" if v is None else f"{v:.1f}"


def summarize(setup: Setup, samples: dict[tuple[str, str], list[Sample]],
              idle: dict[str, float | None], load_start: list[float]) -> Distributed:
    """Per-system rates, per-round ratios to the one process, bytes per token."""
    out = Distributed()
    for (name, kind), got in samples.items():
        why = next((s.error for s in got if s.error), None)
        v = out.values
        v[f"{name}_{kind}_tps"] = stat([s.tps for s in got], "tok/s", reason=why)
        v[f"{name}_{kind}_lo_bytes_per_token"] = stat(
            [s.lo_bytes / s.tokens if s.lo_bytes is not None and s.tokens else None
             for s in got], "B/token", reason=why or "no loopback counter")
        if name == ONE:
            continue
        base = samples[(ONE, kind)]
        v[f"{name}_{kind}_x"] = stat(
            [s.tps / b.tps if s.tps and b.tps else None for s, b in zip(got, base, strict=True)],
            "×", reason=why or "no rate")
        for per, unit in (("tokens", "token"), ("positions", "position")):
            v[f"{name}_{kind}_bytes_per_{unit}"] = stat(
                [s.rank_bytes / getattr(s, per) if s.rank_bytes is not None
                 and getattr(s, per) else None for s in got], f"B/{unit}",
                reason=why or "no socket counters (ss missing?)")
    for name in STRATEGIES:
        if name not in setup.strategies:
            for kind in ("single", "agg"):
                for what in ("tps", "x", "bytes_per_token", "bytes_per_position",
                             "lo_bytes_per_token"):
                    out.values[f"{name}_{kind}_{what}"] = null(
                        f"not measured (--strategies {','.join(setup.strategies)})")
    out.idle_cpu_pct = {k: None if v is None else round(v, 1) for k, v in idle.items()}
    out.setup = {"model": setup.model, "ranks": RANKS, "strategies": list(setup.strategies),
                 "rounds": setup.rounds, "max_tokens": setup.max_tokens,
                 "streams": setup.streams, "idle_seconds": setup.idle_seconds,
                 "backend": "ring (loopback)",
                 "loadavg_start": load_start,
                 "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    return out


async def bench_distributed(ctx: Ctx) -> None:
    """The phase in the main benchmark (full run): the compute-bound model's folder."""
    folder = ctx.folders.get(BIG)
    if not folder:
        return
    setup = Setup(BIG, folder, timeout=ctx.plan.timeout)
    ctx.load_note("distributed-start")
    try:
        ctx.res.afmd.distributed = await m_distributed(
            setup, ctx.work / "distributed", {"AFMD_CACHE_DIR": str(ctx.cache)}, ctx.log)
    except Exception as exc:
        ctx.log(f"  ! afmd distributed failed: {exc!r}")
        ctx.res.afmd.errors["distributed"] = f"{type(exc).__name__}: {exc}"
        reason = f"failed: {type(exc).__name__}: {exc}".splitlines()[0]
        ctx.res.afmd.distributed = Distributed({"tensor_single_x": null(reason, "×")})
        return
    finally:
        ctx.load_note("distributed-end")
    ctx.log("  " + text(ctx.res.afmd.distributed).replace("\n", "\n  "))


def text(d: Distributed) -> str:
    """The results as lines for a terminal."""
    setup = d.setup or {}
    lines = []
    for kind, label in (("single", "one stream"), ("agg", f"{setup.get('streams')} streams")):
        lines.append(f"{label}: 1 rank {fmt(d.get(f'{ONE}_{kind}_tps'))}")
        for name in setup.get("strategies", STRATEGIES):
            lines.append(
                f"  2 ranks, {name}: {fmt(d.get(f'{name}_{kind}_tps'))}, per round "
                f"{fmt(d.get(f'{name}_{kind}_x'))} 1 rank's; between the ranks "
                f"{fmt(d.get(f'{name}_{kind}_bytes_per_token'))}, "
                f"{fmt(d.get(f'{name}_{kind}_bytes_per_position'))} (loopback counter "
                f"{fmt(d.get(f'{name}_{kind}_lo_bytes_per_token'))}, 1 rank's "
                f"{fmt(d.get(f'{ONE}_{kind}_lo_bytes_per_token'))})")
    lines.append(f"idle CPU, % of one core: {d.idle_cpu_pct}; load average "
                 f"{setup.get('loadavg_start')} → {setup.get('loadavg_end')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--streams", type=int, default=STREAMS)
    ap.add_argument("--strategies", default=",".join(STRATEGIES),
                    help="comma-separated subset of tensor,pipeline")
    ap.add_argument("--model", choices=(BIG, "demo-32k"), default=BIG,
                    help="big: the compute-bound h512×8L model (default); demo-32k: tiny")
    ap.add_argument("--idle-seconds", type=float, default=IDLE_SECONDS,
                    help="how long each system's idle CPU is read (default %(default)g)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    if not strategies or set(strategies) - set(STRATEGIES):
        ap.error(f"--strategies: choose from {','.join(STRATEGIES)}")
    from afmd.engine.demo import builtin as demo
    from bench import raw_engine, rows
    from bench.results import Measurements

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # the servers are stopped on the way out

    signal.signal(signal.SIGTERM, stop)
    with tempfile.TemporaryDirectory(prefix="afmd-bench-distributed-") as tmp:
        work, cache = Path(tmp), Path(tmp) / "cache"
        base = demo.materialize("demo-32k", cache)
        path = (str(raw_engine.build_big(base, cache)) if args.model == BIG
                else "afmd:demo-32k")
        setup = Setup(args.model, path, strategies, max(1, args.rounds), args.max_tokens,
                      max(1, args.streams), idle_seconds=max(0.1, args.idle_seconds))
        result = asyncio.run(m_distributed(
            setup, work / "servers", {"AFMD_CACHE_DIR": str(cache)},
            log=lambda m: print(m, file=sys.stderr if args.json else sys.stdout, flush=True)))
    res = Measurements()
    res.afmd.distributed = result
    summary = {**dict(result.items()),
               "rows": rows.evaluate(rows.distributed_rows(
                   True, setup.max_tokens, setup.streams,
                   BIG_TITLE if args.model == BIG else args.model), res)}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{args.model}, {setup.rounds} rounds in turns, {setup.max_tokens} greedy "
              f"tokens per stream:")
        print(text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
