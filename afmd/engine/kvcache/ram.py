"""The RAM tier: blocks held in memory, least recently used evicted first, by bytes.

A block is held once whatever number of conversations share it (they share its key), so
two sessions with one long system prompt pay for its blocks once. Read and written on the
model's generation thread; the event loop reads the counters and clears it (under the
lock).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from afmd.engine.kvcache.kv_compat import Layer


@dataclass(slots=True)
class Block:
    """One block's KV state: per layer, keys and values for its tokens (own buffers, not
    views into a finished row's, which would keep that row's whole state alive)."""

    layers: list[Layer]
    nbytes: int

    @classmethod
    def of(cls, layers: list[Layer]) -> Block:
        return cls(layers, sum(k.nbytes + v.nbytes for k, v in layers))


class RamTier:
    """Blocks by key, bounded by ``max_bytes`` and ``max_blocks``."""

    def __init__(self, max_bytes: int, max_blocks: int) -> None:
        self.max_bytes = max_bytes
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def get(self, key: bytes) -> Block | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is None:
                self.misses += 1
                return None
            self._blocks.move_to_end(key)
            self.hits += 1
            return block

    def put(self, key: bytes, block: Block) -> None:
        """Hold ``block`` (the most recently used now), evicting the least recently used
        blocks beyond the bounds; a block larger than the whole bound is not held."""
        if block.nbytes > self.max_bytes or self.max_blocks <= 0:
            return
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._blocks[key] = block
            self.nbytes += block.nbytes
            while self._blocks and (self.nbytes > self.max_bytes
                                    or len(self._blocks) > self.max_blocks):
                _, gone = self._blocks.popitem(last=False)
                self.nbytes -= gone.nbytes
                self.evictions += 1

    def touch(self, key: bytes) -> None:
        """Mark ``key``'s block, if held, the most recently used."""
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def peek(self, key: bytes) -> Block | None:
        """A held block, marked used, without counting a hit or a miss (a finished row
        storing what it shares with earlier ones)."""
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)
            return block

    def clear(self) -> int:
        """Drop every block; the bytes freed."""
        with self._lock:
            freed = self.nbytes
            self._blocks.clear()
            self.nbytes = 0
            return freed
