"""Memory bounds take effect, on the real demo model: MLX's buffer pool, the prefix cache's
real footprint, glibc's heap, and the soak bench that shows the server levelling off."""

from __future__ import annotations

import asyncio
import os
import platform
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from afmd.config import BUILTIN_DEMO_PATH, CacheConfig, Config, ModelEntry
from afmd.engine.base import GenerationRequest, SamplingParams
from afmd.engine.loaded import LoadedModel
from afmd.engine.loading import load_sync

pytestmark = pytest.mark.slow  # memory soaks

ROOT = Path(__file__).resolve().parent.parent
POOL = 1 << 20  # the MLX buffer pool these tests configure
ENTRIES = 4
CACHE_BYTES = 512 << 10


@pytest.fixture(scope="module")
def loaded() -> Iterator[LoadedModel]:
    """The demo model loaded as a server loads it, with small, easily exceeded bounds."""
    before = mx.set_cache_limit(0)
    mx.set_cache_limit(before)
    config = Config(cache=CacheConfig(
        prompt_cache_bytes=CACHE_BYTES, prompt_cache_entries=ENTRIES,
        mlx_buffer_cache_bytes=POOL,
    ))
    model = load_sync(ModelEntry(id="demo", path=BUILTIN_DEMO_PATH), config)
    try:
        yield model
    finally:
        model.worker.stop()
        mx.set_cache_limit(before)


def _prompts(model: LoadedModel, n: int, tag: str) -> list[list[int]]:
    """Distinct prompts of varied length (no two share more than the template's head)."""
    return [
        model.render_prompt([{"role": "user", "content": f"{tag} {i}: " + "lorem ipsum " * (
            5 + (i * 37) % 120)}])
        for i in range(n)
    ]


def _burst(model: LoadedModel, prompts: list[list[int]], max_tokens: int = 24) -> None:
    async def main() -> None:
        gate = asyncio.Semaphore(4)

        async def one(i: int, prompt: list[int]) -> None:
            async with gate:
                generation = model.start(GenerationRequest(
                    f"r{i}", prompt, max_tokens, sampling=SamplingParams(temperature=0.0)))
                while not generation.done:
                    await generation.next_events()

        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    asyncio.run(main())


def test_mlx_buffer_pool_is_bounded_from_model_load(loaded: LoadedModel) -> None:
    """MLX keeps freed buffers for reuse up to its cache limit; the limit must be the
    configured one from the moment the model loaded, and hold after a burst whose
    temporaries are several times its size."""
    assert mx.set_cache_limit(POOL) == POOL  # returns the limit in force: load set it
    weights = mx.get_active_memory()
    mx.reset_peak_memory()
    _burst(loaded, _prompts(loaded, 24, "pool"))
    assert mx.get_peak_memory() - weights > 4 * POOL  # the burst freed more than fits
    assert mx.get_cache_memory() <= POOL


def test_prefix_cache_holds_only_what_it_counts(loaded: LoadedModel) -> None:
    """After many distinct prompts the prefix cache holds at most its entries and bytes,
    and dropping it frees no more MLX memory than the bytes it counted: an entry that
    still referenced the batch's whole KV buffers would hold several times as much."""
    _burst(loaded, _prompts(loaded, 40, "prefix"))
    cache = loaded.worker._stepper.prompt_cache
    assert cache is not None
    assert 0 < len(cache) <= ENTRIES
    counted = cache.nbytes
    assert 0 < counted <= CACHE_BYTES
    held = mx.get_active_memory()
    cache.trim_to(n_sequences=0)  # the worker is idle: nothing else touches the cache
    freed = held - mx.get_active_memory()
    assert freed <= counted + (16 << 10), (freed, counted)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_large_buffers_leave_the_heap_after_model_load() -> None:
    """glibc raises its mmap threshold to the size of each large block freed, so later
    blocks of that size come from the heap, where freed holes stay resident. After a
    model load (which pins the threshold) freeing them must give the memory back."""
    script = textwrap.dedent("""
        from afmd.config import BUILTIN_DEMO_PATH, Config, ModelEntry
        from afmd.engine.loading import load_sync

        def rss():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024

        model = load_sync(ModelEntry(id="demo", path=BUILTIN_DEMO_PATH), Config())
        big = bytearray(16 << 20)  # freed: the dynamic threshold would rise to 16 MiB
        del big
        blocks, pins = [], []
        for _ in range(48):  # each freed block would be a hole below a live small one
            blocks.append(bytearray(1 << 20))
            pins.append(bytearray(64 << 10))
        before = rss()
        del blocks
        print(before - rss())
        model.worker.stop()
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    returned_mib = float(out.stdout.strip().splitlines()[-1])
    assert returned_mib >= 40, returned_mib


def test_soak_bench_runs_every_kind_of_request(tmp_path: Path) -> None:
    """bench/soak.py against the real server: each request kind ends the way it should."""
    sys.path.insert(0, str(ROOT))
    from bench import soak

    server = soak.start_server(tmp_path, model="demo", concurrency=4, settings={},
                               launcher=None, cache_dir=Path(os.environ["AFMD_CACHE_DIR"]))
    try:
        results = asyncio.run(soak.soak(server, rounds=1, requests=16, concurrency=4,
                                        seed=1, max_seconds=60, settle_s=0.1))
    finally:
        server.stop()
    outcomes: dict[str, Any] = soak.outcome_summary(results)
    kinds = {k.split(":")[0]: k.split(":", 1)[1] for k in outcomes}
    assert set(kinds) == set(soak.KINDS), outcomes
    allowed = {
        "plain": {"200"}, "stream": {"stop", "length"}, "cancel": {"cancelled"},
        "drop": {"dropped"}, "tools": {"tool_calls", "length"}, "json_schema": {"200", "stop"},
        "second_turn": {"200 cached", "200 first turn"},
    }
    for outcome in outcomes:
        kind, result = outcome.split(":", 1)
        if kind == "error":
            assert result.startswith("400 "), outcome
        else:
            assert result in allowed[kind], outcome
    assert [r.round for r in results] == [0, 1]
    assert all(r.rss_mib > 0 and r.mlx_active_mib for r in results)
