"""``afmd pull``: an MLX model from the Hugging Face hub into the standard hub cache.

The download itself is ``huggingface_hub``'s (what mlx-lm uses, so mlx-lm, LM Studio and
afmd share one cache and one copy): it resumes a cut connection with ``Range`` and keeps
every finished file, so a pull run again after an interruption fetches only what is
missing. What afmd adds:

* the repo is refused before any download unless it is an MLX model (``config.json`` and
  safetensors weights);
* one progress bar per file (:mod:`afmd.hub.progress`);
* integrity: the hub client checks no hash, so afmd hashes every file against the hashes
  the hub lists (sha256 for LFS files, the git blob id for the others) and deletes a file
  that does not match, and stops one that runs past the size listed;
* bounds: the listing has a timeout between reads (the hub client's tree listing has
  none), a deadline for the whole of it and a cap on its size (the hub client reads any
  body to its end);
* "present" means complete: files are fetched at the commit the revision resolved to,
  ``config.json`` last, and the ref (``refs/main``) is written only once every file was
  verified (:mod:`afmd.hub.cache` reads that state).
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import functools
import hashlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO
from urllib.parse import quote

from afmd.hub.cache import LATEST_TAG, REPO_ID, human_bytes, repo_folder, without_hub_host
from afmd.hub.progress import bar_class
from afmd.paths import huggingface_hub_cache

if TYPE_CHECKING:
    from huggingface_hub import ModelInfo

#: mlx-lm's own download patterns (``mlx_lm.utils.DEFAULT_ALLOW_PATTERNS``): afmd fetches
#: exactly what a load of the repo would, and nothing it would not.
ALLOW_PATTERNS = ("*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken",
                  "tiktoken.model", "*.txt", "*.jsonl", "*.jinja")


class PullError(Exception):
    """A pull that did not complete, with the sentence to show."""


class _TooLong(Exception):
    """Raised from a progress step once a file's body passes the size the hub listed."""


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


#: The most a repo's listing may be. Each file adds a few hundred bytes (its name, git id,
#: size and LFS sha256) to the listing, so this is room for tens of thousands of files where
#: the largest model repos have a few thousand; and it bounds what parsing it can cost, a
#: JSON text becoming several times its size in Python objects.
LISTING_CAP = 16 * 1024 * 1024

#: The whole listing's time, in waits of the hub client's metadata setting
#: (``HF_HUB_ETAG_TIMEOUT``): a minute unless set.
LISTING_WAITS = 6


#: A branch, tag or commit as the hub names them (``refs/pr/1`` included). It becomes a file
#: under the cache's ``refs/``, so no part may be empty, ``.`` or ``..``, and nothing git
#: forbids in a ref name (spaces, controls, ``~^:?*[\\``) gets through.
_REVISION = re.compile(r"(?!.*(?:\.\.|//|/\.|@\{))[A-Za-z0-9_][A-Za-z0-9_.+=,@{}-]{0,254}"
                       r"(?:/[A-Za-z0-9_][A-Za-z0-9_.+=,@{}-]{0,254})*(?<![./])\Z")


#: A commit as the hub names one (a git object id).
_COMMIT = re.compile(r"[0-9a-f]{40}")


def parse_ref(ref: str) -> tuple[str, str]:
    """``OWNER/NAME[@REVISION]`` -> (repo, revision); the revision defaults to ``main``.
    ``hf.co/OWNER/NAME``, as Ollama names a hub repo, is that repo, and Ollama's default
    tag (``OWNER/NAME:latest``) names it too."""
    repo, at, revision = without_hub_host(ref).partition("@")
    repo = repo.removesuffix(LATEST_TAG)
    if not REPO_ID.match(repo):
        raise PullError(f"'{repo}' is not a Hugging Face repo id (expected OWNER/NAME, e.g. "
                        "mlx-community/Qwen2.5-0.5B-Instruct-4bit)")
    if at and not _REVISION.match(revision):
        raise PullError(f"'{revision}' is not a revision (a branch, tag or commit, e.g. main, "
                        "v1.0 or refs/pr/1)")
    return repo, revision or "main"


def offline() -> bool:
    """Whether the hub client is told to stay offline (``HF_HUB_OFFLINE``), as it reads
    the variable: then nothing is pulled, and a model not on disk is unavailable."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def _explain(exc: BaseException, repo: str, revision: str, *,
             setting: str = "HF_HUB_ETAG_TIMEOUT") -> str:
    """The sentence for a failure of the hub client; ``setting``: the variable that bounds
    the wait that failed (the listing's, or a file's between two reads)."""
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
    if _on_this_disk(exc):
        assert isinstance(exc, OSError)
        where = f": {exc.filename}" if exc.filename else ""
        return (f"this machine's disk refused it ({exc.strerror or exc}{where}); the "
                f"Hugging Face cache is {huggingface_hub_cache()} (HF_HOME or HF_HUB_CACHE "
                "set where it is): free space there or make it a writable folder")
    module = type(exc).__module__
    if module.startswith(("httpx", "httpcore")) and "Timeout" in type(exc).__name__:
        return (f"the hub at {_endpoint()} did not answer within {_timeout(setting):g} s "
                f"({type(exc).__name__}); check the network connection, or allow it longer "
                f"with {setting}")
    if module.startswith(("httpx", "httpcore")) or isinstance(exc, ConnectionError):
        return (f"cannot reach the Hugging Face hub at {_endpoint()} ({type(exc).__name__}: "
                f"{exc}); check the network connection (and HF_ENDPOINT)")
    return f"{type(exc).__name__}: {exc}"


#: The errors of a write to this machine's disk: no network fault, and pulling again as
#: it is will not get past them.
_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS,
                          errno.ENOTDIR, errno.EISDIR})


def _on_this_disk(exc: BaseException) -> bool:
    """Whether ``exc`` is this machine's disk refusing a write (a full disk, a cache
    folder that cannot be made or written), not the hub or the network failing."""
    return (isinstance(exc, OSError) and not isinstance(exc, ConnectionError)
            and exc.errno in _DISK_ERRNOS)


def _timeout(setting: str = "HF_HUB_ETAG_TIMEOUT") -> float:
    """Seconds the hub may take to answer: the hub client's own settings, read where it
    reads them (``HF_HUB_ETAG_TIMEOUT`` for a repo's metadata, ``HF_HUB_DOWNLOAD_TIMEOUT``
    between two reads of a file; 10 s each unless set)."""
    from huggingface_hub import constants

    return float(getattr(constants, setting))


def _listing(repo: str, revision: str) -> ModelInfo:
    """The repo's info at ``revision`` with every file's size and hashes, as the hub client's
    ``HfApi().model_info(files_metadata=True)`` asks for and parses it, but read with bounds.

    The hub client reads a body to its end, and its timeout bounds only the wait between
    two reads: a hub, a proxy or an ``HF_ENDPOINT`` that answered with JSON without end was
    read into memory until the process was killed (a server's pull runs in the server), and
    one that dripped a byte now and then held the pull for ever. So the request is the hub
    client's own (its shared HTTP client, with its offline check, headers and token), but
    its body is streamed, refused past :data:`LISTING_CAP`, and the whole read has a
    deadline of :data:`LISTING_WAITS` times ``HF_HUB_ETAG_TIMEOUT``: the setting people
    already raise for a slow link raises this too, and no second one is needed. An error
    status is mapped by the hub client's own ``hf_raise_for_status`` (repo not found,
    gated, revision not found), so :func:`_explain` reads it as before."""
    import httpx2
    from huggingface_hub import ModelInfo, constants
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    timeout = _timeout()
    deadline = LISTING_WAITS * timeout
    url = f"{constants.ENDPOINT}/api/models/{repo}/revision/{quote(revision, safe='')}"
    start = time.monotonic()
    body = bytearray()
    with get_session().stream("GET", url, params={"blobs": True}, headers=build_hf_headers(),
                              timeout=timeout) as response:
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > LISTING_CAP:
                raise PullError(
                    f"the hub at {_endpoint()} sent a listing of {repo}@{revision} longer than "
                    f"{human_bytes(LISTING_CAP)}, far past any model repo's, and it was not "
                    "read further; check HF_ENDPOINT (and any proxy on the way)")
            if time.monotonic() - start > deadline:
                raise PullError(
                    f"the hub at {_endpoint()} did not finish the listing of {repo}@{revision} "
                    f"within {deadline:g} s ({LISTING_WAITS} × HF_HUB_ETAG_TIMEOUT); check the "
                    "network connection, or allow it longer with HF_HUB_ETAG_TIMEOUT")
        # The body as read, decoded already: its framing and coding headers no longer apply.
        read = httpx2.Response(
            response.status_code, request=response.request, content=bytes(body),
            headers=[(k, v) for k, v in response.headers.multi_items() if k.lower() not in
                     ("content-encoding", "content-length", "transfer-encoding")])
    hf_raise_for_status(read)
    try:
        data = json.loads(body)
        if not isinstance(data, dict):
            raise TypeError(f"a JSON {type(data).__name__}, not an object")
        return ModelInfo(**data)
    except (ValueError, TypeError, AttributeError, KeyError, RecursionError) as exc:
        raise PullError(f"the hub at {_endpoint()} answered the listing of {repo}@{revision} "
                        f"with what is not a repo's listing ({type(exc).__name__}: "
                        f"{exc!s:.200}); check HF_ENDPOINT") from None


def remote_files(repo: str, revision: str) -> tuple[str, list[RemoteFile]]:
    """(commit, the files an MLX load needs) at ``revision``; raises PullError.

    One request, bounded (:func:`_listing`): the repo's info with every file's size and
    hashes. The hub client's tree listing takes no timeout (its HTTP client has none by
    default), so a hub that took the connection and never replied held the pull for
    ever."""
    try:
        info = _listing(repo, revision)
    except PullError:
        raise
    except Exception as exc:
        raise PullError(_explain(exc, repo, revision)) from exc
    commit = info.sha
    if not commit or not _COMMIT.fullmatch(commit):
        # The files are fetched at it, and a snapshot folder is named after it.
        raise PullError(f"the hub at {_endpoint()} did not name the commit of {repo}@{revision} "
                        f"(it said {commit!r:.60})")
    tree = info.siblings or []
    names = [f.rfilename for f in tree]
    wanted = [f for f in tree if any(fnmatch.fnmatch(f.rfilename, p) for p in ALLOW_PATTERNS)]
    weights = [f for f in wanted if f.rfilename.endswith(".safetensors")]
    if "config.json" not in names or not weights:
        lacks = " and ".join(what for what, there in (
            ("config.json", "config.json" in names),
            ("model*.safetensors weights", bool(weights))) if not there)
        raise PullError(
            f"{repo} is not an MLX model: it has no {lacks} (files: "
            f"{', '.join(sorted(names)[:8])}{', …' if len(names) > 8 else ''}). afmd serves "
            "MLX models; look for an MLX conversion, e.g. under huggingface.co/mlx-community")
    unlisted = [f.rfilename for f in wanted if f.size is None or not f.blob_id]
    if unlisted:
        raise PullError(f"the hub at {_endpoint()} listed {unlisted[0]} of {repo} without its "
                        "size or hash, so it cannot be verified")
    files = [RemoteFile(f.rfilename, f.size or 0, f.blob_id or "",
                        f.lfs.sha256 if f.lfs else None) for f in wanted]
    # config.json last: until it is there, no reader takes the snapshot for a model.
    files.sort(key=lambda f: (f.path == "config.json", f.path.endswith(".safetensors"), f.path))
    return commit, files


def file_digest(path: Path, remote: RemoteFile) -> tuple[str, str]:
    """(expected, actual) digest of a downloaded file, as the hub lists it."""
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


def _discard(link: Path, blobs: Path) -> None:
    """Remove a bad file: the link, and the blob it links to when that is one of the
    repo's blobs. The cache is shared, and a snapshot's file may link anywhere (weights
    its user keeps on another disk): nothing outside the cache is deleted."""
    blob = link.resolve()
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    if blob.parent == blobs.resolve():
        with contextlib.suppress(FileNotFoundError):
            blob.unlink()


def _discard_partial(cache: Path, repo: str, remote: RemoteFile) -> bool:
    """Delete what interrupted downloads of this file left in the cache before it is
    fetched again: a killed pull's, or a server's stopped mid-pull. The hub client starts
    a file over under a new name each time and never reads those again
    (:mod:`afmd.hub.hub_compat`), so each was a weight file's worth of disk kept for
    nothing. A download stopped here by an exception (past the listed size, stopped by
    its caller) leaves nothing: the hub client deletes its file on the way out.
    True: another process (a second ``afmd pull``, a server's pull) downloads the file
    now, and the hub client waits for it."""
    from afmd.hub import hub_compat

    etag = remote.sha256 or remote.blob_id
    if re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", etag):
        return hub_compat.discard_leftovers(cache, repo_folder(repo, cache), etag) is None
    return False


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

    def check() -> None:
        if stop is not None and stop.is_set():
            raise PullStopped(f"the pull of {repo} was stopped")

    def progress(remote: RemoteFile, done: int, total: int | None) -> None:
        check()
        if done > remote.size:  # the hub client would write a body without end to disk
            raise _TooLong
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
    downloaded = 0
    for remote in files:
        link = snapshot / remote.path
        cached = link.is_file()
        check()
        if not cached and _discard_partial(cache, repo, remote):
            # The hub client waits for it without a word: a weight file is minutes of
            # a pull that looked hung, and then no line at all for that file.
            out.write(f"  {remote.path}: another pull is downloading it; waiting for it\n")
            out.flush()
        try:
            local = Path(hf_hub_download(
                repo, remote.path, revision=commit, cache_dir=str(cache),
                tqdm_class=bar_class(
                    remote.path, out, terminal=terminal,
                    report=functools.partial(progress, remote))))
        except PullStopped:
            raise
        except _TooLong:
            raise PullError(f"{remote.path}: the hub sent more than the {remote.size} bytes it "
                            "listed; the download was stopped and deleted") from None
        except Exception as exc:
            said = _explain(exc, repo, revision, setting="HF_HUB_DOWNLOAD_TIMEOUT")
            then = ("then run the pull again" if _on_this_disk(exc)
                    else "run the pull again to resume")
            raise PullError(f"downloading {remote.path}: {said}; {then} (finished files are "
                            "kept)") from exc
        except KeyboardInterrupt:
            out.write("\n")
            raise
        if cached:
            out.write(f"  {remote.path}: already downloaded\n")
        downloaded += not cached
        expected, actual = file_digest(local, remote)
        if expected != actual:
            _discard(link, repo_folder(repo, cache) / "blobs")
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


__all__ = ["ALLOW_PATTERNS", "PullError", "PullStopped", "Pulled", "RemoteFile", "offline",
           "parse_ref", "pull"]
