"""Memory soak: a real afmd under rounds of mixed requests, RSS sampled after each round.

A server that grows with every request fails slowly, hours after any test ran. This
starts ``afmd serve`` on a built-in demo model (loopback only), sends ``--rounds`` rounds
of ``--requests`` requests each, cycling through what clients really do — streamed and
non-streamed completions, streams cancelled through the cancel endpoint, streams dropped
mid-way, 400 errors, ``tool_choice: "required"`` and ``json_schema`` requests (a quarter
of them with a grammar never seen before, so the grammar caches reach their bounds) and
second turns that hit the prefix cache — and after each round, with the server idle,
reads VmRSS from ``/proc/PID/status`` and MLX's active and peak memory from an
``X-AFM-Profile: extended`` probe. The table it prints shows whether RSS levels off.

    .venv/bin/python bench/soak.py --rounds 6 --requests 300

Bounded: ``--max-seconds`` stops sending new requests, every request has a timeout, and
``--concurrency`` requests are in flight at most. ``--set section.key=value`` passes a
setting to the server (as ``AFMD_SECTION_KEY``), to attribute growth to one component by
turning it off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from bench.servers import HOST, Server, afmd_process  # noqa: E402

CHAT = "/v1/chat/completions"
MODEL = "demo"  # docs/benchmarks.md's Memory numbers were measured on it
#: The prefix cache's RAM tier, bounded so that it fills within the first round: it is
#: meant to grow to its bound (1 GiB by default), and growth up to there would hide a leak.
PROMPT_CACHE_BYTES = 32 << 20
KINDS = ("plain", "stream", "cancel", "drop", "error", "tools", "json_schema", "second_turn")
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
         "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo",
         "sierra", "tango", "uniform", "victor", "whiskey", "xray")


@dataclass
class RoundResult:
    round: int
    requests: int
    seconds: float
    rss_mib: float
    hwm_mib: float
    mlx_active_mib: float | None
    mlx_peak_mib: float | None
    outcomes: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def proc_status_mib(pid: int, key: str) -> float:
    """A ``/proc/PID/status`` size field (VmRSS, VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def start_server(workdir: Path, *, model: str, concurrency: int, settings: dict[str, str],
                 launcher: str | None, cache_dir: Path) -> Server:
    """``afmd serve`` on a free loopback port; returns once /health is 200."""
    env = {"AFMD_CACHE_DIR": str(cache_dir)}
    for key, value in settings.items():
        section, name = key.split(".", 1)
        env[f"AFMD_{section.upper()}_{name.upper()}"] = value
    return afmd_process(
        workdir, "soak",
        f'[server]\nhost = "{HOST}"\nrequest_timeout = 60.0\n'
        f"[queue]\nmax_concurrent_requests = {concurrency}\nmax_queued_requests = 256\n"
        f"[cache]\nprompt_cache_bytes = {PROMPT_CACHE_BYTES}\n"
        f'[models]\ndefault = "{model}"\n[log]\naccess_log = false\n',
        env=env, launcher=launcher)


# -- the workload ---------------------------------------------------------------------

def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _schema(variant: int) -> dict[str, Any]:
    """Eight recurring schemas; a negative variant is one never seen before."""
    tag = f"v{variant}" if variant >= 0 else f"u{-variant}"
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "kind": {"enum": [tag, "other"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "kind", "count"],
        "additionalProperties": False,
    }


def _tools(variant: int) -> list[dict[str, Any]]:
    name = f"lookup_{variant}" if variant >= 0 else f"once_{-variant}"
    return [
        {"type": "function", "function": {"name": name, "description": "Look a word up.",
                                          "parameters": _schema(variant)}},
        {"type": "function", "function": {"name": "add", "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                           "b": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["a", "b"], "additionalProperties": False}}},
    ]


_ERRORS: tuple[dict[str, Any], ...] = (
    {"messages": [{"role": "user", "content": "hi"}], "temperature": "warm"},
    {"messages": "not a list"},
    {"messages": [{"role": "user", "content": "hi"}], "n": 0},
    {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 12}}}},
)


class Workload:
    """Request ``i`` of the soak, its expectations, and its client-side behaviour."""

    def __init__(self, client: httpx.AsyncClient, seed: int) -> None:
        self.client = client
        self.rng = random.Random(seed)
        self.history: list[list[dict[str, Any]]] = []

    def body(self, i: int, **extra: Any) -> dict[str, Any]:
        rng = self.rng
        messages = [
            {"role": "system", "content": "You are a soak test. " + _text(rng, rng.randint(0, 40))},
            {"role": "user", "content": f"request {i}: " + _text(rng, rng.randint(3, 120))},
        ]
        body: dict[str, Any] = {"messages": messages, "max_tokens": rng.randint(4, 48)}
        if rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body["temperature"], body["seed"] = 0.9, i
        body.update(extra)
        return body

    def grammar_variant(self, i: int) -> int:
        """Every fourth grammar request of a kind brings a new grammar; the rest reuse eight."""
        turn = i // len(KINDS)
        return -i if turn % 4 == 0 else turn % 8

    async def run(self, i: int) -> str:
        """Send request ``i``; the outcome's name (``kind:result``)."""
        kind = KINDS[i % len(KINDS)]
        try:
            return f"{kind}:" + await getattr(self, "_" + kind)(i)
        except httpx.HTTPError as exc:
            return f"{kind}:client {type(exc).__name__}"

    async def _plain(self, i: int) -> str:
        r = await self.client.post(CHAT, json=self.body(i))
        if r.status_code == 200:
            messages = self.body(i)["messages"]
            messages.append(r.json()["choices"][0]["message"])
            self.history = [*self.history[-15:], messages]
        return str(r.status_code)

    async def _stream(self, i: int, *, until_first: str | None = None,
                      **extra: Any) -> str:
        body = self.body(i, stream=True, stream_options={"include_usage": True}, **extra)
        headers = {"X-AFM-Profile": "true"} if i % 3 == 0 else {}
        rid = f"soak-{i}-{self.rng.getrandbits(32):08x}"
        headers["X-Request-ID"] = rid
        finish = None
        async with self.client.stream("POST", CHAT, json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return str(r.status_code)
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "stream error " + str(event["error"].get("code"))
                choices = event.get("choices") or ()
                if choices and choices[0].get("finish_reason"):
                    finish = choices[0]["finish_reason"]
                if until_first == "drop" and choices:
                    return "dropped"  # leaving the block closes the connection mid-stream
                if until_first == "cancel" and choices:
                    until_first = None
                    c = await self.client.post(f"{CHAT}/{rid}/cancel")
                    if c.status_code != 200:
                        return f"cancel {c.status_code}"
        return str(finish)

    async def _cancel(self, i: int) -> str:
        return await self._stream(i, until_first="cancel", max_tokens=2000)

    async def _drop(self, i: int) -> str:
        return await self._stream(i, until_first="drop", max_tokens=2000)

    async def _error(self, i: int) -> str:
        r = await self.client.post(CHAT, json=_ERRORS[i // len(KINDS) % len(_ERRORS)])
        code = r.json().get("error", {}).get("code") if r.status_code >= 400 else None
        return f"{r.status_code} {code}"

    async def _tools(self, i: int) -> str:
        body = self.body(i, tools=_tools(self.grammar_variant(i)), tool_choice="required",
                         max_tokens=200)
        r = await self.client.post(CHAT, json=body)
        if r.status_code != 200:
            return str(r.status_code)
        return str(r.json()["choices"][0]["finish_reason"])

    async def _json_schema(self, i: int) -> str:
        schema = _schema(self.grammar_variant(i))
        body = self.body(i, max_tokens=200, response_format={
            "type": "json_schema", "json_schema": {"name": "soak", "schema": schema}})
        if i % 2:
            return await self._stream(i, **{k: v for k, v in body.items()
                                          if k == "response_format"})
        r = await self.client.post(CHAT, json=body)
        return str(r.status_code)

    async def _second_turn(self, i: int) -> str:
        if not self.history:  # no first turn has finished yet
            return await self._plain(i) + " first turn"
        messages = [*self.rng.choice(self.history),
                    {"role": "user", "content": "and then? " + _text(self.rng, 5)}]
        r = await self.client.post(CHAT, json={"messages": messages, "max_tokens": 16,
                                               "temperature": 0})
        if r.status_code != 200:
            return str(r.status_code)
        cached = (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        return "200 cached" if cached else "200 uncached"


async def _wait_idle(client: httpx.AsyncClient, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = (await client.get("/health")).json()
        if h["active_requests"] == 0 and h["queued_requests"] == 0:
            return
        await asyncio.sleep(0.05)


async def _mlx_memory(client: httpx.AsyncClient) -> tuple[float | None, float | None]:
    """MLX active memory (the extended profile's last sample) and peak, in MiB."""
    body = {"messages": [{"role": "user", "content": "probe"}], "max_tokens": 8,
            "temperature": 0, "stream": True}
    active = peak = None
    async with client.stream("POST", CHAT, json=body,
                             headers={"X-AFM-Profile": "extended"}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and "afm_profile_extended" in line:
                profile = json.loads(line[6:])["afm_profile_extended"]
                samples = profile.get("samples") or []
                if samples:
                    active = samples[-1]["memory_bytes"] / 2**20
                p = profile.get("summary", {}).get("peak_memory_bytes")
                peak = p / 2**20 if p else None
    return active, peak


async def soak(server: Server, *, rounds: int, requests: int, concurrency: int, seed: int,
               max_seconds: float, settle_s: float = 1.0,
               after_round: Callable[[RoundResult], Awaitable[None]] | None = None,
               log: Callable[[str], None] = print,
               ) -> list[RoundResult]:
    """Round 0 is the server before any request; ``log`` gets each round's table row as
    it ends (the harness indents it into its progress log)."""
    results: list[RoundResult] = []
    limits = httpx.Limits(max_connections=concurrency * 2 + 4)
    async with httpx.AsyncClient(base_url=server.url, timeout=60.0, limits=limits) as client:
        work = Workload(client, seed)
        start = time.monotonic()
        active, peak = await _mlx_memory(client)
        results.append(RoundResult(0, 0, 0.0, proc_status_mib(server.pid, "VmRSS"),
                                   proc_status_mib(server.pid, "VmHWM"), active, peak))
        if after_round is not None:
            await after_round(results[-1])
        sent = 0
        for n in range(1, rounds + 1):
            if time.monotonic() - start > max_seconds:
                log(f"stopping: --max-seconds {max_seconds:.0f} reached")
                break
            gate = asyncio.Semaphore(concurrency)
            outcomes: Counter[str] = Counter()
            t0 = time.monotonic()

            async def one(i: int, gate: asyncio.Semaphore = gate,
                          outcomes: Counter[str] = outcomes) -> None:
                async with gate:
                    outcomes[await work.run(i)] += 1

            await asyncio.gather(*(one(sent + k) for k in range(requests)))
            sent += requests
            seconds = time.monotonic() - t0
            await _wait_idle(client)
            await asyncio.sleep(settle_s)
            active, peak = await _mlx_memory(client)
            results.append(RoundResult(
                n, sent, seconds, proc_status_mib(server.pid, "VmRSS"),
                proc_status_mib(server.pid, "VmHWM"), active, peak, dict(outcomes)))
            log(_row(results[-1], results[0]))
            if after_round is not None:
                await after_round(results[-1])
    return results


def _fmt(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"


HEADER = ("| round | requests | seconds | RSS MiB | Δ round | Δ start | HWM MiB "
          "| MLX active MiB | MLX peak MiB |\n|---|---|---|---|---|---|---|---|---|")


def _row(r: RoundResult, first: RoundResult, prev: RoundResult | None = None) -> str:
    delta = "" if prev is None else f"{r.rss_mib - prev.rss_mib:+.1f}"
    return (f"| {r.round} | {r.requests} | {r.seconds:.1f} | {r.rss_mib:.1f} | {delta} "
            f"| {r.rss_mib - first.rss_mib:+.1f} | {r.hwm_mib:.1f} | {_fmt(r.mlx_active_mib)} "
            f"| {_fmt(r.mlx_peak_mib)} |")


def table(results: list[RoundResult]) -> str:
    lines = [HEADER]
    for k, r in enumerate(results):
        lines.append(_row(r, results[0], results[k - 1] if k else None))
    return "\n".join(lines)


@dataclass(frozen=True)
class Plateau:
    """RSS from the middle round to the last: what the second half of the soak added.

    The first rounds pay one-time costs (code paths touched for the first time, caches
    filling to their bounds, worker threads and their heaps); a server that has levelled
    off adds next to nothing after them, while a per-request leak keeps adding in the
    second half as much as in any other stretch of requests.
    """

    from_round: int
    to_round: int
    from_requests: int
    to_requests: int
    from_mib: float
    to_mib: float

    @property
    def growth_mib(self) -> float:
        return self.to_mib - self.from_mib

    @property
    def growth_pct(self) -> float:
        return 100 * self.growth_mib / self.from_mib

    def text(self) -> str:
        return (f"{self.from_mib:.1f} → {self.to_mib:.1f} MiB ({self.growth_mib:+.1f} MiB, "
                f"{self.growth_pct:+.1f} %) from round {self.from_round} to "
                f"{self.to_round} (requests {self.from_requests:,}–{self.to_requests:,})")


def plateau(results: list[RoundResult]) -> Plateau | None:
    """The growth over the last half of the rounds; None with fewer than two rounds."""
    last = results[-1]
    if last.round < 2:
        return None
    mid = results[last.round // 2]  # results[k] is round k
    return Plateau(mid.round, last.round, mid.requests, last.requests, mid.rss_mib,
                   last.rss_mib)


def outcome_summary(results: list[RoundResult]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for r in results:
        total.update(r.outcomes)
    return dict(sorted(total.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--requests", type=int, default=300, help="requests per round")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--model", default=MODEL, choices=("demo", "demo-32k"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=900.0)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a server setting, passed as AFMD_SECTION_KEY (repeatable)")
    p.add_argument("--launcher", help="a Python script run instead of `-m afmd` (it must "
                   "take afmd's CLI arguments), e.g. to attach a memory probe")
    p.add_argument("--cache-dir", type=Path, help="demo model cache (default: a temp dir)")
    p.add_argument("--json", type=Path, help="write the rounds here as JSON")
    args = p.parse_args(argv)
    settings = dict(s.split("=", 1) for s in args.set)
    with tempfile.TemporaryDirectory(prefix="afmd-soak-") as tmp:
        workdir = Path(tmp)
        server = start_server(workdir, model=args.model, concurrency=args.concurrency,
                              settings=settings, launcher=args.launcher,
                              cache_dir=args.cache_dir or workdir / "cache")
        try:
            print(f"afmd pid {server.pid} at {server.url}; model {args.model}; "
                  f"settings {settings or 'defaults'}", flush=True)
            results = asyncio.run(soak(
                server, rounds=args.rounds, requests=args.requests,
                concurrency=args.concurrency, seed=args.seed, max_seconds=args.max_seconds,
                log=lambda line: print(line, flush=True)))
        finally:
            server.stop()
    print()
    print(table(results))
    flat = plateau(results)
    print()
    print("plateau (second half):", flat.text() if flat else "needs two rounds or more")
    print("outcomes:", json.dumps(outcome_summary(results), indent=None))
    if args.json:
        args.json.write_text(json.dumps({
            "argv": sys.argv[1:], "settings": settings,
            "rounds": [r.__dict__ for r in results]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
