"""Speculative decoding rows: the same requests with and without speculation, in turns.

afmd only (mlx_lm.server has no ``prediction``, raw mlx-lm no prompt lookup). Two afmd
processes run side by side, one working at a time: ``plain`` with ``[engine]
prompt_lookup = false`` and ``lookup`` with it on; each row sends its two kinds of request
alternately (the order flipping round by round), so a busy machine's slow phases hit both
alike. Every request is greedy and streamed with usage and ``X-AFM-Profile``; a row's rate
is the decode phase's (tokens after the first over first → last delta), its verdict the
median of the per-round ratios, and the text must be the same in each pair.

The demo models have random weights and cannot edit a file, so the edit workload is made
of the model's own behaviour: ``prediction`` is the request's greedy output with a few
characters in the middle replaced (an edit that diverges and rejoins).

    .venv/bin/python bench/speculative.py [--quick] [--json] [--rounds N] [--max-tokens N]

Quick mode (a few seconds of requests): the edit and the never-matching prediction, one
round each; the rest is "skipped in --quick". ``--only ID,ID`` runs some rows alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from afmd.ports import free_ports  # noqa: E402
from bench import client, servers, workload  # noqa: E402
from bench.measure import HOST  # noqa: E402

PROFILE = {"X-AFM-Profile": "true"}
TIMEOUT = 600.0
BIG_TOKENS = 64  # the compute-bound model is ~50x slower per token


@dataclass(frozen=True)
class SpecRow:
    """A line of the table: its target is ``limit`` × the plain rate (None: report)."""

    id: str
    title: str
    target: str
    limit: float | None
    quick: bool = False


ROWS = (
    SpecRow("edit_prediction", "edit workload, prediction = own output with an edit",
            "≥ 2.5× without, same text", 2.5, quick=True),
    SpecRow("lookup_repeat", "prompt lookup, prompt holds text the model repeats",
            "report, same text", None),
    SpecRow("lookup_free", "prompt lookup on free text", "≥ 0.97× without, same text", 0.97),
    SpecRow("lookup_json_schema", "prompt lookup under a json_schema grammar",
            "≥ 0.97× without, same text", 0.97),
    SpecRow("lookup_tool_required", 'prompt lookup under tool_choice "required"',
            "≥ 0.97× without, same text", 0.97),
    SpecRow("prediction_unrelated", "prediction that never matches",
            "≥ 0.95× without, same text", 0.95, quick=True),
    SpecRow("draft_model", f"draft model: demo-32k drafting for h512×8L ({BIG_TOKENS} tokens)",
            "report, same text", None),
    SpecRow("edit_concurrency_8", "edit workload, 8 streams at once (aggregate)",
            "not slower than without (≥ 1.0×)", 1.0),
    SpecRow("edit_penalized", "edit workload under penalties and a logit bias",
            "≥ 1.2× without, same text", 1.2),
)

#: The sampling fields that read the tokens before each position (they turned speculation
#: off until each position of a pass was scored with its own).
PENALIZED: dict[str, Any] = {"frequency_penalty": 0.5, "presence_penalty": 0.3,
                             "logit_bias": {"30": 1.5}}


@dataclass
class Pair:
    plain: client.StreamResult
    spec: client.StreamResult

    @property
    def ok(self) -> bool:
        return self.plain.ok and self.spec.ok

    @property
    def ratio(self) -> float | None:
        a, b = self.spec.decode_tps, self.plain.decode_tps
        return a / b if a and b else None

    @property
    def cpu_ratio(self) -> float | None:
        """Server CPU per token without over with speculation."""
        a, b = CPU.get(id(self.plain)), CPU.get(id(self.spec))
        if not (a and b and self.plain.tokens and self.spec.tokens):
            return None
        return (a / self.plain.tokens) / (b / self.spec.tokens)

    @property
    def same(self) -> bool:
        return self.plain.text == self.spec.text


@dataclass
class Result:
    row: SpecRow
    pairs: list[Pair] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # per round (aggregate rows: theirs)
    same_text: bool = True
    skipped: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def value(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None

    @property
    def passed(self) -> bool | None:
        if self.skipped or self.value is None or self.row.limit is None:
            return None if self.skipped or self.row.limit is None else False
        return self.value >= self.row.limit and self.same_text

    def to_json(self) -> dict[str, Any]:
        return {"id": self.row.id, "title": self.row.title, "target": self.row.target,
                "ratio": self.value, "ratios": self.ratios, "same_text": self.same_text,
                "pass": self.passed, "skipped": self.skipped, **self.extra}


def _body(text: str, max_tokens: int, model: str = "demo-32k", **extra: Any) -> dict[str, Any]:
    return {**workload.chat_body(workload.messages(text), max_tokens, **extra), "model": model}


def _edit(text: str) -> str:
    """A few characters in the middle replaced: the output diverges there and rejoins."""
    mid = len(text) // 2
    return text[:mid] + " banana split " + text[mid + 12:]


def _prediction(text: str) -> dict[str, Any]:
    return {"prediction": {"type": "content", "content": text}}


def _counts(results: list[client.StreamResult]) -> dict[str, Any]:
    """Summed speculation numbers of the profiles, per source."""
    total: dict[str, dict[str, int]] = {}
    for r in results:
        for source, counts in ((r.profile or {}).get("speculation") or {}).items():
            mine = total.setdefault(source, {})
            for k, n in counts.items():
                mine[k] = mine.get(k, 0) + n
    return total


#: port -> the afmd process serving it, for its CPU time per request.
PIDS: dict[int, int] = {}
#: id of a request's result -> the server's CPU seconds while it ran.
CPU: dict[int, float] = {}


async def _stream(port: int, body: dict[str, Any]) -> client.StreamResult:
    """One request, with the server's CPU seconds meanwhile kept in :data:`CPU` (less
    disturbed by a busy machine than wall-clock rates)."""
    pid = PIDS.get(port)
    before = servers.cpu_seconds(pid) if pid else None
    res = await client.stream_chat(HOST, port, body, timeout=TIMEOUT, headers=PROFILE)
    after = servers.cpu_seconds(pid) if pid else None
    if before is not None and after is not None:
        CPU[id(res)] = after - before
    return res


async def _pairs(rounds: int, plain: Callable[[int], Awaitable[client.StreamResult]],
                 spec: Callable[[int], Awaitable[client.StreamResult]]) -> list[Pair]:
    out = []
    for i in range(rounds):
        if i % 2 == 0:
            a = await plain(i)
            b = await spec(i)
        else:
            b = await spec(i)
            a = await plain(i)
        out.append(Pair(a, b))
    return out


def _fill(result: Result, pairs: list[Pair]) -> Result:
    result.pairs = pairs
    result.ratios = [p.ratio for p in pairs if p.ok and p.ratio is not None]
    result.same_text = all(p.same for p in pairs)
    result.extra.update({
        "tokens": [p.spec.tokens for p in pairs],
        "plain_tps": statistics.median([p.plain.decode_tps or 0 for p in pairs]),
        "spec_tps": statistics.median([p.spec.decode_tps or 0 for p in pairs]),
        "e2e_ratios": [round(p.spec.e2e_tps / p.plain.e2e_tps, 3) for p in pairs
                       if p.ok and p.spec.e2e_tps and p.plain.e2e_tps],
        "cpu_ratios": [round(r, 3) for p in pairs if (r := p.cpu_ratio) is not None],
        "speculation": _counts([p.spec for p in pairs]),
        "errors": [p.plain.error or p.spec.error for p in pairs if not p.ok],
    })
    return result


async def measure(args: argparse.Namespace, plain_port: int, lookup_port: int,
                  big: bool) -> list[Result]:
    n, rounds = args.max_tokens, args.rounds
    out: dict[str, Result] = {row.id: Result(row) for row in ROWS}
    # Each prompt's own greedy output, the material of the edit rows.
    prompts = [workload.prompt("spec-edit", i) for i in range(max(rounds, 8))]
    outputs: dict[int, str] = {}

    async def own(i: int) -> str:
        if i not in outputs:
            outputs[i] = (await _stream(plain_port, _body(prompts[i], n))).text
        return outputs[i]

    async def plain(i: int) -> client.StreamResult:
        await own(i)
        return await _stream(plain_port, _body(prompts[i], n))

    async def edited(i: int) -> client.StreamResult:
        return await _stream(plain_port, _body(prompts[i], n, **_prediction(_edit(await own(i)))))

    async def unrelated(i: int) -> client.StreamResult:
        other = _edit(await own((i + 1) % len(prompts)))[::-1]  # text it never writes
        return await _stream(plain_port, _body(prompts[i], n, **_prediction(other)))

    async def edit_row(result: Result) -> None:
        _fill(result, await _pairs(rounds, plain, edited))

    penalized: dict[int, str] = {}

    async def own_penalized(i: int) -> str:
        if i not in penalized:
            penalized[i] = (await _stream(plain_port, _body(prompts[i], n, **PENALIZED))).text
        return penalized[i]

    async def plain_penalized(i: int) -> client.StreamResult:
        await own_penalized(i)
        return await _stream(plain_port, _body(prompts[i], n, **PENALIZED))

    async def edited_penalized(i: int) -> client.StreamResult:
        prediction = _prediction(_edit(await own_penalized(i)))
        return await _stream(plain_port, _body(prompts[i], n, **PENALIZED, **prediction))

    async def edit_penalized_row(result: Result) -> None:
        _fill(result, await _pairs(rounds, plain_penalized, edited_penalized))

    async def unrelated_row(result: Result) -> None:
        _fill(result, await _pairs(rounds, plain, unrelated))

    async def lookup_repeat_row(result: Result) -> None:
        # The model's own output pasted into the prompt: it goes on repeating it.
        repeats = [f"Repeat exactly: {await own(i)}" for i in range(rounds)]
        _fill(result, await _pairs(
            rounds, lambda i: _stream(plain_port, _body(repeats[i], n)),
            lambda i: _stream(lookup_port, _body(repeats[i], n))))

    async def lookup_free_row(result: Result) -> None:
        free = [workload.prompt("spec-free", i) for i in range(rounds)]
        _fill(result, await _pairs(
            rounds, lambda i: _stream(plain_port, _body(free[i], n)),
            lambda i: _stream(lookup_port, _body(free[i], n))))

    def grammar_row(kind: str) -> Callable[[Result], Awaitable[None]]:
        # A constrained row proposes only once its token is known (the proposal must
        # pass the grammar): what that wait costs shows here.
        async def row(result: Result) -> None:
            bodies = [{**workload.grammar_bodies(workload.prompt(f"spec-{kind}", i), n)[kind],
                       "model": "demo-32k"} for i in range(rounds)]
            _fill(result, await _pairs(rounds, lambda i: _stream(plain_port, bodies[i]),
                                       lambda i: _stream(lookup_port, bodies[i])))
        return row

    async def draft_row(result: Result) -> None:
        ask = [workload.prompt("spec-draft", i) for i in range(rounds)]
        _fill(result, await _pairs(
            rounds, lambda i: _stream(plain_port, _body(ask[i], BIG_TOKENS, model="big")),
            lambda i: _stream(plain_port, _body(ask[i], BIG_TOKENS, model="big-drafted"))))

    async def concurrency_row(conc: Result) -> None:
        texts = [await own(i) for i in range(8)]

        async def batch(spec: bool) -> tuple[float | None, list[client.StreamResult]]:
            bodies = [_body(prompts[i], n, **(_prediction(_edit(texts[i])) if spec else {}))
                      for i in range(8)]
            rs = await asyncio.gather(*(_stream(plain_port, b) for b in bodies))
            span = max(x.t_end for x in rs) - min(x.t_send for x in rs)
            return (sum(x.tokens for x in rs) / span if span > 0 else None), list(rs)

        for r in range(rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            got = {spec: await batch(spec) for spec in order}
            (a, plain_rs), (b, spec_rs) = got[False], got[True]
            if a and b:
                conc.ratios.append(b / a)
            conc.same_text &= [x.text for x in plain_rs] == [x.text for x in spec_rs]
            conc.extra.setdefault("plain_agg_tps", []).append(a)
            conc.extra.setdefault("spec_agg_tps", []).append(b)

    runs = {"edit_prediction": edit_row, "lookup_repeat": lookup_repeat_row,
            "lookup_free": lookup_free_row,
            "lookup_json_schema": grammar_row("json_schema"),
            "lookup_tool_required": grammar_row("tool_required"),
            "prediction_unrelated": unrelated_row,
            "draft_model": draft_row, "edit_concurrency_8": concurrency_row,
            "edit_penalized": edit_penalized_row}
    await _stream(plain_port, _body("warm up", 8))
    await _stream(lookup_port, _body("warm up", 8))
    for row in ROWS:
        result = out[row.id]
        if args.quick and not row.quick:
            result.skipped = "skipped in --quick"
        elif args.only and row.id not in args.only:
            result.skipped = "not asked (--only)"
        elif row.id == "draft_model" and not big:
            result.skipped = "skipped (--no-big)"
        else:
            await runs[row.id](result)
    return list(out.values())


def _server(work: Path, name: str, cache: Path, *, lookup: bool, big: Path | None
            ) -> servers.Server:
    port = free_ports()
    models = ""
    if big is not None:
        models = (f'[[models.model]]\nid = "big"\npath = "{big}"\n\n'
                  f'[[models.model]]\nid = "big-drafted"\npath = "{big}"\n'
                  'draft = "demo-32k"\n\n')
    config = servers.afmd_config(port, default="demo-32k", extra_models=models)
    config += f"\n[engine]\nprompt_lookup = {'true' if lookup else 'false'}\n"
    path = work / f"{name}.toml"
    path.write_text(config)
    return servers.Server(
        name=name, cmd=[sys.executable, "-m", "afmd", "serve", "--config", str(path),
                        "--port", str(port)],
        port=port, log_path=work / f"{name}.log", env={"AFMD_CACHE_DIR": str(cache)})


def _table(results: list[Result], load: tuple[float, float]) -> str:
    lines = ["| row | target | with / without (median of rounds) | server CPU per token, "
             "without / with | same text | verdict |", "|---|---|---|---|---|---|"]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.row.title} | {r.row.target} | {r.skipped} | | | |")
            continue
        v = "n/a" if r.value is None else f"{r.value:.2f}× ({len(r.ratios)} rounds)"
        verdict = {True: "pass", False: "FAIL", None: "report"}[r.passed]
        cpu = r.extra.get("cpu_ratios") or []
        c = f"{statistics.median(cpu):.2f}×" if cpu else "n/a"
        lines.append(f"| {r.row.title} | {r.row.target} | {v} | {c} | "
                     f"{'yes' if r.same_text else 'NO'} | {verdict} |")
    lines.append(f"\nload average (1 min) before {load[0]:.2f}, after {load[1]:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--no-big", action="store_true", help="skip the draft model row")
    ap.add_argument("--only", type=lambda v: set(v.split(",")), default=None,
                    help="comma-separated row ids: " + ",".join(r.id for r in ROWS))
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 8
    big_wanted = not (args.quick or args.no_big) and (
        args.only is None or "draft_model" in args.only)

    from afmd.engine.demo import builtin as demo
    from bench.raw_engine import build_big

    work = Path(tempfile.mkdtemp(prefix="afmd-bench-spec-"))
    cache = work / "cache"
    base = demo.materialize("demo-32k", cache)
    big = build_big(base, cache) if big_wanted else None
    plain = _server(work, "afmd-plain", cache, lookup=False, big=big)
    lookup = _server(work, "afmd-lookup", cache, lookup=True, big=None)

    async def run() -> list[Result]:
        plain.start()
        lookup.start()
        try:
            await plain.ready()
            await lookup.ready()
            PIDS.update({plain.port: plain.pid, lookup.port: lookup.pid})
            return await measure(args, plain.port, lookup.port, big is not None)
        finally:
            plain.stop()
            lookup.stop()

    before = os.getloadavg()[0]
    started = time.perf_counter()
    results = asyncio.run(run())
    load = (before, os.getloadavg()[0])
    if args.json:
        print(json.dumps({"load_before": load[0], "load_after": load[1],
                          "seconds": time.perf_counter() - started,
                          "rows": [r.to_json() for r in results]}, default=str))
    else:
        print(_table(results, load))
        for r in results:
            if not r.skipped:
                print(f"{r.row.id}: {json.dumps(r.extra, default=str)}")
    return 0 if all(r.passed is not False for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
