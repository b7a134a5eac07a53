"""Transient model failures are retried while nothing reached the client; loading is `busy`.

``AFMD_INJECT_FAILURES=N`` makes the first N decode steps of a model's worker fail as a
transient MLX error would. End to end: one failure is absorbed by a retry; more failures
than ``[engine] retries`` give a plain 500 ``generation_failed`` (also for a stream: its
200 is sent only with the first token). In process: no retry once output was sent or a
server tool ran, and 503 ``busy`` while a model loads.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from afmd.config.load import load_config
from afmd.config.tables import ModelEntry, ServerTool
from afmd.core.events import Finish
from afmd.dialects.openai.chat_body import parse_chat_request
from afmd.engine.models import model_registry as models_module
from afmd.engine.models.loaded_model import LoadedModel
from afmd.engine.models.model_registry import ModelRegistry
from afmd.engine.models.residency import Lease
from afmd.errors import APIError, ServiceUnavailableError
from afmd.service.chat_run import ChatRun
from afmd.service.pipeline import ChatPipeline
from afmd.service.scheduler import Scheduler
from afmd.service.servertools import ServerTools, ToolOutcome

from conftest import ServerProcess, start_server
from helpers.openai_schemas import validate_error, validate_response

CHAT = "/v1/chat/completions"


def body(*, stream: bool = False, max_tokens: int = 8) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def retry_events(server: ServerProcess, request_id: str) -> list[dict[str, Any]]:
    return [e for e in server.events
            if e.get("event") == "retrying generation" and e.get("request_id") == request_id]


def post(server: ServerProcess, payload: dict[str, Any]) -> tuple[httpx.Response, float, str]:
    rid = "retry-" + uuid.uuid4().hex[:10]
    started = time.monotonic()
    response = httpx.post(server.url + CHAT, json=payload, timeout=60,
                          headers={"X-Request-ID": rid})
    return response, time.monotonic() - started, rid


# --------------------------------------------------------------------------- e2e


@pytest.fixture(scope="module")
def one_failure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Default [engine] settings (retries 2, backoff 0.2 s); the first decode step fails."""
    proc = start_server(tmp_path_factory.mktemp("retry-once"),
                        env={"AFMD_INJECT_FAILURES": "1"})
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def always_failing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("retry-fail"),
        config="[engine]\nretries = 1\nretry_backoff = 0.3\n",
        env={"AFMD_INJECT_FAILURES": "1000"},
    )
    yield proc
    proc.stop()


def test_a_transient_failure_is_retried(one_failure: ServerProcess) -> None:
    response, elapsed, rid = post(one_failure, body())
    assert response.status_code == 200, response.text
    validate_response(response.json())
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    event = one_failure.wait_event("retrying generation", timeout=5, request_id=rid)
    assert event["attempt"] == 1
    assert event["delay_s"] == pytest.approx(0.2)
    assert elapsed >= 0.2  # the backoff was waited
    assert len(retry_events(one_failure, rid)) == 1
    # The failure itself is logged too, and the server keeps serving.
    again, _, rid2 = post(one_failure, body(stream=True))
    assert again.status_code == 200
    assert retry_events(one_failure, rid2) == []


def test_persistent_failure_is_a_500(always_failing: ServerProcess) -> None:
    response, elapsed, rid = post(always_failing, body())
    assert response.status_code == 500, response.text
    error = response.json()
    validate_error(error)
    assert error["error"]["code"] == "generation_failed"
    assert error["error"]["type"] == "server_error"
    # retries = 1: one retry, after retry_backoff.
    events = retry_events(always_failing, rid)
    assert [e["attempt"] for e in events] == [1]
    assert events[0]["delay_s"] == pytest.approx(0.3)
    assert elapsed >= 0.3


def test_persistent_failure_before_the_first_token_is_a_plain_500_for_streams(
    always_failing: ServerProcess,
) -> None:
    response, elapsed, rid = post(always_failing, body(stream=True))
    # Not a 200 with an error chunk: the stream's status waits for the first token.
    assert response.status_code == 500, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()
    validate_error(error)
    assert error["error"]["code"] == "generation_failed"
    assert [e["attempt"] for e in retry_events(always_failing, rid)] == [1]
    assert elapsed >= 0.3
    assert always_failing.proc.poll() is None


@pytest.fixture(scope="module")
def slow_retry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A retry 30 s after a failure; the first two decode steps fail (one per test)."""
    proc = start_server(tmp_path_factory.mktemp("retry-slow"),
                        config="[engine]\nretries = 1\nretry_backoff = 30.0\n",
                        env={"AFMD_INJECT_FAILURES": "2"})
    yield proc
    proc.stop()


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_a_cancel_during_the_retry_backoff_ends_the_request(
    slow_retry: ServerProcess, path: str
) -> None:
    """Cancelled while it waits to retry, a request ends at once as cancelled: before, the
    cancel found no generation to stop, and the retry then generated to its end."""
    rid = "backoff-" + uuid.uuid4().hex[:10]
    payload = ({"prompt": "Say something.", "max_tokens": 64, "temperature": 0}
               if path != CHAT else body(max_tokens=64))
    result: dict[str, Any] = {}

    def send() -> None:
        result["response"] = httpx.post(slow_retry.url + path, json=payload, timeout=90,
                                        headers={"X-Request-ID": rid})

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    slow_retry.wait_event("retrying generation", timeout=30, request_id=rid)
    started = time.monotonic()
    cancelled = httpx.post(f"{slow_retry.url}{path}/{rid}/cancel", timeout=10)
    assert cancelled.status_code == 200 and cancelled.json()["cancelled"] is True
    thread.join(60)
    assert not thread.is_alive()
    assert time.monotonic() - started < 10, "the back-off was waited out"
    response = result["response"]
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "cancelled"
    assert response.json()["usage"]["completion_tokens"] == 0


# --------------------------------------------------------------------------- in process


@pytest.fixture(scope="module")
def demo_model() -> Iterator[LoadedModel]:
    registry = ModelRegistry(load_config(None, env={}))
    entry = registry.resolve("demo")

    async def load() -> LoadedModel:
        return await registry.begin_load(entry)

    model = asyncio.run(load())
    yield model
    model.worker._faults.left = 0
    registry.close()


@pytest.fixture()
def worker_faults(demo_model: LoadedModel) -> Iterator[Any]:
    """Set how many of the next decode steps fail; reset afterwards."""

    def arm(n: int) -> None:
        demo_model.worker._faults.left = n

    yield arm
    demo_model.worker._faults.left = 0


def pipeline_for(model: LoadedModel, tmp_path: Path, toml: str = "",
                 tools: ServerTools | None = None) -> ChatPipeline:
    path = tmp_path / f"c-{uuid.uuid4().hex[:6]}.toml"
    path.write_text(toml)

    class Registry(ModelRegistry):
        async def lease(self, entry: ModelEntry, *args: Any, **kwargs: Any) -> Lease:
            return Lease.detached(model)

    return ChatPipeline(Registry(load_config(path, env={})), Scheduler(2, 2),
                        request_timeout=60, tools=tools)


async def start(pipeline: ChatPipeline, payload: dict[str, Any]) -> ChatRun:
    request = parse_chat_request(payload, server_tools=pipeline.server_tools.names)
    prepared = await pipeline.prepare(request, "rq-" + uuid.uuid4().hex[:8])
    return await pipeline.start(prepared)


async def drain(run: ChatRun) -> list[Any]:
    outputs: list[Any] = []
    async for batch in run:
        outputs += batch
    return outputs


def test_in_process_retry_then_success(
    demo_model: LoadedModel, tmp_path: Path, worker_faults: Any
) -> None:
    pipeline = pipeline_for(demo_model, tmp_path, "[engine]\nretries = 2\nretry_backoff = 0\n")
    worker_faults(2)

    async def go() -> tuple[ChatRun, list[Any]]:
        run = await start(pipeline, body())
        try:
            return run, await drain(run)
        finally:
            pipeline.release(run)

    run, outputs = asyncio.run(go())
    assert run.attempt == 2
    assert isinstance(outputs[-2], Finish)
    assert outputs[-2].reason in ("stop", "length")


def test_in_process_retries_exhausted(
    demo_model: LoadedModel, tmp_path: Path, worker_faults: Any
) -> None:
    pipeline = pipeline_for(demo_model, tmp_path, "[engine]\nretries = 2\nretry_backoff = 0.05\n")
    worker_faults(3)

    async def go() -> ChatRun:
        run = await start(pipeline, body())
        try:
            with pytest.raises(APIError) as info:
                await drain(run)
            assert info.value.code == "generation_failed"
            assert info.value.status == 500
            return run
        finally:
            pipeline.release(run)

    started = time.monotonic()
    run = asyncio.run(go())
    assert run.attempt == 2
    assert time.monotonic() - started >= 0.05 + 0.1  # backoff doubles each time


def test_no_retry_once_output_reached_the_client(
    demo_model: LoadedModel, tmp_path: Path, worker_faults: Any
) -> None:
    pipeline = pipeline_for(demo_model, tmp_path, "[engine]\nretries = 5\nretry_backoff = 0\n")

    async def go() -> ChatRun:
        run = await start(pipeline, body(max_tokens=2000))
        try:
            first = await anext(aiter(run))
            assert first and not run.finished  # something went out
            worker_faults(1000)
            with pytest.raises(APIError) as info:
                await drain(run)
            assert info.value.code == "generation_failed"
            return run
        finally:
            pipeline.release(run)

    run = asyncio.run(go())
    assert run.attempt == 0


class TrippingTools(ServerTools):
    """Server tools that make the model fail right after a tool ran."""

    def __init__(self, tools: tuple[ServerTool, ...], model: LoadedModel) -> None:
        super().__init__(tools)
        self._model = model
        self.runs = 0

    async def run(self, name: str, arguments: str) -> ToolOutcome:
        self.runs += 1
        self._model.worker._faults.left = 1000
        return ToolOutcome('{"result": 1}', ok=True)


def test_no_retry_once_a_server_tool_ran(
    demo_model: LoadedModel, tmp_path: Path, worker_faults: Any
) -> None:
    # Arguments can only be {}: the forced call always completes well within max_tokens.
    empty = {"type": "object", "properties": {}, "additionalProperties": False}
    tools = TrippingTools(
        (ServerTool(name="trip", command=("true",), parameters=empty),), demo_model
    )
    pipeline = pipeline_for(demo_model, tmp_path, "[engine]\nretries = 5\nretry_backoff = 0\n",
                            tools=tools)
    payload = {**body(max_tokens=64), "reasoning_effort": "none", "parallel_tool_calls": False,
               "tool_choice": {"type": "function", "function": {"name": "trip"}}}

    async def go() -> ChatRun:
        run = await start(pipeline, payload)
        try:
            with pytest.raises(APIError) as info:
                await drain(run)
            assert info.value.code == "generation_failed"
            return run
        finally:
            pipeline.release(run)

    run = asyncio.run(go())
    assert tools.runs == 1  # the tool ran once and was not re-run by a retry
    assert run.attempt == 0


# --------------------------------------------------------------------------- busy


class _Loaded:
    """What the registry reads of a loaded model."""

    worker = embedder = None
    kind = "chat"
    weights_bytes = memory_bytes = 0
    id = "demo"
    last_used = 0.0
    reads_conversation = False  # an MLX model (Apple's reads the conversation itself)

    def touch(self) -> None:
        pass


def test_busy_while_a_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    release = threading.Event()

    def slow_load(entry: ModelEntry, config: Any) -> Any:
        calls.append(entry.id)
        release.wait(10)
        return _Loaded()

    monkeypatch.setattr(models_module, "load_sync", slow_load)
    registry = ModelRegistry(load_config(None, env={}))
    entry = registry.resolve("demo")

    async def go() -> Any:
        for _ in range(2):  # a second request does not start a second load
            with pytest.raises(ServiceUnavailableError) as info:
                # A request waits for the load until its deadline (request_timeout).
                await registry.get(entry, deadline=time.monotonic() + 0.2)
            error = info.value
            assert error.status == 503
            assert error.code == "busy"
            assert int(error.headers["Retry-After"]) >= 1
            assert "loading" in error.message
            assert registry.loads.is_loading("demo")
            assert registry.status()["demo"] == "unavailable: loading"
        release.set()
        return await registry.get(entry)

    started = time.monotonic()
    loaded = asyncio.run(go())
    assert isinstance(loaded, _Loaded)
    assert calls == ["demo"]
    assert registry.is_ready("demo")
    assert time.monotonic() - started < 5
    registry.close()


def test_a_fast_load_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models_module, "load_sync", lambda entry, config: _Loaded())
    registry = ModelRegistry(load_config(None, env={}))
    loaded = asyncio.run(registry.get(registry.resolve("demo")))
    assert isinstance(loaded, _Loaded)  # no 503 for a model ready within the wait
