"""Pulls a running server makes: ``afmd pull`` started from the dashboard, in the background.

The download is :func:`afmd.hub.download.pull`'s, the same verified one the command runs, in a
thread so the event loop keeps serving; what this adds is the state a page polls: per repo,
the files and bytes planned and done, and how it ended. One pull per repo at a time (a
second start while one runs is that same pull); finished pulls stay listed until the same
repo is pulled again, the oldest leaving past :data:`KEPT`.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from afmd.errors import InvalidRequestError
from afmd.hub.cache import REPO_ID

if TYPE_CHECKING:
    from afmd.hub.download import RemoteFile

#: Finished pulls kept for the page.
KEPT = 20

PULLING, DONE, FAILED = "pulling", "done", "failed"


@dataclass
class Pull:
    """One repo's download, as the page shows it."""

    repo: str
    revision: str
    state: str = PULLING
    #: Per file: [bytes done, bytes in all]; filled in once the hub has listed them.
    files: dict[str, list[int]] = field(default_factory=dict)
    error: str | None = None
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def report(self, remote: RemoteFile, done: int, total: int | None) -> None:
        """Progress from the download thread (afmd.hub.download.Report)."""
        with self._lock:
            entry = self.files.setdefault(remote.path, [0, 0])
            entry[0] = done
            if total is not None:
                entry[1] = total

    def describe(self) -> dict[str, Any]:
        with self._lock:
            files = [(done, total) for done, total in self.files.values()]
        return {
            "repo": self.repo,
            "revision": self.revision,
            "state": self.state,
            "files": len(files),
            "files_done": sum(1 for done, total in files if total and done >= total),
            "completed_bytes": sum(min(done, total) if total else done
                                   for done, total in files),
            "total_bytes": sum(total for _, total in files),
            "error": self.error,
            "started_at": round(self.started_at, 3),
            "finished_at": round(self.finished_at, 3) if self.finished_at else None,
        }


class Pulls:
    """The server's pulls, by repo (module doc)."""

    def __init__(self) -> None:
        self._pulls: dict[str, Pull] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, ref: str) -> Pull:
        """Start pulling ``OWNER/NAME[@REVISION]`` (or return the pull of it under way);
        a malformed reference is a 400."""
        from afmd.hub.download import PullError, parse_ref

        try:
            repo, revision = parse_ref(ref)
        except PullError as exc:
            raise InvalidRequestError(str(exc), code="invalid_value", param="model") from None
        assert REPO_ID.match(repo)
        running = self._pulls.get(repo)
        if running is not None and running.state == PULLING:
            return running
        pull = Pull(repo, revision)
        self._pulls.pop(repo, None)
        self._pulls[repo] = pull
        finished = [r for r, p in self._pulls.items() if p.state != PULLING]
        for old in finished[: max(0, len(finished) - KEPT)]:
            del self._pulls[old]
        task = asyncio.get_running_loop().create_task(self._run(pull))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return pull

    async def _run(self, pull: Pull) -> None:
        from afmd.hub.download import PullError

        try:
            await _in_daemon_thread(pull)
        except PullError as exc:
            pull.state, pull.error = FAILED, str(exc)
        except Exception as exc:  # a pull never takes the server down
            pull.state, pull.error = FAILED, f"{type(exc).__name__}: {exc}"
        else:
            pull.state = DONE
        finally:
            pull.finished_at = time.time()

    def get(self, repo: str) -> Pull | None:
        return self._pulls.get(repo)

    def describe(self) -> list[dict[str, Any]]:
        """Every pull listed, the latest started first."""
        return [p.describe() for p in sorted(self._pulls.values(), key=lambda p: -p.started_at)]

    async def drain(self) -> None:
        """Wait for the pulls under way (tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


async def _in_daemon_thread(pull: Pull) -> None:
    """The download, in a thread of its own that does not hold the process: a server
    stopping mid-pull exits at once (the file cut short starts over at the next pull of
    it, which deletes what this one left in the cache), where the loop's executor would
    wait for the whole download."""
    from afmd.hub.download import pull as download

    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(exc: BaseException | None) -> None:
        if done.done():
            return
        if exc is None:
            done.set_result(None)
        else:
            done.set_exception(exc)

    def work() -> None:
        out = io.StringIO()  # the command's progress lines: the page has its own
        error: BaseException | None = None
        try:
            download(f"{pull.repo}@{pull.revision}", out=out, terminal=False,
                     report=pull.report)
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: the server stopped
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=work, name=f"afmd-pull-{pull.repo}", daemon=True).start()
    await done


__all__ = ["DONE", "FAILED", "KEPT", "PULLING", "Pull", "Pulls"]
