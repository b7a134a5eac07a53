"""Where afmd's time goes under load: py-spy samples and strace syscall counts.

Both attach to a running server by pid while run.py drives it; neither is needed for the
benchmark rows, and either is skipped with a reason when the tool is missing or ptrace is
not permitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import signal
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any


def find_tool(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    return shutil.which(name)


async def pyspy_record(pid: int, seconds: float, out: Path, rate: int = 200
                       ) -> asyncio.subprocess.Process | None:
    tool = find_tool("py-spy")
    if tool is None:
        return None
    return await asyncio.create_subprocess_exec(
        tool, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
        "--rate", str(rate), "--format", "raw", "--threads", "--nonblocking", "--function",
        "--output", str(out),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )


_LINE = re.compile(r"^thread \((\d+)\): ([^;]*);?(.*) (\d+)$")
_FRAME_LINE = re.compile(r" \(([^()]*?):\d+\)$")

# Where a sample's time goes: the innermost frame that matches a bucket decides.
BUCKETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("idle (waiting in epoll/queue/condition)",
     ("EpollSelector.select", "Condition.wait", "Event.wait",
      "_worker (concurrent/futures/thread.py)", "BatchWorker._take_inbox")),
    ("loop wake-up from the engine thread (call_soon_threadsafe → self-pipe)",
     ("_write_to_self", "call_soon_threadsafe", "_read_from_self")),
    ("engine → loop hand-off (Generation.push/next_events, _deliver, _flush)",
     ("Generation.push", "Generation.next_events", "_deliver (afmd/engine",
      "BatchWorker._flush", "Generation._wake")),
    ("wire encoding (dialect adapters, orjson)", ("afmd/dialects/",)),
    ("socket writes (transport.write, sanic send)",
     ("_SelectorSocketTransport.write", "HttpProtocol.send", "sanic/http/",
      "sanic/response/")),
    ("output chain (stops, reasoning, tool calls)", ("afmd/output/",)),
    ("pipeline (the run's rounds, server tools)",
     ("afmd/service/pipeline.py", "afmd/service/chat_run.py", "afmd/service/round_builder.py",
      "afmd/service/toolloop.py")),
    ("logging (structlog, access log)",
     ("structlog/", "afmd/logs.py", "afmd/http/access.py", "logging/__init__.py")),
    ("grammar (llguidance, masks)", ("afmd/grammar/", "llguidance")),
    ("request parsing and validation",
     ("afmd/dialects/fields/", "jsonschema/", "afmd/service/output_plan.py")),
    ("chat template and tokenization",
     ("jinja2/", "tokenization_utils", "tokenizer_utils.py", "transformers/")),
    ("mlx model step (BatchGenerator, model forward, sampling)",
     ("mlx_lm/", "mlx/nn/", "mlx/")),
    ("sanic request machinery (routing, signals, middleware)",
     ("sanic/", "sanic_routing/")),
    ("afmd http layer (routes, gate, supervisor)", ("afmd/http/",)),
    ("asyncio machinery (tasks, timers, handles)", ("asyncio/",)),
)
IDLE = BUCKETS[0][0]


def _bucket(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, needles in BUCKETS:
            if any(n in frame for n in needles):
                return name
    return "other"


def _short(frame: str) -> str:
    return _FRAME_LINE.sub(lambda m: f" ({m.group(1)})", frame)


def summarize_pyspy(path: Path, rate: int, seconds: float, top: int = 12) -> dict[str, Any]:
    """Per thread: share of wall time busy, where busy time goes, top functions."""
    threads: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"samples": 0, "self": Counter(), "incl": Counter(), "buckets": Counter()}
    )
    for line in path.read_text(errors="replace").splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        _, name, stack, count_s = m.groups()
        count = int(count_s)
        key = re.sub(r"[-_]?\d+$", "", name) or name  # pool threads merge by name
        t = threads[key]
        frames = [_short(f) for f in stack.split(";") if f]
        if not frames:
            continue
        t["samples"] += count
        bucket = _bucket(frames)
        t["buckets"][bucket] += count
        if bucket == IDLE:
            continue
        t["self"][frames[-1]] += count
        for f in set(frames):
            t["incl"][f] += count
    expected = max(rate * seconds, 1.0)
    out: dict[str, Any] = {}
    for name, t in sorted(threads.items(),
                          key=lambda kv: -(kv[1]["samples"] - kv[1]["buckets"][IDLE])):
        busy = t["samples"] - t["buckets"][IDLE]
        denom = busy or 1
        out[name] = {
            "samples": t["samples"],
            "busy_samples": busy,
            "busy_share_of_wall": round(busy / expected, 3),
            "buckets_of_busy": {b: round(c / denom, 3) for b, c in t["buckets"].most_common()
                                if b != IDLE},
            "top_self_of_busy": [[f, round(c / denom, 3)]
                                 for f, c in t["self"].most_common(top)],
            # Frames on (nearly) every stack are the thread's scaffolding: left out.
            "top_inclusive_of_busy": [[f, round(c / denom, 3)]
                                      for f, c in t["incl"].most_common()
                                      if c < 0.97 * denom][:top],
        }
    return out


def describe(profile: dict[str, Any], label: str, tokens: int | None, seconds: float) -> str:
    """A few plain-text lines for the Markdown report."""
    lines = [f"[{label}] {seconds:.0f} s" + (f", {tokens} tokens streamed" if tokens else "")]
    for name, t in list(profile.items())[:3]:
        lines.append(f"  thread {name}: busy {t['busy_share_of_wall']:.0%} of wall time; "
                     "of that:")
        for bucket, share in list(t["buckets_of_busy"].items())[:7]:
            lines.append(f"    {share:6.1%}  {bucket}")
        lines.append("    top self:")
        for frame, share in t["top_self_of_busy"][:5]:
            lines.append(f"    {share:6.1%}  {frame}")
    return "\n".join(lines)


# -- strace ------------------------------------------------------------------------------


async def strace_start(pid: int, out: Path) -> asyncio.subprocess.Process | None:
    tool = shutil.which("strace")
    if tool is None:
        return None
    proc = await asyncio.create_subprocess_exec(
        tool, "-f", "-c", "-o", str(out), "-p", str(pid),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    await asyncio.sleep(1.0)  # attaching to every thread takes a moment
    return proc


async def strace_stop(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    try:
        async with asyncio.timeout(10):
            await proc.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


def parse_strace(path: Path) -> dict[str, int]:
    calls: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return calls
    for line in text.splitlines():
        parts = line.split()
        # % time, seconds, usecs/call, calls, [errors], syscall
        if len(parts) >= 5 and parts[0].replace(".", "").isdigit() and parts[-1] != "total":
            with contextlib.suppress(ValueError):
                calls[parts[-1]] = int(parts[3])
    return calls
