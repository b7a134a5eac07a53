"""A request whose admission fails fails alone.

Preparing a request reads the prefix cache, whose disk tier holds files any process may
write; an exception there ended the whole step: the requests generating beside it were
failed, and the arriving one (not yet in the batch) was never answered and waited for its
deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import mlx_lm
import pytest

from afmd.engine.batch.generation_thread import BatchWorker
from afmd.engine.demo import builtin as demo
from afmd.engine.generation import Finished, Generation, GenerationRequest
from afmd.errors import APIError


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatchWorker]:
    model, tokenizer = mlx_lm.load(str(demo.materialize("demo", tmp_path_factory.mktemp("m"))))
    w = BatchWorker(model, tokenizer, name="admission-test", max_batch=4,
                    prompt_cache_bytes=0)
    w.start()
    yield w
    w.stop()


def test_a_failed_prefix_lookup_fails_only_its_request(worker: BatchWorker,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    poisoned = [7, 8, 9, 10, 11]
    stepper: Any = worker._stepper
    resume = stepper.resume

    def lookup(prompt: list[int]) -> Any:
        if prompt == poisoned:
            raise AttributeError("'list' object has no attribute 'get'")  # a file's header
        return resume(prompt)

    monkeypatch.setattr(stepper, "resume", lookup)

    async def run() -> tuple[list[Any], APIError | None, float]:
        loop = asyncio.get_running_loop()
        beside = Generation(GenerationRequest(request_id="beside", prompt=[1, 2, 3, 4],
                                              max_tokens=300), loop)
        worker.submit(beside)
        events: list[Any] = await beside.next_events()  # generating before the other comes
        arriving = Generation(GenerationRequest(request_id="poisoned", prompt=poisoned,
                                                max_tokens=8), loop)
        started = time.monotonic()
        worker.submit(arriving)
        failed: APIError | None = None
        try:
            await asyncio.wait_for(arriving.next_events(), 30)
        except APIError as exc:
            failed = exc
        answered_in = time.monotonic() - started
        while not any(isinstance(e, Finished) for e in events):
            events += await beside.next_events()
        return events, failed, answered_in

    events, failed, answered_in = asyncio.run(run())
    assert failed is not None and failed.code == "generation_failed"
    assert answered_in < 10  # at once, not at a deadline
    finished = [e for e in events if isinstance(e, Finished)]
    assert finished[-1].finish_reason in ("stop", "length")  # the other one was not failed
