"""What the event loop sends the generation thread: requests, wake-ups, a stop."""

from __future__ import annotations

import queue
from typing import Any

from afmd.engine.generation import Generation

_WAKE = object()
_STOP = object()


class Inbox:
    """A queue the thread blocks on only when it has nothing running."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def put(self, generation: Generation) -> None:
        self._queue.put(generation)

    def wake(self) -> None:
        """Make the thread look at cancellation flags even if it is idle."""
        self._queue.put(_WAKE)

    def stop(self) -> None:
        self._queue.put(_STOP)

    def take(self, *, block: bool) -> list[Generation] | None:
        """The requests that arrived (``None``: stop; the requests that came with it stay
        for :meth:`drain`)."""
        items: list[Any] = [self._queue.get()] if block else []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if any(item is _STOP for item in items):
            for item in items:
                if isinstance(item, Generation):
                    self._queue.put(item)
            return None
        return [item for item in items if isinstance(item, Generation)]

    def drain(self) -> list[Generation]:
        """The requests still waiting (the thread is stopping)."""
        left: list[Generation] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return left
            if isinstance(item, Generation):
                left.append(item)
