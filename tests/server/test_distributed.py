"""``afmd launch``: one endpoint over two ranks (MLX's ring backend on loopback, CPU).

Every group here is the real thing: ``afmd launch -n 2 -- serve --config FILE`` as a child
process, MLX's launcher under it, two ``afmd serve`` ranks each holding half of
``demo-32k``. Answers are compared token for token with a single-process ``afmd serve`` of
the same model, and the faults are real: a rank killed with SIGKILL or stopped with
SIGSTOP mid-stream.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from afmd.ports import first_source_port, free_ports

from helpers.servers import ROOT, ServerProcess, afmd_command, start_server

pytestmark = pytest.mark.slow  # each group is four processes starting MLX

CONFIG = """
[models]
default = "demo-32k"
[distributed]
strategy = "{strategy}"
heartbeat_timeout = {heartbeat}
"""
PROMPTS = ["hello there", "tell me a story about a cat", "1 2 3 4", "why is the sky blue?"]
#: A rank lost must end the group within this many seconds (detection, the hold that
#: lets clients read why, and the launcher's teardown).
LOSS_BOUND_S = 30.0


def start_group(tmp_path: Path, strategy: str = "auto", port: int = 0,
                heartbeat: float = 8.0) -> ServerProcess:
    """Two ranks under ``afmd launch``. A heartbeat timeout well above the heartbeat's
    period: a loaded machine must not make a healthy rank look lost."""
    config = tmp_path / f"group-{strategy}-{time.monotonic_ns()}.toml"
    config.write_text(CONFIG.format(strategy=strategy, heartbeat=heartbeat)
                      + f"[server]\nport = {port}\n")
    proc = subprocess.Popen(
        [*afmd_command(), "launch", "-n", "2", "--", "serve", "--config", str(config),
         "--log-format", "json"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, cwd=str(ROOT), env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        start_new_session=True,
    )
    # ServerProcess reads the log from stderr; the launcher relays the ranks' on stdout.
    proc.stderr = proc.stdout
    group = ServerProcess(proc)
    threading.Thread(target=group._reader, daemon=True).start()
    try:
        group.wait_event("listening", timeout=120)
        group.wait_ready(timeout=120)
    except AssertionError:
        _stop(group, signal.SIGKILL, timeout=10)
        raise
    return group


def _chat(url: str, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"model": "demo-32k", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 24, "temperature": 0, **extra}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _answer(url: str, prompt: str) -> tuple[str, int]:
    body = _chat(url, prompt)
    return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]


def _stream(url: str, prompt: str, headers: dict[str, str] | None = None,
            **extra: Any) -> Iterator[dict[str, Any]]:
    body = {"model": "demo-32k", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 24, "temperature": 0, "stream": True, **extra}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60,
                      headers=headers) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def _stop(group: ServerProcess, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    if group.proc.poll() is None:
        group.proc.send_signal(sig)
    try:
        return group.proc.wait(timeout)
    finally:
        if group.proc.poll() is None:
            os.killpg(group.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("single"),
                          config='[models]\ndefault = "demo-32k"\n')
    yield server
    server.stop()


@pytest.fixture(scope="module")
def expected(single: ServerProcess) -> dict[str, tuple[str, int]]:
    """Each prompt's greedy answer from one process: what the group must reproduce."""
    return {prompt: _answer(single.url, prompt) for prompt in PROMPTS}


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # A fixed port, so that `afmd doctor --config` finds it as it would a user's. A port
    # found free can be taken before the group binds it (other tests' servers and clients
    # take ports all the time): then the group fails to start, and another port is tried.
    folder = tmp_path_factory.mktemp("group")
    for attempt in range(3):
        try:
            group = start_group(folder, port=free_ports())
            break
        except AssertionError as exc:
            if "already in use" not in str(exc) or attempt == 2:
                raise
    group.config = max(folder.glob("group-auto-*.toml"))  # the last one tried (ns names)
    yield group
    if group.proc.poll() is None:
        _stop(group)


def _health(group: ServerProcess) -> dict[str, Any]:
    """``/health`` once every rank has reported its shard (a follower reports the moment
    its shard is loaded, which may be just after rank 0 is ready)."""
    deadline = time.monotonic() + 5
    while True:
        health = httpx.get(group.url + "/health", timeout=5).json()
        shards = [r["shard"] for r in health["distributed"]["ranks"]]
        if "loading" not in shards or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def test_rank_ports_are_free_and_outside_the_source_ports() -> None:
    """The ranks bind their ports seconds after they are chosen: a port from the range the
    OS takes connections' source ports from could be taken meanwhile (a loaded test run
    once failed so, "[ring] Couldn't bind socket"), so they come from below it."""
    low = first_source_port()
    firsts = {free_ports(4) for _ in range(20)}
    assert len(firsts) > 1  # a random place: two launches at once do not collide
    for first in firsts:
        assert first + 4 <= low
        for port in range(first, first + 4):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))


def test_health_reports_every_rank(group: ServerProcess) -> None:
    health = _health(group)
    assert health["status"] == "ok"
    distributed = health["distributed"]
    assert distributed["size"] == 2 and distributed["strategy"] == "tensor"
    ranks = distributed["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["connected"] and r["pid"] > 0 and r["host"] for r in ranks)
    assert all(r["shard"] == "tensor: 1/2 of layers 0-1" for r in ranks)
    assert ranks[1]["memory"]["active_bytes"] > 0
    assert ranks[0]["pid"] != ranks[1]["pid"]


def test_doctor_reports_every_rank_through_rank_0(group: ServerProcess) -> None:
    _health(group)
    done = subprocess.run([*afmd_command(), "doctor", "--json", "--config", str(group.config)],
                          capture_output=True, text=True, timeout=60)
    report = json.loads(done.stdout)
    ranks = report["distributed"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["shard"].startswith("tensor") and r["host"] for r in ranks)
    assert ranks[1]["memory"]["active_bytes"] > 0
    screen = subprocess.run([*afmd_command(), "doctor", "--config", str(group.config)],
                            capture_output=True, text=True, timeout=60).stdout
    assert "ranks      2 (tensor)" in screen
    assert f"rank 1   {ranks[1]['host']} pid {ranks[1]['pid']}: tensor" in screen


def test_greedy_output_equals_one_process(
    group: ServerProcess, expected: dict[str, tuple[str, int]]
) -> None:
    for prompt in PROMPTS:
        assert _answer(group.url, prompt) == expected[prompt], prompt


#: Requests whose work is rank 0's alone (grammar masks, a seeded sampler, tool calls):
#: the other ranks only see the tokens, and the answers must still be the single process's.
RANK0_REQUESTS: list[dict[str, Any]] = [
    {"temperature": 0.9, "seed": 7, "max_tokens": 32},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "legs": {"type": "integer"}},
        "required": ["name", "legs"]}}}, "max_tokens": 60},
    {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"]}}}], "tool_choice": "required", "max_tokens": 60},
]


def test_grammars_tools_and_seeded_sampling_match_one_process(
    group: ServerProcess, single: ServerProcess
) -> None:
    for extra in RANK0_REQUESTS:
        mine = _chat(group.url, PROMPTS[1], **extra)["choices"][0]
        theirs = _chat(single.url, PROMPTS[1], **extra)["choices"][0]
        for message in (mine["message"], theirs["message"]):
            for call in message.get("tool_calls") or ():
                call.pop("id")  # random per call
        assert mine["message"] == theirs["message"], extra
        assert mine["finish_reason"] == theirs["finish_reason"]
    called = _chat(group.url, PROMPTS[1], **RANK0_REQUESTS[2])["choices"][0]
    assert called["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    shaped = _chat(group.url, PROMPTS[1], **RANK0_REQUESTS[1])["choices"][0]
    assert shaped["message"]["content"].startswith('{"name"')  # the grammar held


def test_prompt_logprobs_and_completions_match_one_process(
    group: ServerProcess, single: ServerProcess
) -> None:
    """echo + logprobs with max_tokens 0 is a forward pass over the prompt alone (every
    rank runs it), then a plain completion reuses the same batch. max_tokens 0 alone puts
    the prompt in the prefix cache on every rank, so the completion after it resumes from
    the same cached prefix everywhere (a rank that had not warmed is out of step)."""
    for body in ({"prompt": "one two three four", "echo": True, "logprobs": 2,
                  "max_tokens": 0},
                 {"prompt": "def add(a, b):", "max_tokens": 0},
                 {"prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0}):
        answers = [httpx.post(url + "/v1/completions", timeout=60,
                              json={"model": "demo-32k", **body}).json()
                   for url in (group.url, single.url)]
        mine, theirs = (a["choices"][0] for a in answers)
        assert mine["text"] == theirs["text"]
        if mine["logprobs"] is not None:
            for ours, want in zip(mine["logprobs"]["token_logprobs"][1:],
                                  theirs["logprobs"]["token_logprobs"][1:], strict=True):
                assert abs(ours - want) < 1e-4


def test_a_stream_says_what_the_plain_answer_says(
    group: ServerProcess, expected: dict[str, tuple[str, int]]
) -> None:
    chunks = list(_stream(group.url, PROMPTS[1]))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == expected[PROMPTS[1]][0]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_four_prompts_are_decoded_together_and_each_exact(
    group: ServerProcess, single: ServerProcess
) -> None:
    """One completions request with four prompts: submitted in one event-loop turn,
    admitted in one plan, decoded in one batch. The stream's own order shows it (every
    prompt's first text before any prompt's finish), which no load on the test machine
    can reorder, and each text is one process's."""
    body = {"model": "demo-32k", "prompt": PROMPTS, "max_tokens": 24, "temperature": 0}
    plain = httpx.post(single.url + "/v1/completions", json=body, timeout=60)
    assert plain.status_code == 200, plain.text
    want = {c["index"]: c["text"] for c in plain.json()["choices"]}
    texts: dict[int, str] = {}
    first: dict[int, int] = {}
    finish: dict[int, int] = {}
    with httpx.stream("POST", group.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as response:
        assert response.status_code == 200
        data = [line[6:] for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]
    for position, chunk in enumerate(map(json.loads, data)):
        for choice in chunk["choices"]:
            index = choice["index"]
            if choice.get("text"):
                texts[index] = texts.get(index, "") + choice["text"]
                first.setdefault(index, position)
            if choice.get("finish_reason"):
                finish[index] = position
    assert texts == want
    assert sorted(first) == sorted(finish) == list(range(len(PROMPTS)))
    assert max(first.values()) < min(finish.values())


def test_cancel_mid_stream_then_the_group_still_answers(
    group: ServerProcess, expected: dict[str, tuple[str, int]]
) -> None:
    request_id = f"dist-cancel-{time.monotonic_ns()}"
    stream = _stream(group.url, PROMPTS[0], headers={"X-Request-ID": request_id},
                     max_tokens=4000)
    first = next(stream)
    assert first["choices"]
    cancel = httpx.post(f"{group.url}/v1/chat/completions/{request_id}/cancel", timeout=10)
    assert cancel.status_code == 200 and cancel.json()["cancelled"] is True
    finishes = [c["choices"][0]["finish_reason"] for c in stream if c["choices"]]
    assert finishes[-1] == "cancelled"
    # The follower dropped the same row: the next request is still token-for-token right.
    assert _answer(group.url, PROMPTS[2]) == expected[PROMPTS[2]]


def test_prefix_cache_hit_stays_in_step(
    group: ServerProcess, expected: dict[str, tuple[str, int]]
) -> None:
    """A repeated prompt resumes from the prefix cache on every rank alike."""
    for _ in range(3):
        assert _answer(group.url, PROMPTS[3]) == expected[PROMPTS[3]]


def test_sigterm_stops_every_rank_with_exit_0(group: ServerProcess) -> None:
    """Last of the tensor group's tests: it stops the group."""
    pids = [r["pid"] for r in _health(group)["distributed"]["ranks"]]
    assert _stop(group) == 0
    assert "stopped" in group.log_text()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _lose_a_rank_mid_stream(group: ServerProcess, sig: int) -> None:
    """Kill or stop rank 1 while a stream runs: the stream ends with the documented error,
    /health and new requests say why, and the launcher exits 1 within the bound."""
    follower = _health(group)["distributed"]["ranks"][1]["pid"]
    events: list[dict[str, Any]] = []
    try:
        stream = _stream(group.url, PROMPTS[1], max_tokens=4000)
        events.append(next(stream))
        os.kill(follower, sig)
        lost_at = time.monotonic()
        for chunk in stream:  # ends with an error event (no choices), then [DONE]
            events.append(chunk)
        assert "error" in events[-1], events[-3:]
        error = events[-1]["error"]
        assert error["code"] == "model_unavailable"
        assert "rank 1 lost" in error["message"]
        health = httpx.get(group.url + "/health", timeout=5)
        assert health.status_code == 503
        assert health.json()["status"] == "unavailable"
        assert health.json()["reason"] == "rank 1 lost"
        late = httpx.post(group.url + "/v1/chat/completions", timeout=10, json={
            "model": "demo-32k", "messages": [{"role": "user", "content": "hi"}]})
        assert late.status_code == 503 and late.json()["error"]["code"] == "model_unavailable"
        assert group.proc.wait(LOSS_BOUND_S) == 1
        assert time.monotonic() - lost_at < LOSS_BOUND_S
    finally:
        if sig == signal.SIGSTOP:
            with contextlib.suppress(ProcessLookupError):  # torn down by the launcher
                os.kill(follower, signal.SIGCONT)
        _stop(group, signal.SIGKILL, timeout=10)


def test_pipeline_group_equals_one_process_then_a_killed_rank_ends_it(
    tmp_path: Path, expected: dict[str, tuple[str, int]]
) -> None:
    group = start_group(tmp_path, strategy="pipeline")
    try:
        health = _health(group)["distributed"]
        assert health["strategy"] == "pipeline"
        assert {r["shard"] for r in health["ranks"]} == {
            "pipeline: layers 1-1 of rank 0/2", "pipeline: layers 0-0 of rank 1/2"}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: _answer(group.url, p), PROMPTS))
        assert answers == [expected[p] for p in PROMPTS]
    except BaseException:
        _stop(group, signal.SIGKILL, timeout=10)
        raise
    _lose_a_rank_mid_stream(group, signal.SIGKILL)


def test_a_hung_rank_is_found_by_its_heartbeat_and_the_group_exits_1(tmp_path: Path) -> None:
    # Shorter than the others' timeout: rank 0 polls in its collective until it gives up
    # on the stopped rank, a core's worth of CPU the whole time; the group runs one
    # stream here, and its heartbeats are still eight periods apart.
    _lose_a_rank_mid_stream(start_group(tmp_path, heartbeat=4.0), signal.SIGSTOP)


def test_bad_configuration_exits_2_before_starting_anything(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[distributed]\nstrategy = "diagonal"\n')
    done = subprocess.run([*afmd_command(), "launch", "-n", "2", "--", "serve", "--config",
                           str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "strategy" in done.stderr
    missing = subprocess.run([*afmd_command(), "launch", "-n", "2", "--", "status"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "serve" in missing.stderr
