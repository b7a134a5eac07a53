"""Background responses (``background: true``) while they run, and the events a streamed
one leaves: what ``GET /v1/responses/{id}``, its ``?stream=true`` and the cancel route read
(:mod:`afmd.http.routes.background_runs` runs them).

A streamed background response's events are kept as written, one encoded SSE event each,
so that the list's index is the event's ``sequence_number`` and a client resumes after
any of them. They are kept while the response runs and then for as long as its response
stays in the store (:attr:`afmd.dialects.responses.store.ResponseStore.on_remove` drops
them with it): a few per output item and one per delta written, so they grow with the
response's output, which ``max_output_tokens`` bounds, as the response itself does. An
event repeats far more than the text it adds (its envelope, the ids, the response whole
at the start and the end), so the finished responses' events are held together to a bound
of their own, ``[responses] max_stored_bytes`` again, the oldest dropped first: such a
response can still be fetched, not streamed again. A non-streamed background response
keeps none.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

from afmd.dialects.responses.responses_api import ResponsesReply
from afmd.errors import APIError
from afmd.logs import get_logger

__all__ = ["KEEPALIVE", "BackgroundRun", "BackgroundRuns"]

log = get_logger("afmd.responses")

#: How long a follower's stream may stay quiet (its run queued behind others, a long
#: prefill) before a comment shows the connection is alive: the server cuts a response
#: that writes nothing for ``request_timeout`` and a margin, and a background run may take
#: its far longer ``background_timeout``.
KEEPALIVE_SECONDS = 15.0
#: An SSE comment: readers skip it (the SDK's among them), and as no event it leaves the
#: sequence numbers the events' indexes.
KEEPALIVE = b": keep-alive\n\n"


class BackgroundRun:
    """One background response from its POST to its end: its task, its reply (which
    stores it) and, streamed, its events so far."""

    __slots__ = ("_changed", "answered", "ended", "events", "final", "refused",
                 "reply", "request_id", "status", "streamed", "task")

    def __init__(self, reply: ResponsesReply, request_id: str, opening: list[bytes],
                 *, streamed: bool) -> None:
        self.reply = reply
        self.request_id = request_id  # the pipeline's id for the run (its X-Request-ID)
        self.streamed = streamed
        # response.created and response.queued now; response.in_progress once the run has
        # begun (started()).
        self.events: list[bytes] = list(opening)
        self.status = "queued"
        self.final: dict[str, Any] | None = None
        #: Set once the POST has answered: a failure from then on is the response's.
        self.answered = False
        #: A refusal before the run could queue (the queue's 429): the POST's own answer.
        self.refused: APIError | None = None
        self.ended = asyncio.Event()
        self._changed = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    @property
    def id(self) -> str:
        return self.reply.id

    def current(self) -> dict[str, Any]:
        """The response as ``GET`` shows it now."""
        return self.final if self.final is not None else self.reply.current(self.status)

    def started(self) -> None:
        """The run has begun (its first events came): ``in_progress``."""
        self.status = "in_progress"
        self.publish(self.reply.began())

    def publish(self, events: list[bytes]) -> None:
        if events:
            self.events.extend(events)
            self._wake()

    def finish(self, final: dict[str, Any], events: list[bytes]) -> None:
        """The response's end, as stored, and its last events."""
        self.final = final
        self.status = final["status"]
        self.publish(events)

    def close(self) -> None:
        """Nothing more will be written: followers end."""
        self.ended.set()
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int, quiet: float = KEEPALIVE_SECONDS
                     ) -> AsyncGenerator[bytes, None]:
        """The events after sequence number ``after``, then each as it is written, to the
        run's end; :data:`KEEPALIVE` after every ``quiet`` seconds without one."""
        next_event = max(after + 1, 0)
        while True:
            if next_event < len(self.events):
                chunk = b"".join(self.events[next_event:])
                next_event = len(self.events)
                yield chunk
                continue
            if self.ended.is_set():
                return
            try:
                async with asyncio.timeout(quiet):
                    await self._changed.wait()
            except TimeoutError:
                yield KEEPALIVE


class BackgroundRuns:
    """The server's background responses: those running (their tasks held here, as asyncio
    keeps only a weak reference to a task), and the events of the streamed ones that
    ended, until their response leaves the store."""

    def __init__(self, max_event_bytes: int = 0) -> None:
        self._running: dict[str, BackgroundRun] = {}
        self._events: OrderedDict[str, list[bytes]] = OrderedDict()  # oldest first
        self._sizes: dict[str, int] = {}
        self.max_event_bytes = max_event_bytes  # 0: no bound
        self.event_bytes = 0  # what the finished responses' kept events come to

    def __len__(self) -> int:
        return len(self._running)

    def running(self, response_id: str) -> BackgroundRun | None:
        return self._running.get(response_id)

    def events(self, response_id: str) -> list[bytes] | None:
        """A finished streamed background response's events (None: none are kept)."""
        return self._events.get(response_id)

    def forget(self, response_id: str) -> None:
        """The response left the store: its events go with it."""
        if self._events.pop(response_id, None) is not None:
            self.event_bytes -= self._sizes.pop(response_id)

    def _keep(self, response_id: str, events: list[bytes]) -> None:
        size = sum(map(len, events))
        if self.max_event_bytes and size > self.max_event_bytes:
            return
        self._events[response_id] = events
        self._sizes[response_id] = size
        self.event_bytes += size
        while self.max_event_bytes and self.event_bytes > self.max_event_bytes:
            self.forget(next(iter(self._events)))

    def add(self, bg: BackgroundRun, work: Coroutine[Any, Any, None],
            stored: Callable[[str], bool]) -> None:
        """Run ``work`` as ``bg``'s task; once it ends, a streamed response's events stay
        while ``stored`` says its response is in the store."""
        task = asyncio.get_running_loop().create_task(work, name=f"background {bg.id}")
        bg.task = task
        self._running[bg.id] = bg

        def ended(done: asyncio.Task[None]) -> None:
            self._running.pop(bg.id, None)
            if bg.streamed and bg.refused is None and stored(bg.id):
                self._keep(bg.id, bg.events)
            if not done.cancelled() and done.exception() is not None:
                log.error("background response task failed", id=bg.id,
                          error=repr(done.exception()))

        task.add_done_callback(ended)

    async def wait(self, deadline: float) -> None:
        """Until every run has ended or ``deadline`` (a :func:`time.monotonic` reading)."""
        tasks = {bg.task for bg in self._running.values() if bg.task is not None}
        if tasks:
            await asyncio.wait(tasks, timeout=max(deadline - time.monotonic(), 0.0))
