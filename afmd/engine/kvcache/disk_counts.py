"""What the disk tier tells ``/metrics`` besides its hits, misses, evictions and bytes: the
files it refused on read, the writes that failed and the blocks it did not write, each by
reason, and whether it writes now. Before these only the log said so, once.

Readable without MLX: the metrics route reads it at scrape time, in a server that may have
loaded no MLX model (and so opened no disk tier). One :class:`DiskCounts` per disk store
(a folder, in this process); the totals add up every store this process opened, closed
ones included, so a counter never goes back.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

#: Why a file under a block's name was not used: not whole or not a block file at all
#: (``corrupt``), whole but another model's, layout's or block's (``foreign``), this
#: model's block but not of its layers' form or its length (``misfit``), no regular file
#: of a block's size (``not_a_file``: a link, a FIFO, a directory, too large), or a read
#: that failed (``unreadable``: computed instead, the file left).
REJECTED = ("corrupt", "foreign", "misfit", "not_a_file", "unreadable")
#: Why a write failed: no space (``full``: ENOSPC, EDQUOT, EFBIG; the tier pauses and
#: retries), no permission (``denied``: EACCES, EPERM, EROFS; it stops), one block's names
#: only (``block``: that block skipped), anything else (``other``: it stops).
WRITE_FAILURES = ("full", "denied", "block", "other")
#: Why a block was not written: the write queue was full (``queue_full``), the free-space
#: margin left no room for it even with the tier's own blocks deleted (``no_room``), writing
#: was paused after a full disk (``paused``) or had stopped (``stopped``).
DROPPED = ("queue_full", "no_room", "paused", "stopped")


class DiskCounts:
    """One disk store's counts; added to from its writer and the generation threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rejected: Counter[str] = Counter()
        self.write_failures: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.writing = True  # neither paused after a full disk nor stopped
        self.open = True

    def reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] += 1

    def failed(self, reason: str) -> None:
        with self._lock:
            self.write_failures[reason] += 1

    def drop(self, reason: str) -> None:
        with self._lock:
            self.dropped[reason] += 1


@dataclass(frozen=True, slots=True)
class Totals:
    """Every store's counts added up; ``writing``: whether every open store writes
    (``None`` while none is open: no disk tier, or no model loaded yet)."""

    rejected: dict[str, int]
    write_failures: dict[str, int]
    dropped: dict[str, int]
    writing: bool | None


_ALL: list[DiskCounts] = []
_ALL_LOCK = threading.Lock()


def new() -> DiskCounts:
    """A new store's counts, added to the totals."""
    counts = DiskCounts()
    with _ALL_LOCK:
        _ALL.append(counts)
    return counts


def totals() -> Totals:
    with _ALL_LOCK:
        every = list(_ALL)
    rejected, failures, dropped = (dict.fromkeys(names, 0)
                                   for names in (REJECTED, WRITE_FAILURES, DROPPED))
    for counts in every:
        with counts._lock:
            for total, counted in ((rejected, counts.rejected),
                                   (failures, counts.write_failures),
                                   (dropped, counts.dropped)):
                for reason, n in counted.items():
                    total[reason] = total.get(reason, 0) + n
    open_ = [counts.writing for counts in every if counts.open]
    return Totals(rejected, failures, dropped, all(open_) if open_ else None)
