"""Requests waiting for the grammar compile worker keep nothing else waiting.

The worker compiles one new grammar at a time, a second or more for a large schema.
Requests that brought new ones were built on asyncio's default executor, whose few
threads then all waited for the worker, and a plain request waited behind them; and a
request answered 504 while it waited was still compiled afterwards, keeping the worker
from the live ones.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from afmd.grammar.sandbox import COMPILE_DEADLINE, CompileAbandoned, CompileWorker

from conftest import ServerProcess, start_server

pytestmark = pytest.mark.slow


def _schema(tag: str) -> dict[str, Any]:
    """A schema new to the server (its names carry ``tag``) that takes most of a second to
    compile here: six hundred alternatives of ten properties each."""
    return {"anyOf": [
        {"type": "object", "required": [f"{tag}_{i}_0"],
         "properties": {f"{tag}_{i}_{j}": {"type": "integer"} for j in range(10)}}
        for i in range(600)]}


def _body(schema: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "demo", "max_tokens": 1,
                            "messages": [{"role": "user", "content": "hi"}]}
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": schema}}
    return body


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("grammar-waits"),
                        config="[server]\nrequest_timeout = 8\n")
    yield proc
    proc.stop()


def test_a_plain_request_does_not_wait_behind_new_schemas(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        # The worker started and given the tokenizer, so every compile below is alike.
        assert http.post("/v1/chat/completions", json=_body(_schema("warm"))).status_code == 200
    done: dict[str, tuple[float, int]] = {}

    def send(name: str, schema: dict[str, Any] | None) -> None:
        answer = httpx.post(server.url + "/v1/chat/completions", json=_body(schema),
                            timeout=120)
        done[name] = (time.monotonic(), answer.status_code)

    schemas = [threading.Thread(target=send, args=(f"s{k}", _schema(f"s{k}")))
               for k in range(8)]
    for thread in schemas:
        thread.start()
    time.sleep(0.5)  # the eight are being built, one compiling, the rest waiting
    plain = threading.Thread(target=send, args=("plain", None))
    plain.start()
    for thread in [*schemas, plain]:
        thread.join()
    finished, status = done.pop("plain")
    assert status == 200
    ends = sorted(at for at, _ in done.values())
    assert finished < ends[1], (
        f"the plain request ended {finished - ends[0]:+.2f} s after the first schema's, "
        f"{finished - ends[1]:+.2f} s after the second's")
    # Each ended: compiled and answered, or past its deadline while it waited (504).
    assert {code for _, code in done.values()} <= {200, 504}


def test_a_compile_waits_for_the_worker_no_longer_than_its_deadline() -> None:
    worker = CompileWorker()
    holder = threading.Thread(target=lambda: (worker._lock.acquire(), time.sleep(1.5),
                                              worker._lock.release()))
    holder.start()  # as a compile in progress holds it
    time.sleep(0.1)
    token = COMPILE_DEADLINE.set(time.monotonic() + 0.3)
    started = time.monotonic()
    try:
        with pytest.raises(CompileAbandoned):
            worker.validate('start: "a"', None, None)
    finally:
        COMPILE_DEADLINE.reset(token)
    assert time.monotonic() - started < 1.2  # before the holder let go
    assert worker.pid is None  # nothing was started for it, nothing compiled
    holder.join()
    try:
        assert worker.validate('start: "a"', None, None) == (False, ())  # no deadline
    finally:
        worker.close()
