"""A Hugging Face hub stand-in on loopback, for tests that must never touch the network.

It answers exactly what ``huggingface_hub`` asks when ``HF_ENDPOINT`` points at it:

* ``GET /api/models/{repo}/revision/{rev}`` (and ``/api/models/{repo}``): ``id``, ``sha``,
  ``siblings`` (with ``?blobs=true``, each with its ``blobId``, ``size`` and ``lfs``);
* ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=true``: every file with its git
  ``oid`` and ``size``, weight files (``*.safetensors``) as LFS with ``lfs.oid`` = sha256;
* ``HEAD`` and ``GET /{repo}/resolve/{rev}/{file}``: ``ETag`` (the sha256 for LFS files, the
  git oid otherwise), ``X-Repo-Commit``, ``Content-Length``, ``Accept-Ranges`` and ``Range``
  requests answered ``206`` with ``Content-Range``;
* unknown repo, revision or file: ``404`` with the hub's ``X-Error-Code``.

Faults a test can ask for: cut a file's connection after some bytes (the client resumes
with ``Range``), serve a file with one byte flipped while the tree keeps the true hash,
answer a file with an HTTP error, send a file slowly (a download a client can leave
in the middle of), send a file's bytes and then zeros without end, hold every API
request unanswered (a hub that accepts connections and never replies), or answer a repo's
listing with JSON without end, sent as fast as it goes or a byte at a time. Every request
is logged for assertions.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")
#: Where a body "without end" ends after all: far past any file the tests host.
ENDLESS_CAP = 64 * 1024 * 1024


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str
    refs: dict[str, str]

    def is_lfs(self, path: str) -> bool:
        return path.endswith(LFS_SUFFIXES)

    def etag(self, path: str) -> str:
        data = self.files[path]
        return hashlib.sha256(data).hexdigest() if self.is_lfs(path) else git_oid(data)


@dataclass(frozen=True)
class Logged:
    method: str
    path: str
    range: str | None
    query: str = ""


@dataclass
class FakeHub:
    """The stand-in: ``with FakeHub() as hub: env = {"HF_ENDPOINT": hub.url, ...}``."""

    repos: dict[str, Repo] = field(default_factory=dict)
    log: list[Logged] = field(default_factory=list)
    #: file -> [bytes to send before cutting the connection, times left]
    cuts: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    corrupted: set[tuple[str, str]] = field(default_factory=set)
    failures: dict[tuple[str, str], int] = field(default_factory=dict)
    #: file -> bytes per second it is sent at
    rates: dict[tuple[str, str], int] = field(default_factory=dict)
    #: files whose GET never ends (chunked, no Content-Length; HEAD tells the true size)
    endless: set[tuple[str, str]] = field(default_factory=set)
    #: while set, API requests wait unanswered (released when the hub stops)
    stalled: bool = False
    #: repo -> how its listing is answered with JSON that never ends: "fast" or "drip"
    listings: dict[str, str] = field(default_factory=dict)
    _released: threading.Event = field(default_factory=threading.Event)
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # ------------------------------------------------------------------ content

    def add_repo(self, repo: str, files: dict[str, bytes], *, tags: tuple[str, ...] = ()) -> str:
        """Host ``files`` as ``repo`` at one commit (``main`` and each tag name it)."""
        digest = hashlib.sha1(repo.encode())
        for name in sorted(files):
            digest.update(name.encode() + b"\0" + files[name])
        commit = digest.hexdigest()
        self.repos[repo] = Repo(dict(files), commit, {"main": commit, **dict.fromkeys(tags,
                                                                                       commit)})
        return commit

    def add_folder(self, repo: str, folder: Path, **kwargs: Any) -> str:
        files = {str(p.relative_to(folder)): p.read_bytes()
                 for p in sorted(folder.rglob("*")) if p.is_file()}
        return self.add_repo(repo, files, **kwargs)

    def cut(self, repo: str, path: str, after: int, times: int = 1) -> None:
        """Close the connection after ``after`` bytes of the next ``times`` GETs of a file."""
        self.cuts[(repo, path)] = [after, times]

    def corrupt(self, repo: str, path: str) -> None:
        self.corrupted.add((repo, path))

    def fail(self, repo: str, path: str, status: int = 500) -> None:
        self.failures[(repo, path)] = status

    def throttle(self, repo: str, path: str, bytes_per_s: int) -> None:
        """Send a file at ``bytes_per_s``, in small writes, so that a client that leaves
        is noticed within a write."""
        self.rates[(repo, path)] = bytes_per_s

    def without_end(self, repo: str, path: str) -> None:
        """Answer a file's GET with its bytes, then zeros until the client leaves (or,
        so that a client that never stops cannot fill the disk, :data:`ENDLESS_CAP`)."""
        self.endless.add((repo, path))

    def listing_without_end(self, repo: str, *, drip: bool = False) -> None:
        """Answer ``repo``'s listing with the start of a true one, then siblings without
        end: as fast as the client reads (until :data:`ENDLESS_CAP`), or with ``drip`` a
        byte every few hundredths of a second, never long enough apart for a read
        timeout (until the client leaves or the hub stops)."""
        self.listings[repo] = "drip" if drip else "fast"

    def gets(self, path_suffix: str) -> list[Logged]:
        return [r for r in self.log if r.method == "GET" and r.path.endswith(path_suffix)]

    # ------------------------------------------------------------------ serving

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            owner = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        # shutdown() waits for the serving loop's next poll: at the default half second,
        # every test's teardown would wait that long for nothing.
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                         daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._released.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Handler(BaseHTTPRequestHandler):
    owner: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def do_GET(self) -> None:
        self._dispatch(head=False)

    # ------------------------------------------------------------------ routing

    def _dispatch(self, *, head: bool) -> None:
        hub = self.owner
        path, query = urlsplit(self.path).path, urlsplit(self.path).query
        with hub._lock:
            hub.log.append(Logged(self.command, path, self.headers.get("Range"), query))
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and hub.stalled:
            hub._released.wait()
            self.close_connection = True
            return
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            self._api(f"{parts[2]}/{parts[3]}", parts[4:])
        elif len(parts) >= 5 and parts[2] == "resolve":
            self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), head=head)
        else:
            self._error(404, "EntryNotFound", "Not found")

    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.owner.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
        return repo

    def _commit(self, repo: Repo, revision: str) -> str | None:
        if revision == repo.commit:
            return revision
        commit = repo.refs.get(revision)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return commit

    def _api(self, repo_id: str, rest: list[str]) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        if not rest or rest[0] == "revision":
            commit = self._commit(repo, "/".join(rest[1:]) or "main")
            if commit is not None and repo_id in self.owner.listings:
                self._listing_without_end(repo_id, commit, self.owner.listings[repo_id])
            elif commit is not None:
                blobs = "blobs=true" in urlsplit(self.path).query
                self._json({"_id": "0" * 24, "id": repo_id, "modelId": repo_id,
                            "sha": commit, "private": False, "disabled": False, "tags": [],
                            "siblings": [self._sibling(repo, p, blobs)
                                         for p in sorted(repo.files)]})
        elif rest[0] == "tree" and len(rest) >= 2:
            commit = self._commit(repo, rest[1])
            if commit is not None:
                self._json(self._tree(repo, "/".join(rest[2:])))
        else:
            self._error(404, "EntryNotFound", "Not found")

    def _sibling(self, repo: Repo, path: str, blobs: bool) -> dict[str, Any]:
        """A ``siblings`` entry; with ``?blobs=true`` (the hub client's
        ``files_metadata``), its git oid, size and LFS sha256 as the tree has them."""
        if not blobs:
            return {"rfilename": path}
        data = repo.files[path]
        entry: dict[str, Any] = {"rfilename": path, "blobId": git_oid(data), "size": len(data)}
        if repo.is_lfs(path):
            entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                            "pointerSize": 134}
        return entry

    def _tree(self, repo: Repo, under: str) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = []
        folders: set[str] = set()
        for path in sorted(repo.files):
            if under and not path.startswith(under.rstrip("/") + "/"):
                continue
            data = repo.files[path]
            parents = path.split("/")[:-1]
            for i in range(1, len(parents) + 1):
                folders.add("/".join(parents[:i]))
            entry: dict[str, Any] = {"type": "file", "oid": git_oid(data), "size": len(data),
                                     "path": path}
            if repo.is_lfs(path):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                                "pointerSize": 134}
            entries.append(entry)
        entries += [{"type": "directory", "oid": git_oid(f.encode()), "size": 0, "path": f}
                    for f in sorted(folders)]
        return entries

    def _resolve(self, repo_id: str, revision: str, path: str, *, head: bool) -> None:
        hub = self.owner
        repo = self._repo(repo_id)
        if repo is None:
            return
        commit = self._commit(repo, revision)
        if commit is None:
            return
        if path not in repo.files:
            self._error(404, "EntryNotFound", f"{path} does not exist")
            return
        key = (repo_id, path)
        if not head and key in hub.failures:
            self._error(hub.failures[key], "", "Internal Error")
            return
        data = repo.files[path]
        if key in hub.corrupted:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        start = 0
        status = 200
        headers = {"ETag": f'"{repo.etag(path)}"', "X-Repo-Commit": commit,
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        wanted = self.headers.get("Range")
        if wanted and not head and wanted.startswith("bytes="):
            first, _, last = wanted[len("bytes="):].partition("-")
            start = int(first or 0)
            end = int(last) + 1 if last else len(data)
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
            data = data[start:end]
            status = 206
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        if key in hub.endless and not head:
            self._without_end(data)
            return
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if head:
            return
        with hub._lock:
            cut = hub.cuts.get(key)
            cutting = cut is not None and cut[1] > 0 and start < cut[0]
            if cutting and cut is not None:
                cut[1] -= 1
        if cutting and cut is not None:
            self.wfile.write(data[: cut[0] - start])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        rate = hub.rates.get(key)
        if rate is None:
            self.wfile.write(data)
            return
        step = max(1, rate // 20)
        try:
            for start in range(0, len(data), step):
                self.wfile.write(data[start:start + step])
                self.wfile.flush()
                time.sleep(step / rate)
        except OSError:  # the client went away
            self.close_connection = True

    def _without_end(self, data: bytes) -> None:
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.close_connection = True
        zeros = bytes(1 << 16)
        try:
            if data:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            for _ in range(ENDLESS_CAP // len(zeros)):
                if self.owner._released.is_set():
                    return
                self.wfile.write(b"%x\r\n%s\r\n" % (len(zeros), zeros))
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client went away
            pass

    def _listing_without_end(self, repo_id: str, commit: str, how: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.close_connection = True
        head = json.dumps({"id": repo_id, "sha": commit, "siblings": []})[:-2].encode()
        # Long names: few objects per byte, so that a client that parses it all anyway
        # (an unbounded one, given ENDLESS_CAP) is not slowed by millions of them.
        entry = b'{"rfilename": "%s.json", "size": 2}, ' % (b"x" * 4000)
        released = self.owner._released
        try:
            if how == "drip":
                for byte in head + entry * 1000:
                    if released.wait(0.05):
                        return
                    self.wfile.write(b"1\r\n%c\r\n" % byte)
                    self.wfile.flush()
                return
            block = entry * 16
            self.wfile.write(b"%x\r\n%s\r\n" % (len(head), head))
            for _ in range(ENDLESS_CAP // len(block)):
                if released.is_set():
                    return
                self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block))
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client went away
            pass

    # ------------------------------------------------------------------ answers

    def _json(self, payload: Any) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def safetensors_bytes(tensors: dict[str, tuple[str, list[int]]]) -> bytes:
    """A valid safetensors file of zero-filled tensors: ``{name: (dtype, shape)}``."""
    sizes = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "U8": 1}
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * sizes[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + bytes(offset)
