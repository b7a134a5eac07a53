"""Memory measurements that run in a process of their own: :func:`run` starts
``python -m helpers.memory_probes NAME`` and returns what the probe printed.

MLX's active, peak and cache memory and RSS are per process: measured in a test worker,
they also move with whatever else that process holds or frees at the time (another test's
models and servers, their caches, a garbage collection), so a delta would belong to more
than the one thing measured. A fresh process holds only what its probe loads.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent
#: The buffer pool and prefix-cache bounds the bounds probe configures.
POOL = 1 << 20
ENTRIES = 4
CACHE_BYTES = 512 << 10


def run(name: str, timeout: float = 300) -> dict[str, Any]:
    """The probe's result, from a fresh interpreter (the environment passes on)."""
    proc = subprocess.run([sys.executable, "-m", "helpers.memory_probes", name], cwd=TESTS,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


def unload() -> dict[str, Any]:
    """The 32k demo model's weights, what loading it added and what unloading it freed,
    in MLX's active memory and in RSS; after a first model, so that imports and MLX's
    one-off allocations are not counted as the model's."""
    import mlx.core as mx

    from afmd.config.load import load_config
    from afmd.engine.models.model_registry import ModelRegistry

    registry = ModelRegistry(load_config(None, env={}))
    entry = registry.resolve("demo-32k")

    async def main() -> dict[str, Any]:
        await registry.get(registry.resolve("demo"))
        before_mx, before_rss = mx.get_active_memory(), _rss_bytes()
        lease = await registry.lease(entry, keep_alive=0.0)
        model = lease.model
        weights = model.weights_bytes
        accounted = model.memory_bytes == weights + model.worker.cache_bytes  # idle
        loaded_mx, loaded_rss = mx.get_active_memory(), _rss_bytes()
        del model
        lease.release()  # keep_alive 0: unloaded right away
        await registry.residency.drain()
        return {
            "weights": weights, "accounted": accounted,
            "ready_after": registry.is_ready("demo-32k"),
            "unloads": registry.counts.unloads["demo-32k"],
            "grew_mx": loaded_mx - before_mx, "freed_mx": loaded_mx - mx.get_active_memory(),
            "grew_rss": loaded_rss - before_rss, "freed_rss": loaded_rss - _rss_bytes(),
        }

    try:
        return asyncio.run(main())
    finally:
        registry.close()


def bounds() -> dict[str, Any]:
    """The demo model loaded as a server loads it, with small, easily exceeded bounds:
    MLX's buffer pool around a burst of prompts, then the prefix cache after more."""
    import mlx.core as mx

    from afmd.config.sections import BUILTIN_DEMO_PATH, CacheConfig, Config
    from afmd.config.tables import ModelEntry
    from afmd.engine.generation import GenerationRequest, SamplingParams
    from afmd.engine.models.loading import load_sync

    config = Config(cache=CacheConfig(prompt_cache_bytes=CACHE_BYTES,
                                      prompt_cache_entries=ENTRIES, block_tokens=16,
                                      disk_bytes=0,
                                      mlx_buffer_cache_bytes=POOL))
    model = load_sync(ModelEntry(id="demo", path=BUILTIN_DEMO_PATH), config)

    def burst(n: int, tag: str) -> None:
        """Distinct prompts of varied length (no two share more than the template's
        head), four at a time."""
        prompts = [model.render_prompt([{"role": "user", "content": f"{tag} {i}: " + (
            "lorem ipsum " * (5 + (i * 37) % 120))}]) for i in range(n)]

        async def main() -> None:
            gate = asyncio.Semaphore(4)

            async def one(i: int, prompt: list[int]) -> None:
                async with gate:
                    generation = model.start(GenerationRequest(
                        f"r{i}", prompt, 24, sampling=SamplingParams(temperature=0.0)))
                    while not generation.done:
                        await generation.next_events()

            await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

        asyncio.run(main())

    try:
        limit_after_load = mx.set_cache_limit(POOL)  # returns the limit in force
        weights = mx.get_active_memory()
        mx.reset_peak_memory()
        burst(8, "pool")
        pool = {"limit_after_load": limit_after_load,
                "peak_over_weights": mx.get_peak_memory() - weights,
                "cache_memory": mx.get_cache_memory()}
        burst(12, "prefix")
        cache = model.worker.blocks
        assert cache is not None
        entries, counted = len(cache.ram), cache.ram.nbytes
        held = mx.get_active_memory()
        cache.ram.clear()  # the worker is idle: nothing else touches the cache
        prefix = {"entries": entries, "counted": counted,
                  "freed": held - mx.get_active_memory()}
        return {"pool": pool, "prefix": prefix}
    finally:
        model.worker.stop()


PROBES: dict[str, Callable[[], dict[str, Any]]] = {"unload": unload, "bounds": bounds}

if __name__ == "__main__":
    print(json.dumps(PROBES[sys.argv[1]]()), flush=True)
    # Skip interpreter teardown, as `afmd serve` does: MLX's native threads can abort the
    # process while Python finalises ("terminate called without an active exception").
    sys.stderr.flush()
    os._exit(0)
