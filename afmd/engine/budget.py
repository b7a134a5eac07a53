"""How much memory models may take, and how much a model will take before it loads.

The budget (``[models] memory_budget_bytes``) defaults to a fraction of the machine's
memory, because what else runs on it differs by platform:

- **macOS** (Apple silicon): the GPU computes from the same physical memory, and Metal
  lets one process wire only about two thirds to three quarters of it; 60 % keeps the
  models inside that and leaves the system, the client (an editor, a browser) and the
  page cache room to live.
- **Linux** (MLX's CPU backend): the weights live in afmd's own heap while the page cache
  may still hold the files they were read from, and a long prefill allocates large
  temporary buffers; 50 % leaves that room. A container's memory limit (cgroup v2
  ``memory.max``) counts as the machine's memory when it is lower. On a discrete GPU (MLX's
  CUDA backend) the limit is the GPU's memory, which this cannot see: set the budget.

A model's size before loading is the size of its safetensors files on disk: MLX loads
them as they are stored, so that is what its weights will take (measured again once
loaded).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from afmd.config import BUILTIN_SYSTEM_PATH, ModelEntry
from afmd.engine import kinds

#: The share of physical memory the default budget allows, per platform (module doc).
DEFAULT_FRACTION = 0.6 if sys.platform == "darwin" else 0.5

_CGROUP_LIMIT = Path("/sys/fs/cgroup/memory.max")


def physical_memory_bytes() -> int:
    """The machine's memory, or its container's limit when that is lower."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = 0
    try:
        limit = _CGROUP_LIMIT.read_text().strip()
    except OSError:
        limit = "max"
    if limit.isdigit() and (total <= 0 or 0 < int(limit) < total):
        total = int(limit)
    return total


def effective_budget(configured: int) -> int:
    """``configured`` bytes, or (0) the platform's share of physical memory."""
    if configured > 0:
        return configured
    return int(physical_memory_bytes() * DEFAULT_FRACTION)


def weights_on_disk(folder: Path) -> int:
    """Bytes of the model's weight files (a hub snapshot's links followed to the blobs)."""
    total = 0
    for path in folder.glob("*.safetensors"):
        try:
            total += path.stat().st_size
        except OSError:
            continue
    return total


def size_before_loading(entry: ModelEntry) -> int | None:
    """What ``entry``'s weights will take, read from disk; None while unknown (a Hugging
    Face repo not downloaded yet: its load downloads it, and it is measured then).

    A built-in demo is built here if it was not yet (a moment's work its load would do
    anyway), so it is sized like any other folder.
    """
    if entry.path == BUILTIN_SYSTEM_PATH:
        return None  # Apple's model: its weights are the system's, not in afmd's memory
    if entry.path.startswith(kinds.BUILTIN_PREFIX):
        from afmd.engine import demo

        folder: Path | None = demo.materialize(entry.path[len(kinds.BUILTIN_PREFIX):])
    else:
        folder = kinds.model_folder(entry.path)
    if folder is None:
        return None
    size = weights_on_disk(folder)
    return size or None


def format_bytes(count: int) -> str:
    """``1.5 GiB``: sizes in messages people read."""
    value = float(count)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{count} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # unreachable; keeps type checkers content


__all__ = [
    "DEFAULT_FRACTION",
    "effective_budget",
    "format_bytes",
    "physical_memory_bytes",
    "size_before_loading",
    "weights_on_disk",
]
