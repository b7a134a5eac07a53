"""A raw mlx-lm process kept up between server requests, sampled right after each one.

Comparing afmd with raw mlx-lm over a few milliseconds needs both measured close in
time: a shared machine's slow phases last about as long as a benchmark phase, so the raw
sample is taken from a long-lived process (``bench/raw_engine.py sample-server``) while
the server under test is idle, instead of from a separate phase minutes later.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from typing import Any

from bench.plan import ROOT, Ctx


class RawSampler:
    """A raw mlx-lm process (bench/raw_engine.py sample-server) sampled between requests."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, ctx: Ctx) -> RawSampler | None:
        folder = ctx.folders.get("demo-32k")
        if not folder:
            return None
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(ROOT / "bench" / "raw_engine.py"), "sample-server", folder,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, cwd=str(ROOT))
        assert proc.stdout is not None
        try:
            async with asyncio.timeout(120):
                while (await proc.stdout.readline()).strip() != b"ready":
                    if proc.stdout.at_eof():
                        raise RuntimeError("raw sample-server exited")
        except (TimeoutError, RuntimeError) as exc:
            ctx.log(f"  ! paired raw samples unavailable: {exc}")
            proc.kill()
            return None
        return cls(proc)

    async def sample(self, prompt: str, max_tokens: int, *, stop_after: int | None = None
                     ) -> dict[str, Any] | None:
        """One generation's timings: ttft, stream_tps, decode_tps, tokens."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens,
                                          "stop_after": stop_after}).encode() + b"\n")
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        return json.loads(line) if line else None

    async def ttft(self, prompt: str, max_tokens: int) -> float | None:
        res = await self.sample(prompt, max_tokens, stop_after=1)
        return res["ttft"] if res else None

    async def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                await self.proc.wait()
                return
        self.proc.kill()
