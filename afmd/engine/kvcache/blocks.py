"""The prefix index: a prompt's longest cached run of blocks, from RAM or disk, and a
finished row's state cut into blocks for the next prompt that shares its prefix.

Only whole blocks are kept; the tokens after the last whole block of a prompt (fewer than
one block) are computed again on a hit. A hit always leaves at least one prompt token to
compute, because the next token's logits come from running it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from afmd.engine.kvcache import compat
from afmd.engine.kvcache.chain import block_keys, chain_root
from afmd.engine.kvcache.disk import DiskTier
from afmd.engine.kvcache.ram import Block, RamTier


@dataclass(frozen=True, slots=True)
class Resume:
    """Where a prompt resumes: the KV state of its first ``tokens`` tokens (``None``: none
    cached), and how many of those came from each tier."""

    cache: Any
    tokens: int
    ram_tokens: int = 0
    disk_tokens: int = 0


NOTHING = Resume(None, 0)


class BlockCache:
    """One model's blocks in its RAM tier and (optionally) its disk tier. Used from the
    model's generation thread; the event loop reads counters and may clear it."""

    def __init__(self, identity: bytes, block_tokens: int, ram: RamTier,
                 disk: DiskTier | None = None) -> None:
        self.identity = identity
        self.block_tokens = block_tokens
        self.ram = ram
        self.disk = disk
        self._root = chain_root(identity, block_tokens)

    def keys(self, tokens: list[int], limit: int | None = None) -> list[bytes]:
        return block_keys(self._root, tokens, self.block_tokens, limit)

    def lookup(self, prompt: list[int]) -> Resume:
        """The longest run of leading blocks of ``prompt`` held in either tier (a block
        read from disk is held in RAM from then on)."""
        limit = (len(prompt) - 1) // self.block_tokens
        blocks: list[Block] = []
        ram = disk = 0
        for key in self.keys(prompt, limit):
            block = self.ram.get(key)
            if block is not None:
                ram += 1
            elif self.disk is not None and (block := self.disk.get(key)) is not None:
                disk += 1
                self.ram.put(key, block)
            else:
                break
            blocks.append(block)
        if not blocks:
            return NOTHING
        layers = [
            (mx.concatenate([b.layers[i][0] for b in blocks], axis=2),
             mx.concatenate([b.layers[i][1] for b in blocks], axis=2))
            for i in range(len(blocks[0].layers))
        ]
        size = self.block_tokens
        return Resume(compat.build(layers), len(blocks) * size, ram * size, disk * size)

    def store(self, tokens: list[int], cache: Any) -> None:
        """Keep the whole blocks of a finished row's state (``tokens``: its prompt and
        output); blocks already held are only marked used, never copied again."""
        found = compat.layers_of(cache)
        if found is None:
            return
        layers, offset = found
        size = self.block_tokens
        for i, key in enumerate(self.keys(tokens, min(offset, len(tokens)) // size)):
            block = self.ram.peek(key)
            if block is None:
                block = Block.of([
                    (mx.contiguous(k[..., i * size:(i + 1) * size, :]),
                     mx.contiguous(v[..., i * size:(i + 1) * size, :]))
                    for k, v in layers
                ])
                mx.eval([a for pair in block.layers for a in pair])
                self.ram.put(key, block)
            if self.disk is not None and block is not None:
                self.disk.put(key, block)  # queued; skipped when already on disk

    def clear(self) -> tuple[int, int]:
        """Empty both tiers: (RAM bytes, disk bytes) freed."""
        return self.ram.clear(), self.disk.clear() if self.disk is not None else 0

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier: hits and misses (blocks), bytes held, evictions (blocks)."""
        out = {"ram": {"hits": self.ram.hits, "misses": self.ram.misses,
                       "bytes": self.ram.nbytes, "evictions": self.ram.evictions}}
        if self.disk is not None:
            out["disk"] = {"hits": self.disk.hits, "misses": self.disk.misses,
                           "bytes": self.disk.nbytes, "evictions": self.disk.store.evictions}
        return out
