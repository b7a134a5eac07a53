"""The block KV cache (afmd.engine.kvcache): keys, tiers, files that must never be wrong,
and the real server resuming a conversation from RAM and, after a restart, from disk.

Unit tests drive the tiers with real MLX arrays; the engine tests load the demo model as
a server does (``load_sync``); the end-to-end tests run ``afmd serve`` twice over one
disk folder and compare greedy output with the cold run's.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hashlib
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import pytest

from afmd.config.sections import BUILTIN_DEMO_PATH, CacheConfig, Config
from afmd.config.tables import ModelEntry
from afmd.engine.generation import GenerationRequest, SamplingParams
from afmd.engine.kvcache import disk as disk_module
from afmd.engine.kvcache import disk_counts
from afmd.engine.kvcache import folder as layout
from afmd.engine.kvcache import kv_compat as compat
from afmd.engine.kvcache.blocks import BlockCache
from afmd.engine.kvcache.chain import block_keys, chain_root
from afmd.engine.kvcache.disk import (
    LAYOUT,
    DiskStore,
    DiskTier,
    _Write,
    decode,
    encode,
    margin_of,
    raw_views,
)
from afmd.engine.kvcache.identity import model_identity
from afmd.engine.kvcache.ram import Block, RamTier

from conftest import parse_sse
from helpers.servers import ServerProcess, afmd_command, start_server

CHAT = "/v1/chat/completions"
BLOCK = 16


def _block(seed: int, tokens: int = BLOCK, layers: int = 2) -> Block:
    mx.random.seed(seed)
    arrays = [(mx.random.normal((1, 2, tokens, 8)).astype(mx.float16),
               mx.random.normal((1, 2, tokens, 8)).astype(mx.float16)) for _ in range(layers)]
    mx.eval(arrays)
    return Block.of(arrays)


def _same(a: Block, b: Block) -> bool:
    return all(mx.array_equal(x, y).item() for (k1, v1), (k2, v2) in zip(
        a.layers, b.layers, strict=True) for x, y in ((k1, k2), (v1, v2)))


# -- what mlx-lm is, and what a key is ---------------------------------------------------


def test_upstream_is_what_compat_was_written_against() -> None:
    problems = compat.upstream_problems()
    assert not problems, (
        "mlx-lm changed under afmd/engine/kvcache/kv_compat.py: re-read each of these, adapt "
        "compat, then update its fingerprint:\n  " + "\n  ".join(problems))


def test_two_models_never_share_keys_and_a_change_keeps_the_keys_before_it() -> None:
    tokens = list(range(100, 100 + 8 * BLOCK))
    a = block_keys(chain_root(b"model-a", BLOCK), tokens, BLOCK)
    b = block_keys(chain_root(b"model-b", BLOCK), tokens, BLOCK)
    assert len(a) == 8 and not set(a) & set(b)  # same tokens, other model: nothing shared
    changed = list(tokens)
    changed[5 * BLOCK + 3] += 1  # an old tool output rewritten by a compaction
    c = block_keys(chain_root(b"model-a", BLOCK), changed, BLOCK)
    assert c[:5] == a[:5] and not set(c[5:]) & set(a)
    # Same block tokens after a different history: a different key.
    shifted = [7] * BLOCK + tokens[BLOCK:]
    assert block_keys(chain_root(b"model-a", BLOCK), shifted, BLOCK)[1] != a[1]


def test_model_identity_follows_weights_and_tokenizer(tmp_path: Path) -> None:
    from afmd.engine.demo.builtin import materialize

    source = materialize("demo")
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    assert model_identity(copy, "x") == model_identity(source, "y")  # same files
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # a different checkpoint of the same shapes
    weights.write_bytes(bytes(data))
    assert model_identity(copy, "x") != model_identity(source, "x")
    assert model_identity(materialize("demo-32k"), "x") != model_identity(source, "x")


def test_the_same_files_under_another_runtime_are_another_model(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks are what the model's code computed on MLX on one device: after an upgrade of
    mlx-lm (a fixed rotary embedding) or a move to the GPU, the old blocks were reused."""
    from afmd.engine.demo.builtin import materialize
    from afmd.engine.kvcache import identity

    source = materialize("demo")
    here = identity.runtime()
    assert "mlx-lm " in here and here.endswith(("cpu", "gpu"))
    before = model_identity(source, "x")
    for other in (here.replace("mlx-lm ", "mlx-lm 0"), here[:-3] + "gpu"
                  if here.endswith("cpu") else here[:-3] + "cpu"):
        monkeypatch.setattr(identity, "runtime", lambda other=other: other)
        assert model_identity(source, "x") != before
    monkeypatch.setattr(identity, "runtime", lambda: here)
    assert model_identity(source, "x") == before


def test_a_checkpoint_changed_where_no_sample_looks_is_another_model(tmp_path: Path) -> None:
    """A fine-tune that changed some tensors (a fused LoRA adapter) may differ from its base
    only between the sampled chunks; same name, same size. Its blocks were the base
    model's: a restart over one folder answered with the other model's state."""
    from afmd.engine.demo.builtin import materialize
    from afmd.engine.kvcache import identity

    source = materialize("demo")
    tuned = tmp_path / "tuned"
    shutil.copytree(source, tuned)
    weights = next(tuned.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    size = len(data)
    chunk, samples = identity._SAMPLE, identity._SAMPLES
    assert size > chunk * (samples + 2)  # sampled, not hashed whole
    start = (size - chunk) * (samples // 2) // (samples + 1) + chunk  # after one sample
    end = (size - chunk) * (samples // 2 + 1) // (samples + 1)  # before the next
    assert end - start > 1000
    for i in range(start, end, 2):
        data[i] ^= 0x5A
    weights.write_bytes(bytes(data))
    assert model_identity(tuned, "x") != model_identity(source, "x")


# -- the RAM tier ----------------------------------------------------------------------


def test_ram_tier_evicts_least_recently_used_by_bytes() -> None:
    blocks = [_block(i) for i in range(3)]
    ram = RamTier(max_bytes=2 * blocks[0].nbytes, max_blocks=100)
    ram.put(b"a", blocks[0])
    ram.put(b"b", blocks[1])
    assert ram.get(b"a") is blocks[0]  # a is now the most recently used
    ram.put(b"c", blocks[2])
    assert b"b" not in ram and b"a" in ram and b"c" in ram
    assert ram.evictions == 1 and ram.nbytes == 2 * blocks[0].nbytes
    assert ram.get(b"b") is None and ram.misses == 1 and ram.hits == 1
    assert ram.clear() == 2 * blocks[0].nbytes and len(ram) == 0 and ram.nbytes == 0
    counted = RamTier(max_bytes=1 << 30, max_blocks=2)  # prompt_cache_entries
    for i, block in enumerate(blocks):
        counted.put(bytes([i]), block)
    assert len(counted) == 2 and bytes([0]) not in counted and counted.evictions == 1


def test_shared_prefix_blocks_are_held_once_and_a_change_reuses_what_precedes_it() -> None:
    """Two conversations with one system prompt hold its blocks once; a conversation
    changed in its middle resumes from every block before the change."""
    ram = RamTier(1 << 30, 1 << 20)
    cache = BlockCache(b"m", BLOCK, ram)
    system = list(range(1, 1 + 4 * BLOCK))
    one = system + list(range(500, 500 + 2 * BLOCK))
    two = system + list(range(700, 700 + 2 * BLOCK))

    def state(tokens: list[int]) -> list[Any]:
        layers = [(mx.random.normal((1, 2, len(tokens), 8)),
                   mx.random.normal((1, 2, len(tokens), 8))) for _ in range(2)]
        return compat.build(layers)

    cache.store(one, state(one))
    cache.store(two, state(two))
    assert len(ram) == 4 + 2 + 2  # the system prompt's four blocks once
    resume = cache.lookup([*two, 1, 2, 3])
    assert resume.tokens == 6 * BLOCK and resume.ram_tokens == 6 * BLOCK
    assert [c.offset for c in resume.cache] == [6 * BLOCK] * 2
    edited = list(one)
    edited[5 * BLOCK + 1] = 9
    assert cache.lookup([*edited, 1]).tokens == 5 * BLOCK + 1  # every token before it
    # A whole prompt of blocks still leaves its last token to compute.
    assert cache.lookup(one).tokens == 6 * BLOCK - 1


def test_a_tail_shorter_than_a_block_is_reused_for_what_it_shares() -> None:
    """The next turn resends the prompt, the answer and a new message: it resumes from
    the previous turn's end, not from its last block boundary."""
    ram = RamTier(1 << 30, 1 << 20)
    cache = BlockCache(b"m", BLOCK, ram)
    turn = list(range(1, 1 + 3 * BLOCK + 5))  # three blocks and a five-token tail
    layers = [(mx.random.normal((1, 2, len(turn), 8)), mx.random.normal((1, 2, len(turn), 8)))]
    cache.store(turn, compat.build(layers))
    assert len(ram) == 4  # three blocks, one tail
    resume = cache.lookup([*turn, 40, 41])
    assert resume.tokens == 3 * BLOCK + 5 and resume.ram_tokens == resume.tokens
    keys = resume.cache[0].keys
    assert mx.array_equal(keys, layers[0][0][..., : 3 * BLOCK + 5, :]).item()
    assert cache.lookup([*turn[:-2], 99, 98]).tokens == 3 * BLOCK + 3  # what it shares
    assert cache.lookup(turn).tokens == 3 * BLOCK + 4  # the same prompt: all but one


def test_a_conversation_longer_than_the_tier_keeps_its_head() -> None:
    """A lookup reaches a block only through every block before it. Used head first, the
    head was the least recently used and left first: a conversation longer than the RAM
    tier never found a block in RAM again (cached 16, 0, 0 tokens on three turns)."""
    turn = list(range(1, 1 + 6 * BLOCK + 5))  # six blocks and a tail
    layers = [(mx.random.normal((1, 2, len(turn), 8)), mx.random.normal((1, 2, len(turn), 8)))]
    block_bytes = Block.of([(k[..., :BLOCK, :], v[..., :BLOCK, :]) for k, v in layers]).nbytes
    ram = RamTier(int(4.5 * block_bytes), 1 << 20)  # four blocks and the tail
    cache = BlockCache(b"m", BLOCK, ram)
    cache.store(turn, compat.build(layers))
    for _ in range(3):  # each turn resends the conversation
        resume = cache.lookup([*turn, 50])
        assert resume.tokens >= 4 * BLOCK and resume.ram_tokens == resume.tokens
        keys = resume.cache[0].keys
        assert mx.array_equal(keys, layers[0][0][..., : resume.tokens, :]).item()


# -- the disk tier ----------------------------------------------------------------------


@pytest.fixture()
def disk(tmp_path: Path) -> Iterator[DiskTier]:
    store = DiskStore(tmp_path / "kv", 1 << 30)
    yield DiskTier(store, b"identity-a" * 3, "a")
    store.close()


def _written(tier: DiskTier, key: bytes, block: Block) -> Path:
    tier.put(key, block)
    assert tier.store.flush()
    path = layout.block_path(tier.folder, key)
    assert path.is_file()
    return path


def test_a_block_written_to_disk_reads_back_the_same(disk: DiskTier) -> None:
    block = _block(1)
    _written(disk, b"k" * 32, block)
    got = disk.get(b"k" * 32, BLOCK)
    assert got is not None and _same(got, block) and disk.hits == 1
    assert disk.nbytes > block.nbytes  # a header and a checksum besides
    assert not [p for p in disk.folder.iterdir() if p.name.startswith(layout.TEMP_PREFIX)]


def _rewritten(data: bytearray, change: Callable[[Any], Any]) -> bytes:
    """The file with its header changed and its checksum made to match again: a file a
    checksum cannot catch (another version's writer, or anyone's)."""
    size = int.from_bytes(data[12:16], "little")
    header = change(json.loads(bytes(data[16:16 + size])))
    raw = json.dumps(header).encode()
    body = bytes(data[48 + size:])
    digest = hashlib.sha256(raw)
    digest.update(body)
    return bytes(data[:12]) + len(raw).to_bytes(4, "little") + raw + digest.digest() + body


def _with_array(header: dict[str, Any], at: int, value: Any) -> dict[str, Any]:
    header["arrays"][0][at] = value
    return header


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign", "layout", "key",
                                    "header-list", "dtype-number", "shape-text"])
def test_a_file_that_does_not_match_is_deleted_not_used(disk: DiskTier, damage: str,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    key = b"k" * 32
    path = _written(disk, key, _block(2))
    data = bytearray(path.read_bytes())
    if damage == "corrupt":
        data[-7] ^= 0x40
        path.write_bytes(bytes(data))
    elif damage == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "layout":
        data[8:12] = (LAYOUT + 1).to_bytes(4, "little")
        path.write_bytes(bytes(data))
    elif damage == "header-list":
        path.write_bytes(_rewritten(data, lambda header: [1, 2]))
    elif damage == "dtype-number":
        path.write_bytes(_rewritten(data, lambda header: _with_array(header, 1, 5)))
    elif damage == "shape-text":
        path.write_bytes(_rewritten(data, lambda header: _with_array(header, 0, ["a"])))
    elif damage == "key":  # a file renamed over another block's name
        os.replace(path, layout.block_path(disk.folder, b"j" * 32))
        key = b"j" * 32
        path = layout.block_path(disk.folder, key)
    else:  # another model's file in this model's folder, under the same key
        other = DiskTier(disk.store, b"identity-b" * 3, "b")
        foreign = _written(other, key, _block(3))
        shutil.copyfile(foreign, path)
    with caplog.at_level(logging.WARNING, logger="afmd.kvcache"):
        assert disk.get(key, BLOCK) is None
    assert not path.exists()  # deleted: recomputed next time, never read again
    assert disk.misses == 1 and any("deleted" in r.getMessage() for r in caplog.records)
    # /metrics counts it, by what it was (afmd_kv_cache_disk_rejected_total).
    reason = "foreign" if damage in ("foreign", "layout", "key") else "corrupt"
    assert disk.store.counts.rejected == {reason: 1}


def test_a_fifo_under_a_block_name_does_not_hang_the_lookup(disk: DiskTier,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    """Whatever is under a block's name is read only if it is a regular file: a FIFO
    blocked the generation thread in ``open`` until something wrote to it (the server
    hung), and a link to ``/dev/zero`` was read until memory ran out."""
    key = b"f" * 32
    path = layout.block_path(disk.folder, key)
    os.mkfifo(path)
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(disk.get(key, BLOCK)), daemon=True)
    with caplog.at_level(logging.WARNING, logger="afmd.kvcache"):
        reader.start()
        reader.join(5)
    hung = reader.is_alive()
    if hung:  # release it: a writer opening the FIFO ends the reader's open
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        reader.join(5)
    assert not hung and got == [None]
    assert not path.exists() and any("not a regular file" in r.getMessage()
                                      for r in caplog.records)
    (disk.folder / "elsewhere").write_bytes(b"x")
    path.symlink_to(disk.folder / "elsewhere")  # afmd writes no links: one is not read
    assert disk.get(key, BLOCK) is None and not path.exists()
    assert (disk.folder / "elsewhere").read_bytes() == b"x"
    assert disk.store.counts.rejected == {"not_a_file": 2}


def test_a_file_larger_than_a_block_can_be_is_not_read(tmp_path: Path) -> None:
    """A file under a block's name larger than any block of the model (junk, anyone's) was
    read whole into memory before its checksum failed: up to the whole tier's bound."""
    import tracemalloc

    layers = _block(6, layers=2).layers
    store = DiskStore(tmp_path / "kv", 1 << 30)
    tier = DiskTier(store, b"identity-c" * 3, "c", lambda: [
        ((k.shape[1], k.shape[3], k.dtype), (v.shape[1], v.shape[3], v.dtype))
        for k, v in layers])
    key = b"h" * 32
    path = layout.block_path(tier.folder, key)
    with path.open("wb") as f:
        f.truncate(64 << 20)  # sparse: takes no disk
    tracemalloc.start()
    try:
        assert tier.get(key, BLOCK) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        store.close()
    assert peak < 8 << 20 and not path.exists()
    assert store.counts.rejected == {"not_a_file": 1}


def test_a_model_whose_layers_cannot_be_read_still_reads_blocks(
        disk: DiskTier, caplog: pytest.LogCaptureFixture) -> None:
    """The one-token run that says what the model's layers are made of failing fails no
    lookup: the blocks read are checked for their own form only (logged once)."""
    block = _block(7)
    _written(disk, b"k" * 32, block)
    tier = DiskTier(disk.store, disk.identity, "a", lambda: 1 / 0)  # type: ignore[arg-type,return-value]
    with caplog.at_level(logging.ERROR, logger="afmd.kvcache"):
        got = tier.get(b"k" * 32, BLOCK)
        assert got is not None and _same(got, block)
        assert tier.get(b"k" * 32, BLOCK // 2) is None  # its own length still checked
    assert len([r for r in caplog.records if r.name == "afmd.kvcache"
                and r.levelno == logging.ERROR]) == 1


def test_a_misfit_that_cannot_be_deleted_is_not_read_again(
        disk: DiskTier, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A read-only folder: the corrupt file stays. It was logged as deleted, and read,
    found wrong and logged again at every lookup that reached it."""
    key = b"r" * 32
    path = _written(disk, key, _block(4))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    original = Path.unlink

    def refuse(self: Path, missing_ok: bool = False) -> None:
        if self == path:
            raise PermissionError(errno.EROFS, "Read-only file system", str(self))
        original(self, missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    with caplog.at_level(logging.WARNING, logger="afmd.kvcache"):
        assert disk.get(key, BLOCK) is None
        assert disk.get(key, BLOCK) is None
    assert path.exists() and disk.misses == 2
    messages = [r.getMessage() for r in caplog.records if r.name == "afmd.kvcache"]
    assert len(messages) == 1 and "not deleted" in messages[0], messages


def test_a_chain_read_from_disk_leaves_its_head_the_newest(tmp_path: Path) -> None:
    """The disk tier's order survives a restart in the files' times: a chain read back
    (after a restart) is marked used from its end to its head there too, or the head,
    read first, would be the first of it evicted."""
    turn = list(range(1, 1 + 4 * BLOCK))
    layers = [(mx.random.normal((1, 2, len(turn), 8)), mx.random.normal((1, 2, len(turn), 8)))]
    store = DiskStore(tmp_path / "kv", 1 << 30)
    first = DiskTier(store, b"m", "m")
    writer = BlockCache(b"m", BLOCK, RamTier(1 << 30, 1 << 20), first)
    writer.store(turn, compat.build(layers))
    assert store.flush()
    store.close()
    folder = tmp_path / "kv"
    keys = writer.keys(turn, 4)
    paths = [layout.block_path(first.folder, key) for key in keys]
    assert all(path.is_file() for path in paths)
    for i, path in enumerate(paths):
        os.utime(path, ns=(10**18, 10**18 + i))  # the head the oldest
    # A restart with room for these four files alone: one more write evicts one.
    again = DiskStore(folder, sum(path.stat().st_size for path in paths))
    tier = DiskTier(again, b"m", "m")
    reader = BlockCache(b"m", BLOCK, RamTier(1 << 30, 1 << 20), tier)
    assert reader.lookup([*turn, 9]).disk_tokens == 4 * BLOCK
    tier.put(b"z" * 32, _block(5, tokens=BLOCK, layers=1))
    assert again.flush()
    assert paths[0].is_file() and not paths[-1].exists()  # the chain's end went
    again.close()


def test_a_write_cut_short_leaves_a_prefix_a_lookup_reaches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row of more blocks than the write queue holds, the writer busy (a large model's
    blocks are tens of MiB): what does not fit in the queue is dropped, as the rest of a
    chain is when the process is killed mid-write or the disk fills. Queued from the end to
    the head, the head was what went: nothing of the row was found after a restart,
    though most of it was on disk."""
    monkeypatch.setattr(disk_module, "_QUEUE", 4)
    busy = threading.Event()
    write = DiskStore._write

    def held(self: DiskStore, item: _Write) -> None:
        busy.wait(30)
        write(self, item)

    monkeypatch.setattr(DiskStore, "_write", held)
    turn = list(range(1, 1 + 12 * BLOCK + 5))
    layers = [(mx.random.normal((1, 2, len(turn), 8)), mx.random.normal((1, 2, len(turn), 8)))]
    store = DiskStore(tmp_path / "kv", 1 << 30)
    writer = BlockCache(b"m", BLOCK, RamTier(1 << 30, 1 << 20), DiskTier(store, b"m", "m"))
    writer.store(turn, compat.build(layers))
    busy.set()
    assert store.flush() and store.dropped > 0
    store.close()
    monkeypatch.setattr(DiskStore, "_write", write)
    again = DiskStore(tmp_path / "kv", 1 << 30)
    reader = BlockCache(b"m", BLOCK, RamTier(1 << 30, 1 << 20), DiskTier(again, b"m", "m"))
    resume = reader.lookup([*turn, 9])
    assert resume.disk_tokens >= 4 * BLOCK
    assert mx.array_equal(resume.cache[0].keys, layers[0][0][..., :resume.tokens, :]).item()
    again.close()


def test_a_chain_longer_than_the_disk_tier_keeps_its_head(tmp_path: Path) -> None:
    """The tier holds the head of a chain it cannot hold whole, within its bound, and
    evicts a chain from its end."""
    probe = DiskStore(tmp_path / "probe", 1 << 30)
    size = _written(DiskTier(probe, b"p", "p"), b"x" * 32, _block(0, layers=1)).stat().st_size
    probe.close()
    turn = list(range(1, 1 + 10 * BLOCK))
    layers = [(mx.random.normal((1, 2, len(turn), 8)).astype(mx.float16),
               mx.random.normal((1, 2, len(turn), 8)).astype(mx.float16))]
    store = DiskStore(tmp_path / "kv", int(4.5 * size))
    tier = DiskTier(store, b"m", "m")
    writer = BlockCache(b"m", BLOCK, RamTier(1 << 30, 1 << 20), tier)
    writer.store(turn, compat.build(layers))
    assert store.flush() and store.nbytes <= store.max_bytes
    paths = [layout.block_path(tier.folder, key) for key in writer.keys(turn)]
    assert [path.exists() for path in paths] == [True] * 4 + [False] * 6
    tier.put(b"z" * 32, _block(5, layers=1))  # one more: the chain's end goes
    assert store.flush()
    assert [path.exists() for path in paths] == [True] * 3 + [False] * 7
    store.close()
    again = DiskStore(tmp_path / "kv", int(4.5 * size))
    reader = BlockCache(b"m", BLOCK, RamTier(1 << 30, 1 << 20), DiskTier(again, b"m", "m"))
    assert reader.lookup([*turn, 9]).disk_tokens == 3 * BLOCK
    again.close()
    # disk_bytes lowered under what the chain holds there: its next store keeps the bound.
    lowered = DiskStore(tmp_path / "kv", int(1.5 * size))
    tier = DiskTier(lowered, b"m", "m")
    writer = BlockCache(b"m", BLOCK, RamTier(1 << 30, 1 << 20), tier)
    writer.store(turn, compat.build(layers))
    assert lowered.flush() and lowered.nbytes <= lowered.max_bytes
    assert [path.exists() for path in paths] == [True] + [False] * 9
    assert layout.held_bytes(tmp_path / "kv") == lowered.nbytes
    lowered.close()


def test_files_deleted_behind_its_back_are_all_written_again(disk: DiskTier) -> None:
    """Another process sharing the folder (its evictions), ``afmd cache clear`` or a user
    deleted a prefix's files. The first read that misses has the writer check the
    folder's index, so the request that recomputes the prefix writes every block of it
    again, not only the one it read (it came back a block a request)."""
    keys = [bytes([i]) * 32 for i in range(4)]
    blocks = [_block(10 + i) for i in range(4)]
    paths = [_written(disk, key, block) for key, block in zip(keys, blocks, strict=True)]
    for path in paths:
        path.unlink()
    assert disk.get(keys[0], BLOCK) is None  # the chain stops at its first block
    assert disk.store.flush()
    for key, block in zip(keys, blocks, strict=True):  # the recomputed prefix, stored
        disk.put(key, block)
    assert disk.store.flush()
    assert all(path.is_file() for path in paths)
    assert all(disk.get(key, BLOCK) is not None for key in keys)
    assert disk.store.nbytes == sum(path.stat().st_size for path in paths)


def test_a_folder_emptied_under_a_hot_conversation_is_written_again(
        disk: DiskTier) -> None:
    """The folder emptied while the server runs (``rm -rf``, a cache cleaner) and the
    conversation hot in RAM: its blocks, indexed as on disk, were only skipped at each
    store and never read, so never written again (a restart found nothing), and the
    bytes deleted were counted as held."""
    keys = [bytes([i]) * 32 for i in range(3)]
    blocks = [_block(30 + i) for i in range(3)]
    paths = [_written(disk, key, block) for key, block in zip(keys, blocks, strict=True)]
    shutil.rmtree(disk.store.root)
    for _ in range(2):  # the conversation's next turns store its blocks again
        for key, block in zip(keys, blocks, strict=True):
            disk.put(key, block)
        assert disk.store.flush()
    assert all(path.is_file() for path in paths)
    assert disk.store.nbytes == sum(path.stat().st_size for path in paths)


def test_a_block_another_process_wrote_first_is_counted_once(tmp_path: Path) -> None:
    """This process indexed the file another one wrote (found at its start, or read),
    then its own queued write of the same block lands: the file is counted once."""
    key, block = b"s" * 32, _block(20)
    other = DiskStore(tmp_path / "kv", 1 << 30)
    path = _written(DiskTier(other, b"shared", "m"), key, block)
    other.close()
    store = DiskStore(tmp_path / "kv", 1 << 30)
    assert store.nbytes == path.stat().st_size
    store._write(_Write(path, key, b"shared", block, raw_views(block)))
    assert store.nbytes == path.stat().st_size
    store.close()


def test_disk_tier_evicts_least_recently_used_by_bytes(tmp_path: Path) -> None:
    probe = DiskStore(tmp_path / "probe", 1 << 30)
    size = _written(DiskTier(probe, b"p", "p"), b"x" * 32, _block(0)).stat().st_size
    probe.close()
    store = DiskStore(tmp_path / "kv", int(2.5 * size))
    tier = DiskTier(store, b"i", "m")
    for i in range(2):
        _written(tier, bytes([i]) * 32, _block(i))
        time.sleep(0.01)
    assert tier.get(bytes([0]) * 32, BLOCK) is not None  # block 0 used last: block 1 goes
    _written(tier, bytes([2]) * 32, _block(2))
    assert store.evictions == 1 and store.nbytes == 2 * size
    assert not layout.block_path(tier.folder, bytes([1]) * 32).exists()
    assert layout.block_path(tier.folder, bytes([0]) * 32).exists()
    store.close()
    # After a restart the order and the bytes are read back from the folder.
    again = DiskStore(tmp_path / "kv", int(2.5 * size))
    assert again.nbytes == 2 * size
    again.close()
    # disk_bytes lowered since: the least recently used go at the start, not at a write.
    lowered = DiskStore(tmp_path / "kv", int(1.5 * size))
    assert lowered.nbytes == size and lowered.evictions == 1
    assert layout.block_path(tier.folder, bytes([2]) * 32).exists()
    assert not layout.block_path(tier.folder, bytes([0]) * 32).exists()
    lowered.close()


def test_a_torn_temporary_file_is_never_read(disk: DiskTier) -> None:
    key = b"t" * 32
    temp = disk.folder / f"{layout.TEMP_PREFIX}999-{key.hex()}{layout.SUFFIX}"
    temp.write_bytes(b"AFMDKVB\x00 half a file")  # what a killed writer leaves
    assert disk.get(key, BLOCK) is None and temp.exists()


def test_a_dead_writers_temporary_file_is_swept_while_serving(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process killed mid-write, restarted at once (launchd's KeepAlive): its temporary
    file was too recent for the new process's start-up scan, and stayed for as long as the
    new process ran, one more after each crash."""
    monkeypatch.setattr(disk_module, "_STALE_TEMP_S", 0.2)
    store = DiskStore(tmp_path / "kv", 1 << 30)
    tier = DiskTier(store, b"i", "m")
    dead = tier.folder / layout.temp_name(f"{'ab' * 32}{layout.SUFFIX}")
    dead.write_bytes(b"AFMDKVB\x00 half a block")  # the killed writer's, just now
    fresh = tier.folder / layout.temp_name(f"{'cd' * 32}{layout.SUFFIX}")
    time.sleep(0.3)
    fresh.write_bytes(b"AFMDKVB\x00 a live writer's")  # another process writing now
    _written(tier, b"k" * 32, _block(1))  # the writer sweeps before its next write
    assert not dead.exists() and fresh.exists()
    store.close()


# -- the engine: a model loaded as a server loads it --------------------------------------


def _generate(model: Any, prompt: list[int], max_tokens: int = 12) -> tuple[list[int], Any]:
    async def main() -> tuple[list[int], Any]:
        generation = model.start(GenerationRequest(
            f"r{time.monotonic_ns()}", prompt, max_tokens,
            sampling=SamplingParams(temperature=0.0)))
        events: list[Any] = []
        while not generation.done:
            events.extend(await generation.next_events())
        return [getattr(e, "text", "") for e in events], events[-1]

    return asyncio.run(main())


def _load(cache: CacheConfig, path: str = BUILTIN_DEMO_PATH, model_id: str = "demo") -> Any:
    from afmd.engine.models.loading import load_sync

    return load_sync(ModelEntry(id=model_id, path=path), Config(cache=cache))


def test_unwritable_folder_logs_once_and_serves_from_ram(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="afmd.kvcache"):
        model = _load(CacheConfig(block_tokens=BLOCK, disk_dir=str(blocker / "kv"),
                                  disk_min_free=0))
        try:
            prompt = model.render_prompt([{"role": "user", "content": "tides " * 40}])
            cold, _ = _generate(model, prompt)
            for _ in range(2):
                warm, end = _generate(model, prompt)
                assert warm == cold and end.cached_tokens >= len(prompt) - BLOCK
                assert end.cached_disk_tokens == 0
        finally:
            model.worker.stop()
    warnings = [r for r in caplog.records if r.name == "afmd.kvcache"]
    assert len(warnings) == 1 and "serving on from RAM" in warnings[0].getMessage()


def test_a_write_that_fails_later_logs_once(tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """A folder that goes away under the server (an unmounted disk fails the same way: the
    write raises): logged once, RAM serves on; ``/metrics`` says so (a full disk pauses
    instead: below)."""
    store = DiskStore(tmp_path / "kv", 1 << 30)
    tier = DiskTier(store, b"i", "m")
    shutil.rmtree(tier.folder)
    tier.folder.write_text("in the way")
    with caplog.at_level(logging.WARNING, logger="afmd.kvcache"):
        for i in range(3):
            tier.put(bytes([i]) * 32, _block(i))
            assert store.flush()
    assert store.failed is not None
    assert len([r for r in caplog.records if r.name == "afmd.kvcache"]) == 1
    assert store.counts.write_failures == {"other": 1} and not store.counts.writing
    assert store.counts.dropped == {"stopped": 2}
    store.close()


# -- the disk tier on a full disk ----------------------------------------------------------


class _Volume:
    """A volume of ``size`` bytes holding the tier's folder and ``other`` bytes of other
    programs' files: what the tier's :func:`disk.free_space` reads instead of the disk."""

    def __init__(self, root: Path, size: int, other: int) -> None:
        self.root, self.size, self.other = root, size, other

    def free(self) -> int:
        used = sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())
        return max(0, self.size - self.other - used)

    def __call__(self, path: Path) -> tuple[int, int]:
        return self.free(), self.size


def _file_size(tmp_path: Path) -> int:
    """The bytes of a ``_block``'s file."""
    probe = DiskStore(tmp_path / "probe", 1 << 30)
    size = _written(DiskTier(probe, b"i", "m"), b"x" * 32, _block(0)).stat().st_size
    probe.close()
    return size


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "afmd.kvcache" and r.levelno >= logging.WARNING]


def test_the_disk_tier_leaves_the_margin_free_deleting_its_own_oldest_blocks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``disk_bytes`` (10 GiB by default) was the tier's only bound: on a nearly full disk
    it wrote until the disk was full, and kept it so across restarts. It leaves
    ``disk_min_free`` free now, deleting its least recently used blocks to make room for
    new ones, at a write (the volume read once for them all), while idle (space others
    took given back), and at its start."""
    size = _file_size(tmp_path)
    root = tmp_path / "kv"
    volume = _Volume(root, size=100 * size, other=90 * size)  # 10 blocks free
    margin = 6 * size  # room for 3 blocks (and models.json) above it
    monkeypatch.setattr(disk_module, "free_space", volume)
    monkeypatch.setattr(disk_module, "_IDLE_S", 0.05)
    folder = layout.model_folder(root, b"i")
    folder.mkdir(parents=True)
    layout.add_name(folder, "m")  # as an earlier run left it: the volume read counts it
    store = DiskStore(root, 1 << 30, margin)
    tier = DiskTier(store, b"i", "m")
    keys = [bytes([i]) * 32 for i in range(8)]
    for i, key in enumerate(keys):
        _written(tier, key, _block(i))  # each written: it makes room, it does not stop
        assert volume.free() >= margin, i
    assert [k for k in keys if layout.block_path(tier.folder, k).exists()] == keys[-3:]
    assert store.evictions == 5 and store.writing and store.nbytes == 3 * size
    # Another program takes two blocks' worth: the idle tier gives it back.
    monkeypatch.setattr(disk_module, "_PROBE_S", 0.05)
    volume.other += 2 * size
    assert _wait(lambda: volume.free() >= margin, 5), volume.free()
    assert store.nbytes == size and layout.block_path(tier.folder, keys[-1]).exists()
    store.close()
    # The disk filled further while no afmd ran: the next one gives it back at its start.
    volume.other += size
    again = DiskStore(root, 1 << 30, margin)
    assert volume.free() >= margin and again.nbytes == 0
    again.close()


def test_a_margin_that_leaves_no_room_pauses_writing_until_space_returns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Less free than the margin, the tier holding nothing to delete: it pauses (each
    block queued meanwhile dropped, not encoded and refused one by one), retries later
    and later, logged once, and writes again once the space is back."""
    size = _file_size(tmp_path)
    root = tmp_path / "kv"
    volume = _Volume(root, size=100 * size, other=95 * size)
    monkeypatch.setattr(disk_module, "free_space", volume)
    monkeypatch.setattr(disk_module, "_BACKOFF_S", 0.5)
    monkeypatch.setattr(disk_module, "_BACKOFF_MAX_S", 1.0)
    store = DiskStore(root, 1 << 30, 6 * size)
    tier = DiskTier(store, b"i", "m")
    keys = [bytes([i]) * 32 for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="afmd.kvcache"):
        tier.put(keys[0], _block(0))
        assert store.flush() and not store.writing and store.counts.writing is False
        tier.put(keys[1], _block(1))  # paused: not even queued
        time.sleep(0.6)
        tier.put(keys[2], _block(2))  # tried again: still no room, the wait doubles
        assert store.flush() and not store.writing
        volume.other = 50 * size
        time.sleep(1.1)
        _written(tier, keys[3], _block(3))
    assert store.writing and store.counts.writing
    assert not any(layout.block_path(tier.folder, k).exists() for k in keys[:3])
    assert store.counts.dropped == {"no_room": 2, "paused": 1}
    assert store.counts.write_failures == {}
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "pauses writing" in warnings[0], warnings
    assert "disk_min_free" in warnings[0]
    store.close()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_a_full_disk_pauses_writing_and_resumes_when_space_returns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        code: int) -> None:
    """A write that found no space (the disk, a quota, a file size limit) stopped the tier
    for the rest of the process, its files left filling the disk. It deletes its least
    recently used blocks now (a block's worth at least: the volume may show room that a
    quota or its inodes do not give; none for a file size limit, which no deletion
    mends), pauses, retries later and later (logged once), and writes again when a write
    goes through."""
    monkeypatch.setattr(disk_module, "_BACKOFF_S", 0.5)
    monkeypatch.setattr(disk_module, "_BACKOFF_MAX_S", 2.0)
    store = DiskStore(tmp_path / "kv", 1 << 30)  # no margin: the write itself fails
    tier = DiskTier(store, b"i", "m")
    keys = [bytes([i]) * 32 for i in range(8)]
    for i in range(3):
        _written(tier, keys[i], _block(i))
    written = disk_module.write_file
    full = True

    def write(path: Path, parts: list[bytes | memoryview]) -> None:
        if not full:
            return written(path, parts)
        path.write_bytes(b"AFMDKVB\x00 cut short")
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(disk_module, "write_file", write)
    deletes = code != errno.EFBIG
    with caplog.at_level(logging.WARNING, logger="afmd.kvcache"):
        tier.put(keys[3], _block(3))
        assert store.flush()
        assert store.failed is None and not store.writing
        assert store.counts.write_failures == {"full": 1}
        assert store.evictions == deletes
        assert layout.block_path(tier.folder, keys[0]).exists() != deletes  # the oldest
        tier.put(keys[4], _block(4))  # paused: dropped
        time.sleep(0.6)
        tier.put(keys[5], _block(5))  # tried again: still full, the wait doubles
        assert store.flush() and store.counts.write_failures == {"full": 2}
        time.sleep(0.6)
        tier.put(keys[7], _block(7))  # within the doubled wait: dropped
        full = False
        time.sleep(0.5)
        _written(tier, keys[6], _block(6))
    assert store.writing and store.counts.writing and store.failed is None
    assert store.evictions == 2 * deletes
    assert store.counts.dropped == {"paused": 2}
    assert not [p for p in tier.folder.iterdir() if p.name.startswith(layout.TEMP_PREFIX)]
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "pauses writing" in warnings[0], warnings
    store.close()


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS])
def test_a_folder_it_may_not_write_still_stops_the_tier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        code: int) -> None:
    """No waiting mends a read-only or another user's folder: the tier stops, logged
    once, and ``/metrics`` says why."""
    monkeypatch.setattr(disk_module, "_BACKOFF_S", 0.05)
    store = DiskStore(tmp_path / "kv", 1 << 30)
    tier = DiskTier(store, b"i", "m")

    def refuse(path: Path, parts: list[bytes | memoryview]) -> None:
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(disk_module, "write_file", refuse)
    with caplog.at_level(logging.WARNING, logger="afmd.kvcache"):
        for i in range(3):
            tier.put(bytes([i]) * 32, _block(i))
            assert store.flush()
            time.sleep(0.1)
    assert store.failed is not None and not store.writing
    assert store.counts.write_failures == {"denied": 1}
    assert store.counts.dropped == {"stopped": 2}
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "stops writing" in warnings[0], warnings
    store.close()


def test_the_margin_by_default_is_the_larger_of_2_gib_and_5_percent_of_the_volume(
        tmp_path: Path) -> None:
    assert margin_of(None, 16 << 30) == 2 << 30
    assert margin_of(None, 1 << 40) == (1 << 40) // 20
    assert margin_of(0, 1 << 40) == 0 and margin_of(12345, 1 << 40) == 12345
    for setting in (None, 12345):  # [cache] disk_min_free reaches the tier
        cache = CacheConfig(block_tokens=BLOCK, disk_dir=str(tmp_path / f"kv-{setting}"),
                            disk_min_free=setting)
        model = _load(cache)
        try:
            assert model.kv_cache.disk.store.min_free == setting
        finally:
            model.worker.stop()


def _forged(path: Path, change: Callable[[list[compat.Layer]], list[compat.Layer]]) -> None:
    """Rewrite a block file with its arrays changed: whole, its checksum matching, its
    model and key the ones asked for (what another afmd writing blocks otherwise under the
    same layout number would leave, or anyone)."""
    data = path.read_bytes()
    size = int.from_bytes(data[12:16], "little")
    header = json.loads(data[16:16 + size])
    key, identity = bytes.fromhex(header["key"]), bytes.fromhex(header["identity"])
    layers = [(mx.contiguous(k), mx.contiguous(v))
              for k, v in change(decode(data, key, identity).layers)]
    block = Block.of(layers)
    path.write_bytes(b"".join(bytes(part) for part in
                              encode(key, identity, block, raw_views(block))))


FORGERIES: dict[str, Callable[[list[compat.Layer]], list[compat.Layer]]] = {
    "fewer tokens": lambda layers: [(k[..., :BLOCK // 2, :], v[..., :BLOCK // 2, :])
                                    for k, v in layers],
    "fewer layers": lambda layers: layers[:-1],
    "more heads": lambda layers: [(mx.concatenate([k, k], axis=1),
                                   mx.concatenate([v, v], axis=1)) for k, v in layers],
    "another dtype": lambda layers: [(k.astype(mx.float16), v.astype(mx.float16))
                                     for k, v in layers],
    "another rank": lambda layers: [(k[0], v[0]) for k, v in layers],
}


def test_a_whole_file_that_does_not_fit_the_model_is_deleted_not_used(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A block file whose checksum, model and key are right but whose arrays are not this
    model's state for its tokens: fewer tokens or layers resumed a row silently wrong (the
    answer changed), other heads or another rank failed every batch the prompt joined,
    the file staying to fail the next."""
    kv = tmp_path / "kv"
    cache = CacheConfig(block_tokens=BLOCK, disk_dir=str(kv), disk_min_free=0)
    model = _load(cache)
    try:
        prompt = model.render_prompt([{"role": "user", "content": "moons and tides " * 20}])
        cold, _ = _generate(model, prompt)
        assert model.kv_cache.disk.store.flush()
    finally:
        model.worker.stop()
    blocks = [p for p in kv.rglob(f"*{layout.SUFFIX}") if layout.parse_tail(p.name) is None]
    assert len(blocks) >= 4
    for name, change in FORGERIES.items():
        copy = tmp_path / name.replace(" ", "-")
        shutil.copytree(kv, copy)
        forged = [copy / p.relative_to(kv) for p in blocks]
        for path in forged:
            _forged(path, change)
        was = {path: path.read_bytes() for path in forged}
        caplog.clear()
        model = _load(CacheConfig(block_tokens=BLOCK, disk_dir=str(copy), disk_min_free=0))
        try:
            with caplog.at_level(logging.WARNING, logger="afmd.kvcache"):
                for _ in range(2):
                    text, end = _generate(model, prompt)
                    assert text == cold, name
                    assert end.cached_disk_tokens == 0, name
        finally:
            model.worker.stop()
        # The chain's head was read, deleted (and its recomputed block written again).
        assert any(not path.exists() or path.read_bytes() != was[path] for path in forged)
        assert any("not this model's state" in r.getMessage() for r in caplog.records), name
        assert model.kv_cache.disk.store.counts.rejected["misfit"] >= 1, name


def test_a_directory_under_a_block_name_stops_only_that_block(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A directory where a block's file goes (made after the folder was indexed): that
    block is not written, the next ones are. The failed rename was taken for the
    folder's, and the tier stopped writing for good."""
    store = DiskStore(tmp_path / "kv", 1 << 30)
    tier = DiskTier(store, b"i", "m")
    layout.block_path(tier.folder, b"\0" * 32).mkdir()
    with caplog.at_level(logging.WARNING, logger="afmd.kvcache"):
        for i in range(3):
            tier.put(bytes([i]) * 32, _block(i))
            assert store.flush()
    assert store.failed is None
    assert all(layout.block_path(tier.folder, bytes([i]) * 32).is_file() for i in (1, 2))
    assert len([r for r in caplog.records if r.name == "afmd.kvcache"]) == 1
    assert store.counts.write_failures == {"block": 1} and store.writing
    assert not [p for p in tier.folder.iterdir() if p.name.startswith(layout.TEMP_PREFIX)]
    store.close()


def test_a_model_folder_it_cannot_list_is_skipped_not_the_tier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user's model folder in a shared ``disk_dir`` (mode 700): listing it failed
    the start-up scan, and the tier stopped writing for every model."""
    root = tmp_path / "kv"
    theirs = root / ("ab" * 16)
    theirs.mkdir(parents=True)
    listing = Path.iterdir

    def refuse(self: Path) -> Iterator[Path]:
        if self == theirs:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return listing(self)

    monkeypatch.setattr(Path, "iterdir", refuse)
    store = DiskStore(root, 1 << 30)
    tier = DiskTier(store, b"i", "m")
    assert store.failed is None
    _written(tier, b"k" * 32, _block(1))
    store.close()
    held = layout.held_bytes(root)
    assert held > 0 and layout.clear(root) == (1, held)  # `afmd cache clear`
    assert layout.held_bytes(root) == 0


def test_a_temporary_file_deleted_under_the_writer_stops_only_that_block(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``afmd cache clear`` (it deletes every ``.kvb`` name, temporary ones too) or another
    process sweeping the folder deleted a block's temporary file before its rename: the
    tier stopped writing for good. Temporary names are unique across processes too (two
    containers sharing a volume both run afmd as pid 1)."""
    store = DiskStore(tmp_path / "kv", 1 << 30)
    tier = DiskTier(store, b"i", "m")
    replace = os.replace
    swept: list[str] = []

    def sweep_first(src: Any, dst: Any) -> None:
        if not swept and Path(src).name.startswith(layout.TEMP_PREFIX):
            swept.append(Path(src).name)
            Path(src).unlink()  # what `afmd cache clear` does to a .tmp-*.kvb
        replace(src, dst)

    monkeypatch.setattr(os, "replace", sweep_first)
    for i in range(3):
        tier.put(bytes([i]) * 32, _block(i))
        assert store.flush()
    assert swept and store.failed is None
    assert all(layout.block_path(tier.folder, bytes([i]) * 32).is_file() for i in (1, 2))
    assert layout.temp_name("x.kvb") != layout.temp_name("x.kvb")
    store.close()


def test_two_models_on_one_folder_never_share_blocks(tmp_path: Path) -> None:
    cache = CacheConfig(block_tokens=BLOCK, disk_dir=str(tmp_path / "kv"), disk_min_free=0)
    tokens = [(i * 7) % 900 + 20 for i in range(6 * BLOCK)]  # ids both vocabularies have
    first = _load(cache)
    try:
        _generate(first, tokens)
        assert first.kv_cache.disk.store.flush()
    finally:
        first.worker.stop()
    second = _load(cache, "afmd:demo-32k", "demo-32k")
    try:
        _, end = _generate(second, tokens)
        assert end.cached_tokens == 0
        assert second.kv_cache.disk.folder != first.kv_cache.disk.folder
    finally:
        second.worker.stop()


# -- the real server, restarted ----------------------------------------------------------


def _config(kv: Path) -> str:
    # No free-space margin: these tests are about what the tier keeps, on any machine's
    # disk, however full (the margin's own tests set it).
    return f'[cache]\nblock_tokens = {BLOCK}\ndisk_dir = "{kv}"\ndisk_min_free = 0\n'


CONVERSATION = [
    {"role": "system", "content": "You are a careful coding agent. " * 12},
    {"role": "user", "content": "Read the file and summarise it."},
    {"role": "assistant", "content": "The file defines three functions and a test. " * 3},
    {"role": "user", "content": "Now rename the second function everywhere."},
]


def _turn(url: str, messages: list[dict[str, str]] | None = None
          ) -> tuple[str, dict[str, Any], dict[str, Any]]:
    r = httpx.post(url + CHAT, timeout=120, headers={"X-AFM-Profile": "true"}, json={
        "model": "demo", "messages": messages or CONVERSATION, "max_tokens": 16,
        "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    events = parse_sse(r.text)
    text = "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in events if isinstance(c, dict) and c.get("choices"))
    usage = next(c["usage"] for c in events if isinstance(c, dict) and c.get("usage"))
    profile = next(c["afm_profile"] for c in events if isinstance(c, dict)
                   and "afm_profile" in c)
    return text, usage, profile


def _kv_detail(url: str) -> dict[str, Any]:
    detail = httpx.get(url + "/health", timeout=10).json()["model_details"]["demo"]
    return detail["kv_cache"]


def _wait(predicate: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def _metric(url: str, name: str, tier: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f'{name}{{model="demo",tier="{tier}"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} for tier {tier} missing")


def test_a_restarted_server_resumes_from_disk_with_the_cold_runs_output(
        tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    config = _config(kv)
    first: ServerProcess = start_server(tmp_path, config=config)
    try:
        cold, usage, profile = _turn(first.url)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        prompt_tokens = usage["prompt_tokens"]
        hot, usage, profile = _turn(first.url)
        assert hot == cold  # greedy, from RAM
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached == prompt_tokens - 1  # all of it but the token that gives logits
        assert profile["cached_ram_tokens"] == cached and profile["cached_disk_tokens"] == 0
        assert _metric(first.url, "afmd_kv_cache_hits_total", "ram") >= cached // BLOCK
        assert _metric(first.url, "afmd_kv_cache_misses_total", "ram") > 0
        tiers = _wait(lambda: (d := _kv_detail(first.url))["disk_bytes"] > 0 and d)
        assert tiers and tiers["ram_bytes"] > 0
        assert _metric(first.url, "afmd_kv_cache_bytes", "disk") == tiers["disk_bytes"]
    finally:
        assert first.stop() == 0
    second = start_server(tmp_path, config=config)
    try:
        restarted, usage, profile = _turn(second.url)
        assert restarted == cold  # greedy, from disk after a restart
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        # The whole blocks from disk; what follows the last of them, from RAM after that.
        assert prompt_tokens - BLOCK <= cached < prompt_tokens
        assert profile["cached_disk_tokens"] == cached and profile["cached_ram_tokens"] == 0
        assert _metric(second.url, "afmd_kv_cache_hits_total", "disk") == cached // BLOCK
        again, usage, profile = _turn(second.url)
        assert again == cold and profile["cached_ram_tokens"] == prompt_tokens - 1
        # Anthropic's and the Responses API's counts come from the same cache.
        body = {"model": "demo", "max_tokens": 8, "temperature": 0,
                "system": CONVERSATION[0]["content"], "messages": CONVERSATION[1:]}
        for _ in range(2):
            r = httpx.post(second.url + "/v1/messages", json=body, timeout=60)
        assert r.json()["usage"]["cache_read_input_tokens"] >= BLOCK
        # afmd cache clear, through the running server.
        done = subprocess.run(
            [sys.executable, "-m", "afmd", "cache", "clear", "--model", "demo", "--url",
             second.url, "--json"], capture_output=True, text=True, timeout=60,
            env={**os.environ, "AFMD_CONFIG": ""}, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert '"disk_bytes"' in done.stdout
        assert _kv_detail(second.url) == {"ram_bytes": 0, "disk_bytes": 0,
                                          "disk_writing": True}
        assert not list(kv.rglob(f"*{layout.SUFFIX}"))
        _, usage, _ = _turn(second.url)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        second.stop()


def test_the_next_turn_after_a_restart_resumes_from_all_of_the_previous_turn(
        tmp_path: Path) -> None:
    """An agent's next turn starts with the whole previous turn and its answer: after a
    restart its whole blocks and the previous turn's tail come from disk, and the answer
    is the cold run's."""
    config = _config(tmp_path / "kv")
    first = start_server(tmp_path, config=config)
    try:
        answer, usage, _ = _turn(first.url)
        previous = usage["prompt_tokens"] + usage["completion_tokens"]
    finally:
        assert first.stop() == 0
    following = [*CONVERSATION, {"role": "assistant", "content": answer},
                 {"role": "user", "content": "Thanks. Now run the tests."}]
    second = start_server(tmp_path, config=config)
    try:
        text, usage, profile = _turn(second.url, following)
        assert usage["prompt_tokens_details"]["cached_tokens"] == previous
        assert profile["cached_disk_tokens"] == previous
    finally:
        second.stop()
    cold = start_server(tmp_path, config="[cache]\nprompt_cache_bytes = 0\n")
    try:
        expected, usage, _ = _turn(cold.url, following)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0 and text == expected
    finally:
        cold.stop()


def test_cache_clear_without_a_server_empties_the_folder(tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    folder = kv / "abc"
    folder.mkdir(parents=True)
    (folder / f"{'00' * 32}{layout.SUFFIX}").write_bytes(b"x" * 100)
    config = tmp_path / "afmd.toml"
    config.write_text(_config(kv))
    done = subprocess.run(
        [sys.executable, "-m", "afmd", "cache", "clear", "--config", str(config), "--url",
         "http://127.0.0.1:9", "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert '"disk_bytes": 100' in done.stdout
    assert not list(kv.rglob(f"*{layout.SUFFIX}"))


def _disk_metrics(url: str) -> dict[tuple[str, str], float]:
    """The disk tier's own series: ``(name, reason)`` (``""`` for the gauge) -> value."""
    found = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("afmd_kv_cache_disk_"):
            series, value = line.rsplit(" ", 1)
            name, _, labels = series.partition("{")
            found[name, labels.removeprefix('reason="').removesuffix('"}')] = float(value)
    return found


def _chat(url: str, topic: str, length: int = 12, **extra: Any) -> dict[str, Any]:
    """A conversation of its own (no block shared with another topic's)."""
    r = httpx.post(url + CHAT, timeout=120, headers={"X-AFM-Profile": "true"}, json={
        "model": "demo", "max_tokens": 8, "temperature": 0, **extra,
        "messages": [{"role": "system", "content": f"You write about {topic}. " * length},
                     {"role": "user", "content": f"Tell me about {topic}."}]})
    assert r.status_code == 200, r.text
    return r.json()


def _settled(kv: Path) -> list[Path]:
    """The block files once the writer has stopped adding them."""
    seen: list[Path] = []

    def same() -> bool:
        nonlocal seen
        now = sorted(kv.rglob(f"*{layout.SUFFIX}"))
        steady, seen = bool(now) and now == seen, now
        return steady

    assert _wait(lambda: time.sleep(0.3) or same()), seen
    return seen


def test_metrics_count_the_files_the_disk_tier_refused(tmp_path: Path) -> None:
    """Only the log said that a block file was corrupt (once): ``/metrics`` counts the
    refusals by reason, every reason from 0, and says that the tier writes."""
    kv = tmp_path / "kv"
    server = start_server(tmp_path, config=_config(kv))
    try:
        metrics = _disk_metrics(server.url)
        for name, reasons in (
                ("afmd_kv_cache_disk_rejected_total", disk_counts.REJECTED),
                ("afmd_kv_cache_disk_write_failures_total", disk_counts.WRITE_FAILURES),
                ("afmd_kv_cache_disk_dropped_total", disk_counts.DROPPED)):
            assert {r: metrics[name, r] for r in reasons} == dict.fromkeys(reasons, 0), name
        assert metrics["afmd_kv_cache_disk_writing", ""] == 1
        cold = _chat(server.url, "tides", keep_alive=0)  # unloaded after: RAM emptied
        files = _settled(kv)
        for path in files:
            data = bytearray(path.read_bytes())
            data[-5] ^= 0x20
            path.write_bytes(bytes(data))
        again = _chat(server.url, "tides")  # loaded again: every block read from disk
        assert again["choices"] == cold["choices"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        metrics = _disk_metrics(server.url)
        assert metrics["afmd_kv_cache_disk_rejected_total", "corrupt"] >= 1
        assert metrics["afmd_kv_cache_disk_rejected_total", "misfit"] == 0
        assert metrics["afmd_kv_cache_disk_writing", ""] == 1
    finally:
        server.stop()


@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="resource.prlimit is Linux's")
def test_a_server_whose_disk_fills_pauses_its_disk_tier_and_writes_again(
        tmp_path: Path) -> None:
    """A real server's writes failing for want of space (``RLIMIT_FSIZE`` set on it: each
    block write fails with EFBIG, as a full disk fails with ENOSPC): the tier stopped
    for the rest of the process, said so once in the log, and ``/metrics`` showed
    nothing. It pauses now, ``/metrics`` shows the failure and that it does not write,
    and once space is back (the limit lifted) it writes again, on its own."""
    kv = tmp_path / "kv"
    server = start_server(tmp_path, config=_config(kv))
    pid = server.proc.pid
    try:
        _chat(server.url, "tides")
        before = set(_settled(kv))
        limit = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (1024, limit[1]))  # no block fits
        try:
            _chat(server.url, "volcanoes")
            metrics = _wait(lambda: (m := _disk_metrics(server.url))[
                "afmd_kv_cache_disk_write_failures_total", "full"] >= 1 and m)
            assert metrics and metrics["afmd_kv_cache_disk_writing", ""] == 0, metrics
            assert _kv_detail(server.url)["disk_writing"] is False  # /health says so too
            _chat(server.url, "glaciers")  # paused: dropped, not tried
        finally:
            resource.prlimit(pid, resource.RLIMIT_FSIZE, limit)
        assert set(kv.rglob(f"*{layout.SUFFIX}")) == before
        time.sleep(1.2)  # the first retry comes after a second
        _chat(server.url, "deserts")
        assert _wait(lambda: _disk_metrics(server.url)["afmd_kv_cache_disk_writing", ""] == 1)
        assert _kv_detail(server.url)["disk_writing"] is True
        assert len(_settled(kv)) > len(before)
        metrics = _disk_metrics(server.url)
        assert metrics["afmd_kv_cache_disk_write_failures_total", "full"] == 1
        assert metrics["afmd_kv_cache_disk_dropped_total", "paused"] >= 1
        assert metrics["afmd_kv_cache_disk_write_failures_total", "other"] == 0
        log = server.log_text()
        assert log.count("pauses writing") == 1 and log.count("writes again") == 1, log
        assert "stops writing" not in log
    finally:
        server.stop()


@functools.cache
def _unshare() -> str | None:
    """``unshare``, where it gives a process a tmpfs of its own (a user and a mount
    namespace: no root needed, and no mount anyone else sees)."""
    tool = shutil.which("unshare")
    if tool is None or not sys.platform.startswith("linux"):
        return None
    with tempfile.TemporaryDirectory() as where:
        done = subprocess.run([tool, "-rm", "sh", "-c", 'mount -t tmpfs -o size=64k afmd "$0"',
                               where], capture_output=True, timeout=30)
    return tool if done.returncode == 0 else None


def _serve_on_a_small_disk(tmp_path: Path, size: int, free: int, cache: str
                           ) -> tuple[ServerProcess, Path]:
    """``afmd serve`` with its ``disk_dir`` on a tmpfs of ``size`` bytes of its own, filled
    but for ``free`` bytes by a file ``filler``: a small disk, really full, that no other
    process sees. Also the volume as this process reaches it (through the server's
    ``/proc/<pid>/root``)."""
    tool = _unshare()
    assert tool is not None
    volume = tmp_path / "volume"
    volume.mkdir()
    config = tmp_path / "afmd.toml"
    config.write_text(f'[cache]\ndisk_dir = "{volume / "kv"}"\n{cache}')
    script = (f'mount -t tmpfs -o size={size} afmd "$0" && '
              f'head -c {size - free} /dev/zero > "$0/filler" && exec "$@"')
    env = {**os.environ}
    env.pop("AFMD_CONFIG", None)
    proc = subprocess.Popen(
        [tool, "-rm", "sh", "-c", script, str(volume), *afmd_command(), "serve",
         "--log-format", "json", "--config", str(config), "--port", "0"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, env=env, cwd=str(tmp_path))
    server = ServerProcess(proc)
    threading.Thread(target=server._reader, daemon=True).start()
    try:
        server.wait_event("listening", timeout=60)
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    seen = Path(f"/proc/{proc.pid}/root") / volume.relative_to("/")
    if not (seen / "filler").is_file():  # not this process's to look into (ptrace rules)
        server.stop()
        pytest.skip("the server's tmpfs cannot be read from outside it")
    return server, seen


def _free(volume: Path) -> int:
    st = os.statvfs(volume)
    return st.f_bavail * st.f_frsize


@pytest.mark.skipif(_unshare() is None, reason="no tmpfs of its own (unshare -rm)")
def test_a_really_full_disk_pauses_the_disk_tier_until_space_returns(tmp_path: Path) -> None:
    """A disk with no room for one block (ENOSPC on a real file system): the tier stopped
    for the rest of the process. It pauses now, and writes again once space is back."""
    server, volume = _serve_on_a_small_disk(tmp_path, 1 << 20, 4096,  # models.json fits
                                            f"block_tokens = {BLOCK}\ndisk_min_free = 0\n")
    try:
        _chat(server.url, "tides")
        metrics = _wait(lambda: (m := _disk_metrics(server.url))[
            "afmd_kv_cache_disk_write_failures_total", "full"] >= 1 and m)
        assert metrics and metrics["afmd_kv_cache_disk_writing", ""] == 0, metrics
        assert not list(volume.rglob(f"*{layout.SUFFIX}"))
        (volume / "filler").unlink()  # the user makes room
        time.sleep(1.2)  # the first retry comes after a second
        _chat(server.url, "volcanoes")
        assert _wait(lambda: _disk_metrics(server.url)["afmd_kv_cache_disk_writing", ""] == 1)
        assert _settled(volume)
        log = server.log_text()
        assert log.count("pauses writing") == 1 and log.count("writes again") == 1, log
        assert "No space left on device" in log and "stops writing" not in log
    finally:
        server.stop()


@pytest.mark.skipif(_unshare() is None, reason="no tmpfs of its own (unshare -rm)")
def test_a_server_on_a_nearly_full_disk_keeps_the_margin_free(tmp_path: Path) -> None:
    """The probe's case: a nearly full disk, ``disk_bytes`` far above what it has free.
    The tier wrote until the disk was full (0 bytes left to the user) and stopped there.
    It keeps ``disk_min_free`` free on the volume now, deleting its own least recently
    used blocks to write new ones. Within what the file system rounds files up to, and
    what it writes between two looks at the volume (every 2 s)."""
    margin, size = 4 << 20, 8 << 20
    server, volume = _serve_on_a_small_disk(
        tmp_path, size, margin + (1 << 20), f"block_tokens = 256\ndisk_min_free = {margin}\n")
    slack = 64 << 10
    lowest = _free(volume)
    try:
        for topic in ("tides", "volcanoes", "glaciers", "deserts", "comets"):
            _chat(server.url, topic, length=200)
            lowest = min(lowest, _free(volume))
            _settled(volume)
            lowest = min(lowest, _free(volume))
        assert lowest >= margin - slack, (lowest, margin)
        metrics = _disk_metrics(server.url)
        assert metrics["afmd_kv_cache_disk_writing", ""] == 1
        assert sum(v for (name, _), v in metrics.items() if "failures" in name) == 0, metrics
        assert _metric(server.url, "afmd_kv_cache_evictions_total", "disk") > 0
        assert len(list(volume.rglob(f"*{layout.SUFFIX}"))) >= 2  # it writes on
    finally:
        server.stop()
