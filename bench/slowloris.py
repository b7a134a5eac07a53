"""Connection exhaustion (slowloris): can legitimate clients still get answers?

Attackers on loopback open connections and trickle a request head one byte at a time
(``--byte-interval``), never finishing it, and reconnect as soon as the server closes one
(``--reconnect-delay``, 0 by default: the worst case). Once they hold the server's
``max_connections``, legitimate clients start sending short requests on fresh connections,
one after another, for ``--seconds``: ``GET /health``, and every ``--chat-every``-th a
``max_tokens: 2`` chat completion. The verdict is the share of legitimate requests
answered 200.

    .venv/bin/python bench/slowloris.py --attackers 150 --legit 4 --seconds 20
    .venv/bin/python bench/slowloris.py --port 9999       # an afmd that is already running

Without ``--port`` it starts ``afmd serve`` itself (built-in demo model, an OS-chosen
loopback port, ``--max-connections``, ``--idle-timeout``) and stops it at the end. Bounded:
attackers and legitimate clients stop at their deadline, every socket operation has a
timeout, and the attack holds ``--attackers`` connections at most. ``--json`` prints one
JSON object instead of the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from bench.servers import HOST, afmd_process  # noqa: E402

ATTACK_HEAD = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: "
HEALTH = b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
CHAT_BODY = json.dumps({"messages": [{"role": "user", "content": "Hi."}],
                        "max_tokens": 2}).encode()
CHAT = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(CHAT_BODY)
        + CHAT_BODY)
TIMEOUT = 5.0  # per legitimate request, connect included
# The attack's shape unless told otherwise (the CLI's defaults and the harness's).
WARMUP = 2.0
BYTE_INTERVAL = 1.0
RECONNECT_DELAY = 0.0
CHAT_EVERY = 4
PAUSE = 0.05


@dataclass
class Stats:
    attack_connections: int = 0
    attack_connect_errors: int = 0
    attack_answered: Counter[str] = field(default_factory=Counter)  # how the server ended one
    tries: int = 0
    ok: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)

        def pct(p: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 1) if lat else None

        return {
            "legit_tries": self.tries,
            "legit_ok": self.ok,
            "legit_success": round(self.ok / self.tries, 4) if self.tries else 0.0,
            "legit_failures": dict(self.failures),
            "latency_ms_p50": round(statistics.median(lat) * 1000, 1) if lat else None,
            "latency_ms_p95": pct(0.95),
            "latency_ms_max": round(lat[-1] * 1000, 1) if lat else None,
            "attack_connections": self.attack_connections,
            "attack_connect_errors": self.attack_connect_errors,
            "attack_ended_by_server": dict(self.attack_answered),
        }


async def attacker(port: int, stop_at: float, stats: Stats, interval: float,
                   reconnect_delay: float) -> None:
    loop = asyncio.get_running_loop()
    while loop.time() < stop_at:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 3)
        except (TimeoutError, OSError):
            stats.attack_connect_errors += 1
            await asyncio.sleep(0.1)
            continue
        stats.attack_connections += 1
        read = asyncio.ensure_future(reader.read(4096))
        sent = 0
        try:
            while loop.time() < stop_at:
                byte = ATTACK_HEAD[sent:sent + 1] or b"a"
                sent += 1
                writer.write(byte)
                done, _ = await asyncio.wait({read}, timeout=interval)
                if done:
                    break
        except OSError:
            pass
        finally:
            if read.done() and not read.cancelled() and read.exception() is None:
                data = read.result()
                stats.attack_answered[data[:12].decode("latin-1") or "closed"] += 1
            elif read.done():
                stats.attack_answered["reset"] += 1
            read.cancel()
            writer.close()
        if reconnect_delay:
            await asyncio.sleep(reconnect_delay)


async def one_request(port: int, raw: bytes) -> str:
    """'200', another status, or what went wrong."""
    try:
        reader, writer = await asyncio.open_connection(HOST, port)
    except OSError as exc:
        return f"connect:{type(exc).__name__}"
    try:
        writer.write(raw)
        data = await reader.read()  # Connection: close: the server ends it
    except OSError as exc:
        return f"read:{type(exc).__name__}"
    finally:
        writer.close()
    if not data:
        return "closed"
    parts = data.split(b" ", 2)
    return parts[1].decode("latin-1") if len(parts) > 1 else "garbled"


async def legit(port: int, stop_at: float, stats: Stats, chat_every: int,
                pause: float) -> None:
    loop = asyncio.get_running_loop()
    n = 0
    while loop.time() < stop_at:
        n += 1
        raw = CHAT if chat_every and n % chat_every == 0 else HEALTH
        started = time.perf_counter()
        try:
            outcome = await asyncio.wait_for(one_request(port, raw), TIMEOUT)
        except TimeoutError:
            outcome = "timeout"
        stats.tries += 1
        if outcome == "200":
            stats.ok += 1
            stats.latencies.append(time.perf_counter() - started)
        else:
            stats.failures[outcome] += 1
        await asyncio.sleep(pause)


async def attack(port: int, *, attackers: int, legit_clients: int, seconds: float,
                 warmup: float = WARMUP, byte_interval: float = BYTE_INTERVAL,
                 reconnect_delay: float = RECONNECT_DELAY, chat_every: int = CHAT_EVERY,
                 pause: float = PAUSE) -> Stats:
    """The attackers take the slots for ``warmup`` s, then legitimate clients join them
    for ``seconds``; runs in the caller's event loop (the harness's or the CLI's)."""
    stats = Stats()
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + warmup + seconds
    tasks = [asyncio.create_task(attacker(port, stop_at, stats, byte_interval,
                                          reconnect_delay)) for _ in range(attackers)]
    await asyncio.sleep(warmup)  # the attackers take every slot first
    tasks += [asyncio.create_task(legit(port, stop_at, stats, chat_every, pause))
              for _ in range(legit_clients)]
    await asyncio.wait(tasks, timeout=warmup + seconds + TIMEOUT + 5)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return stats


# -- our own server -----------------------------------------------------------------------


def start_afmd(workdir: Path, max_connections: int | None = None,
               idle_timeout: float | None = None, *, cache_dir: Path | None = None,
               ) -> tuple[subprocess.Popen[bytes], int, Path]:
    """afmd on its built-in demo model and an OS-chosen loopback port, once /health is 200.

    A limit left ``None`` is afmd's own default, so the attack meets what users run;
    ``cache_dir`` (AFMD_CACHE_DIR) lets a caller that has built the demo model reuse it.
    Blocking (it runs its own event loop to probe /health): call it from a thread when
    a loop is running.
    """
    limits = "".join(f"{key} = {value}\n" for key, value in (
        ("max_connections", max_connections), ("idle_timeout", idle_timeout))
        if value is not None)
    cache = cache_dir if cache_dir is not None else Path(
        os.environ.get("AFMD_CACHE_DIR") or workdir / "cache")
    server = afmd_process(
        workdir, "slowloris", f'[server]\nhost = "{HOST}"\n{limits}[log]\naccess_log = false\n',
        env={"AFMD_CACHE_DIR": str(cache)})
    assert server.proc is not None
    return server.proc, server.port, server.log_path


def stop_afmd(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0,
                        help="attack an afmd already listening on this loopback port")
    parser.add_argument("--max-connections", type=int,
                        help="the server's max_connections (only when it is started here; "
                             "default: afmd's)")
    parser.add_argument("--idle-timeout", type=float,
                        help="the server's idle_timeout (only when it is started here; "
                             "default: afmd's)")
    parser.add_argument("--attackers", type=int, default=150)
    parser.add_argument("--legit", type=int, default=4, help="legitimate clients")
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="how long the legitimate clients run")
    parser.add_argument("--warmup", type=float, default=WARMUP,
                        help="seconds of attack before the first legitimate request")
    parser.add_argument("--byte-interval", type=float, default=BYTE_INTERVAL)
    parser.add_argument("--reconnect-delay", type=float, default=RECONNECT_DELAY)
    parser.add_argument("--chat-every", type=int, default=CHAT_EVERY,
                        help="every Nth legitimate request is a chat completion (0: never)")
    parser.add_argument("--pause", type=float, default=PAUSE,
                        help="seconds a legitimate client waits between its requests")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 0 < args.attackers <= 2000 or not 0 < args.seconds <= 600:
        parser.error("--attackers must be 1-2000 and --seconds 0-600")

    proc = None
    port = args.port
    with tempfile.TemporaryDirectory(prefix="afmd-slowloris-") as tmp:
        if not port:
            proc, port, _ = start_afmd(Path(tmp), args.max_connections, args.idle_timeout)
        try:
            stats = asyncio.run(attack(
                port, attackers=args.attackers, legit_clients=args.legit,
                seconds=args.seconds, warmup=args.warmup, byte_interval=args.byte_interval,
                reconnect_delay=args.reconnect_delay, chat_every=args.chat_every,
                pause=args.pause))
        finally:
            if proc is not None:
                stop_afmd(proc)
    result = {"attackers": args.attackers, "legit_clients": args.legit,
              "seconds": args.seconds, **stats.summary()}
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:24} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
