"""What the dashboard keeps for one server: the server's recent past (the last requests
and a per-second series), and the page's own files, pulls and downloads seen.

The last requests are the access log's lines kept in memory (a ring of
:data:`RING_SIZE`), whether or not the log itself is on, so that the page shows what a
tail of the log would without reading a file; the page's own traffic (``/ui/``) is left
out of the ring, or its polling would be all there is to see.

The series has one point a second for the last :data:`SERIES_SECONDS`: tokens generated
during that second, the mean time to first token of the requests that ended in it, and the
requests running and queued at its end. Tokens are counted as they reach the event loop
(each generation's live count), so a long stream shows its speed while it runs, and the
rest of a request's tokens are added when it ends, so that the series adds up to what the
clients were told. Sampling is a timer on the event loop, started with the server; it
reads counts the scheduler and the pipeline keep anyway and costs nothing per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
import weakref
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

from afmd.core.events import Usage
from afmd.engine.generation import Generation
from afmd.http.routes.metrics import AnyRun, generations_of
from afmd.hub import cache as hubcache
from afmd.hub.server_pulls import DONE, Pulls
from afmd.logs import get_logger
from afmd.service.pipeline import ChatPipeline

_log = get_logger("afmd.http")

#: Requests kept for the page.
RING_SIZE = 200
#: Seconds of series kept.
SERIES_SECONDS = 600
#: Paths whose requests the ring leaves out: the dashboard's own page and polling.
OWN_PREFIX = "/ui/"


@dataclass(frozen=True, slots=True)
class RequestEntry:
    """One access-log line, as the page lists it."""

    seq: int
    time: float  # Unix time it ended
    method: str
    path: str
    status: int
    duration_ms: float | None
    request_id: str | None
    model: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    ttft_ms: float | None
    finish_reason: str | None
    error_code: str | None


@dataclass(frozen=True, slots=True)
class Point:
    t: int  # the Unix second it ends
    tokens_per_s: float
    ttft_ms: float | None  # mean over the requests that ended in it (None: none did)
    active: int
    queued: int


class _Live:
    """What the series has counted of one running request so far."""

    __slots__ = ("counted", "run", "seen")

    def __init__(self, run: AnyRun) -> None:
        self.seen: dict[Generation, int] = {}  # its tokens at the last sample
        self.counted = 0
        #: Whose counts these are: a request id is the client's, and another request may
        #: send the same one (refused as a duplicate while this one runs).
        self.run: weakref.ref[AnyRun] = weakref.ref(run)


class Activity:
    """The ring of recent requests and the series (module doc)."""

    def __init__(self) -> None:
        self.requests: deque[RequestEntry] = deque(maxlen=RING_SIZE)
        self.series: deque[Point] = deque(maxlen=SERIES_SECONDS)
        self._seq = 0
        self._live: dict[str, _Live] = {}
        self._tokens = 0  # generated since the last sample
        self._ttfts: list[float] = []  # of requests ended since the last sample
        self._timer: asyncio.TimerHandle | None = None
        self._sampled: tuple[ChatPipeline, Counter[str]] | None = None

    # -- what happened (on the event loop) --
    def record(
        self,
        method: str,
        path: str,
        status: int,
        *,
        duration_ms: float | None,
        request_id: str | None,
        model: str | None,
        usage: Usage | None,
        ttft_ms: float | None,
        finish_reason: str | None,
        error_code: str | None,
        run: AnyRun | None = None,
    ) -> None:
        """A request ended (its access-log line): into the ring, its remaining tokens
        and its time to first token into the series. ``run``: the run the line is about,
        where it generated. A line with no usage (a refusal, such as the 409 of a request
        that reused a running one's id) or another run's leaves the running one's counts
        alone: taking them made the next sample count all its tokens again."""
        live = None
        if request_id and (found := self._live.get(request_id)) is not None and (
                usage is not None and (run is None or run is found.run())):
            live = self._live.pop(request_id)
        if usage is not None:
            self._tokens += max(0, usage.completion_tokens - (live.counted if live else 0))
        if ttft_ms is not None:
            self._ttfts.append(ttft_ms)
        if path == OWN_PREFIX.rstrip("/") or path.startswith(OWN_PREFIX):
            return
        self._seq += 1
        self.requests.append(RequestEntry(
            self._seq, round(time.time(), 3), method, path, status, duration_ms, request_id,
            model, usage.prompt_tokens if usage is not None else None,
            usage.completion_tokens if usage is not None else None, ttft_ms, finish_reason,
            error_code))

    # -- the series --
    def start(self, pipeline: ChatPipeline, running: Counter[str]) -> None:
        """Sample the pipeline's runs every second from now on (in its event loop);
        ``running``: the request ids being handled (the server's state keeps them)."""
        self._sampled = (pipeline, running)
        if self._timer is None:
            self._schedule()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _schedule(self) -> None:
        # On the next whole second, so that each point covers one second of the clock.
        delay = 1.0 - (time.time() % 1.0)
        self._timer = asyncio.get_running_loop().call_later(delay, self._tick)

    def _tick(self) -> None:
        self._timer = None
        try:
            assert self._sampled is not None, "sampling before start()"
            self.sample(*self._sampled)
        except Exception:  # a sample never breaks the server; the next one is taken anyway
            _log.error("the dashboard's per-second sample failed", exc_info=True)
        with contextlib.suppress(RuntimeError):  # the loop is closing
            self._schedule()

    def sample(
        self, pipeline: ChatPipeline, running: Counter[str], now: float | None = None
    ) -> Point:
        """Close the current second: count the running requests' new tokens."""
        for request_id in list(running):
            run = pipeline.find(request_id)
            if run is None:
                continue
            live = self._live.get(request_id)
            if live is None or live.run() is not run:
                live = self._live[request_id] = _Live(run)
            for generation in generations_of(run):
                tokens = generation.tokens
                new = tokens - live.seen.get(generation, 0)
                live.seen[generation] = tokens
                if new > 0:
                    live.counted += new
                    self._tokens += new
        for request_id in [r for r in self._live if r not in running]:
            del self._live[request_id]  # ended without an access-log line of its own
        scheduler = pipeline.scheduler
        ttfts = self._ttfts
        point = Point(
            t=round(time.time() if now is None else now),
            tokens_per_s=float(self._tokens),
            ttft_ms=round(sum(ttfts) / len(ttfts), 2) if ttfts else None,
            active=scheduler.active,
            queued=scheduler.queued,
        )
        self.series.append(point)
        self._tokens = 0
        self._ttfts = []
        return point

    # -- what the page reads --
    def snapshot(self, since: int = 0, after: int = 0) -> dict[str, Any]:
        """The ring's entries after sequence number ``since`` and the points after Unix
        second ``after`` (0: all), oldest first; ``seq`` and ``t`` are where to resume."""
        return {
            "requests": [asdict(e) for e in self.requests if e.seq > since],
            "series": [asdict(p) for p in self.series if p.t > after],
            "seq": self._seq,
            "t": self.series[-1].t if self.series else after,
        }


# ------------------------------------------------------------------- the page's own


#: The page's files, in ``afmd/data/ui/``, with their media types.
ASSET_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
#: Seconds the list of downloaded models (a walk of the hub cache) is reused.
DOWNLOADS_TTL_S = 5.0


def _read_assets() -> dict[str, bytes]:
    """The page's files by name; importlib.resources finds them inside a frozen app too."""
    folder = resources.files("afmd").joinpath("data", "ui")
    return {item.name: item.read_bytes() for item in folder.iterdir()
            if os.path.splitext(item.name)[1] in ASSET_TYPES}


@dataclass
class Dashboard:
    """What the dashboard keeps for one server: its files, its pulls, the downloads seen."""

    assets: dict[str, bytes] = field(default_factory=_read_assets)
    #: Which server process this is, for a page that outlives it: another server on the
    #: same address counts its requests from one again, so a page that went on from the
    #: first one's count would show none of them.
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)
    pulls: Pulls = field(default_factory=Pulls)
    _downloads: list[hubcache.CachedRepo] = field(default_factory=list)
    _downloads_at: float = -DOWNLOADS_TTL_S
    _pulls_done: int = 0

    async def downloads(self) -> list[hubcache.CachedRepo]:
        """The complete repos in the hub cache, walked at most every few seconds (and at
        once when a pull has ended since)."""
        done = sum(1 for p in self.pulls.describe() if p["state"] == DONE)
        now = time.monotonic()
        if now - self._downloads_at >= DOWNLOADS_TTL_S or done != self._pulls_done:
            found = await asyncio.to_thread(
                lambda: [c for c in hubcache.cached_repos() if c.complete])
            self._downloads, self._downloads_at, self._pulls_done = found, now, done
        return self._downloads


__all__ = ["ASSET_TYPES", "OWN_PREFIX", "RING_SIZE", "SERIES_SECONDS", "Activity", "Dashboard",
           "Point", "RequestEntry"]
