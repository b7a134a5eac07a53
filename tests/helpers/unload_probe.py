"""Load a demo model and unload it in a process of its own, and say what memory that took
and gave back (tests/test_residency.py runs it: ``python -m helpers.unload_probe``).

MLX's active-memory counter and RSS are per process: measured in a test worker, they also
move with whatever else that process holds or frees at the time (another test's models and
servers, their caches, a garbage collection), so the deltas would belong to more than the
one model. A fresh process holds only what this probe loads.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import mlx.core as mx

from afmd.config import load_config
from afmd.engine.models import ModelRegistry


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


def measure() -> dict[str, Any]:
    """The 32k demo model's weights, what loading it added and what unloading it freed,
    in MLX's active memory and in RSS; after a first model, so that imports and MLX's
    one-off allocations are not counted as the model's."""
    registry = ModelRegistry(load_config(None, env={}))
    entry = registry.resolve("demo-32k")

    async def main() -> dict[str, Any]:
        await registry.get(registry.resolve("demo"))
        before_mx, before_rss = mx.get_active_memory(), rss_bytes()
        lease = await registry.lease(entry, keep_alive=0.0)
        model = lease.model
        weights = model.weights_bytes
        accounted = model.memory_bytes == weights + model.worker.cache_bytes  # idle
        loaded_mx, loaded_rss = mx.get_active_memory(), rss_bytes()
        del model
        lease.release()  # keep_alive 0: unloaded right away
        await registry.residency.drain()
        return {
            "weights": weights, "accounted": accounted,
            "ready_after": registry.is_ready("demo-32k"),
            "unloads": registry.counts.unloads["demo-32k"],
            "grew_mx": loaded_mx - before_mx, "freed_mx": loaded_mx - mx.get_active_memory(),
            "grew_rss": loaded_rss - before_rss, "freed_rss": loaded_rss - rss_bytes(),
        }

    try:
        return asyncio.run(main())
    finally:
        registry.close()


if __name__ == "__main__":
    print(json.dumps(measure()))
