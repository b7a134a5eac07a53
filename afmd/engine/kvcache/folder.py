"""The disk tier's layout, readable without MLX (the CLI clears it with no model loaded).

``<disk_dir>/<model identity>/<block key>.kvb``, one folder per model identity (a tail,
fewer tokens than a block after the block ``before``, is
``<before>_<tokens>_<tail key>.kvb``: its name says which block it follows and how long it
is, so that it is found without reading it), with a
``models.json`` naming the model ids that wrote there (so ``afmd cache clear --model ID``
finds a model's folder without loading it). Files being written are ``.tmp-*`` names in
the same folder, renamed into place only when complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path

from afmd.paths import cache_dir

SUFFIX = ".kvb"
TEMP_PREFIX = ".tmp-"
NAMES = "models.json"
#: Where a running server takes ``afmd cache clear`` (:mod:`afmd.http.routes.cache_routes`);
#: here because the CLI must know it without importing the HTTP edge (Sanic).
CLEAR_PATH = "/afmd/cache/clear"


def temp_name(name: str) -> str:
    """A temporary name for writing ``name``: unique across the processes sharing the
    folder. The process id alone is not: two containers sharing a volume both run afmd
    as pid 1, and both write a shared prefix's blocks at once."""
    return f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{name}"


def default_disk_dir() -> Path:
    return cache_dir() / "kv"


def resolve(disk_dir: str) -> Path:
    """``[cache] disk_dir``, ``""`` meaning the default under afmd's cache folder."""
    return Path(disk_dir).expanduser() if disk_dir else default_disk_dir()


def model_folder(root: Path, identity: bytes) -> Path:
    return root / identity.hex()[:32]


def block_path(folder: Path, key: bytes) -> Path:
    return folder / (key.hex() + SUFFIX)


def tail_path(folder: Path, before: bytes, length: int, key: bytes) -> Path:
    return folder / f"{before.hex()}_{length}_{key.hex()}{SUFFIX}"


def parse_tail(name: str) -> tuple[bytes, int, bytes] | None:
    """``(before, length, key)`` of a tail file's name; ``None`` for any other name."""
    parts = name[: -len(SUFFIX)].split("_") if name.endswith(SUFFIX) else []
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    try:
        return bytes.fromhex(parts[0]), int(parts[1]), bytes.fromhex(parts[2])
    except ValueError:
        return None


def names(folder: Path) -> list[str]:
    try:
        found = json.loads((folder / NAMES).read_text())
    except (OSError, ValueError):
        return []
    return [n for n in found if isinstance(n, str)] if isinstance(found, list) else []


def add_name(folder: Path, name: str) -> None:
    """Record that model ``name`` uses ``folder`` (atomic, like every file here)."""
    known = names(folder)
    if name in known:
        return
    temp = folder / temp_name(NAMES)
    temp.write_text(json.dumps([*known, name]))
    os.replace(temp, folder / NAMES)


def model_folders(root: Path, model: str | None = None) -> list[Path]:
    """The model folders under ``root`` (only those ``model`` wrote to, if given)."""
    try:
        folders = [p for p in root.iterdir() if p.is_dir()]
    except OSError:
        return []
    return [p for p in folders if model is None or model in names(p)]


def entries(folder: Path) -> list[Path]:
    """What ``folder`` holds; nothing when it cannot be listed (another user's model
    folder in a shared ``disk_dir``: raised, it failed ``afmd cache clear`` and the
    server's clear with it)."""
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def clear(root: Path, model: str | None = None) -> tuple[int, int]:
    """Delete the block files under ``root`` (a model's only, if given): (files, bytes)."""
    files = size = 0
    for folder in model_folders(root, model):
        for path in entries(folder):
            if path.name.endswith(SUFFIX):
                try:
                    n = path.stat().st_size
                    path.unlink()
                except OSError:
                    continue
                files += 1
                size += n
    return files, size


def held_bytes(root: Path, model: str | None = None) -> int:
    total = 0
    for folder in model_folders(root, model):
        for path in entries(folder):
            if path.name.endswith(SUFFIX):
                with contextlib.suppress(OSError):
                    total += path.stat().st_size
    return total
