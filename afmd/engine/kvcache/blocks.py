"""The prefix index: a prompt's longest cached run of blocks, from RAM or disk, and a
finished row's state cut into blocks for the next prompt that shares its prefix.

Whole blocks go to both tiers, and so does what a finished row holds after its last
whole block (its *tail*: fewer tokens than a block, the end of the prompt and the answer),
keyed by the block before it and its own tokens. In RAM, blocks and tails are also indexed
by the block before them, with their tokens: a prompt that ends inside a block (the same
prompt sent again, the next turn of a conversation: the prompt, the answer, a new message)
resumes from every token it shares with what follows its last whole block, not from that
block's boundary. On disk a tail's file name says which block it follows and its length,
so after a restart the next turn of a conversation (which starts with the whole previous
turn and its answer) finds the previous turn's tail by its key without reading others. A
hit always leaves at least one prompt token to compute: the next token's logits come from
running it.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from afmd.engine.kvcache import kv_compat as compat
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
#: What follows one block, kept per block (the latest first): a conversation's branches.
_FOLLOWERS = 8


def _shared(tokens: array[int], rest: list[int]) -> int:
    n = 0
    for x, y in zip(tokens, rest, strict=False):
        if x != y:
            break
        n += 1
    return n


def tail_key(before: bytes, tokens: list[int] | array[int]) -> bytes:
    """A tail's key: the block it follows and its own tokens (chained as blocks are)."""
    return hashlib.sha256(b"tail" + before + array("q", tokens).tobytes()).digest()


def _slice(layers: list[compat.Layer], start: int, end: int) -> list[compat.Layer]:
    return [(k[..., start:end, :], v[..., start:end, :]) for k, v in layers]


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
        # Key of a block (or the root) -> [(tokens, key in the RAM tier)] of the blocks and
        # tails held after it.
        self._after: dict[bytes, list[tuple[array[int], bytes]]] = {}

    def keys(self, tokens: list[int], limit: int | None = None) -> list[bytes]:
        return block_keys(self._root, tokens, self.block_tokens, limit)

    def lookup(self, prompt: list[int]) -> Resume:
        """The longest cached prefix of ``prompt``: its run of whole blocks held in either
        tier (a block read from disk is held in RAM from then on), then as much as it
        shares with a block or tail held after the last of them."""
        size = self.block_tokens
        usable = len(prompt) - 1
        parts: list[list[compat.Layer]] = []
        ram = disk = 0
        last = self._root
        used: list[tuple[bytes, Block | None]] = []  # (key, the block read from disk)
        for i, key in enumerate(self.keys(prompt, usable // size)):
            block = self.ram.get(key)
            if block is not None:
                ram += size
                used.append((key, None))
            elif self.disk is not None and (block := self.disk.get(key, size)) is not None:
                disk += size
                used.append((key, block))
                self._follows(last, prompt[i * size:(i + 1) * size], key)
            else:
                break
            parts.append(block.layers)
            last = key
        self._keep_head_first(used)
        start = len(parts) * size
        rest = prompt[start:usable]
        follower, shared = self._follower(last, rest)
        if follower is not None:
            parts.append(_slice(follower.layers, 0, shared))
            ram += shared
        elif (found := self._disk_tail(last, rest)) is not None:
            tail, shared = found
            parts.append(tail.layers)
            disk += shared
        if not parts:
            return NOTHING
        layers = [
            (mx.concatenate([p[i][0] for p in parts], axis=2),
             mx.concatenate([p[i][1] for p in parts], axis=2))
            for i in range(len(parts[0]))
        ]
        return Resume(compat.build(layers), start + shared, ram, disk)

    def _keep_head_first(self, chain: list[tuple[bytes, Block | None]]) -> None:
        """Mark a chain's blocks used from its end to its head, holding those given (read
        from disk) as they come: a lookup reaches a block only through every block before
        it, so when the tier cannot hold the whole chain it must keep the head and let the
        end go (used head first, the head went first, and a conversation longer than the
        tier never found a block in RAM again)."""
        for key, block in reversed(chain):
            if block is not None:
                self.ram.put(key, block)
                if self.disk is not None:  # its read marked it head first there too
                    self.disk.touch(key)
            else:
                self.ram.touch(key)

    def _follower(self, before: bytes, rest: list[int]) -> tuple[Block | None, int]:
        """The block or tail held after ``before`` sharing the most leading tokens with
        ``rest``, and how many it shares."""
        best: tuple[Block | None, int] = (None, 0)
        if not rest:
            return best
        for tokens, key in self._after.get(before, ()):
            shared = _shared(tokens, rest)
            if shared > best[1] and (block := self.ram.peek(key)) is not None:
                best = (block, shared)
        return best

    def _disk_tail(self, before: bytes, rest: list[int]) -> tuple[Block, int] | None:
        """The longest tail on disk after ``before`` that ``rest`` starts with (read, held
        in RAM and indexed from then on), and its length."""
        if self.disk is None or not rest:
            return None
        for length, key in sorted(self.disk.tails(before), reverse=True):
            if length > len(rest) or tail_key(before, rest[:length]) != key:
                continue
            block = self.disk.get_tail(before, length, key)
            if block is not None:
                self.ram.put(key, block)
                self._follows(before, rest[:length], key)
                return block, length
        return None

    def _follows(self, before: bytes, tokens: list[int], key: bytes) -> None:
        """Index ``key`` (held in RAM) as following ``before``."""
        known = self._after.get(before, [])
        if any(k == key for _, k in known):
            return
        if len(self._after) > 2 * len(self.ram) + 64:  # forget what the tier let go
            self._after = {b: live for b, entries in self._after.items()
                           if (live := [e for e in entries if e[1] in self.ram])}
            known = self._after.get(before, [])
        live = [e for e in known if e[1] in self.ram][: _FOLLOWERS - 1]
        self._after[before] = [(array("q", tokens), key), *live]

    def store(self, tokens: list[int], cache: Any) -> None:
        """Keep a finished row's state (``tokens``: its prompt and output) as whole blocks
        and a tail; blocks already held are only marked used, never copied again."""
        found = compat.layers_of(cache)
        if found is None:
            return
        layers, offset = found
        size = self.block_tokens
        held = min(offset, len(tokens))
        keys = self.keys(tokens, held // size)
        # From the end to the head in RAM: the head is what every lookup needs first, so it
        # is the most recently used (see _keep_head_first).
        blocks: list[Block] = []
        for i in reversed(range(len(keys))):
            key = keys[i]
            block = self.ram.peek(key)
            if block is None:
                block = self._copy(_slice(layers, i * size, (i + 1) * size))
                self.ram.put(key, block)
            blocks.append(block)
        blocks.reverse()
        before = self._root
        for i, key in enumerate(keys):
            self._follows(before, tokens[i * size:(i + 1) * size], key)
            before = key
        start = len(keys) * size
        tail: tuple[bytes, int, bytes, Block] | None = None
        if held > start:
            tokens_left = tokens[start:held]
            key = tail_key(before, tokens_left)
            block = self.ram.peek(key)
            if block is None:
                block = self._copy(_slice(layers, start, held))
                self.ram.put(key, block)
            self._follows(before, tokens_left, key)
            tail = (before, len(tokens_left), key, block)
        if self.disk is not None:
            # On disk from the head to the end (see disk.Chain); each skipped when there.
            chain = self.disk.chain(keys, tail[:3] if tail is not None else None)
            for i, key in enumerate(keys):
                self.disk.put(key, blocks[i], chain, i)
            if tail is not None:
                self.disk.put_tail(*tail, chain, len(keys))

    @staticmethod
    def _copy(layers: list[compat.Layer]) -> Block:
        """A block of its own buffers (a view would keep the row's whole state alive)."""
        block = Block.of([(mx.contiguous(k), mx.contiguous(v)) for k, v in layers])
        mx.eval([a for pair in block.layers for a in pair])
        return block

    def clear(self) -> tuple[int, int]:
        """Empty both tiers: (RAM bytes, disk bytes) freed."""
        self._after = {}
        return self.ram.clear(), self.disk.clear() if self.disk is not None else 0

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier: hits and misses (blocks), bytes held, evictions (blocks)."""
        out = {"ram": {"hits": self.ram.hits, "misses": self.ram.misses,
                       "bytes": self.ram.nbytes, "evictions": self.ram.evictions}}
        if self.disk is not None:
            out["disk"] = {"hits": self.disk.hits, "misses": self.disk.misses,
                           "bytes": self.disk.nbytes, "evictions": self.disk.store.evictions}
        return out
