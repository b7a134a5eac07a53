"""The events that finished background streams leave behind, held to their bound."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from afmd.dialects.responses.background import BackgroundRun, BackgroundRuns


def _finished(runs: BackgroundRuns, response_id: str, size: int) -> None:
    """A streamed background run whose task wrote ``size`` bytes of events and ended."""
    reply: Any = SimpleNamespace(id=response_id)
    bg = BackgroundRun(reply, f"req_{response_id}", [b"x" * size], streamed=True)

    async def work() -> None:
        return None

    async def run() -> None:
        runs.add(bg, work(), lambda rid: True)
        assert bg.task is not None
        await bg.task
        await asyncio.sleep(0)  # the done callback

    asyncio.run(run())


def test_the_oldest_streams_go_past_the_bound_and_the_store_still_drops_them() -> None:
    runs = BackgroundRuns(max_event_bytes=1000)
    for name in ("a", "b", "c"):
        _finished(runs, name, 400)
    assert runs.events("a") is None  # pushed out: 1,200 bytes were over the bound
    assert runs.events("b") == [b"x" * 400] and runs.events("c") == [b"x" * 400]
    assert runs.event_bytes == 800
    runs.forget("b")  # its response left the store
    assert runs.events("b") is None and runs.event_bytes == 400
    runs.forget("b")  # twice is nothing
    assert runs.event_bytes == 400


def test_a_stream_larger_than_the_bound_is_not_kept_and_pushes_none_out() -> None:
    runs = BackgroundRuns(max_event_bytes=1000)
    _finished(runs, "a", 600)
    _finished(runs, "big", 1001)
    assert runs.events("big") is None
    assert runs.events("a") is not None and runs.event_bytes == 600


def test_no_bound_keeps_them_all() -> None:
    runs = BackgroundRuns()
    for name in ("a", "b"):
        _finished(runs, name, 10_000)
    assert runs.event_bytes == 20_000
