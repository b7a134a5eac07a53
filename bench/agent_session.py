"""The agent-session workload: a long, growing conversation resent turn after turn, a
compaction, a sub-agent, and a restart; what the block KV cache (docs/kv-cache.md) does
for its time to first token.

One afmd process serves demo-32k (``--model big``: the compute-bound bench model, a random
hidden-512 × 8-layer Qwen2 with demo-32k's tokenizer, ``bench/raw_engine.py``'s), with
``[cache] disk_dir`` in the run's folder. The session, every request greedy, streamed,
with ``X-AFM-Profile``:

1. **growth**: a long system prompt and a task, then turn after turn the model's own
   answer and a tool output are appended (a conversation of about ``--tokens`` tokens);
2. **compaction**: an old tool output is replaced by a short summary (the conversation
   changes in its middle: everything before the change is reused);
3. **sub-agent**: a new conversation with the same system prompt;
4. **hot**: the next turn of the main conversation (its answer and a new message
   appended), on the running server: what the turn costs with everything in RAM;
5. **restart**: the server stops (SIGTERM) and starts again on the same folders, as
   ``brew services`` does after an upgrade, and the same next turn is sent: the **restart
   turn**. The disk folder is first put back as it was before the hot turn (a copy taken
   once the writes settled), so the restart turn finds only what the session wrote;
6. **cold**: the same request on a server with no cache at all (``prompt_cache_bytes =
   0``), the cost without any cache.

Reported: each turn's TTFT and where its cached tokens came from; the restart turn
against the hot and the cold turn (targets: within 1.5x the hot turn, under 0.35x the
cold one); the RAM tier's bytes after the session and the sub-agent (one shared system
prompt held once) against what the two conversations would hold as whole copies; decode
tok/s of a long stream while another request's blocks are written to disk, with the disk
tier on and off, in turns (the ratio's median).

    .venv/bin/python bench/agent_session.py [--quick] [--json] [--peer] [--tokens N]
        [--rounds N] [--model demo-32k|big]

``--peer`` runs the same session on mlx_lm.server (this environment's mlx-lm; its prefix
cache lives in its process, so its restart turn is a fresh process's); ``--vllm-mlx VENV``
on vllm-mlx installed in a venv of its own (``pip install vllm-mlx==0.6.0 "mlx[cpu]"
"torch==2.13.*" "torchvision==0.28.*"`` with PyTorch's CPU index), which persists its
prefix cache at shutdown under its home folder and loads it at start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from afmd.ports import free_ports  # noqa: E402
from bench import client, servers  # noqa: E402
from bench.raw_engine import build_big  # noqa: E402

_PROSE = ("the function returns a value when its argument is valid and raises an error "
          "otherwise so callers check the result before they use it in the next step of "
          "parsing files reading lines counting tokens writing tests fixing bugs renaming "
          "variables moving modules")
WORDS = tuple(_PROSE.split(" "))


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _config(port: int, model: Path, kv: Path, *, cache: bool = True,
            disk: bool = True) -> str:
    return f"""\
[server]
host = "{servers.HOST}"
port = {port}
request_timeout = 900.0

[models]
default = "big"

[[models.model]]
id = "big"
path = "{model}"
context_length = 32768

[cache]
prompt_cache_bytes = {1 << 30 if cache else 0}
disk_dir = "{kv}"
disk_bytes = {10 << 30 if disk else 0}

[log]
access_log = false
"""


async def _start(work: Path, name: str, config: str, cache_root: Path) -> servers.Server:
    return await asyncio.to_thread(servers.afmd_process, work / name, name, config,
                                   env={"AFMD_CACHE_DIR": str(cache_root)}, timeout=300)


async def _turn(srv: servers.Server, messages: list[dict[str, str]],
                max_tokens: int) -> client.StreamResult:
    body: dict[str, Any] = {
        "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if srv.name.startswith("vllm-mlx"):  # it requires a model name (mlx_lm.server loads one)
        body["model"] = "big"
    res = await client.stream_chat(servers.HOST, srv.port, body,
                                   headers={"X-AFM-Profile": "true"})
    if not res.ok:
        raise RuntimeError(f"{srv.name}: {res.status} {res.error}")
    return res


def _row(label: str, res: client.StreamResult) -> dict[str, Any]:
    profile = res.profile or {}
    return {"turn": label, "prompt_tokens": res.prompt_tokens, "ttft_s": round(res.ttft, 4),
            "cached_tokens": res.cached_tokens,
            "cached_ram_tokens": profile.get("cached_ram_tokens"),
            "cached_disk_tokens": profile.get("cached_disk_tokens")}


async def _kv_bytes(srv: servers.Server) -> dict[str, int]:
    _, body = await client.request(servers.HOST, srv.port, "GET", "/health", timeout=10)
    details = body["model_details"]
    return next(iter(details.values()))["kv_cache"]


async def _settled(srv: servers.Server) -> dict[str, int]:
    """The tiers' bytes once the disk tier's writes stopped growing."""
    last = await _kv_bytes(srv)
    while True:
        await asyncio.sleep(0.5)
        now = await _kv_bytes(srv)
        if now == last:
            return now
        last = now


async def _mlx_lm(work: Path, name: str, model: Path) -> servers.Server:
    srv = servers.mlx_server(work, name, model).start()
    try:
        await srv.ready(300)
    except BaseException:
        srv.stop()
        raise
    return srv


async def _vllm_mlx(work: Path, name: str, model: Path, venv: Path,
                    home: Path) -> servers.Server:
    """vllm-mlx from its own venv, its persisted prefix cache under ``home`` (it saves the
    cache at shutdown and loads it at start: the same ``home`` after a restart)."""
    port = free_ports()
    home.mkdir(parents=True, exist_ok=True)
    srv = servers.Server(
        name=name,
        cmd=[str(venv / "bin" / "vllm-mlx"), "serve", str(model), "--host", servers.HOST,
             "--port", str(port), "--continuous-batching", "--served-model-name", "big"],
        port=port, log_path=work / f"{name}.log",
        env={"HOME": str(home), "HF_HUB_OFFLINE": "1"},
    ).start()
    try:
        await srv.ready(600)
    except BaseException:
        srv.stop()
        raise
    return srv


async def session(work: Path, model: Path, cache_root: Path, *, tokens: int,
                  answer_tokens: int, peer: str | None = None,
                  vllm_venv: Path | None = None) -> dict[str, Any]:
    """The session on afmd, or on a peer: ``mlx_lm`` (mlx_lm.server, whose prefix cache
    lives in its process only: its restart turn and its cold turn are both a fresh
    process's) or ``vllm-mlx`` (its prefix cache persisted at shutdown; cold: a fresh
    home folder)."""
    rng = random.Random(7)
    kv = work / "kv"
    system = {"role": "system", "content": "You are a coding agent. " + _text(rng, tokens // 4)}
    messages = [system, {"role": "user", "content": "Fix the failing test in parser.py."}]
    growth = max(1, (tokens - tokens // 4) // 600)
    turns: list[dict[str, Any]] = []

    async def start(name: str, cache: bool = True) -> servers.Server:
        if peer == "mlx_lm":
            return await _mlx_lm(work, f"mlx-lm-{name}", model)
        if peer == "vllm-mlx":
            assert vllm_venv is not None
            home = work / ("vllm-home" if cache else "vllm-home-cold")
            return await _vllm_mlx(work, f"vllm-mlx-{name}", model, vllm_venv, home)
        folder = kv if cache else work / "kv-off"
        return await _start(work, f"afmd-{name}",
                            _config(free_ports(), model, folder, cache=cache),
                            cache_root)

    srv = await start("session")
    shared_kv = {"ram_bytes": 0, "disk_bytes": 0}
    try:
        for i in range(growth + 1):
            res = await _turn(srv, messages, answer_tokens)
            turns.append(_row(f"growth {i + 1}", res))
            messages += [{"role": "assistant", "content": res.text or "ok"},
                         {"role": "user", "content": f"Tool output {i}: " + _text(rng, 450)}]
        # Compaction: the first tool output becomes a summary.
        messages[3] = {"role": "user", "content": "Tool output 0 (summarised): parser ok."}
        res = await _turn(srv, messages, answer_tokens)
        turns.append(_row("compaction", res))
        messages += [{"role": "assistant", "content": res.text or "ok"},
                     {"role": "user", "content": "Now run the tests."}]
        sub = [system, {"role": "user", "content": "Sub-agent: list the files under src/."}]
        res = await _turn(srv, sub, answer_tokens)
        turns.append(_row("sub-agent", res))
        sub_tokens = res.prompt_tokens or 0
        main_tokens = turns[-2]["prompt_tokens"] or 0
        if not peer:
            shared_kv = await _settled(srv)
            shutil.copytree(kv, work / "kv-before-hot")
        hot = await _turn(srv, messages, answer_tokens)
        turns.append(_row("hot (next turn, no restart)", hot))
    finally:
        srv.stop()
    if not peer:
        shutil.rmtree(kv)
        (work / "kv-before-hot").rename(kv)
    srv = await start("restarted")
    try:
        restart = await _turn(srv, messages, answer_tokens)
        turns.append(_row("restart (same next turn)", restart))
    finally:
        srv.stop()
    srv = await start("cold", cache=False)
    try:
        cold = await _turn(srv, messages, answer_tokens)
        turns.append(_row("cold (no cache)", cold))
    finally:
        srv.stop()
    per_token = shared_kv["ram_bytes"] / max(1, main_tokens)  # an upper estimate
    return {
        "turns": turns,
        "session_ttft_s": round(sum(t["ttft_s"] for t in turns if not
                                    t["turn"].startswith(("hot", "cold"))), 3),
        "restart_vs_hot": round(restart.ttft / hot.ttft, 2),
        "restart_vs_cold": round(restart.ttft / cold.ttft, 3),
        "ram": {"kv_ram_bytes": shared_kv["ram_bytes"], "kv_disk_bytes": shared_kv["disk_bytes"],
                "main_tokens": main_tokens, "sub_agent_tokens": sub_tokens,
                "whole_copies_estimate_bytes": round(per_token * (main_tokens + sub_tokens))},
    }


async def decode_with_writes(work: Path, model: Path, cache_root: Path, *, rounds: int,
                             prompt_words: int, max_tokens: int) -> dict[str, Any]:
    """A long stream decodes while a short one, started with it, finishes and has its
    blocks written: the long stream's decode rate, disk tier on against off, in turns."""
    on = await _start(work, "afmd-disk-on", _config(free_ports(), model, work / "kv-on"),
                cache_root)
    off = await _start(work, "afmd-disk-off", _config(free_ports(), model, work / "kv-no",
                                                disk=False), cache_root)
    rng = random.Random(11)
    rates: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for r in range(rounds):
            order = [("on", on), ("off", off)] if r % 2 == 0 else [("off", off), ("on", on)]
            for label, srv in order:
                tag = f"{label}-{r}-{rng.random()}"
                long_msgs = [{"role": "user", "content": tag + " " + _text(rng, 40)}]
                short_msgs = [{"role": "user", "content": tag + " short " +
                               _text(rng, prompt_words)}]
                long_res, _ = await asyncio.gather(_turn(srv, long_msgs, max_tokens),
                                                   _turn(srv, short_msgs, 4))
                if long_res.decode_tps:
                    rates[label].append(long_res.decode_tps)
        ratios = [a / b for a, b in zip(rates["on"], rates["off"], strict=False)]
        written = await _kv_bytes(on)
    finally:
        on.stop()
        off.stop()
    return {"decode_tps_disk_on": [round(x, 1) for x in rates["on"]],
            "decode_tps_disk_off": [round(x, 1) for x in rates["off"]],
            "on_over_off_median": round(statistics.median(ratios), 3) if ratios else None,
            "disk_bytes_written": written["disk_bytes"]}


def _table(result: dict[str, Any]) -> str:
    lines = ["| turn | prompt tokens | TTFT (s) | cached | from RAM | from disk |",
             "|---|---:|---:|---:|---:|---:|"]
    for t in result["session"]["turns"]:
        lines.append(f"| {t['turn']} | {t['prompt_tokens']} | {t['ttft_s']:.3f} | "
                     f"{t['cached_tokens']} | {t['cached_ram_tokens']} | "
                     f"{t['cached_disk_tokens']} |")
    s = result["session"]
    lines += ["", f"restart turn / hot turn: {s['restart_vs_hot']} (target <= 1.5); "
              f"restart turn / cold turn: {s['restart_vs_cold']} (target < 0.35)",
              f"session TTFT sum (growth, compaction, sub-agent, restart): "
              f"{s['session_ttft_s']} s",
              f"RAM tier after the session and the sub-agent: {s['ram']['kv_ram_bytes']} bytes "
              f"(whole copies of both conversations: about "
              f"{s['ram']['whole_copies_estimate_bytes']} bytes)"]
    peers = [(label, result[key]) for key, label in (("mlx_lm_server", "mlx_lm.server"),
                                                      ("vllm_mlx", "vllm-mlx"))
             if result.get(key)]
    if peers:
        lines += ["", "| turn | afmd TTFT (s) | " + " | ".join(
            f"{label} TTFT (s)" for label, _ in peers) + " |",
            "|---|---:|" + "---:|" * len(peers)]
        for i, mine in enumerate(s["turns"]):
            lines.append(f"| {mine['turn']} | {mine['ttft_s']:.3f} | " + " | ".join(
                f"{p['turns'][i]['ttft_s']:.3f}" for _, p in peers) + " |")
        lines.append("session TTFT sum: afmd " + f"{s['session_ttft_s']} s, " + ", ".join(
            f"{label} {p['session_ttft_s']} s" for label, p in peers))
    d = result.get("decode")
    if d:
        lines.append(f"decode tok/s while blocks are written, disk tier on / off (median of "
                     f"rounds): {d['on_over_off_median']} (on {d['decode_tps_disk_on']}, "
                     f"off {d['decode_tps_disk_off']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/agent_session.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a shorter session, one round")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--tokens", type=int, default=10000, help="the conversation's length")
    ap.add_argument("--rounds", type=int, default=4, help="decode rounds (disk on/off)")
    ap.add_argument("--peer", action="store_true",
                    help="also run the session on mlx_lm.server (this environment's mlx-lm)")
    ap.add_argument("--vllm-mlx", metavar="VENV",
                    help="also run it on vllm-mlx installed in VENV (its own venv)")
    ap.add_argument("--cache-dir", metavar="DIR", help="where models are built (reused)")
    ap.add_argument("--model", choices=("demo-32k", "big"), default="demo-32k",
                    help="demo-32k (default), or the compute-bound bench model (slow on a "
                         "shared CPU: minutes per cold 10k-token turn)")
    args = ap.parse_args(argv)
    tokens = 3000 if args.quick else args.tokens
    rounds = 1 if args.quick else args.rounds
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="afmd-agent-") as tmp:
        work = Path(tmp)
        cache_root = Path(args.cache_dir) if args.cache_dir else work / "cache"
        from afmd.engine.demo.builtin import materialize

        model = materialize("demo-32k", cache_root)
        if args.model == "big":
            model = build_big(model, cache_root)
        result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"),
                                  "tokens": tokens}
        result["session"] = asyncio.run(session(work, model, cache_root, tokens=tokens,
                                                answer_tokens=16))
        if args.peer:
            result["mlx_lm_server"] = asyncio.run(session(
                work, model, cache_root, tokens=tokens, answer_tokens=16, peer="mlx_lm"))
        if args.vllm_mlx:
            result["vllm_mlx"] = asyncio.run(session(
                work, model, cache_root, tokens=tokens, answer_tokens=16, peer="vllm-mlx",
                vllm_venv=Path(args.vllm_mlx)))
        result["decode"] = asyncio.run(decode_with_writes(
            work, model, cache_root, rounds=rounds, prompt_words=1200, max_tokens=96))
        result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
