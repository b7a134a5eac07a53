"""The engine's two paths (afmd/engine/batch/backend.py), each against mlx-lm's own generation.

The CPU path (host-side projection and log-softmax, the transposed output projection) is
what runs here by default; the GPU path (everything in MLX, the model warmed up at load) is
what Metal and CUDA users run. ``AFMD_BACKEND_LAYOUT`` forces either, so both are checked on
this CPU machine: the same requests, decoded alone and batched, must give what
``mlx_lm.generate.generate_step`` gives one row at a time, tokens and log-probabilities, with
the tolerances of the device the tests run on (tests/helpers/numerics.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from afmd.engine.batch import backend, logprobs
from afmd.engine.batch.backend import Backend
from afmd.engine.batch.cpu_layout import TransposedLinear, relayout_for_cpu
from afmd.engine.batch.generation_thread import BatchWorker
from afmd.engine.demo import builtin as demo
from afmd.engine.generation import (
    Finished,
    Generation,
    GenerationRequest,
    SamplingParams,
    Text,
    TokenIdLogprob,
)
from afmd.engine.speculative.verify_head import DeviceHead, HostHead, VerifyHead

from helpers.numerics import (
    LOGPROB_TOLERANCE,
    assert_greedy_agrees,
    assert_top_agrees,
    layout,
)

LAYOUTS = ("cpu", "gpu")
GREEDY = SamplingParams(temperature=0.0)
TEXTS = ("write me a story about a cat", "def fibonacci(n):", "The quick brown fox",
         "explain relativity to a child, please")


# -- the switch -----------------------------------------------------------------------


def test_the_switch_and_the_device() -> None:
    assert backend._resolve("auto", "cpu") == Backend("cpu", "cpu")
    assert backend._resolve("auto", "metal") == Backend("gpu", "metal")
    assert backend._resolve("auto", "cuda") == Backend("gpu", "cuda")
    assert backend._resolve("gpu", "cpu") == Backend("gpu", "cpu", forced=True)
    assert backend._resolve("cpu", "metal") == Backend("cpu", "metal", forced=True)
    with pytest.raises(ValueError, match=r"AFMD_BACKEND_LAYOUT='fast'.*auto, cpu, gpu"):
        backend._resolve("fast", "cpu")
    assert Backend("cpu", "cpu").host_layout and not Backend("cpu", "cpu").warms_up
    assert Backend("gpu", "cuda").warms_up and not Backend("gpu", "cuda").host_layout


def test_current_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    device = backend.device_kind()  # "cpu" here; the tests run on a GPU machine too
    auto = Backend("cpu" if device == "cpu" else "gpu", device)
    monkeypatch.delenv(backend.ENV, raising=False)
    assert backend.current() == auto
    monkeypatch.setenv(backend.ENV, " GPU ")
    assert backend.current() == Backend("gpu", device, forced=True)
    assert "forced by AFMD_BACKEND_LAYOUT" in backend.current().describe()
    monkeypatch.setenv(backend.ENV, "")
    assert backend.current() == auto


def test_an_unknown_choice_fails_the_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path
                                          ) -> None:
    from afmd.config.sections import Config
    from afmd.config.tables import ModelEntry
    from afmd.engine.models.loading import load_sync

    monkeypatch.setenv(backend.ENV, "tpu")
    with pytest.raises(ValueError, match=r"AFMD_BACKEND_LAYOUT='tpu'"):
        load_sync(ModelEntry(id="demo", path="afmd:demo"), Config())


def test_mlx_settings_on_cuda_only_keeping_an_operators_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    monkeypatch.setenv("MLX_CUDA_GRAPH_CACHE_SIZE", "123")
    monkeypatch.delenv("MLX_CUDA_SDPA_CACHE_SIZE", raising=False)
    monkeypatch.setattr(backend, "device_kind", lambda: "metal")
    backend.prepare_mlx()  # nothing to set off MLX's CUDA backend
    assert "MLX_CUDA_SDPA_CACHE_SIZE" not in os.environ
    monkeypatch.setattr(backend, "device_kind", lambda: "cuda")
    backend.prepare_mlx()
    assert os.environ["MLX_CUDA_GRAPH_CACHE_SIZE"] == "123"
    assert os.environ["MLX_CUDA_SDPA_CACHE_SIZE"] == backend.CUDA_CACHE_SIZES[
        "MLX_CUDA_SDPA_CACHE_SIZE"]


def test_verification_builds_plans_only_in_half_precision_on_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    half = nn.Linear(4, 4)
    half.set_dtype(mx.bfloat16)
    full = nn.Linear(4, 4)
    cuda, metal = Backend("gpu", "cuda"), Backend("gpu", "metal")
    assert backend.compute_dtype(half) == "bfloat16"
    assert backend.verify_builds_plans(half, cuda)
    assert not backend.verify_builds_plans(full, cuda)
    assert not backend.verify_builds_plans(half, metal)
    assert not backend.verify_builds_plans(half, Backend("cpu", "cpu"))
    assert backend.verify_builds_plans(half) == (backend.device_kind() == "cuda")
    monkeypatch.setenv("MLX_CUDA_USE_CUDNN_SDPA", "0")
    assert not backend.verify_builds_plans(half, cuda)
    q = nn.QuantizedLinear(64, 64)
    assert backend.compute_dtype(q) == "float32"  # its scales


# -- each choice follows the switch ---------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.materialize("demo", tmp_path_factory.mktemp("backend-cache"))


@pytest.fixture(scope="module", params=LAYOUTS)
def path(request: pytest.FixtureRequest, folder: Path) -> Iterator[tuple[str, Any, Any]]:
    """(layout, model, tokenizer): the demo model loaded as afmd loads it on that path,
    the path forced while the module's tests use it."""
    with layout(request.param):
        model, tokenizer = mlx_lm.load(str(folder))
        relayout_for_cpu(model)
        yield request.param, model, tokenizer


@pytest.fixture(scope="module")
def worker(path: tuple[str, Any, Any]) -> Iterator[BatchWorker]:
    name, model, tokenizer = path
    w = BatchWorker(model, tokenizer, name=f"backend-{name}", max_batch=8,
                    prompt_cache_bytes=0, prompt_lookup=False)
    w.start()
    assert w.ready(60)
    yield w
    w.stop()


def test_each_choice_follows_the_path(path: tuple[str, Any, Any]) -> None:
    name, model, _ = path
    on_cpu_path = name == "cpu"
    assert isinstance(model.lm_head, TransposedLinear) == on_cpu_path
    assert isinstance(VerifyHead.of(model), HostHead) == on_cpu_path
    assert isinstance(VerifyHead.of(model), DeviceHead) != on_cpu_path
    assert logprobs._on_host() == on_cpu_path
    assert backend.current().warms_up != on_cpu_path


def _prompt(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True))


def reference(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """mlx-lm's own greedy generation: its tokens and each step's log-probabilities."""
    tokens: list[int] = []
    rows: list[np.ndarray] = []
    for token, lp in generate_step(mx.array(prompt), model, max_tokens=n,
                                   sampler=lambda x: mx.argmax(x, axis=-1)):
        tokens.append(int(token))
        rows.append(np.array(lp.astype(mx.float32)).reshape(-1))
    return tokens, rows


def run(worker: BatchWorker, *requests: GenerationRequest) -> list[list[Any]]:
    """Every request's engine events, submitted to the running batch together."""

    async def one(request: GenerationRequest) -> list[Any]:
        generation = Generation(request, asyncio.get_running_loop())
        worker.submit(generation)
        events: list[Any] = []
        while not any(isinstance(e, Finished) for e in events):
            events += await generation.next_events()
        return events

    async def every() -> list[list[Any]]:
        return list(await asyncio.gather(*(one(r) for r in requests)))

    return asyncio.run(every())


def _request(prompt: list[int], n: int, **extra: Any) -> GenerationRequest:
    return GenerationRequest(f"r{time.monotonic_ns()}", prompt, n, sampling=GREEDY, **extra)


def _entries(events: list[Any]) -> list[TokenIdLogprob]:
    return [e.logprobs[0] for e in events if isinstance(e, Text) and e.logprobs]


def _tokens_of(events: list[Any]) -> list[int]:
    return [e.token for e in _entries(events)]


def test_greedy_output_is_mlx_lm_generate_alone_and_batched(
    path: tuple[str, Any, Any], worker: BatchWorker
) -> None:
    """Each prompt alone and all four in one batch: the tokens mlx-lm generates for it
    (read from the log-probabilities each token carries, so ids are compared, not text)."""
    _, model, tokenizer = path
    prompts = [_prompt(tokenizer, t) for t in TEXTS]
    n = 24
    alone = [_tokens_of(run(worker, _request(p, n, logprobs=0))[0]) for p in prompts]
    together = [_tokens_of(e) for e in run(worker, *(_request(p, n, logprobs=0)
                                                      for p in prompts))]
    for prompt, one, batched in zip(prompts, alone, together, strict=True):
        want, _ = reference(model, prompt, n)
        want = want[: len(one)]  # a row ends at an end-of-sequence token, unseen
        assert one and len(one) == len(batched)
        assert_greedy_agrees(model, prompt, one, want)
        assert_greedy_agrees(model, prompt, batched, one)


def test_logprobs_are_mlx_lm_generates(path: tuple[str, Any, Any], worker: BatchWorker
                                       ) -> None:
    """Rows asking for 5 alternatives beside a row asking for none, batched: each token's
    number and alternatives are those of mlx-lm's own step for that sequence."""
    _, model, tokenizer = path
    prompts = [_prompt(tokenizer, t) for t in TEXTS[:3]]
    n = 12
    events = run(worker, _request(prompts[0], n, logprobs=5), _request(prompts[1], n),
                 _request(prompts[2], n, logprobs=5))
    assert _entries(events[1]) == []
    for prompt, got in ((prompts[0], _entries(events[0])), (prompts[2], _entries(events[2]))):
        want, rows = reference(model, prompt, n)
        assert_greedy_agrees(model, prompt, [e.token for e in got], want[: len(got)])
        for entry, row, token in zip(got, rows, want, strict=False):
            if entry.token != token:
                break  # a near-tie off the CPU: each follows its own token from here
            assert abs(entry.logprob - float(row[token])) <= LOGPROB_TOLERANCE
            assert_top_agrees(entry.top, row, 5)


def test_the_gpu_path_warms_the_model_up_and_keeps_nothing_of_it(
    path: tuple[str, Any, Any],
) -> None:
    """The warm-up decodes three rows on the GPU path, none on the CPU path, and leaves
    no row, no prefix-cache entry and no number kept for a row; the first request after
    it decodes what mlx-lm generates."""
    name, model, tokenizer = path
    w = BatchWorker(model, tokenizer, name=f"warm-{name}")
    w.start()
    try:
        assert w.ready(60)
        stepper = w._stepper
        assert stepper._generator is not None and stepper.batch is not None
        assert stepper._generator._uid_count == (3 if name == "gpu" else 0)
        assert stepper.cache_bytes == 0 and stepper.batch.uids == []
        assert stepper.batch.logprob_rows == {} and stepper.batch.spec_rows == {}
        prompt = _prompt(tokenizer, TEXTS[0])
        (events,) = run(w, _request(prompt, 6, logprobs=0))
        got = _tokens_of(events)
        want, _ = reference(model, prompt, 6)
        assert_greedy_agrees(model, prompt, got, want[: len(got)])
    finally:
        w.stop()


def test_prompt_lookup_is_off_where_verification_builds_plans(
    path: tuple[str, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a verification pass would build an attention plan (MLX's CUDA backend in
    half precision), a row gets no prompt-lookup source; a prediction still speculates."""
    from afmd.engine.batch.admission import Admissions
    from afmd.engine.batch.stepper import Stepper

    _, model, tokenizer = path
    prompt = _prompt(tokenizer, TEXTS[0])

    async def spec_of(builds: bool, **extra: Any) -> Any:
        monkeypatch.setattr(backend, "verify_builds_plans", lambda *_: builds)
        stepper = Stepper(model, tokenizer, name="gate", prompt_cache_bytes=0)
        stepper.reset()
        try:
            admissions = Admissions(stepper, prompt_lookup=True, draft_model=None,
                                    speculates=True)
            generation = Generation(_request(prompt, 4, **extra), asyncio.get_running_loop())
            joining = admissions.prepare(generation)
            assert joining is not None
            row = admissions.admit(joining)
            assert row is not None
            return row.spec
        finally:
            stepper.close()

    assert asyncio.run(spec_of(False)).stats() == {
        "prompt_lookup": {"accepted": 0, "rejected": 0, "verifications": 0}}
    assert asyncio.run(spec_of(True)) is None
    assert list(asyncio.run(spec_of(True, prediction="a cat")).stats()) == ["prediction"]


def test_the_step_trace_accounts_for_every_token(
    path: tuple[str, Any, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``AFMD_STEP_TRACE``: one line per iteration of the generation thread, whose tokens
    add up to what the requests received and whose waits fit inside their step calls."""
    import json

    from afmd.engine.batch import steptrace

    name, model, tokenizer = path
    trace = tmp_path / "steps.jsonl"
    monkeypatch.setenv(steptrace.ENV, str(trace))
    w = BatchWorker(model, tokenizer, name=f"trace-{name}", prompt_cache_bytes=0,
                    prompt_lookup=False)
    w.start()
    try:
        events = run(w, *(_request(_prompt(tokenizer, t), 10) for t in TEXTS[:3]))
    finally:
        w.stop()
    finished = [next(e for e in evs if isinstance(e, Finished)) for evs in events]
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert lines and {line["model"] for line in lines} == {f"trace-{name}"}
    ended = sum(f.finish_reason == "stop" for f in finished)  # an unseen end token
    assert sum(line["tokens"] for line in lines) == sum(
        f.completion_tokens for f in finished) + ended
    assert max(line["rows"] for line in lines) == 3
    for line in lines:
        assert 0 <= line["wait_ms"] <= line["next_ms"] + 0.01
        assert min(line["admit_ms"], line["deliver_ms"]) >= 0
