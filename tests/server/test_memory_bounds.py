"""Memory bounds take effect, on the real demo model: MLX's buffer pool, the prefix cache's
real footprint and glibc's heap. (The soak bench that shows the server levelling off runs
in the quick benchmark: tests/server/test_bench_quick.py checks its rounds and requests.)"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from helpers import memory_probes
from helpers.paths import REPO_ROOT

pytestmark = pytest.mark.slow  # memory soaks

ROOT = REPO_ROOT


@pytest.fixture(scope="module")
def bounds() -> dict[str, Any]:
    """The demo model loaded as a server loads it, with small, easily exceeded bounds
    (tests/helpers/memory_probes.py): a burst, then more prompts, in a process of its own,
    where nothing else allocates or frees MLX memory meanwhile."""
    return memory_probes.run("bounds")


def test_mlx_buffer_pool_is_bounded_from_model_load(bounds: dict[str, Any]) -> None:
    """MLX keeps freed buffers for reuse up to its cache limit; the limit must be the
    configured one from the moment the model loaded, and hold after a burst whose
    temporaries are several times its size."""
    pool = bounds["pool"]
    assert pool["limit_after_load"] == memory_probes.POOL  # load set it
    assert pool["peak_over_weights"] > 4 * memory_probes.POOL  # freed more than fits
    assert pool["cache_memory"] <= memory_probes.POOL


def test_prefix_cache_holds_only_what_it_counts(bounds: dict[str, Any]) -> None:
    """After many distinct prompts the prefix cache holds at most its entries and bytes,
    and dropping it frees no more MLX memory than the bytes it counted: an entry that
    still referenced the batch's whole KV buffers would hold several times as much."""
    prefix = bounds["prefix"]
    assert 0 < prefix["entries"] <= memory_probes.ENTRIES
    counted = prefix["counted"]
    assert 0 < counted <= memory_probes.CACHE_BYTES
    assert prefix["freed"] <= counted + (16 << 10), prefix


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_large_buffers_leave_the_heap_after_model_load() -> None:
    """glibc raises its mmap threshold to the size of each large block freed, so later
    blocks of that size come from the heap, where freed holes stay resident. After a
    model load (which pins the threshold) freeing them must give the memory back."""
    script = textwrap.dedent("""
        from afmd.config.sections import BUILTIN_DEMO_PATH, Config
        from afmd.config.tables import ModelEntry
        from afmd.engine.models.loading import load_sync

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
        print(before - rss(), flush=True)
        model.worker.stop()
        import os
        os._exit(0)  # as `afmd serve`: MLX's threads can abort Python's teardown
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    returned_mib = float(out.stdout.strip().splitlines()[-1])
    assert returned_mib >= 40, returned_mib
