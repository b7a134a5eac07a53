"""The demo models' cache folders: built privately, published whole by an atomic rename.

Every demo variant (the text ones of :mod:`afmd.engine.demo.builtin`, the vision one of
:mod:`afmd.engine.demo.vision_demo`) lives in ``<cache>/models/<variant>-<fingerprint>``. A
folder only ever appears by the rename of a complete build, so concurrent callers
(threads or processes) each build privately and whoever renames second simply adopts
the winner's identical folder; builds a killed process left behind are swept up later.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Stale temporary build folders (from a killed process) older than this are removed.
_STALE_TMP_S = 3600.0


def place(target: Path, build: Callable[[Path], None], files: Sequence[str]) -> Path:
    """``target``, built by ``build`` (into a private folder) unless it already holds
    every one of ``files``."""
    if is_complete(target, files):
        return target
    models_dir = target.parent
    models_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(models_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=models_dir))
    try:
        build(tmp)
        for name in files:
            _fsync(tmp / name)
        for _ in range(3):
            try:
                os.rename(tmp, target)
                return target
            except OSError:
                if is_complete(target, files):
                    return target  # Lost a race to an identical build.
                if target.exists():
                    _discard(target, models_dir)  # Damaged (files deleted by hand).
        raise OSError(f"could not place the demo model at {target}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def is_complete(folder: Path, files: Sequence[str]) -> bool:
    return all((folder / name).is_file() for name in files)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """A model folder's JSON file, written the same way for every variant (its bytes are
    part of what the fingerprint names)."""
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _fsync(path: Path) -> None:
    """Flush before the rename publishes the folder, so a crash cannot leave it truncated."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _discard(folder: Path, models_dir: Path) -> None:
    """Move a folder aside atomically before deleting it, so it never looks half-gone."""
    trash = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=models_dir))
    with contextlib.suppress(OSError):
        os.rename(folder, trash / "old")
    shutil.rmtree(trash, ignore_errors=True)


def _remove_stale_builds(models_dir: Path) -> None:
    """Delete temporary folders left by killed builds; recent ones may be in progress."""
    cutoff = time.time() - _STALE_TMP_S
    for entry in models_dir.glob(".*.tmp-*"):
        try:
            if entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            pass
