"""``afmd pull``: an MLX model from the Hugging Face hub into the standard hub cache.

The download itself is ``huggingface_hub``'s (what mlx-lm uses, so mlx-lm, LM Studio and
afmd share one cache and one copy): it resumes a cut connection with ``Range`` and keeps
every finished file, so a pull run again after an interruption fetches only what is
missing. What afmd adds:

* the repo is refused before any download unless it is an MLX model (``config.json`` and
  safetensors weights);
* one progress bar per file (:mod:`afmd.hub.progress`);
* integrity: the hub client checks no hash, so afmd hashes every file against the hub's
  tree (sha256 for LFS files, the git blob id for the others) and deletes a file that
  does not match;
* "present" means complete: files are fetched at the commit the revision resolved to,
  ``config.json`` last, and the ref (``refs/main``) is written only once every file was
  verified (:mod:`afmd.hub.cache` reads that state).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import hashlib
import os
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from afmd.hub.cache import REPO_ID, human_bytes, repo_folder
from afmd.hub.progress import bar_class
from afmd.paths import huggingface_hub_cache

#: mlx-lm's own download patterns (``mlx_lm.utils.DEFAULT_ALLOW_PATTERNS``): afmd fetches
#: exactly what a load of the repo would, and nothing it would not.
ALLOW_PATTERNS = ("*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken",
                  "tiktoken.model", "*.txt", "*.jsonl", "*.jinja")


class PullError(Exception):
    """A pull that did not complete, with the sentence to show."""


class PullStopped(Exception):
    """A pull its caller stopped (its client went away): not a failure to report. The
    files verified so far stay, so the same pull again fetches only the rest."""


@dataclass(frozen=True, slots=True)
class RemoteFile:
    path: str
    size: int
    blob_id: str  # the git object id
    sha256: str | None  # LFS files only


#: ``report(file, bytes done, bytes in all)``: a pull's progress for a caller that shows it
#: itself, beside the command's own lines.
Report = Callable[[RemoteFile, int, int | None], None]


@dataclass(frozen=True, slots=True)
class Pulled:
    repo: str
    revision: str
    commit: str
    snapshot: Path
    files: int
    downloaded: int  # files fetched now (the rest were in the cache already)
    size_bytes: int


#: A branch, tag or commit as the hub names them (``refs/pr/1`` included). It becomes a file
#: under the cache's ``refs/``, so no part may be empty, ``.`` or ``..``, and nothing git
#: forbids in a ref name (spaces, controls, ``~^:?*[\\``) gets through.
_REVISION = re.compile(r"(?!.*(?:\.\.|//|/\.|@\{))[A-Za-z0-9_][A-Za-z0-9_.+=,@{}-]{0,254}"
                       r"(?:/[A-Za-z0-9_][A-Za-z0-9_.+=,@{}-]{0,254})*(?<![./])\Z")


def parse_ref(ref: str) -> tuple[str, str]:
    """``OWNER/NAME[@REVISION]`` -> (repo, revision); the revision defaults to ``main``."""
    repo, at, revision = ref.partition("@")
    if not REPO_ID.match(repo):
        raise PullError(f"'{repo}' is not a Hugging Face repo id (expected OWNER/NAME, e.g. "
                        "mlx-community/Qwen2.5-0.5B-Instruct-4bit)")
    if at and not _REVISION.match(revision):
        raise PullError(f"'{revision}' is not a revision (a branch, tag or commit, e.g. main, "
                        "v1.0 or refs/pr/1)")
    return repo, revision or "main"


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def _explain(exc: BaseException, repo: str, revision: str) -> str:
    """The sentence for a failure of the hub client."""
    from huggingface_hub import errors

    if isinstance(exc, errors.OfflineModeIsEnabled):
        return (f"cannot download {repo}: offline mode is on (HF_HUB_OFFLINE is set); "
                "unset it to pull")
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"{repo} has no revision '{revision}' on {_endpoint()}"
    if isinstance(exc, errors.GatedRepoError):
        return (f"{repo} is gated: accept its terms on the hub's page, then log in "
                "(`hf auth login`) and pull again")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return (f"{repo} was not found on {_endpoint()} (check the spelling; a private "
                "repo needs `hf auth login`)")
    if isinstance(exc, errors.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "?"
        return f"the hub at {_endpoint()} answered HTTP {status} for {repo}: {exc}"
    module = type(exc).__module__
    if module.startswith(("httpx", "httpcore")) or isinstance(exc, ConnectionError):
        return (f"cannot reach the Hugging Face hub at {_endpoint()} ({type(exc).__name__}: "
                f"{exc}); check the network connection (and HF_ENDPOINT)")
    return f"{type(exc).__name__}: {exc}"


def remote_files(repo: str, revision: str) -> tuple[str, list[RemoteFile]]:
    """(commit, the files an MLX load needs) at ``revision``; raises PullError."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi()
    try:
        commit = api.model_info(repo, revision=revision).sha
        assert commit, "the hub names the commit a revision resolves to"
        tree = [f for f in api.list_repo_tree(repo, recursive=True, revision=commit)
                if isinstance(f, RepoFile)]
    except Exception as exc:
        raise PullError(_explain(exc, repo, revision)) from exc
    names = [f.path for f in tree]
    wanted = [f for f in tree if any(fnmatch.fnmatch(f.path, p) for p in ALLOW_PATTERNS)]
    weights = [f for f in wanted if f.path.endswith(".safetensors")]
    if "config.json" not in names or not weights:
        lacks = " and ".join(what for what, there in (
            ("config.json", "config.json" in names),
            ("model*.safetensors weights", bool(weights))) if not there)
        raise PullError(
            f"{repo} is not an MLX model: it has no {lacks} (files: "
            f"{', '.join(sorted(names)[:8])}{', …' if len(names) > 8 else ''}). afmd serves "
            "MLX models; look for an MLX conversion, e.g. under huggingface.co/mlx-community")
    files = [RemoteFile(f.path, f.size, f.blob_id, f.lfs.sha256 if f.lfs else None)
             for f in wanted]
    # config.json last: until it is there, no reader takes the snapshot for a model.
    files.sort(key=lambda f: (f.path == "config.json", f.path.endswith(".safetensors"), f.path))
    return commit, files


def file_digest(path: Path, remote: RemoteFile) -> tuple[str, str]:
    """(expected, actual) digest of a downloaded file, as the hub's tree states it."""
    if remote.sha256 is not None:
        digest = hashlib.sha256()
        expected = remote.sha256
    else:
        digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
        expected = remote.blob_id
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return expected, digest.hexdigest()


def _discard(link: Path) -> None:
    """Remove a bad file: the blob it links to and the link."""
    blob = link.resolve()
    for path in (blob, link):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def pull(ref: str, *, out: TextIO | None = None, terminal: bool | None = None,
         report: Report | None = None, stop: threading.Event | None = None) -> Pulled:
    """Download and verify ``ref``; progress to ``out`` (stderr), and to ``report`` when
    given (the dashboard's pulls, Ollama's ``/api/pull``): each file with 0 bytes done
    before any download, its bytes as they come, and all its bytes once it is verified
    (or was already there). Raises PullError, or PullStopped once ``stop`` is set: a
    server's pull runs in a thread nothing else can interrupt, so the flag is looked at
    on every progress step the hub client makes and between files."""
    out = out if out is not None else sys.stderr
    terminal = out.isatty() if terminal is None else terminal
    repo, revision = parse_ref(ref)
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

    def check() -> None:
        if stop is not None and stop.is_set():
            raise PullStopped(f"the pull of {repo} was stopped")

    def progress(remote: RemoteFile, done: int, total: int | None) -> None:
        check()
        if report is not None:
            report(remote, done, total)

    commit, files = remote_files(repo, revision)
    total = sum(f.size for f in files)
    out.write(f"pulling {repo}@{revision} (commit {commit[:12]}): {len(files)} files, "
              f"{human_bytes(total)}\n")
    out.flush()
    if report is not None:
        for remote in files:
            report(remote, 0, remote.size)

    from huggingface_hub import hf_hub_download

    cache = huggingface_hub_cache()
    snapshot = repo_folder(repo, cache) / "snapshots" / commit
    watched = report is not None or stop is not None
    downloaded = 0
    for remote in files:
        link = snapshot / remote.path
        cached = link.is_file()
        check()
        try:
            local = Path(hf_hub_download(
                repo, remote.path, revision=commit, cache_dir=str(cache),
                tqdm_class=bar_class(
                    remote.path, out, terminal=terminal,
                    report=functools.partial(progress, remote) if watched else None)))
        except PullStopped:
            raise
        except Exception as exc:
            raise PullError(f"downloading {remote.path}: {_explain(exc, repo, revision)}; "
                            "run the pull again to resume (finished files are kept)") from exc
        except KeyboardInterrupt:
            out.write("\n")
            raise
        if cached:
            out.write(f"  {remote.path}: already downloaded\n")
        downloaded += not cached
        expected, actual = file_digest(local, remote)
        if expected != actual:
            _discard(link)
            kind = "sha256" if remote.sha256 else "git blob id"
            raise PullError(f"{remote.path} failed verification ({kind} {actual}, the hub "
                            f"says {expected}); the file was deleted, run the pull again")
        if report is not None:
            report(remote, remote.size, remote.size)
    ref_file = repo_folder(repo, cache) / "refs" / revision
    if revision != commit:
        ref_file.parent.mkdir(parents=True, exist_ok=True)
        ref_file.write_text(commit, encoding="utf-8")
    out.write(f"verified {len(files)} files (sha256 for weights); {repo} is ready: "
              f"{snapshot}\n")
    out.flush()
    return Pulled(repo, revision, commit, snapshot, len(files), downloaded, total)


__all__ = ["ALLOW_PATTERNS", "PullError", "PullStopped", "Pulled", "RemoteFile", "parse_ref",
           "pull"]
