"""afmd.hub.hub_compat: the one module that reads huggingface_hub's private cache layout.

First the upgrade alarm (the functions that name, delete and lock a download's partial file
must read as they did in the version compat names), then what compat deletes: the partial
files of downloads that are over, never the one a running download writes.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub.utils import WeakFileLock

from afmd.hub import hub_compat

ETAG = "ab" * 32


def test_upstream_is_what_compat_was_written_against() -> None:
    problems = hub_compat.upstream_problems()
    assert not problems, (
        "huggingface_hub changed under afmd/hub/hub_compat.py (written against "
        f"huggingface_hub {hub_compat.HUB_VERSION}): re-read each of these upstream (what an "
        "interrupted download leaves in blobs/, and the lock it holds), adapt compat, then "
        "update its fingerprints:\n  " + "\n  ".join(problems))


def _cache(tmp_path: Path) -> tuple[Path, Path, Path]:
    cache = tmp_path / "hub"
    folder = cache / "models--o--r"
    (folder / "blobs").mkdir(parents=True)
    (cache / ".locks" / folder.name).mkdir(parents=True)
    left = folder / "blobs" / f"{ETAG}.0123abcd.incomplete"
    left.write_bytes(b"x" * 10)
    return cache, folder, left


def test_leftovers_are_deleted_and_nothing_else(tmp_path: Path) -> None:
    cache, folder, left = _cache(tmp_path)
    blob = folder / "blobs" / ETAG
    other = folder / "blobs" / f"{'cd' * 32}.0123abcd.incomplete"
    for kept in (blob, other):
        kept.write_bytes(b"kept")
    assert hub_compat.discard_leftovers(cache, folder, ETAG) == 10
    assert not left.exists() and blob.exists() and other.exists()


def test_a_running_download_keeps_its_file(tmp_path: Path) -> None:
    """The hub client holds the blob's lock while it writes: its file is not left over."""
    cache, folder, left = _cache(tmp_path)
    with WeakFileLock(cache / ".locks" / folder.name / f"{ETAG}.lock"):
        assert hub_compat.discard_leftovers(cache, folder, ETAG) is None
    assert left.exists()
