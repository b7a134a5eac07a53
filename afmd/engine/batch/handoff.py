"""Handing a step's events from the generation thread to the event loop, paced.

Each hand-off wakes the event loop through a pipe and makes the two threads trade the GIL,
so between a request's first token and its finish, hand-offs are paced: one hop carries the
tokens of a few steps (a few ms of latency, invisible in a stream). A first token or a
finish goes out at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

from afmd.engine.batch.sequence import Row
from afmd.engine.generation import Event, Generation
from afmd.errors import APIError

FLUSH_INTERVAL_S = 0.008
# At most this long the thread waits for the loop to take a first token (see ``pace``).
_FIRST_TOKEN_HANDOFF_S = 0.003


class Handoff:
    """The rows with events not yet handed out, and when they last were (thread-owned)."""

    def __init__(self) -> None:
        self._unflushed: dict[int, Row] = {}
        self._last = 0.0

    def touched(self, row: Row) -> None:
        self._unflushed[id(row)] = row

    def pace(self, now: float, *, urgent: bool, first: bool) -> None:
        """Hand out what this step produced if it is ``urgent`` (a first token, a finish,
        the batch emptied) or the interval has passed."""
        if not (urgent or now - self._last >= FLUSH_INTERVAL_S):
            return
        # A first token is waited for: let the event loop send it before this thread goes
        # back to building the next step, which would hold the GIL the loop needs
        # (measured: the hand-off otherwise waits a switch interval or more).
        ack = threading.Event() if first else None
        flush(list(self._unflushed.values()), ack)
        self._unflushed.clear()
        self._last = now
        if ack is not None:
            ack.wait(_FIRST_TOKEN_HANDOFF_S)

    def clear(self) -> None:
        self._unflushed.clear()


def flush(rows: list[Row], ack: threading.Event | None = None) -> None:
    """Give each row's pending events to its generation, one hop per event loop."""
    batch = [(r.generation, r.pending) for r in rows if r.pending]
    for r in rows:
        r.pending = []
    by_loop: dict[Any, list[tuple[Generation, list[Event]]]] = {}
    for item in batch:
        by_loop.setdefault(item[0]._loop, []).append(item)
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # that loop closed (shutdown, tests)
            loop.call_soon_threadsafe(_deliver, items, ack)


def fail(generation: Generation, error: APIError) -> None:
    """End a generation with ``error``, on its own event loop."""
    with contextlib.suppress(RuntimeError):
        generation._loop.call_soon_threadsafe(generation.fail, error)


def _deliver(
    batch: list[tuple[Generation, list[Event]]], ack: threading.Event | None = None
) -> None:
    for generation, events in batch:
        generation.push(events)
    if ack is not None:
        # Queued behind the consumers that push() just woke: set once they have run.
        asyncio.get_running_loop().call_soon(ack.set)
