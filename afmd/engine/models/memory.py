"""Process-wide memory bounds a loaded model needs, applied once when a model loads.

A daemon that runs for weeks must level off, not creep. Two pools outside afmd's own data
structures would otherwise keep memory afmd freed:

- **MLX's buffer cache.** MLX keeps freed buffers to reuse them; its default limit is the
  whole memory limit on Metal, so after one long prefill the pool keeps that prefill's
  largest temporaries for good. ``[cache] mlx_buffer_cache_bytes`` bounds it.
- **glibc's heap (Linux).** MLX's CPU backend allocates its buffers with ``malloc``.
  glibc serves large blocks with ``mmap`` and returns them on ``free``, but each time
  such a block is freed it raises its mmap threshold to that block's size (up to
  32 MiB), so later buffers of that size come from the heap, where freed holes between
  live blocks stay resident. Setting the threshold explicitly turns that adjustment off;
  ``MALLOC_MMAP_THRESHOLD_`` in the environment still wins (glibc reads it at start, and
  afmd then leaves the threshold alone).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger("afmd.engine")

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
# glibc's own initial threshold: large MLX buffers are mapped, small objects are not.
MMAP_THRESHOLD_BYTES = 128 * 1024


def apply_memory_bounds(mlx_buffer_cache_bytes: int) -> None:
    """Bound MLX's buffer pool and, on glibc, pin the mmap threshold (see the module doc)."""
    import mlx.core as mx

    mx.set_cache_limit(mlx_buffer_cache_bytes)
    pin_malloc_mmap_threshold()


def pin_malloc_mmap_threshold() -> bool:
    """Set glibc's mmap threshold once, which disables its dynamic raising; True if set."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False  # not glibc (musl has no dynamic threshold to turn off)
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    if not ok:
        log.warning("could not set glibc's mmap threshold; RSS may keep freed MLX buffers")
    return ok
