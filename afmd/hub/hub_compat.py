"""Every huggingface_hub internal ``afmd pull`` depends on, and nothing else.

Written against **huggingface_hub 2.4.0** (``huggingface_hub/file_download.py``). The hub
client downloads a file into ``blobs/<etag>.<8 hex>.incomplete``, a name new at every
attempt, under the lock ``.locks/<repo folder>/<etag>.lock``, then renames it to
``blobs/<etag>``. An exception in the process (a stopped pull, Ctrl-C, a network failure)
deletes that file on its way out; a process that ends without unwinding (``afmd serve``
stopped mid-pull, whose download thread does not hold the process; a killed ``afmd
pull``) leaves it behind, and no later download reads it again: it only takes disk space,
up to a whole weight file per interrupted pull. :func:`discard_leftovers` deletes those files while
no download of the same blob is running; :func:`upstream_problems` names whatever an
upgrade changed of this, and ``tests/meta/test_hub_compat.py`` fails with its list.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import re
from pathlib import Path

import huggingface_hub
from filelock import Timeout
from huggingface_hub import file_download
from huggingface_hub.utils import WeakFileLock

HUB_VERSION = "2.4.0"
#: sha256 (first 16 hex digits) of ``inspect.getsource`` of each function in that version:
#: the temporary file's name and its deletion, and the lock the download holds.
FINGERPRINTS = {
    "_download_to_tmp_and_move": "2f6f966674ce66b1",
    "_hf_hub_download_to_cache_dir": "f8d0813b271a0e8d",
}

#: How long to wait for the lock: held, it means a download of the blob is under way now,
#: and its file is no leftover.
_LOCK_WAIT_S = 0.1


def _fingerprint(name: str) -> str:
    source = inspect.getsource(getattr(file_download, name))
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def upstream_problems() -> list[str]:
    """What an upgrade of huggingface_hub changed of what this module relies on."""
    problems = []
    for name, expected in FINGERPRINTS.items():
        if not hasattr(file_download, name):
            problems.append(f"huggingface_hub.file_download.{name} is gone")
            continue
        seen = _fingerprint(name)
        if seen != expected:
            problems.append(
                f"huggingface_hub.file_download.{name} is not the one of huggingface_hub "
                f"{HUB_VERSION} (huggingface_hub {huggingface_hub.__version__} installed; "
                f"fingerprint {seen})")
    return problems


def _lock_path(cache: Path, folder: Path, etag: str) -> Path:
    return cache / ".locks" / folder.name / f"{etag}.lock"


def discard_leftovers(cache: Path, folder: Path, etag: str) -> int | None:
    """Delete the partial files interrupted downloads of blob ``etag`` of the repo at
    ``folder`` left; the bytes freed. The hub client's lock on that blob is held meanwhile,
    so no download of it starts in between; while one runs (the lock is held elsewhere),
    nothing is deleted: its file is in use, not left over, and None says so (a download
    of the blob now waits for that one)."""
    pattern = re.compile(rf"{re.escape(etag)}\.[0-9a-f]{{8}}\.incomplete")
    blobs = folder / "blobs"
    lock = _lock_path(cache, folder, etag)
    if not blobs.is_dir() or not lock.parent.is_dir():
        return 0
    freed = 0
    try:
        with WeakFileLock(lock, timeout=_LOCK_WAIT_S):
            for path in blobs.iterdir():
                if pattern.fullmatch(path.name):
                    with contextlib.suppress(FileNotFoundError):
                        size = path.stat().st_size
                        path.unlink()
                        freed += size
    except Timeout:
        return None
    return freed
