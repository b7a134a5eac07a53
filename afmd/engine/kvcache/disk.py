"""The disk tier: blocks written behind the decode path, read back on a hit (also after a
restart), least recently used deleted first, by bytes.

Never wrong: each file carries its layout version, the model identity, its key and a
sha256 of the rest; a file that does not match on every count (torn, corrupt, another
model's, another layout's) is deleted on read and its block recomputed. Files are written
under a temporary name and renamed into place (``os.replace``), so a killed process never
leaves a file that is later read. A step never waits on the disk: the generation thread
only queues a block (dropped when the queue is full); one writer thread per folder
writes. A folder that cannot be created or written is logged once and the tier stops
writing; RAM serves on.

Never the disk's last bytes: besides ``disk_bytes`` the tier leaves ``disk_min_free`` free
on its volume, deleting its own least recently used blocks to make room for new ones (and,
while idle, to give back what others took). A full disk all the same (another process, a
quota) pauses writing: the tier deletes its oldest blocks to get back above the margin,
retries after a delay that doubles up to a cap, and writes again once a block fits; logged
once an episode. ``/metrics`` counts what it refused, failed and dropped
(:mod:`.disk_counts`).

One :class:`DiskStore` per folder per process, shared by the models it serves, so that
``disk_bytes`` bounds the whole folder as this process knows it. Several processes may
share a folder (each reads what the others wrote: a read looks at the file, not only at
this process's index); each keeps its own index, and bound, and checks it against the
folder when a file it indexed turns out gone.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import queue
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from afmd.engine.kvcache import disk_counts
from afmd.engine.kvcache import folder as layout
from afmd.engine.kvcache.kv_compat import LayerShape
from afmd.engine.kvcache.ram import Block

log = logging.getLogger("afmd.kvcache")

MAGIC = b"AFMDKVB\x00"
#: The file layout; a file of another layout is another afmd's and is deleted, not read.
LAYOUT = 1
_QUEUE = 64
#: A temporary file older than this belongs to a writer that died.
_STALE_TEMP_S = 600.0
#: What a block file holds besides its arrays, at most (magic, sizes, checksum, header).
_HEADER_ROOM = 1 << 20
#: How often a folder whose indexed blocks are stored again is checked against the disk.
_VERIFY_S = 60.0
#: Rename failures about one block's names, not the folder or the disk (DiskStore._write).
_THIS_BLOCK_ONLY = frozenset({errno.ENOENT, errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST})
#: Write failures for want of space (a full disk, a quota, a file size limit): the tier
#: pauses and retries. Taken for good, one full disk stopped it for the process's life.
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
#: Write failures that no waiting mends (a read-only or another user's folder): it stops.
_DENIED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
#: The free space left on the volume when ``disk_min_free`` is not set: the larger of a floor
#: and a share of the volume (see docs/kv-cache.md, "Free space").
MIN_FREE_FLOOR = 2 << 30
MIN_FREE_SHARE = 0.05
#: The volume's free space is read at most this often while writing. Between two reads
#: what the tier holds plus what is free stays the same whatever it writes or deletes, so
#: only what others did since is seen late.
_PROBE_S = 2.0
#: An idle writer checks the margin this often: space others took is given back unasked.
_IDLE_S = 30.0
#: After a full disk, writing waits this long, twice as long after each failed retry, up to
#: the cap: a disk that stays full costs one failed block a minute at most.
_BACKOFF_S = 1.0
_BACKOFF_MAX_S = 60.0


def free_space(path: Path) -> tuple[int, int]:
    """``(bytes free to this user, bytes in all)`` of the volume holding ``path``: the
    tier's one look at the volume (tests replace it with a volume of their own)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def write_file(path: Path, parts: list[bytes | memoryview]) -> None:
    """Write a new file: the tier's one write (tests replace it with a full disk)."""
    with open(path, "wb") as f:
        for part in parts:
            f.write(part)


def margin_of(min_free: int | None, volume: int) -> int:
    """The free space to leave on a volume of ``volume`` bytes: ``min_free``, or when it is
    not set the larger of 2 GiB and 5 % of the volume."""
    if min_free is not None:
        return min_free
    return max(MIN_FREE_FLOOR, int(volume * MIN_FREE_SHARE))


class NotThisBlock(ValueError):
    """A file under a block's name that is not the block asked for; ``reason`` is its
    ``/metrics`` label (:data:`disk_counts.REJECTED`)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _dtype(name: str) -> mx.Dtype:
    dtype = getattr(mx, name.rsplit(".", 1)[-1], None)
    if not isinstance(dtype, mx.Dtype):
        raise ValueError(f"unknown dtype {name}")
    return dtype


def raw_views(block: Block) -> list[mx.array]:
    """A block's arrays as bytes, evaluated: made on the generation thread, so that the
    writer thread only reads finished buffers and never runs MLX work of its own."""
    raws = [a.view(mx.uint8) for pair in block.layers for a in pair]
    mx.eval(raws)
    return raws


def encode(key: bytes, identity: bytes, block: Block,
           raw: list[mx.array]) -> list[bytes | memoryview]:
    """A block's file contents, as parts (header, checksum, raw arrays)."""
    arrays = [a for pair in block.layers for a in pair]
    header = json.dumps({
        "layout": LAYOUT, "key": key.hex(), "identity": identity.hex(),
        "arrays": [[list(a.shape), str(a.dtype)] for a in arrays],
    }).encode()
    # MLX's stub omits the buffer protocol its arrays have.
    raws = [memoryview(r).cast("B") for r in raw]  # type: ignore[arg-type]
    digest = hashlib.sha256(header)
    for part in raws:
        digest.update(part)
    return [MAGIC, LAYOUT.to_bytes(4, "little"), len(header).to_bytes(4, "little"), header,
            digest.digest(), *raws]


def decode(data: bytes, key: bytes, identity: bytes) -> Block:
    """The block a file holds; ``ValueError`` naming why it is not the one asked for."""
    if data[:8] != MAGIC:
        raise NotThisBlock("corrupt", "not a block file")
    if int.from_bytes(data[8:12], "little") != LAYOUT:
        raise NotThisBlock("foreign", "another layout version")
    size = int.from_bytes(data[12:16], "little")
    header_raw = data[16:16 + size]
    digest = data[16 + size:48 + size]
    body = memoryview(data)[48 + size:]
    check = hashlib.sha256(header_raw)
    check.update(body)
    if check.digest() != digest:
        raise NotThisBlock("corrupt", "checksum mismatch (torn or corrupt)")
    header = json.loads(header_raw)
    if header.get("layout") != LAYOUT:
        raise NotThisBlock("foreign", "another layout version")
    if header.get("identity") != identity.hex():
        raise NotThisBlock("foreign", "another model's block")
    if header.get("key") != key.hex():
        raise NotThisBlock("foreign", "another block's key")
    arrays = []
    at = 0
    for shape, dtype_name in header["arrays"]:
        dtype = _dtype(dtype_name)
        n = int(np.prod(shape)) * dtype.size
        raw = np.frombuffer(body[at:at + n], dtype=np.uint8)
        at += n
        flat = mx.array(raw)
        arrays.append(flat.view(dtype).reshape(shape))
    if at != len(body) or len(arrays) % 2:
        raise NotThisBlock("corrupt", "size mismatch")
    mx.eval(arrays)
    return Block.of([(arrays[i], arrays[i + 1]) for i in range(0, len(arrays), 2)])


def contents(path: Path, limit: int) -> bytes:
    """A block file's bytes; ``ValueError`` when what is under its name cannot be one. Only
    a regular file of at most ``limit`` bytes is read: a FIFO under a block's name blocked
    the generation thread in ``open`` forever, a link to a device (``/dev/zero``) was read
    until memory ran out, and afmd writes no links."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotThisBlock("not_a_file", "a symbolic link, not a block file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotThisBlock("not_a_file", "not a regular file")
        if st.st_size > limit:
            raise NotThisBlock("not_a_file",
                               f"{st.st_size} bytes, more than a block can be ({limit})")
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        return f.read(st.st_size)


def misfit(block: Block, tokens: int, shapes: list[LayerShape] | None) -> str | None:
    """Why ``block`` cannot be ``tokens`` tokens of a model whose layers are ``shapes``
    (``None``: not known, only the block's own form is checked); ``None`` when it can be.

    A file's checksum says only that it is whole: one whose arrays were another length,
    another layer count, or other heads, dims or dtype than the model's (an afmd that wrote
    blocks otherwise under the same layout number, anyone's file) resumed a row from them,
    and it answered wrongly or failed every batch it joined, the file staying to fail the
    next."""
    if not block.layers:
        return "no layers"
    if shapes is not None and len(block.layers) != len(shapes):
        return f"{len(block.layers)} layers, the model has {len(shapes)}"
    for i, pair in enumerate(block.layers):
        for j, array in enumerate(pair):
            form = tuple(array.shape)
            if len(form) != 4 or form[0] != 1 or form[2] != tokens:
                return f"layer {i}: shape {form} for {tokens} tokens"
            if shapes is not None and (form[1], form[3], array.dtype) != shapes[i][j]:
                heads, dim, dtype = shapes[i][j]
                return (f"layer {i}: {form[1]} heads of {form[3]} {array.dtype}, the model's "
                        f"are {heads} of {dim} {dtype}")
    return None


@dataclass(slots=True)
class Chain:
    """The files one finished row stores, from its head to its end (its tail last), in the
    order they are queued: a write cut short (a full queue, a killed process, a full disk)
    leaves a prefix that a lookup reaches, not an end it never can. Queued from the end to
    the head, a row of more blocks than the queue holds had its head dropped (nothing of it
    was found after a restart though most of it was on disk), and a kill mid-write left only
    ends. The writer keeps the head the most recently used all the same (DiskStore._write)."""

    paths: list[Path]
    stamp: int = field(default_factory=time.time_ns)  # the head's modification time
    stopped: bool = False  # the tier is full of its blocks: the rest are not written


@dataclass(slots=True)
class _Write:
    path: Path
    key: bytes
    identity: bytes
    block: Block
    raw: list[mx.array]
    chain: Chain | None = None
    at: int = 0  # its place in the chain


#: Wakes the writer to check a folder's index against the folder (see DiskStore.read).
_RECHECK = "recheck"
#: What the writer does when nothing came for ``_IDLE_S``: check the margin.
_IDLE = "idle"

_STORES: dict[Path, DiskStore] = {}
_STORES_LOCK = threading.Lock()


def flush_every_store(timeout: float) -> bool:
    """Finish the writes queued to every folder, within ``timeout`` in all: at shutdown,
    so that the turn a client just got (its tail above all) is on disk for the next
    turn after a restart. Whether everything was written."""
    deadline = time.monotonic() + timeout
    with _STORES_LOCK:
        stores = [store for store in _STORES.values() if not store.closed]
    done = True
    for store in stores:
        done = store.flush(max(0.0, deadline - time.monotonic())) and done
    return done


class DiskStore:
    """One folder's files, their LRU order and byte total, and its writer thread."""

    @classmethod
    def at(cls, root: Path, max_bytes: int, min_free: int | None) -> DiskStore:
        with _STORES_LOCK:
            store = _STORES.get(root)
            if store is None or store.closed:
                store = _STORES[root] = cls(root, max_bytes, min_free)
            store.max_bytes = max_bytes
            store.min_free = min_free
            return store

    def __init__(self, root: Path, max_bytes: int, min_free: int | None = 0) -> None:
        """``min_free``: the free space to leave on the volume (``None``: the larger of 2 GiB
        and 5 % of it, :func:`margin_of`; 0: none, ``max_bytes`` alone bounds the tier)."""
        self.root = root
        self.max_bytes = max_bytes
        self.min_free = min_free
        self.closed = False
        self.failed: str | None = None  # why writing stopped (logged once)
        self.counts = disk_counts.new()
        # The volume as last read (DiskStore._bound): what the tier may hold, all told.
        self._room: int | None = None
        self._probed = -_PROBE_S
        # A full disk's episode (DiskStore._pause): no block queued before this time, and
        # the delay of the next retry (0: not paused).
        self._paused_until = 0.0
        self._backoff = 0.0
        self._tries = 0
        self._paused_at = 0.0
        self._read_warned = False
        self._skip_warned = False
        # Misfits that could not be deleted (a read-only folder, a directory under a block's
        # name): not read again, nor logged again, by this process.
        self._refused: set[Path] = set()
        self._lock = threading.Lock()
        self._files: OrderedDict[Path, int] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.evictions = 0
        self.writes = 0
        self.dropped = 0
        self._queue: queue.Queue[_Write | str | None] = queue.Queue(_QUEUE)
        self._pending: set[Path] = set()
        self._recheck: set[Path] = set()  # folders whose index may name files now gone
        self._checking = False
        self._swept = time.monotonic()  # the scan below sweeps stale temporary files
        self._verified: dict[Path, float] = {}  # folder -> when its index was last checked
        # (model folder, block before) -> {tail path: (length, key)}: the tails on disk.
        self._tails: dict[tuple[Path, bytes], dict[Path, tuple[int, bytes]]] = {}
        try:
            root.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as exc:
            self.trouble(exc, f"cannot use {root}")
        self._thread = threading.Thread(target=self._write_loop, name="afmd-kv-disk",
                                        daemon=True)
        self._thread.start()

    def _scan(self) -> None:
        found: list[tuple[float, Path, int]] = []
        now = time.time()
        for folder in layout.model_folders(self.root):
            try:
                entries = list(folder.iterdir())
            except OSError as exc:
                # Another user's model folder, say: not this process's to count or evict.
                # Raised out of the scan, it stopped the tier for every model.
                log.warning("KV cache folder %s skipped: %s", folder, exc)
                continue
            for path in entries:
                try:
                    st = path.lstat()
                except OSError:
                    continue
                if path.name.startswith(layout.TEMP_PREFIX):
                    if now - st.st_mtime > _STALE_TEMP_S:
                        with contextlib.suppress(OSError):
                            path.unlink()
                elif path.name.endswith(layout.SUFFIX) and stat.S_ISREG(st.st_mode):
                    found.append((st.st_mtime, path, st.st_size))
        for _, path, size in sorted(found):
            self._files[path] = size
            self.nbytes += size
            self._index_tail(path, True)
        # The bounds hold from the start (disk_bytes lowered since the files were written,
        # the disk filled up): held over them, the folder stayed so until this process
        # wrote, and forever if it only read; a disk it had filled stayed full across
        # restarts.
        self._evict_to(self._bound(fresh=True))

    def _index_tail(self, path: Path, present: bool) -> None:
        """Keep the tail index in step with a file that appeared or went (under the lock,
        or before the writer runs)."""
        tail = layout.parse_tail(path.name)
        if tail is None:
            return
        before, length, key = tail
        group = self._tails.setdefault((path.parent, before), {})
        if present:
            group[path] = (length, key)
        else:
            group.pop(path, None)
            if not group:
                self._tails.pop((path.parent, before), None)

    def tails(self, folder: Path, before: bytes) -> list[tuple[int, bytes]]:
        """``(length, key)`` of the tails on disk after block ``before``."""
        with self._lock:
            return list(self._tails.get((folder, before), {}).values())

    def fail(self, why: str) -> None:
        """Stop writing, saying why once (a folder that cannot be used)."""
        self.counts.writing = False
        if self.failed is None:
            self.failed = why
            log.warning("KV cache disk tier stops writing (serving on from RAM): %s", why)

    def trouble(self, exc: OSError, what: str) -> None:
        """A write, or making the tier's folders, failed: for want of space, pause and
        retry (:meth:`_pause`); for anything else, stop (:meth:`fail`)."""
        why = f"{what}: {type(exc).__name__}: {exc}"
        if exc.errno in _FULL:
            self.counts.failed("full")
            self._pause(why)
        else:
            self.counts.failed("denied" if exc.errno in _DENIED else "other")
            self.fail(why)

    @property
    def writing(self) -> bool:
        """Whether the tier writes: neither stopped nor paused after a full disk."""
        return self.failed is None and self._backoff == 0

    def _bound(self, fresh: bool = False) -> int:
        """The most bytes the tier may hold now: ``max_bytes``, and no more than leaves
        ``min_free`` free on its volume. The volume is read at most every ``_PROBE_S``
        (``fresh``: now): what the tier holds plus what is free stays the same whatever it
        writes or deletes itself, so the room found then holds until others write. A volume
        that cannot be read bounds nothing."""
        if self.min_free == 0:
            return self.max_bytes
        now = time.monotonic()
        if fresh or now - self._probed >= _PROBE_S:
            self._probed = now
            try:
                free, volume = free_space(self.root)
            except OSError:
                self._room = None
            else:
                with self._lock:
                    self._room = self.nbytes + free - margin_of(self.min_free, volume)
        return self.max_bytes if self._room is None else min(self.max_bytes, self._room)

    def _evict_to(self, bound: int, keep: frozenset[Path] | set[Path] = frozenset(),
                  at_least: int = 0) -> int:
        """Delete the least recently used files but ``keep`` until the tier holds at most
        ``bound`` bytes, and ``at_least`` bytes are freed; how many were deleted."""
        victims = []
        with self._lock:
            freed = 0
            for path in list(self._files):
                if self.nbytes <= bound and freed >= at_least:
                    break
                if path in keep:
                    continue
                size = self._files.pop(path)
                self.nbytes -= size
                freed += size
                self._index_tail(path, False)
                victims.append(path)
        self._delete(victims)
        return len(victims)

    def _delete(self, victims: list[Path]) -> None:
        for path in victims:
            with contextlib.suppress(OSError):
                path.unlink()
            self.evictions += 1

    def _pause(self, why: str, evicted: int = 0) -> None:
        """No room for a block (a full disk, a quota, the margin): queue nothing for a
        while, then try again; each failed try doubles the wait, up to ``_BACKOFF_MAX_S``.
        Logged once an episode, when it starts."""
        first = self._backoff == 0
        if first:
            self._paused_at = time.monotonic()
        self._backoff = _BACKOFF_S if first else min(2 * self._backoff, _BACKOFF_MAX_S)
        self._paused_until = time.monotonic() + self._backoff
        self._probed = -_PROBE_S  # the retry reads the volume afresh
        self._tries += 1
        self.counts.writing = False
        if first:
            log.warning(
                "KV cache disk tier pauses writing (serving on; %d of its least recently used "
                "blocks deleted, it retries in %gs, then less often, up to every %gs): %s",
                evicted, self._backoff, _BACKOFF_MAX_S, why)

    def _resume(self) -> None:
        """A block written after a full disk: the episode is over."""
        if self._backoff:
            log.info("KV cache disk tier writes again (paused for %.0fs, %d tries failed)",
                     time.monotonic() - self._paused_at, self._tries)
            self._backoff = 0.0
            self._tries = 0
            self.counts.writing = self.failed is None

    def _hold_margin(self) -> None:
        """Give back, while idle, the space others took below the margin."""
        if self.failed is None and self.min_free != 0:
            self._evict_to(self._bound())

    # -- the generation thread --
    def queue(self, path: Path, key: bytes, identity: bytes, block: Block,
              chain: Chain | None = None, at: int = 0) -> bool:
        """Queue a block to write; ``False`` when it is not (already there, writing
        stopped or paused, or the queue full: a step never waits)."""
        if self.closed:
            return False
        stopped = self.failed is not None
        paused = time.monotonic() < self._paused_until
        with self._lock:
            skip = path in self._files or path in self._pending
            verify = not stopped and path in self._files and self._verify_due(path.parent)
            if not (skip or stopped or paused):
                self._pending.add(path)
        if verify:
            self._recheck_later(path.parent)
        if skip:
            return False
        if stopped or paused:
            self.counts.drop("stopped" if stopped else "paused")
            return False
        try:
            self._queue.put_nowait(_Write(path, key, identity, block, raw_views(block),
                                          chain, at))
        except queue.Full:
            with self._lock:
                self._pending.discard(path)
            self.dropped += 1
            self.counts.drop("queue_full")
            return False
        return True

    def read(self, path: Path, key: bytes, identity: bytes,
             fits: Callable[[Block], str | None] | None = None,
             limit: int | None = None) -> Block | None:
        """The block at ``path`` if it is there and is the one asked for (and ``fits``
        finds nothing wrong with it); a file that is not is deleted. A file larger than
        ``limit`` (the most such a block takes), or than the tier, is not even read."""
        if path in self._refused:
            return None
        try:
            data = contents(path, min(self.max_bytes, limit or self.max_bytes))
            block = decode(data, key, identity)
            wrong = fits(block) if fits is not None else None
            if wrong is not None:
                raise NotThisBlock("misfit", f"not this model's state: {wrong}")
        except (FileNotFoundError, NotADirectoryError):
            self._forget(path)
            self._recheck_later(path.parent)
            return None
        except OSError as exc:  # unreadable, not wrong: logged once, computed instead
            self.counts.reject("unreadable")
            if not self._read_warned:
                self._read_warned = True
                log.warning("KV cache block %s unreadable (computed instead): %s",
                            path.name, exc)
            return None
        except Exception as exc:
            # A file anyone may write: any misfit is one. A header of another shape (valid
            # JSON, a valid checksum) raised what a narrower list did not name, and the
            # file stayed to fail every later lookup.
            self.counts.reject(getattr(exc, "reason", "corrupt"))
            self._drop(path, exc)
            return None
        with self._lock:
            if path not in self._files:
                self.nbytes += len(data)
                self._index_tail(path, True)
            self._files[path] = len(data)
            self._files.move_to_end(path)
        with contextlib.suppress(OSError):
            os.utime(path)  # the LRU order survives a restart
        return block

    def _drop(self, path: Path, why: object) -> None:
        """Delete a file that is not the block asked for, saying why; one that cannot be
        deleted is not read again by this process."""
        try:
            path.unlink()
            done = "deleted"
        except FileNotFoundError:
            done = "deleted"
        except OSError as exc:
            done = f"refused (not deleted: {exc.strerror or exc})"
            self._refused.add(path)
        log.warning("KV cache block %s %s: %s", path.name, done, why)
        self._forget(path)

    def touch(self, path: Path) -> None:
        """Mark a file read before as used now (its place in the eviction order)."""
        with self._lock:
            if path not in self._files:
                return
            self._files.move_to_end(path)
        with contextlib.suppress(OSError):
            os.utime(path)

    def _verify_due(self, folder: Path) -> bool:
        """Whether to check ``folder``'s index against the disk now (under the lock): a
        block it names is held in RAM and only skipped, so its file is never read to find
        it gone. The folder emptied under a running server (``rm -rf``, a cache cleaner)
        was never written again while the conversations stayed hot: a restart found none
        of them, and ``/metrics`` counted the bytes deleted as held."""
        now = time.monotonic()
        if now - self._verified.get(folder, -_VERIFY_S) < _VERIFY_S:
            return False
        self._verified[folder] = now
        return True

    def _recheck_later(self, folder: Path) -> None:
        """A file this process indexed is gone: someone else deleted it (another process
        sharing the folder evicting, ``afmd cache clear``, a user), and likely its
        neighbours too. :meth:`queue` skips what the index names, so without a check
        a lost prefix came back one block a request; the writer checks the folder's
        index against the disk instead, off the generation thread, so that the blocks
        this request recomputes are all written again when it ends."""
        with self._lock:
            if folder in self._recheck:
                return
            self._recheck.add(folder)
        with contextlib.suppress(queue.Full):  # a busy writer checks after its next item
            self._queue.put_nowait(_RECHECK)

    def _forget(self, path: Path) -> None:
        with self._lock:
            size = self._files.pop(path, None)
            if size is not None:
                self.nbytes -= size
            self._index_tail(path, False)

    # -- the writer thread --
    def _write_loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=_IDLE_S)
            except queue.Empty:
                item = _IDLE
            if item is None:
                return
            try:
                self._check_folders()
                self._sweep()
                if item == _IDLE:
                    self._hold_margin()
                elif isinstance(item, _Write):
                    if self.failed is not None:
                        self.counts.drop("stopped")
                    elif time.monotonic() < self._paused_until:
                        self.counts.drop("paused")  # queued before the disk filled
                    else:
                        self._write(item)
            except Exception:  # never let one block stop the writer
                if isinstance(item, _Write):
                    self.counts.failed("other")
                log.exception("KV cache disk write failed")
            finally:
                if isinstance(item, _Write):
                    with self._lock:
                        self._pending.discard(item.path)

    def _sweep(self) -> None:
        """Delete the temporary files that writers which died left, every
        ``_STALE_TEMP_S``: one killed just before this process started left one too recent
        for the scan to take, and a server restarted at once after each crash (launchd's
        KeepAlive) never scanned again, one file of up to a block's size more each time."""
        now = time.monotonic()
        if now - self._swept < _STALE_TEMP_S:
            return
        self._swept = now
        cutoff = time.time() - _STALE_TEMP_S
        for folder in layout.model_folders(self.root):
            for path in layout.entries(folder):
                if path.name.startswith(layout.TEMP_PREFIX):
                    with contextlib.suppress(OSError):
                        if path.lstat().st_mtime < cutoff:
                            path.unlink()

    def _check_folders(self) -> None:
        """Forget the indexed files of the folders marked by :meth:`_recheck_later` that
        are no longer on disk."""
        with self._lock:
            folders, self._recheck = self._recheck, set()
            if not folders:
                return
            self._checking = True
            named = [path for path in self._files if path.parent in folders]
        try:
            for path in named:
                if not path.exists():
                    self._forget(path)
        finally:
            self._checking = False

    def _write(self, item: _Write) -> None:
        chain = item.chain
        if chain is not None and chain.stopped:
            return
        parts = encode(item.key, item.identity, item.block, item.raw)
        size = sum(len(p) for p in parts)
        if size > self.max_bytes:
            return
        # Never the blocks before this one of its own chain: evicting its head to hold its
        # end would leave nothing a lookup reaches.
        keep = frozenset(chain.paths[:item.at]) if chain is not None else frozenset()
        if not self._make_room(item, size, keep):
            return
        folder = item.path.parent
        temp = folder / layout.temp_name(item.path.name)
        renaming = False
        try:
            folder.mkdir(parents=True, exist_ok=True)
            write_file(temp, parts)
            renaming = True
            os.replace(temp, item.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                temp.unlink()
            if renaming and exc.errno in _THIS_BLOCK_ONLY:
                # Its temporary file deleted under it (another process's sweep, `afmd cache
                # clear`), a directory under its name: this block is not written, the next
                # ones are. Taken for the folder's failure, one stray entry stopped the tier.
                self.counts.failed("block")
                if not self._skip_warned:
                    self._skip_warned = True
                    log.warning("KV cache block %s not written (the next ones are): %s",
                                item.path.name, exc)
                return
            if exc.errno in _FULL:
                self._full(exc, item, size)
            else:
                self.trouble(exc, f"cannot write {item.path}")
            return
        self.writes += 1
        self._resume()
        if chain is not None:
            with contextlib.suppress(OSError):  # the head newest, after a restart too
                os.utime(item.path, ns=(chain.stamp - item.at, chain.stamp - item.at))
        with self._lock:
            # A read may have indexed the path meanwhile (another process wrote it first).
            self.nbytes += size - self._files.pop(item.path, 0)
            self._files[item.path] = size
            self._index_tail(item.path, True)
            if chain is not None:
                # Written head first, used head last: the blocks before this one are the
                # more recently used (a lookup reaches a block only through them).
                for path in reversed(chain.paths[:item.at]):
                    if path in self._files:
                        self._files.move_to_end(path)
        # What reads indexed meanwhile: the bounds hold after the write too.
        self._evict_to(self._bound(), keep | {item.path})

    def _make_room(self, item: _Write, size: int, keep: frozenset[Path]) -> bool:
        """Delete the least recently used files but ``keep`` until ``item``'s block fits the
        bounds once written, before writing it: the disk never goes below the margin, not
        even for the time of one write. Whether it fits; when it does not, a chain longer
        than the tier keeps the head of it that fits (its own blocks evicted from its end,
        the rest not written), and a margin that leaves no room for one block, with every
        block of the tier's gone, pauses writing (:meth:`_pause`)."""
        bound = self._bound(fresh=self._backoff > 0)  # a retry reads the volume afresh
        mine = keep | {item.path}
        with self._lock:
            old = self._files.get(item.path, 0)  # another process wrote it, and it was read
            held = sum(self._files.get(path, 0) for path in mine)
        if held - old + size <= bound:
            self._evict_to(bound - size + old, mine)
            return True
        if item.chain is not None:
            item.chain.stopped = True
        evicted = self._evict_to(bound, keep)
        victims = []
        with self._lock:
            for path in reversed(item.chain.paths[:item.at] if item.chain is not None else []):
                if self.nbytes <= bound:
                    break
                if path in self._files:
                    self.nbytes -= self._files.pop(path)
                    self._index_tail(path, False)
                    victims.append(path)
        self._delete(victims)
        if size > bound:
            self.counts.drop("no_room")
            self._pause(f"{self._free_text()}: no room for a block of {size} bytes",
                        evicted + len(victims))
        return False

    def _full(self, exc: OSError, item: _Write, size: int) -> None:
        """No space for a block (ENOSPC, EDQUOT, EFBIG): its chain stops there (what was
        written is a prefix a lookup reaches), the tier deletes its least recently used
        blocks to get back above the margin, and a block's worth at least (the volume
        may show room that a quota or its inodes do not give; not for a file size limit,
        which no deletion mends), and pauses."""
        if item.chain is not None:
            item.chain.stopped = True
        self.counts.failed("full")
        evicted = self._evict_to(self._bound(fresh=True),
                                 at_least=0 if exc.errno == errno.EFBIG else size)
        self._pause(f"cannot write {item.path}: {type(exc).__name__}: {exc}", evicted)

    def _free_text(self) -> str:
        try:
            free, volume = free_space(self.root)
        except OSError:
            return f"{self.root}'s volume cannot be read"
        return (f"{free} bytes free on {self.root}'s volume, which [cache] disk_min_free "
                f"keeps {margin_of(self.min_free, volume)} free")

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued block is written and every folder check done (tests,
        shutdown); whether they were."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending and not self._recheck and not self._checking:
                    return True
            time.sleep(0.01)
        return False

    def bytes_of(self, folder: Path) -> int:
        with self._lock:
            return sum(size for path, size in self._files.items() if path.parent == folder)

    def clear(self, folder: Path | None = None) -> int:
        """Delete the block files (of one model's ``folder``, if given); the bytes freed.
        Files other processes wrote are deleted too."""
        self._refused = {p for p in self._refused if folder is not None and p.parent != folder}
        with self._lock:
            gone = [p for p in self._files if folder is None or p.parent == folder]
            for path in gone:
                self.nbytes -= self._files.pop(path)
                self._index_tail(path, False)
        freed = 0
        for target in ([folder] if folder is not None else layout.model_folders(self.root)):
            with contextlib.suppress(OSError):
                for path in target.iterdir():
                    if path.name.endswith(layout.SUFFIX):
                        with contextlib.suppress(OSError):
                            freed += path.stat().st_size
                            path.unlink()
        return freed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.counts.open = False
            self._queue.put(None)


class DiskTier:
    """One model's view of a :class:`DiskStore`: its folder, identity and counters."""

    def __init__(self, store: DiskStore, identity: bytes, name: str,
                 shapes: Callable[[], list[LayerShape]] | None = None) -> None:
        """``shapes``: what the model's layers are made of (:func:`kv_compat.layer_shapes`),
        asked once, on the thread that reads, when a block is first read; a block that
        does not fit them is deleted, not used."""
        self.store = store
        self.identity = identity
        self.folder = layout.model_folder(store.root, identity)
        self.hits = 0
        self.misses = 0
        self._shapes = shapes
        self._known: list[LayerShape] | None = None
        if store.failed is None:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                layout.add_name(self.folder, name)
            except OSError as exc:
                store.trouble(exc, f"cannot use {self.folder}")

    @property
    def nbytes(self) -> int:
        return self.store.bytes_of(self.folder)

    def _fits(self, tokens: int) -> Callable[[Block], str | None]:
        known = self._layers()
        return lambda block: misfit(block, tokens, known)

    def _layers(self) -> list[LayerShape] | None:
        if self._known is None and self._shapes is not None:
            shapes, self._shapes = self._shapes, None
            try:
                self._known = shapes()
            except Exception:  # a lookup must not fail for it: the blocks' own form is checked
                log.exception("KV cache: the model's layers could not be read; blocks read "
                              "from disk are checked for their own form only")
        return self._known

    def _limit(self, tokens: int) -> int | None:
        """The most bytes a file of ``tokens`` tokens of this model takes (its arrays and
        a header with room to spare); ``None`` while the model's layers are not known."""
        known = self._layers()
        if known is None:
            return None
        per_token = sum(heads * dim * dtype.size for pair in known for heads, dim, dtype in pair)
        return per_token * tokens + _HEADER_ROOM

    def get(self, key: bytes, tokens: int) -> Block | None:
        """The block of ``tokens`` tokens under ``key``, if on disk and fit to use."""
        block = self.store.read(layout.block_path(self.folder, key), key, self.identity,
                                self._fits(tokens), self._limit(tokens))
        if block is None:
            self.misses += 1
        else:
            self.hits += 1
        return block

    def has(self, key: bytes) -> bool:
        return layout.block_path(self.folder, key).exists()

    def touch(self, key: bytes) -> None:
        self.store.touch(layout.block_path(self.folder, key))

    def chain(self, keys: list[bytes], tail: tuple[bytes, int, bytes] | None) -> Chain:
        """The files of a row's blocks ``keys`` and its ``tail`` (before, length, key), to
        queue head first (:class:`Chain`)."""
        paths = [layout.block_path(self.folder, key) for key in keys]
        if tail is not None:
            paths.append(layout.tail_path(self.folder, *tail))
        return Chain(paths)

    def put(self, key: bytes, block: Block, chain: Chain | None = None, at: int = 0) -> None:
        self.store.queue(layout.block_path(self.folder, key), key, self.identity, block,
                         chain, at)

    def put_tail(self, before: bytes, length: int, key: bytes, block: Block,
                 chain: Chain | None = None, at: int = 0) -> None:
        self.store.queue(layout.tail_path(self.folder, before, length, key), key,
                         self.identity, block, chain, at)

    def tails(self, before: bytes) -> list[tuple[int, bytes]]:
        return self.store.tails(self.folder, before)

    def get_tail(self, before: bytes, length: int, key: bytes) -> Block | None:
        block = self.store.read(layout.tail_path(self.folder, before, length, key), key,
                                self.identity, self._fits(length), self._limit(length))
        if block is None:
            self.misses += 1
        else:
            self.hits += 1
        return block

    def clear(self) -> int:
        return self.store.clear(self.folder)
