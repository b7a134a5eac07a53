"""The GPU mode: afmd against mlx_lm.server on one model folder, in turns, results to --out.

Made for the GPU machine's prepared run (``../shared/device/README.md``), which builds a
~1.2B random bf16 Qwen2 at ``/tmp/m/big`` and sets ``$OUT``::

    bash .devN/run.sh python3 bench/gpu.py --model /tmp/m/big --out $OUT --label COMMIT

The same command checks itself on a CPU with a small model and smaller sizes (the GPU run
then only changes the model)::

    .venv/bin/python bench/gpu.py --model DIR --out DIR --max-tokens 32 --rounds 1 \\
        --streams 1,8 --prefix-tokens 400

Every system is its own server process on a free port, all up together, one working at a
time; each starts with an empty MLX kernel cache of its own (``MLX_PTX_CACHE_DIR``), so
neither inherits kernels the other compiled. In order:

1. **Start**: each server started and waited for alone (``ready_s``: start → /health 200;
   afmd's includes its warm-up on the GPU path).
2. **First round**: each system's very first requests, one system at a time: one stream
   (time to first token, tok/s), then 8 streams (aggregate tok/s). Shapes never seen.
3. **Rounds in turns** (``--rounds``): per round, one stream on each system, then each
   level of ``--streams`` above 1 on each system, the order rotating round by round; a
   ratio is the median of per-round ratios.
4. **Prefix reuse**: a conversation of ``--prefix-tokens``, then its second turn; the second
   turn's time to first token as % of the first's, in turns.
5. **Speculative decoding's edit workload** (afmd systems): the request's own greedy
   output with a few characters replaced as ``prediction``, against the same request
   without, in turns; decode-rate ratio (the engine's, from ``X-AFM-Profile``), same text,
   the proposals accepted.
6. **afmd's step trace** (``AFMD_STEP_TRACE``, afmd/engine/batch/steptrace.py) per phase: how
   long an iteration of its generation thread took, how much of it waited for the device.

Writes ``gpu-bench.json`` (every run) and ``gpu-bench.md`` (the table) under ``--out``,
with the servers' log tails when one fails. ``--baseline DIR`` adds afmd from another
checkout (``afmd-base``), ``--variant NAME:VAR=VALUE,...`` afmd with other environment
variables (e.g. ``cudnn-off:MLX_CUDA_USE_CUDNN_SDPA=0``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from afmd.ports import free_ports  # noqa: E402
from bench import client, servers, workload  # noqa: E402
from bench.measure import concurrent  # noqa: E402
from bench.speculative import _edit, _prediction  # noqa: E402

HOST = servers.HOST
PROFILE = {"X-AFM-Profile": "true"}
MLX = "mlx_lm_server"


@dataclass
class System:
    """One server under test and what was measured of it."""

    name: str
    server: servers.Server
    afmd: bool
    trace: Path | None = None
    results: dict[str, Any] = field(default_factory=dict)
    #: (phase, wall-clock start, end) of each measurement, to split the step trace.
    windows: list[tuple[str, float, float]] = field(default_factory=list)

    def add(self, key: str, value: Any) -> None:
        self.results.setdefault(key, []).append(value)


def _afmd(work: Path, name: str, model: Path, *, streams: int, root: Path | None,
          env: dict[str, str]) -> System:
    port = free_ports()
    entry = f'[[models.model]]\nid = "bench"\npath = "{model}"\n'
    config = work / f"{name}.toml"
    config.write_text(servers.afmd_config(port, default="bench", extra_models=entry,
                                          max_concurrent=max(streams, 8)))
    trace = work / f"{name}-steps.jsonl"
    full = {"AFMD_CACHE_DIR": str(work / f"{name}-cache"),
            "MLX_PTX_CACHE_DIR": str(work / f"{name}-ptx"), "AFMD_STEP_TRACE": str(trace),
            **env}
    if root is not None:
        full["PYTHONPATH"] = os.pathsep.join(
            [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])
    server = servers.Server(
        name=name, cmd=[sys.executable, "-m", "afmd", "serve", "--config", str(config),
                        "--port", str(port)],
        port=port, log_path=work / f"{name}.log", env=full, cwd=root)
    return System(name, server, afmd=True, trace=trace)


def _mlx(work: Path, model: Path) -> System:
    server = servers.mlx_server(work, MLX, model)
    server.env["MLX_PTX_CACHE_DIR"] = str(work / f"{MLX}-ptx")
    return System(MLX, server, afmd=False)


def _body(text: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return workload.chat_body(workload.messages(text), max_tokens, **extra)


async def _one(system: System, phase: str, body: dict[str, Any], timeout: float,
               headers: dict[str, str] | None = None) -> client.StreamResult:
    start = time.time()
    res = await client.stream_chat(HOST, system.server.port, body, timeout=timeout,
                                   headers=headers if system.afmd else None)
    system.windows.append((phase, start, time.time()))
    if not res.ok:
        system.add("errors", f"{phase}: {res.error or f'HTTP {res.status}'}")
    return res


async def _many(system: System, phase: str, bodies: list[dict[str, Any]], timeout: float
                ) -> Any:
    start = time.time()
    batch = await concurrent(system.server.port, bodies, timeout)
    system.windows.append((phase, start, time.time()))
    if batch.error:
        system.add("errors", f"{phase}: {batch.error}")
    return batch


def _order(systems: list[System], r: int) -> list[System]:
    k = r % len(systems)
    return systems[k:] + systems[:k]


async def measure(args: argparse.Namespace, systems: list[System], log: Any) -> None:
    levels = [n for n in args.streams if n > 1]
    t = args.timeout
    log("first round (each system's first requests):")
    for s in systems:
        one = await _one(s, "first", _body(workload.prompt("gpu-first", 0), args.max_tokens),
                         t, PROFILE)
        batch = await _many(s, "first", [_body(workload.prompt("gpu-first-c8", i),
                                               args.max_tokens) for i in range(8)], t)
        profile = one.profile or {}
        s.results["first_round"] = {
            "ttft_ms": one.ttft * 1e3 if one.ok else None,
            "tps": one.stream_tps, "decode_tps": one.decode_tps,
            "c8_tps": batch.agg_tps, "c8_ttft_ms": batch.ttft * 1e3 if batch.ttft else None,
            # afmd's own split: request parsed → admitted (render, plan), admitted → token
            "server_queue_ms": profile.get("queue_ms"),
            "server_ttft_ms": profile.get("ttft_ms")}
        log(f"  {s.name}: ttft {_f(s.results['first_round']['ttft_ms'])} ms, "
            f"{_f(one.stream_tps)} tok/s; 8 streams {_f(batch.agg_tps)} tok/s")
    for r in range(args.rounds):
        log(f"round {r + 1}/{args.rounds} in turns:")
        for s in _order(systems, r):
            one = await _one(s, "c1", _body(workload.prompt(f"gpu-one-{r}", r),
                                             args.max_tokens), t)
            s.add("c1_tps", one.stream_tps)
            s.add("c1_decode_tps", one.decode_tps)
            s.add("c1_ttft_ms", one.ttft * 1e3 if one.ok else None)
        for n in levels:
            for s in _order(systems, r):
                bodies = [_body(workload.prompt(f"gpu-c{n}-{r}", i), args.max_tokens)
                          for i in range(n)]
                batch = await _many(s, f"c{n}", bodies, t)
                s.add(f"c{n}_tps", batch.agg_tps)
                s.add(f"c{n}_ttft_ms", batch.ttft * 1e3 if batch.ttft else None)
        log("  " + "; ".join(
            f"{s.name} " + ", ".join(f"c{n} {_f(s.results.get(f'c{n}_tps', [None])[-1])}"
                                     for n in args.streams) for s in systems))
    if args.prefix_tokens > 0:
        log(f"prefix reuse ({args.prefix_tokens}-token conversation, second turn):")
        counter = workload.TokenCounter(args.model)
        for r in range(args.rounds):
            for s in _order(systems, r):
                conv = workload.prefix_conversation(f"gpu-prefix-{s.name}-{r}",
                                                    args.prefix_tokens, counter)
                first = await _one(s, "prefix", workload.chat_body(conv, 16), t)
                if not first.ok:
                    continue
                second = await _one(s, "prefix", workload.chat_body(
                    workload.second_turn(conv, first.text), 16), t)
                if second.ok and first.ttft > 0:
                    s.add("prefix_first_ms", first.ttft * 1e3)
                    s.add("prefix_second_ms", second.ttft * 1e3)
                    s.add("prefix_pct", 100 * second.ttft / first.ttft)
                    s.add("prefix_cached_tokens", second.cached_tokens)
        log("  " + "; ".join(f"{s.name} {_f(_median(s.results.get('prefix_pct')))} %"
                             for s in systems))
    if args.spec_tokens > 0:
        await _speculative(args, [s for s in systems if s.afmd], log)


async def _speculative(args: argparse.Namespace, systems: list[System], log: Any) -> None:
    """The edit workload on each afmd system, plain and with the prediction in turns."""
    log("speculative decoding, edit workload (afmd):")
    n, t = args.spec_tokens, args.timeout
    for s in systems:
        for r in range(args.rounds):
            text = workload.prompt("gpu-edit", r)
            own = await _one(s, "edit", _body(text, n), t)
            if not own.ok:
                continue
            runs = {}
            for kind in (("plain", "edit") if r % 2 == 0 else ("edit", "plain")):
                extra = _prediction(_edit(own.text)) if kind == "edit" else {}
                runs[kind] = await _one(s, "edit", _body(text, n, **extra), t, PROFILE)
            plain, edit = runs["plain"], runs["edit"]
            plain_tps, edit_tps = _engine_decode_tps(plain), _engine_decode_tps(edit)
            if plain_tps and edit_tps:
                s.add("edit_ratio", edit_tps / plain_tps)
            s.add("edit_same_text", plain.text == edit.text)
            # In half precision a verification pass and a step round differently, so a
            # near-tie can part the two texts: where they part says how far they agreed.
            s.add("edit_parted_at", _parted(plain.text, edit.text))
            spec = (edit.profile or {}).get("speculation") or {}
            s.add("edit_accepted", (spec.get("prediction") or {}).get("accepted"))
            s.add("edit_tokens", edit.tokens)
        log(f"  {s.name}: with / without prediction "
            f"{_f(_median(s.results.get('edit_ratio')))}x, same text "
            f"{all(s.results.get('edit_same_text') or [False])}")


def _engine_decode_tps(result: Any) -> float | None:
    """The decode rate afmd's profile measured (its engine's first token to its last), else
    the client's. An accepted prediction arrives in a few large deltas, which a busy client
    can read in one go, leaving no span of its own to measure over."""
    rate = (result.profile or {}).get("decode_tokens_per_s")
    return float(rate) if rate else result.decode_tps


def _parted(a: str, b: str) -> int | None:
    """The first character where ``a`` and ``b`` differ (None: the same text)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def steps(system: System) -> dict[str, Any]:
    """The step trace split by phase: iterations, rows, time per iteration and waiting."""
    if system.trace is None or not system.trace.exists():
        return {}
    lines = [json.loads(x) for x in system.trace.read_text().splitlines() if x.strip()]
    out: dict[str, Any] = {}
    for phase in dict.fromkeys(p for p, _, _ in system.windows):
        spans = [(a, b) for p, a, b in system.windows if p == phase]
        mine = [x for x in lines if any(a <= x["t"] <= b for a, b in spans)]
        if not mine:
            continue
        total = [x["admit_ms"] + x["next_ms"] + x["deliver_ms"] for x in mine]
        waited = sum(x["wait_ms"] for x in mine)
        out[phase] = {
            "iterations": len(mine),
            "rows_mean": round(statistics.fmean(x["rows"] for x in mine), 2),
            "iteration_ms_median": round(statistics.median(total), 3),
            "next_ms_median": round(statistics.median(x["next_ms"] for x in mine), 3),
            "wait_ms_median": round(statistics.median(x["wait_ms"] for x in mine), 3),
            "deliver_ms_median": round(statistics.median(x["deliver_ms"] for x in mine), 3),
            "admit_ms_max": round(max(x["admit_ms"] for x in mine), 3),
            "wait_share": round(waited / sum(total), 3) if sum(total) else None,
        }
    return out


def _median(values: list[Any] | None) -> float | None:
    vals = [v for v in values or () if isinstance(v, int | float) and not isinstance(v, bool)]
    return statistics.median(vals) if vals else None


def _f(v: float | None, digits: int = 1) -> str:
    return "n/a" if v is None else f"{v:,.{digits}f}"


def _ratios(a: list[Any] | None, b: list[Any] | None) -> list[float]:
    return [x / y for x, y in zip(a or (), b or (), strict=False) if x and y]


def summarize(args: argparse.Namespace, systems: list[System]) -> dict[str, Any]:
    by = {s.name: s for s in systems}
    out: dict[str, Any] = {}
    for s in systems:
        res = dict(s.results)
        res["medians"] = {k: _median(v) for k, v in s.results.items()
                          if isinstance(v, list) and k != "errors"}
        res["steps"] = steps(s)
        res["ready_s"] = s.server.ready_after
        out[s.name] = res
    ratios: dict[str, Any] = {}
    if MLX in by:
        for s in systems:
            if not s.afmd:
                continue
            mine = {}
            for n in args.streams:
                r = _ratios(s.results.get(f"c{n}_tps"), by[MLX].results.get(f"c{n}_tps"))
                mine[f"c{n}_tps"] = {"median": statistics.median(r) if r else None, "runs": r}
            d = [x - y for x, y in zip(s.results.get("c1_ttft_ms") or (),
                                       by[MLX].results.get("c1_ttft_ms") or (), strict=False)
                 if x is not None and y is not None]
            mine["c1_ttft_minus_ms"] = {"median": statistics.median(d) if d else None, "runs": d}
            ratios[f"{s.name}/{MLX}"] = mine
    return {"systems": out, "ratios": ratios}


def table(doc: dict[str, Any], args: argparse.Namespace) -> str:
    systems = doc["systems"]
    names = list(systems)
    mlx = systems.get(MLX)

    def cell(name: str, key: str, scale: float = 1.0, digits: int = 1) -> str:
        v = systems[name]["medians"].get(key)
        return _f(None if v is None else v * scale, digits)

    rows = ["| | " + " | ".join(names) + (" | afmd / server |" if mlx else " |"),
            "|---|" + "---|" * (len(names) + (1 if mlx else 0))]

    def row(title: str, key: str, *, first: bool = False, ratio: str | None = None) -> None:
        if first:
            vals = [_f(systems[n].get("first_round", {}).get(key)) for n in names]
        else:
            vals = [cell(n, key) for n in names]
        extra = ""
        if mlx:
            r = doc["ratios"].get(f"afmd/{MLX}", {}).get(ratio or "", {}).get("median")
            if ratio and r is not None:
                extra = f" {r:.2f}x" if "ttft" not in ratio else f" {r:+.1f} ms"
            elif first and systems.get("afmd", {}).get("first_round", {}).get(key) \
                    and mlx.get("first_round", {}).get(key):
                extra = f" {systems['afmd']['first_round'][key] / mlx['first_round'][key]:.2f}x"
            extra = f" |{extra}"
        rows.append(f"| {title} | " + " | ".join(vals) + extra + " |")

    rows.append("| ready (start → /health), s | " + " | ".join(
        _f(systems[n].get("ready_s"), 2) for n in names) + (" | |" if mlx else " |"))
    row(f"one stream, {args.max_tokens} tokens, tok/s", "c1_tps", ratio="c1_tps")
    row("its first token, ms", "c1_ttft_ms", ratio="c1_ttft_minus_ms")
    for n in args.streams:
        if n > 1:
            row(f"{n} concurrent streams, aggregate tok/s", f"c{n}_tps", ratio=f"c{n}_tps")
    row("first round: one stream, tok/s", "tps", first=True)
    row("first round: its first token, ms", "ttft_ms", first=True)
    row("first round: 8 streams, aggregate tok/s", "c8_tps", first=True)
    row("second-turn TTFT, % of first", "prefix_pct")
    row("edit workload, with / without prediction", "edit_ratio")
    lines = [f"# GPU bench {doc['meta']['date']} ({doc['meta']['label']})", "",
             f"{doc['meta']['device']}; model {doc['meta']['model']}; "
             f"{args.rounds} rounds in turns, {args.max_tokens} tokens a stream", "",
             *rows, ""]
    for name in names:
        st = systems[name].get("steps") or {}
        if st:
            lines.append(f"{name}'s generation thread (median per iteration): " + "; ".join(
                f"{p} {v['iteration_ms_median']} ms, waiting {v['wait_ms_median']} ms "
                f"({v['rows_mean']} rows)" for p, v in st.items()))
    errors = {n: systems[n].get("errors") for n in names if systems[n].get("errors")}
    if errors:
        lines += ["", "Errors: " + json.dumps(errors)]
    return "\n".join(lines) + "\n"


def _device() -> str:
    code = ("import mlx.core as mx; d = mx.default_device(); "
            "c = getattr(mx, 'cuda', None); "
            "print(mx.__version__, d, 'cuda' if c and c.is_available() else "
            "('metal' if mx.metal.is_available() else 'cpu'))")
    try:
        got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        got = "?"
    gpu = ""
    if shutil.which("nvidia-smi"):
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
    return f"MLX {got}" + (f", {gpu}" if gpu else "") + f", {platform.machine()}"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench/gpu.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="MLX model folder to serve")
    ap.add_argument("--out", type=Path, required=True, help="results folder ($OUT)")
    ap.add_argument("--streams", default="1,8,32",
                    type=lambda v: sorted({int(x) for x in v.split(",")} | {1}),
                    help="concurrency levels (1 is always measured)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=2000, help="0: no prefix rows")
    ap.add_argument("--spec-tokens", type=int, default=256, help="0: no speculative rows")
    ap.add_argument("--systems", default=f"afmd,{MLX}",
                    help=f"afmd and/or {MLX} (plus --baseline and --variant systems)")
    ap.add_argument("--baseline", type=Path, help="another afmd checkout, run as afmd-base")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:VAR=VALUE,...: afmd with these environment variables")
    ap.add_argument("--label", default="", help="what is measured (e.g. the commit)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    ap.add_argument("--keep-work", action="store_true", help="keep logs and traces in --out")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="afmd-gpu-bench-"))
    wanted = {x.strip() for x in args.systems.split(",") if x.strip()}
    top = max(args.streams)
    systems: list[System] = []
    if "afmd" in wanted:
        systems.append(_afmd(work, "afmd", args.model, streams=top, root=None, env={}))
    if args.baseline is not None:
        systems.append(_afmd(work, "afmd-base", args.model, streams=top,
                             root=args.baseline.resolve(), env={}))
    for spec in args.variant:
        name, _, pairs = spec.partition(":")
        env = dict(p.split("=", 1) for p in pairs.split(",") if "=" in p)
        systems.append(_afmd(work, f"afmd-{name}", args.model, streams=top, root=None,
                             env=env))
    if MLX in wanted:
        systems.append(_mlx(work, args.model))
    if not systems:
        raise SystemExit("no system to measure (--systems)")
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "label": args.label or "unlabelled", "model": str(args.model),
            "device": _device(), "argv": sys.argv[1:],
            "load_average": list(os.getloadavg())}
    log(f"gpu bench: {meta['device']}; {', '.join(s.name for s in systems)}")
    code = 0

    async def run() -> None:
        for s in systems:  # one at a time: a start is measured alone
            s.server.start()
            await s.server.ready(timeout=900)
            log(f"  {s.name} ready in {s.server.ready_after:.2f} s")
        await measure(args, systems, log)

    try:
        asyncio.run(run())
    except Exception as exc:
        log(f"! failed: {exc}")
        meta["error"] = str(exc)
        code = 1
    finally:
        for s in systems:
            s.server.stop()
    doc = {"meta": meta, **summarize(args, systems)}
    doc["meta"]["seconds"] = round(time.perf_counter() - started, 1)
    for s in systems:
        if s.results.get("errors") or code:
            doc["systems"][s.name]["log_tail"] = s.server.log_tail(40)
    (args.out / "gpu-bench.json").write_text(json.dumps(doc, indent=1, default=str))
    md = table(doc, args)
    (args.out / "gpu-bench.md").write_text(md)
    print(md)
    if args.keep_work:
        for f in work.glob("*.log"):
            shutil.copy(f, args.out / f.name)
    shutil.rmtree(work, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
