"""The Hugging Face hub cache as afmd reads it: which model repos are on disk, and whether
each is complete enough to serve.

The cache is shared with mlx-lm, LM Studio and every ``huggingface_hub`` user, so afmd
reads its standard layout (``models--OWNER--NAME/{refs,snapshots,blobs}``) rather than
keeping a list of its own, and a model pulled by another tool counts as present. Standard
library only: ``afmd list``, ``afmd rm`` and ``afmd doctor`` answer without importing the
hub client.

A snapshot counts as complete when it has ``config.json`` and every weight file the model
needs (those a ``model.safetensors.index.json`` names, else at least one ``*.safetensors``),
none of them a dangling link. ``afmd pull`` downloads ``config.json`` last and writes the
ref only after every file was verified, so an interrupted pull never satisfies this.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from afmd.paths import huggingface_hub_cache

#: The hub's own rule for ``OWNER/NAME``: ASCII letters, digits, ``_``, ``-`` and ``.``, each
#: part ending in a letter, digit or ``_``, no ``--`` (the cache's folder separator) or
#: ``..``, at most 96 characters a part. ``\Z``, not ``$``: ``$`` also matches before a
#: final newline, and a name goes into file paths.
REPO_ID = re.compile(
    r"^(?!.*(?:--|\.\.))"
    r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
    r"/[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?\Z"
)
#: The hub's hosts as a name may start with them: Ollama names a Hugging Face repo
#: ``hf.co/OWNER/NAME`` (``ollama pull hf.co/…``), and a repo's page is at
#: ``huggingface.co/OWNER/NAME``.
HUB_HOSTS = ("hf.co/", "huggingface.co/")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_PREFIX = "models--"


@dataclass(frozen=True, slots=True)
class CachedRepo:
    """One model repo in the cache and the snapshot afmd would serve from it."""

    repo: str
    folder: Path  # models--OWNER--NAME
    snapshot: Path | None
    missing: tuple[str, ...]  # what the snapshot lacks to be served (empty: complete)
    size_bytes: int

    @property
    def complete(self) -> bool:
        return self.snapshot is not None and not self.missing


def repo_folder(repo: str, cache: Path | None = None) -> Path:
    return (cache or huggingface_hub_cache()) / (_PREFIX + repo.replace("/", "--"))


def snapshot_of(folder: Path, revision: str = "main") -> Path | None:
    """The snapshot ``revision`` names (a ref or a commit), else the newest one there is."""
    snapshots = folder / "snapshots"
    if _COMMIT.match(revision) and (snapshots / revision).is_dir():
        return snapshots / revision
    try:
        ref = (folder / "refs" / revision).read_text(encoding="utf-8").strip()
    except OSError:
        ref = ""
    if ref and (snapshots / ref).is_dir():
        return snapshots / ref
    try:
        found = sorted((p for p in snapshots.iterdir() if p.is_dir()),
                       key=lambda p: p.stat().st_mtime)
    except OSError:
        return None
    return found[-1] if found else None


def missing_files(snapshot: Path) -> tuple[str, ...]:
    """What an MLX model folder lacks to be loaded: config.json, its weights."""
    missing = [] if (snapshot / "config.json").is_file() else ["config.json"]
    index = snapshot / "model.safetensors.index.json"
    weights: list[str] = []
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
            weights = sorted(set(weight_map.values()))
            if not all(isinstance(w, str) and w for w in weights):
                raise ValueError("a weight file that is not a name")
        except (OSError, ValueError, AttributeError, TypeError):
            weights = []
            missing.append("model.safetensors.index.json (unreadable)")
    if weights:
        missing += [w for w in weights if not (snapshot / w).is_file()]
    elif not index.is_file() and not any(p.is_file() for p in snapshot.glob("*.safetensors")):
        missing.append("*.safetensors")
    return tuple(missing)


def snapshot_size(snapshot: Path) -> int:
    """Bytes of the files the snapshot links to (each blob once)."""
    seen: set[Path] = set()
    total = 0
    for path in snapshot.rglob("*"):
        try:
            real = path.resolve()
            if real in seen or not real.is_file():
                continue
            seen.add(real)
            total += real.stat().st_size
        except OSError:
            continue
    return total


def without_hub_host(name: str) -> str:
    """``hf.co/OWNER/NAME`` (Ollama's name for a hub repo, its host in any case, as
    Ollama compares hosts) as the repo id ``OWNER/NAME``; any other name as it is
    (``hf.co/NAME`` too: that is a repo id, an owner ``hf.co``'s)."""
    for host in HUB_HOSTS:
        rest = name[len(host):]
        if name[:len(host)].lower() == host and "/" in rest:
            return rest
    return name


#: Ollama's default tag, which its users and clients add to a name that has none.
LATEST_TAG = ":latest"


def plain_name(name: str) -> str:
    """A model name as Ollama's users write it (``hf.co/OWNER/NAME:latest``,
    ``demo:latest``) as afmd knows it: without the hub host and the default tag. The
    commands take what the server's routes take, so a name copied from Ollama's docs or
    from ``/api/tags`` works in both."""
    return without_hub_host(name.removesuffix(LATEST_TAG))


def _repo_id(folder: Path) -> str | None:
    name = folder.name[len(_PREFIX):]
    owner, sep, rest = name.partition("--")
    repo = f"{owner}/{rest}" if sep else name
    return repo if REPO_ID.match(repo) else None


def inspect(repo: str, revision: str = "main", cache: Path | None = None) -> CachedRepo | None:
    """The repo's state in the cache (None: nothing of it is there). A repo removed while
    it is read (a delete beside this one, ``afmd rm``) is not there: walking its folder as
    it went raised FileNotFoundError, and the request that read it was a 500."""
    folder = repo_folder(repo, cache)
    if not folder.is_dir():
        return None
    try:
        snapshot = snapshot_of(folder, revision)
        if snapshot is None:
            return CachedRepo(repo, folder, None, ("a snapshot",), 0)
        return CachedRepo(repo, folder, snapshot, missing_files(snapshot),
                          snapshot_size(snapshot))
    except FileNotFoundError:
        if folder.is_dir():
            raise
        return None


def cached_repos(cache: Path | None = None) -> Iterator[CachedRepo]:
    """Every model repo in the cache, complete or not, by name."""
    root = cache or huggingface_hub_cache()
    try:
        folders = sorted(p for p in root.iterdir() if p.name.startswith(_PREFIX) and p.is_dir())
    except OSError:
        return
    for folder in folders:
        repo = _repo_id(folder)
        if repo is not None:
            found = inspect(repo, cache=root)
            if found is not None:
                yield found


def complete_snapshot(repo: str, cache: Path | None = None) -> Path | None:
    """The repo's servable snapshot, if the cache holds one."""
    found = inspect(repo, cache=cache)
    return found.snapshot if found is not None and found.complete else None


def remove(repo: str, cache: Path | None = None) -> int | None:
    """Delete every revision of ``repo`` (and its download locks); the bytes freed, None
    when it was not there (another removal took it first). A repo folder that is a link
    (moved to another disk) loses the link only: nothing outside the cache is deleted."""
    taken = take_out(repo, cache)
    return None if taken is None else taken.delete()


@dataclass(frozen=True, slots=True)
class TakenOut:
    """A repo out of the cache's view, its files still to delete (:meth:`delete`)."""

    folder: Path | None  # None: the repo's folder was a link, and the link is gone
    locks: Path

    def delete(self) -> int:
        """Delete what was taken out; the bytes freed."""
        freed = 0
        if self.folder is not None:
            freed = stored_bytes(self.folder)
            shutil.rmtree(self.folder, ignore_errors=False)
        shutil.rmtree(self.locks, ignore_errors=True)
        return freed


def take_out(repo: str, cache: Path | None = None) -> TakenOut | None:
    """Take ``repo`` out of the cache's view at once (one rename, or a link unlinked);
    None when it was not there.

    Only one of several removals at once (two requests, the server and ``afmd rm``) can
    rename the folder: the others find nothing, where each went into the same tree and
    found it vanishing under it. And a caller that has just checked that nothing uses the
    repo (the server, on its event loop) takes it out in the same step, so no load can
    start on files about to go; the deleting itself can then wait for a thread."""
    root = cache or huggingface_hub_cache()
    folder = repo_folder(repo, root)
    locks = root / ".locks" / folder.name
    if folder.is_symlink():
        try:
            folder.unlink()
        except FileNotFoundError:
            return None
        return TakenOut(None, locks)
    doomed = root / f".{folder.name}.deleting-{uuid.uuid4().hex}"
    try:
        folder.rename(doomed)
    except FileNotFoundError:
        return None
    return TakenOut(doomed, locks)


def stored_bytes(folder: Path) -> int:
    """What deleting a repo's folder frees: its files, not the links between them (a
    snapshot links to blobs), nothing for a folder that is itself a link."""
    if folder.is_symlink():
        return 0
    total = 0
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            path = Path(dirpath) / name
            if not path.is_symlink():
                with contextlib.suppress(OSError):
                    total += path.stat().st_size
    return total


def human_bytes(n: float) -> str:
    """``1.5 GB``: sizes as people read them (powers of 1024, one decimal)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"  # pragma: no cover
