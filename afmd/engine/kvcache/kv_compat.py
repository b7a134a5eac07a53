"""Every mlx-lm cache internal the block cache depends on, and nothing else.

Written against **mlx-lm 0.32.2** (``mlx_lm/models/cache.py``). The block cache reads a
finished row's per-layer ``KVCache`` (its ``keys``, ``values`` and ``offset``: the buffers
are allocated in steps, so only the first ``offset`` positions hold state) and builds a
``KVCache`` back from blocks for a row to resume from. Only models whose every layer is a
plain ``KVCache`` can be cut into blocks: a rotating window, a quantized cache or a
recurrent state (SSM layers) does not hold one independent slice per token, so such models
keep mlx-lm's whole-sequence cache. :func:`upstream_problems` names whatever an upgrade
changed of what is used here; ``tests/server/test_kvcache.py`` fails with its list.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import KVCache, make_prompt_cache

MLX_LM_VERSION = "0.32.2"
#: sha256 (first 16 hex digits) of ``inspect.getsource(KVCache)`` in that version.
KVCACHE_FINGERPRINT = "9e33b1620e278398"

#: One layer's state for a run of positions: keys and values, each (1, heads, T, dim).
Layer = tuple[mx.array, mx.array]
#: What one layer's keys and values are made of, whatever their length: (heads, dim, dtype)
#: for each.
LayerShape = tuple[tuple[int, int, mx.Dtype], tuple[int, int, mx.Dtype]]


def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def upstream_problems() -> list[str]:
    """What an upgrade of mlx-lm changed of what this module relies on; empty if nothing."""
    problems = []
    seen = _fingerprint(KVCache)
    if seen != KVCACHE_FINGERPRINT:
        problems.append(f"mlx_lm.models.cache.KVCache is not the one of mlx-lm {MLX_LM_VERSION} "
                        f"(mlx-lm {mlx_lm.__version__} installed; fingerprint {seen})")
    probe = KVCache()
    for attribute in ("keys", "values", "offset"):
        if not hasattr(probe, attribute):
            problems.append(f"mlx-lm KVCache has no {attribute}")
    return problems


def cuts_into_blocks(model: Any) -> bool:
    """Whether every layer of ``model``'s cache is a plain ``KVCache`` (see the module)."""
    try:
        caches = make_prompt_cache(model)
    except Exception:  # a model mlx-lm cannot make a cache for: no blocks
        return False
    return bool(caches) and all(type(c) is KVCache for c in caches)


def layer_shapes(model: Any) -> list[LayerShape]:
    """Per layer, what ``model``'s keys and values are made of: read off the cache one token
    of it fills (on the thread that runs the model)."""
    caches = make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    mx.eval([a for c in caches for a in (c.keys, c.values)])
    return [((int(c.keys.shape[1]), int(c.keys.shape[3]), c.keys.dtype),
             (int(c.values.shape[1]), int(c.values.shape[3]), c.values.dtype))
            for c in caches]


def layers_of(cache: Any) -> tuple[list[Layer], int] | None:
    """A row's per-layer keys and values (views up to its offset) and that offset;
    ``None`` when the cache is not plain ``KVCache`` layers holding state."""
    if not cache or not all(type(c) is KVCache and c.keys is not None for c in cache):
        return None
    offset = min(int(c.offset) for c in cache)
    return [(c.keys[..., :offset, :], c.values[..., :offset, :]) for c in cache], offset


def build(layers: list[Layer]) -> list[Any]:
    """A fresh per-layer ``KVCache`` holding ``layers`` (keys and values of equal length),
    for one row to resume from; the row appends to its own buffers, never to these."""
    caches = []
    for keys, values in layers:
        cache = KVCache()
        cache.keys, cache.values, cache.offset = keys, values, int(keys.shape[2])
        caches.append(cache)
    return caches
