"""A store's entries on disk (``[responses] persist``): one JSON file an entry, so that a
restart keeps the stored responses and the conversations.

Files are written by one thread per store, in the order of the changes, so that the event
loop never waits for a disk and a later state of an entry never lands before an earlier
one. Each is written whole: into a temporary file renamed over the old, so that a crash or
a full disk leaves the previous file or none, never part of one. Reading back at start
takes only what a store could have written. The names come from the store's own ids (a
prefix and hex digits, made by afmd), never from a client.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from afmd.logs import get_logger

log = get_logger("afmd.responses")


class EntryFiles:
    """The folder of one store: ``{id}.json`` an entry."""

    def __init__(self, folder: Path, what: str) -> None:
        """``what``: the entries' name in thread names and log lines (``response``)."""
        self.folder = folder
        self.what = what
        self._writer = ThreadPoolExecutor(1, f"afmd-{what}s")

    def write(self, entry_id: str, data: bytes | Callable[[], bytes]) -> None:
        """Write the entry's file, on the writer thread: ``data`` itself, or what it
        returns there (an entry that is large to serialize is serialized off the loop)."""
        self._writer.submit(self._write, entry_id, data)

    def remove(self, entry_id: str) -> None:
        self._writer.submit(self._unlink, entry_id)

    def close(self) -> None:
        """Finish the pending writes (at shutdown)."""
        self._writer.shutdown(wait=True)

    def stored(self, prefix: str) -> Iterator[Path]:
        """The files of entries whose ids begin with ``prefix``, as a previous run left
        them."""
        return iter(self.folder.glob(f"{prefix}*.json") if self.folder.is_dir() else ())

    def _path(self, entry_id: str) -> Path:
        return self.folder / f"{entry_id}.json"

    def _write(self, entry_id: str, data: bytes | Callable[[], bytes]) -> None:
        path = self._path(entry_id)
        tmp = path.with_suffix(".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data if isinstance(data, bytes) else data())
            os.replace(tmp, path)
        except OSError as exc:
            # A full disk leaves part of a file: one per entry would pile up unseen.
            with contextlib.suppress(OSError):
                tmp.unlink()
            log.warning(f"{self.what} not persisted", id=entry_id, error=str(exc))

    def _unlink(self, entry_id: str) -> None:
        with contextlib.suppress(OSError):
            self._path(entry_id).unlink()


def read_entry_file(path: Path, max_bytes: int, bound: str) -> bytes:
    """A file's bytes, if it is a file a store could have written: reading a FIFO waits
    for a writer forever (the server never starts), a device such as ``/dev/zero`` never
    ends, and a file larger than the whole bound (``max_bytes``, named ``bound``) would
    be dropped once read."""
    with open(path, "rb", opener=_nonblocking) as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if max_bytes and info.st_size > max_bytes:
            raise ValueError(f"{info.st_size} bytes, more than {bound}")
        return file.read()


def _nonblocking(path: str, flags: int) -> int:
    """Opening a FIFO for reading blocks until a writer comes; non-blocking, it does not
    (and a regular file reads the same either way)."""
    return os.open(path, flags | os.O_NONBLOCK)
