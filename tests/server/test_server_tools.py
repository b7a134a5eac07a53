"""Server tools: afmd runs operator-configured tools itself and hides them from the client.

End to end on a real server with the demo model (which calls a tool only when a
``tool_choice`` forces it through the grammar), plus units of :class:`ServerTools` and
in-process runs of the pipeline where a test needs to see inside a request (budgets,
operator instructions).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
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
from afmd.core.events import Content, Finish, ToolCallArguments, ToolCallEnd, ToolCallStart
from afmd.core.request import ChatRequest, Message, ToolCall, ToolChoice
from afmd.dialects.openai.chat_body import parse_chat_request
from afmd.dialects.responses.responses_body import parse_responses_request
from afmd.engine.models.loaded_model import LoadedModel
from afmd.engine.models.model_registry import ModelRegistry
from afmd.engine.models.residency import Lease
from afmd.service import round_builder, toolloop
from afmd.service.chat_run import ChatRun
from afmd.service.chat_template import template_messages
from afmd.service.pipeline import ChatPipeline
from afmd.service.scheduler import Scheduler
from afmd.service.servertools import ServerTools

from conftest import ServerProcess, parse_sse, start_server
from helpers.openai_schemas import validate_chunk, validate_error, validate_response
from helpers.paths import TESTS_DIR

CHAT = "/v1/chat/completions"
TOOLS_DIR = TESTS_DIR / "tools"
PY = sys.executable
SECRET = "afmd-test-secret-" + uuid.uuid4().hex[:8]
NONCE = "nonce" + uuid.uuid4().hex[:16]
WORDS = ("kumquat", "rutabaga")

PROBE = "zz_probe_tool"
SLEEPY = "zz_sleepy_tool"
GARBAGE = "zz_garbage_tool"
FAILING = "zz_failing_tool"
PYTOOL = "zz_py_tool"
CLIENT = "zz_client_tool"

# A schema the grammar enforces completely: the call's arguments are one of two words.
WORD_SCHEMA = {
    "type": "object",
    "properties": {"word": {"type": "string", "enum": list(WORDS)}},
    "required": ["word"],
    "additionalProperties": False,
}
WORD_SCHEMA_TOML = (
    '{ type = "object", properties = { word = { type = "string", enum = ["kumquat", '
    '"rutabaga"] } }, required = ["word"], additionalProperties = false }'
)


def q(value: str) -> str:
    """A TOML basic string (JSON's escaping is valid TOML)."""
    return json.dumps(value)


def command_tool(name: str, script: str, *, env: dict[str, str] | None = None,
                 timeout: float = 10.0, extra: str = "", flags: str = "") -> str:
    env_toml = ", ".join(f"{k} = {q(v)}" for k, v in (env or {}).items())
    return (
        "[[tools.server]]\n"
        f"name = {q(name)}\n"
        f'description = "Look a word up."\n'
        f"parameters = {WORD_SCHEMA_TOML}\n"
        f"command = [{q(PY)}, {flags}{q(str(TOOLS_DIR / script))}]\n"
        f"timeout = {timeout}\n"
        f"env = {{ {env_toml} }}\n"
        f"{extra}"
    )


def python_tool(name: str, function: str) -> str:
    return (
        "[[tools.server]]\n"
        f"name = {q(name)}\n"
        f"parameters = {WORD_SCHEMA_TOML}\n"
        f"python = {q(str(TOOLS_DIR / 'py_tool.py') + ':' + function)}\n"
    )


def marks(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def forced(name: str, *, max_tokens: int = 48, stream: bool = False,
           **extra: Any) -> dict[str, Any]:
    """A request whose first step must call ``name`` (one call: parallel calls off)."""
    body: dict[str, Any] = {
        "messages": [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "Look up a word for me."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "reasoning_effort": "none",  # the demo template's thinking off: the call comes first
        "parallel_tool_calls": False,
        "tool_choice": {"type": "function", "function": {"name": name}},
        **extra,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


SECRETS = (PROBE, NONCE, *WORDS, "KUMQUAT", "RUTABAGA", "<tool_call>", "tool_calls")


def assert_no_trace(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} reached the client: {text[:2000]}"


def server_tool_events(server: ServerProcess, tool: str) -> list[dict[str, Any]]:
    return [e for e in server.events if e.get("event") == "server tool" and e.get("tool") == tool]


# --------------------------------------------------------------------------- e2e server


@dataclasses.dataclass
class ToolServer:
    proc: ServerProcess
    probe_marks: Path
    sleepy_marks: Path
    py_marks: Path

    @property
    def url(self) -> str:
        return self.proc.url


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ToolServer]:
    tmp = tmp_path_factory.mktemp("server-tools")
    probe_marks = tmp / "probe.jsonl"
    sleepy_marks = tmp / "sleepy.txt"
    py_marks = tmp / "py.jsonl"
    config = "\n".join([
        command_tool(PROBE, "echo_tool.py",
                     env={"MARK_FILE": str(probe_marks), "TOOL_NONCE": NONCE}),
        # -S: no site import, so the tool starts well within its timeout on a busy machine.
        command_tool(SLEEPY, "sleep_tool.py", timeout=1.0, flags='"-S", ',
                     env={"MARK_FILE": str(sleepy_marks), "SLEEP_S": "30"}),
        command_tool(GARBAGE, "garbage_tool.py"),
        command_tool(FAILING, "fail_tool.py"),
        python_tool(PYTOOL, "shout"),
    ])
    proc = start_server(tmp, config=config,
                        env={"AFMD_TEST_SECRET": SECRET, "AFMD_PYTOOL_MARK": str(py_marks)})
    yield ToolServer(proc, probe_marks, sleepy_marks, py_marks)
    proc.stop()


def post(url: str, body: dict[str, Any], timeout: float = 60) -> httpx.Response:
    return httpx.post(url + CHAT, json=body, timeout=timeout)


def test_server_tool_runs_and_stays_hidden(tool_server: ToolServer) -> None:
    before = len(marks(tool_server.probe_marks))
    # The same request cut after one token: only the first round's prompt is counted,
    # and a call that never finished does not run.
    first = post(tool_server.url, forced(PROBE, max_tokens=1))
    assert first.status_code == 200, first.text
    single_round_prompt = first.json()["usage"]["prompt_tokens"]
    assert len(marks(tool_server.probe_marks)) == before

    response = post(tool_server.url, forced(PROBE, max_tokens=48))
    assert response.status_code == 200, response.text
    body = response.json()
    validate_response(body)
    ran = marks(tool_server.probe_marks)[before:]
    assert ran, "the server tool never ran"
    # Schema-valid arguments, one JSON value on stdin.
    for record in ran:
        assert record["args"] in [{"word": w} for w in WORDS]
        assert json.loads(record["raw"]) == record["args"]
        # The environment: allow-listed PATH plus the tool's own env, never afmd's secrets.
        assert record["secret"] is None
        assert "AFMD_TEST_SECRET" not in record["env_keys"]
        assert "AFMD_PYTOOL_MARK" not in record["env_keys"]
        assert record["path"] == os.environ["PATH"]
        assert record["nonce"] == NONCE
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    assert "tool_calls" not in choice["message"]
    assert_no_trace(response.text)
    usage = body["usage"]
    # Every round's prompt is counted: at least the first round plus a longer second one.
    assert usage["prompt_tokens"] > 2 * single_round_prompt
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # max_tokens bounds the completion of all rounds together.
    assert usage["completion_tokens"] <= 48
    ok = server_tool_events(tool_server.proc, PROBE)
    assert ok and all(e["ok"] is True for e in ok)


def test_server_tool_hidden_in_stream(tool_server: ToolServer) -> None:
    before = len(marks(tool_server.probe_marks))
    single = post(tool_server.url, forced(PROBE, max_tokens=1)).json()["usage"]["prompt_tokens"]
    response = post(tool_server.url, forced(PROBE, max_tokens=48, stream=True))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    assert len(marks(tool_server.probe_marks)) > before
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    for chunk in chunks:
        validate_chunk(chunk)
        for choice in chunk["choices"]:
            assert "tool_calls" not in choice["delta"]
    assert_no_trace(response.text)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes in (["stop"], ["length"])
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] > 2 * single
    assert usage["completion_tokens"] <= 48


@pytest.mark.parametrize(
    ("tool", "error_text"),
    [
        (SLEEPY, "timed out after 1 s"),
        (GARBAGE, "did not write one JSON value"),
        (FAILING, "exited with status 3"),
    ],
)
def test_failing_tools_become_error_outputs(
    tool_server: ToolServer, tool: str, error_text: str
) -> None:
    started = time.monotonic()
    response = post(tool_server.url, forced(tool))
    elapsed = time.monotonic() - started
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert tool not in response.text
    event = tool_server.proc.wait_event("server tool", timeout=10, tool=tool)
    assert event["ok"] is False
    assert error_text in event["error"]
    if tool == FAILING:
        assert "boom-stderr" in event["error"]  # the stderr tail says why
    if tool == SLEEPY:
        assert elapsed < 15  # the tool sleeps 30 s: it was killed at its timeout
        if tool_server.sleepy_marks.exists():  # it got as far as recording its pid
            pid = int(tool_server.sleepy_marks.read_text().split()[0])
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    assert tool_server.proc.proc.poll() is None  # never a crash


def test_python_tool_end_to_end(tool_server: ToolServer) -> None:
    before = len(marks(tool_server.py_marks))
    response = post(tool_server.url, forced(PYTOOL))
    assert response.status_code == 200, response.text
    ran = marks(tool_server.py_marks)[before:]
    assert ran and all(r["word"] in WORDS for r in ran)
    event = tool_server.proc.wait_event("server tool", timeout=10, tool=PYTOOL)
    assert event["ok"] is True
    for secret in (PYTOOL, "shouted", "RUTABAGA", "KUMQUAT", "<tool_call>", "tool_calls"):
        assert secret not in response.text


def client_tool(name: str = CLIENT) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": WORD_SCHEMA}}


def test_request_tool_named_like_a_server_tool_is_rejected(tool_server: ToolServer) -> None:
    body = forced(CLIENT, tools=[client_tool(), client_tool(PROBE)])
    response = post(tool_server.url, body)
    assert response.status_code == 400, response.text
    error = response.json()
    validate_error(error)
    assert error["error"]["code"] == "invalid_value"
    assert error["error"]["param"] == "tools[1].function.name"
    assert PROBE in error["error"]["message"]


def _function(name: str) -> dict[str, Any]:
    return {"type": "function", "name": name, "parameters": WORD_SCHEMA}


@pytest.mark.parametrize(("tools", "param"), [
    ([_function(CLIENT), _function(PROBE)], "tools[1].name"),
    ([{"type": "web_search"}, _function(CLIENT), _function(PROBE)], "tools[2].name"),
    ([{"type": "namespace", "name": "ns", "tools": [_function("a"), _function("b")]},
      _function(PROBE)], "tools[1].name"),
    ([{"type": "namespace", "name": "ns", "tools": [_function("a"), _function(PROBE)]}],
     "tools[0].tools[1].name"),
    ([{"type": "web_search"}, {"type": "custom", "name": PROBE}], "tools[1].name"),
], ids=["flat", "after-hosted", "after-namespace", "in-namespace", "custom"])
@pytest.mark.parametrize("path", ["/v1/responses", "/v1/responses/input_tokens"])
def test_responses_tool_named_like_a_server_tool_names_it_as_sent(
    tool_server: ToolServer, tools: list[dict[str, Any]], param: str, path: str
) -> None:
    """The Responses body's own path to the name: hosted tools left out and namespaces
    offered as their functions make the offered tool's index another tool's."""
    body = {"model": "demo", "input": "Look up a word for me.", "tools": tools}
    response = httpx.post(tool_server.url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_value", param)
    assert PROBE in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_client_call_returns_only_the_client_call(tool_server: ToolServer, stream: bool) -> None:
    before = len(marks(tool_server.probe_marks))
    events_before = len(server_tool_events(tool_server.proc, PROBE))
    response = post(tool_server.url, forced(CLIENT, tools=[client_tool()], stream=stream))
    assert response.status_code == 200, response.text
    if stream:
        chunks = [e for e in parse_sse(response.text) if isinstance(e, dict)]
        names = [
            call["function"]["name"]
            for c in chunks if c["choices"]
            for call in c["choices"][0]["delta"].get("tool_calls") or []
            if "name" in call.get("function", {})
        ]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks
                    if c["choices"] and c["choices"][0]["finish_reason"]]
        assert names == [CLIENT]
        assert finishes == ["tool_calls"]
    else:
        body = response.json()
        validate_response(body)
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        calls = choice["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == [CLIENT]
        assert json.loads(calls[0]["function"]["arguments"]) in [{"word": w} for w in WORDS]
    assert PROBE not in response.text
    assert len(marks(tool_server.probe_marks)) == before  # the server tool did not run
    assert len(server_tool_events(tool_server.proc, PROBE)) == events_before


def test_truncated_server_call_does_not_leak(tool_server: ToolServer) -> None:
    response = post(tool_server.url, forced(PROBE, max_tokens=4))
    assert response.status_code == 200
    content = response.json()["choices"][0]["message"]["content"] or ""
    assert "<tool_call>" not in content
    assert PROBE[:4] not in content


STUCK = "zz_stuck_tool"


@dataclasses.dataclass
class StuckServer:
    proc: ServerProcess
    marks: Path  # the pid of each run of the tool, one a line

    @property
    def url(self) -> str:
        return self.proc.url

    def pids(self) -> list[int]:
        return [int(x) for x in self.marks.read_text().split()] if self.marks.exists() else []

    def next_pid(self, before: int) -> int:
        """The pid of the tool's next run, once it started (``before``: runs so far)."""
        deadline = time.monotonic() + 30
        while len(self.pids()) <= before:
            assert time.monotonic() < deadline, "the server tool never started"
            time.sleep(0.02)
        return self.pids()[before]


@pytest.fixture(scope="module")
def stuck_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StuckServer]:
    """One server tool that runs for two minutes, within a timeout of one (its own server:
    a model that called it unasked would hold any other test that long)."""
    tmp = tmp_path_factory.mktemp("stuck-tool")
    mark = tmp / "stuck.txt"
    proc = start_server(tmp, config=command_tool(
        STUCK, "sleep_tool.py", timeout=60.0, flags='"-S", ',
        env={"MARK_FILE": str(mark), "SLEEP_S": "120"}))
    yield StuckServer(proc, mark)
    for pid in StuckServer(proc, mark).pids():  # whatever a failed test left running
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    proc.stop()


def assert_gone(pid: int, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, f"the tool's process {pid} still runs"
        time.sleep(0.05)


def _forced_response(name: str, *, stream: bool) -> dict[str, Any]:
    return {"input": "Look up a word for me.", "max_output_tokens": 48, "temperature": 0,
            "reasoning": {"effort": "none"}, "parallel_tool_calls": False,
            "tool_choice": {"type": "function", "name": name}, "stream": stream}


@pytest.mark.parametrize(("path", "stream"), [(CHAT, False), (CHAT, True),
                                              ("/v1/responses", False)],
                         ids=["chat", "chat-stream", "responses"])
def test_cancel_stops_a_running_server_tool(stuck_server: StuckServer, path: str,
                                            stream: bool) -> None:
    """A cancel while the request's server tool runs ends the request at once, as
    cancelled, and the tool with it: before, the request waited for the tool (up to its
    timeout, a minute here) and only then ended."""
    rid = "stuck-" + uuid.uuid4().hex[:10]
    body = (forced(STUCK, stream=stream) if path == CHAT
            else _forced_response(STUCK, stream=stream))
    before = len(stuck_server.pids())
    result: dict[str, Any] = {}

    def send() -> None:
        result["response"] = httpx.post(stuck_server.url + path, json=body, timeout=90,
                                        headers={"X-Request-ID": rid})

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    pid = stuck_server.next_pid(before)
    cancelled = httpx.post(f"{stuck_server.url}{path}/{rid}/cancel", timeout=10)
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["cancelled"] is True
    thread.join(10)
    assert not thread.is_alive(), "the cancelled request waited for its server tool"
    response = result["response"]
    assert response.status_code == 200, response.text
    if path == CHAT and stream:
        chunks = [c for c in parse_sse(response.text) if c != "[DONE]"]
        assert [c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"]] == ["cancelled"]
    elif path == CHAT:
        assert response.json()["choices"][0]["finish_reason"] == "cancelled"
    else:
        assert response.json()["status"] == "cancelled"
    assert_gone(pid)
    again = post(stuck_server.url, {"messages": [{"role": "user", "content": "Hi."}],
                                    "max_tokens": 2, "tool_choice": "none"}, timeout=30)
    assert again.status_code == 200, again.text


def test_a_client_leaving_stops_its_server_tool(stuck_server: StuckServer) -> None:
    """The tool of a request whose client left is killed: before, nothing stopped it (its
    timeout ran in the request's task, which the disconnect ended)."""
    before = len(stuck_server.pids())
    data = json.dumps(forced(STUCK, stream=True)).encode()
    host, port = stuck_server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                     .encode() + data)
        pid = stuck_server.next_pid(before)
    assert_gone(pid)
    assert stuck_server.proc.proc.poll() is None


def test_budget_of_one_round_runs_the_tool_once(tmp_path: Path) -> None:
    # max_calls = 1 behaves the same; the in-process tests below cover each budget.
    mark = tmp_path / "probe.jsonl"
    config = "[tools]\nmax_rounds = 1\n\n" + command_tool(
        PROBE, "echo_tool.py", env={"MARK_FILE": str(mark), "TOOL_NONCE": NONCE}
    )
    proc = start_server(tmp_path, config=config)
    try:
        for n in (1, 2):
            response = post(proc.url, forced(PROBE, max_tokens=64))
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
            assert len(marks(mark)) == n  # exactly once per request
            assert_no_trace(response.text)
    finally:
        proc.stop()


def test_missing_instructions_file_fails_check_config(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f"[server]\ninstructions_file = {q(str(tmp_path / 'nope.txt'))}\n")
    result = subprocess.run(
        [PY, "-m", "afmd", "check-config", str(config)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "server.instructions_file" in result.stderr
    assert "nope.txt" in result.stderr


def test_missing_python_tool_file_fails_check_config(tmp_path: Path) -> None:
    """Found when the config loads, not at the model's first call of the tool."""
    config = tmp_path / "c.toml"
    config.write_text("[[tools.server]]\nname = \"zz_gone\"\n"
                      f"python = {q(str(tmp_path / 'gone.py') + ':f')}\n")
    result = subprocess.run(
        [PY, "-m", "afmd", "check-config", str(config)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "tools.server[0].python" in result.stderr and "gone.py" in result.stderr


# --------------------------------------------------------------------------- ServerTools units


def echo_tool(mark: Path, **changes: Any) -> ServerTool:
    fields: dict[str, Any] = {
        "name": PROBE,
        "parameters": WORD_SCHEMA,
        "command": (PY, str(TOOLS_DIR / "echo_tool.py")),
        "env": {"MARK_FILE": str(mark), "TOOL_NONCE": NONCE},
    }
    fields.update(changes)
    return ServerTool(**fields)


def run_tool(tool: ServerTool, arguments: str) -> Any:
    return asyncio.run(ServerTools((tool,)).run(tool.name, arguments))


def test_unit_valid_call_runs_with_clean_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AFMD_TEST_SECRET", SECRET)
    mark = tmp_path / "m.jsonl"
    outcome = run_tool(echo_tool(mark), '{"word": "kumquat"}')
    assert outcome.ok is True
    assert json.loads(outcome.content) == {"result": f"{NONCE}-KUMQUAT"}
    (record,) = marks(mark)
    assert record["args"] == {"word": "kumquat"}
    assert record["secret"] is None
    assert record["path"] == os.environ["PATH"]
    allowed = {"PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TZ", "MARK_FILE", "TOOL_NONCE"}
    # What Python itself may add to a child's environment on some platforms.
    extras = {"LC_CTYPE", "__CF_USER_TEXT_ENCODING", "__PYVENV_LAUNCHER__"}
    assert set(record["env_keys"]) <= allowed | extras, record["env_keys"]


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ("{not json", "not valid JSON"),
        ('{"word": "banana"}', "invalid arguments"),
        ('{"word": "kumquat", "extra": 1}', "invalid arguments"),
        ("{}", "invalid arguments"),
        ("[1, 2]", "invalid arguments"),
    ],
)
def test_unit_invalid_arguments_never_run_the_command(
    tmp_path: Path, arguments: str, problem: str
) -> None:
    mark = tmp_path / "m.jsonl"
    outcome = run_tool(echo_tool(mark), arguments)
    assert outcome.ok is False
    assert problem in json.loads(outcome.content)["error"]
    assert not mark.exists()


@pytest.mark.parametrize(
    ("script", "changes", "problem"),
    [
        ("garbage_tool.py", {}, "did not write one JSON value"),
        ("fail_tool.py", {}, "exited with status 3: boom-stderr"),
        ("big_tool.py", {"max_output_bytes": 1000}, "wrote more than 1000 bytes"),
    ],
)
def test_unit_broken_commands(
    tmp_path: Path, script: str, changes: dict[str, Any], problem: str
) -> None:
    tool = echo_tool(tmp_path / "m", command=(PY, str(TOOLS_DIR / script)), **changes)
    outcome = run_tool(tool, '{"word": "rutabaga"}')
    assert outcome.ok is False
    assert problem in json.loads(outcome.content)["error"]


def test_unit_missing_command_is_an_error_output(tmp_path: Path) -> None:
    tool = echo_tool(tmp_path / "m", command=(str(tmp_path / "no-such-binary"),))
    outcome = run_tool(tool, '{"word": "rutabaga"}')
    assert outcome.ok is False
    assert "could not be started" in json.loads(outcome.content)["error"]


def test_unit_timeout_kills_the_tool(tmp_path: Path) -> None:
    mark = tmp_path / "pid.txt"
    tool = echo_tool(mark, command=(PY, "-S", str(TOOLS_DIR / "sleep_tool.py")), timeout=2.0,
                     env={"MARK_FILE": str(mark), "SLEEP_S": "30"})
    started = time.monotonic()
    outcome = run_tool(tool, '{"word": "kumquat"}')
    assert time.monotonic() - started < 10
    assert outcome.ok is False
    assert "timed out after 2 s" in json.loads(outcome.content)["error"]
    pid = int(mark.read_text().split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_unit_tool_that_logs_a_lot_to_stderr_still_succeeds(tmp_path: Path) -> None:
    tool = echo_tool(tmp_path / "m", command=(PY, str(TOOLS_DIR / "noisy_tool.py")), timeout=10)
    outcome = run_tool(tool, '{"word": "kumquat"}')
    assert outcome.ok is True, outcome.content
    assert json.loads(outcome.content) == {"ok": True}


def py_tool(function: str, path: Path | None = None) -> ServerTool:
    source = path or TOOLS_DIR / "py_tool.py"
    return ServerTool(name=PYTOOL, parameters=WORD_SCHEMA, python=f"{source}:{function}")


def test_unit_python_tool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mark = tmp_path / "py.jsonl"
    monkeypatch.setenv("AFMD_PYTOOL_MARK", str(mark))
    outcome = run_tool(py_tool("shout"), '{"word": "rutabaga"}')
    assert outcome.ok is True
    assert json.loads(outcome.content) == {"shouted": "RUTABAGA"}
    assert marks(mark) == [{"word": "rutabaga"}]
    # Schema checked before the function is called.
    bad = run_tool(py_tool("shout"), '{"word": "beet"}')
    assert bad.ok is False and len(marks(mark)) == 1


@pytest.mark.parametrize(
    ("function", "problem"),
    [
        ("explode", "failed: ValueError: cannot handle kumquat"),
        ("not_json", "returned a value that is not JSON"),
        ("no_such_function", "could not be loaded"),
    ],
)
def test_unit_python_tool_failures(function: str, problem: str) -> None:
    outcome = run_tool(py_tool(function), '{"word": "kumquat"}')
    assert outcome.ok is False
    assert problem in json.loads(outcome.content)["error"]


def test_unit_python_tool_missing_file(tmp_path: Path) -> None:
    outcome = run_tool(py_tool("shout", tmp_path / "absent.py"), '{"word": "kumquat"}')
    assert outcome.ok is False
    assert "could not be loaded" in json.loads(outcome.content)["error"]


# --------------------------------------------------------------------------- in-process


class SharedRegistry(ModelRegistry):
    """A registry for one config that serves an already loaded model."""

    def __init__(self, config: Any, model: LoadedModel) -> None:
        super().__init__(config)
        self._model = model

    async def lease(self, entry: ModelEntry, *args: Any, **kwargs: Any) -> Lease:
        return Lease.detached(self._model)


@pytest.fixture(scope="module")
def demo_model() -> Iterator[LoadedModel]:
    config = load_config(None, env={})
    registry = ModelRegistry(config)
    entry = registry.resolve("demo")

    async def load() -> LoadedModel:
        return await registry.begin_load(entry)

    yield asyncio.run(load())
    registry.close()


def in_process(demo_model: LoadedModel, tmp_path: Path, toml: str) -> ChatPipeline:
    path = tmp_path / f"config-{uuid.uuid4().hex[:6]}.toml"
    path.write_text(toml)
    config = load_config(path, env={})
    return ChatPipeline(SharedRegistry(config, demo_model), Scheduler(4, 16), request_timeout=60)


async def chat(pipeline: ChatPipeline, body: dict[str, Any]) -> tuple[ChatRun, list[Any]]:
    request = parse_chat_request(body, server_tools=pipeline.server_tools.names)
    return await drain(pipeline, await pipeline.prepare(request, "req-" + uuid.uuid4().hex[:8]))


async def drain(pipeline: ChatPipeline, prepared: Any) -> tuple[ChatRun, list[Any]]:
    """The prepared request run to its end: the run, and every output it made."""
    run = await pipeline.start(prepared)
    outputs: list[Any] = []
    try:
        async for batch in run:
            outputs += batch
    finally:
        pipeline.release(run)
    return run, outputs


@pytest.mark.parametrize(
    ("budget", "runs"),
    [("", 4), ("max_rounds = 2", 2), ("max_calls = 3", 3), ("max_rounds = 1", 1),
     ("max_calls = 1", 1)],
)
def test_budgets_stop_a_model_that_always_calls(
    demo_model: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    budget: str, runs: int,
) -> None:
    # Make tool_choice bind every round, not only the request's first: the model then
    # calls the tool in every round, and only the budget can end the loop.
    plan_output = round_builder.plan_output
    monkeypatch.setattr(round_builder, "plan_output",
                        lambda *a, **k: plan_output(*a, **{**k, "first_step": True}))
    mark = tmp_path / "probe.jsonl"
    pipeline = in_process(demo_model, tmp_path, f"[tools]\n{budget}\n\n" + command_tool(
        PROBE, "echo_tool.py", env={"MARK_FILE": str(mark), "TOOL_NONCE": NONCE}))
    run, outputs = asyncio.run(chat(pipeline, forced(PROBE, max_tokens=400)))
    assert len(marks(mark)) == runs  # default max_rounds is 4
    assert isinstance(outputs[-2], Finish)
    assert run.finish_reason in ("stop", "length")
    assert not any(isinstance(o, ToolCallEnd) for o in outputs)
    assert not any(isinstance(o, ToolCallStart | ToolCallArguments) for o in outputs)
    text = "".join(o.text for o in outputs if isinstance(o, Content))
    assert NONCE not in text
    # The last round was told to answer without tools, and had none.
    last = run.round.request
    assert last.tool_choice.mode == "none"
    assert last.messages[-1] == Message(role="system",
                                        content=toolloop.ANSWER_WITHOUT_TOOLS)
    tool_outputs = [m for m in last.messages if m.role == "tool"]
    assert len(tool_outputs) == runs
    assert all(NONCE in (m.content or "") for m in tool_outputs)
    assert run.usage is not None and run.usage.completion_tokens <= 400


@pytest.mark.parametrize("limit", [1, 2])
def test_responses_max_tool_calls_bounds_the_server_tools(
    demo_model: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int,
) -> None:
    """The Responses API's ``max_tool_calls`` bounds the calls of the tools the server
    runs itself, as OpenAI's bounds its built-in tools': afmd took it, echoed it and ran
    the server tools up to ``[tools]`` budgets alone (four rounds here)."""
    plan_output = round_builder.plan_output
    monkeypatch.setattr(round_builder, "plan_output",
                        lambda *a, **k: plan_output(*a, **{**k, "first_step": True}))
    mark = tmp_path / "probe.jsonl"
    pipeline = in_process(demo_model, tmp_path, command_tool(
        PROBE, "echo_tool.py", env={"MARK_FILE": str(mark), "TOOL_NONCE": NONCE}))
    body = {"model": "demo", "input": "Look up a word for me.", "max_output_tokens": 400,
            "temperature": 0, "reasoning": {"effort": "none"}, "parallel_tool_calls": False,
            "tool_choice": {"type": "function", "name": PROBE}, "max_tool_calls": limit}

    async def run_it() -> tuple[ChatRun, list[Any]]:
        request = parse_responses_request(body, lookup=lambda _: None,
                                          server_tools=pipeline.server_tools.names)
        return await drain(pipeline, await pipeline.prepare(request, "req-max-tool-calls"))

    run, _ = asyncio.run(run_it())
    assert len(marks(mark)) == limit
    last = run.round.request
    assert last.tool_choice.mode == "none"  # the budget ended the loop
    assert len([m for m in last.messages if m.role == "tool"]) == limit


@pytest.mark.parametrize("choice", ["required", "named"])
def test_the_round_after_a_server_tool_ran_is_free(
    demo_model: LoadedModel, tmp_path: Path, choice: str
) -> None:
    """tool_choice binds the request's first step; afmd's own next round may answer.

    Were the next round forced too, the model would call the tool again in every round
    until the budget (four rounds) ran out.
    """
    mark = tmp_path / "probe.jsonl"
    pipeline = in_process(demo_model, tmp_path, command_tool(
        PROBE, "echo_tool.py", env={"MARK_FILE": str(mark), "TOOL_NONCE": NONCE}))
    body = forced(PROBE, max_tokens=200)
    if choice == "required":
        body["tool_choice"] = "required"
    run, outputs = asyncio.run(chat(pipeline, body))
    assert len(marks(mark)) == 1
    last = run.round
    assert last.request.tool_choice.mode != "none"  # not the budget's doing
    assert [m.role for m in last.request.messages][-2:] == ["assistant", "tool"]
    grammar = last.plan.grammar
    assert grammar is not None and "TEXT" in grammar.text  # free text is allowed
    assert isinstance(outputs[-2], Finish) and run.finish_reason in ("stop", "length")
    assert not any(isinstance(o, ToolCallEnd) for o in outputs)


def test_a_prefill_that_ends_in_a_server_call_is_one_assistant_turn(
    demo_model: LoadedModel, tmp_path: Path
) -> None:
    """A prefilled answer the model ends with a call of a server tool (a model that calls
    on its own may): the next round's conversation holds the prefill and the call as one
    assistant message, and continues nothing (two assistant turns in a row, or a prompt
    ending inside the tool's output, were what a naive append made)."""
    mark = tmp_path / "probe.jsonl"
    pipeline = in_process(demo_model, tmp_path, command_tool(
        PROBE, "echo_tool.py", env={"MARK_FILE": str(mark), "TOOL_NONCE": NONCE}))
    prefill = "Let me look that up"
    body = forced(PROBE, max_tokens=200, tool_choice="auto", continue_final_message=True)
    body["messages"].append({"role": "assistant", "content": prefill})

    async def run_it() -> tuple[ChatRun, list[Any]]:
        request = parse_chat_request(body, server_tools=pipeline.server_tools.names)
        assert request.continue_final
        # The demo model calls only when made to: force the first step's call, as a
        # model that calls by itself would write it after the prefill.
        request = dataclasses.replace(request, tool_choice=ToolChoice(
            "required", allowed=(PROBE,), named=True))
        prepared = await pipeline.prepare(request, "req-prefill-" + uuid.uuid4().hex[:6])
        return await drain(pipeline, prepared)

    run, outputs = asyncio.run(run_it())
    assert len(marks(mark)) == 1
    last = run.round.request
    assert not last.continue_final
    turn = [m for m in last.messages if m.role != "system"][-3:]
    assert [m.role for m in turn] == ["user", "assistant", "tool"]
    assert turn[1].content == prefill and [c.name for c in turn[1].tool_calls] == [PROBE]
    assert isinstance(outputs[-2], Finish) and run.finish_reason in ("stop", "length")


def test_the_round_after_a_server_tool_is_trimmed_as_the_first(
    demo_model: LoadedModel, tmp_path: Path
) -> None:
    """Under ``[context] policy = "trim"`` a tool's output that pushes the conversation
    past the window drops the oldest turns, as the request's first round would: the
    round after it failed with context_length_exceeded mid-turn."""
    pipeline = in_process(demo_model, tmp_path, '[context]\npolicy = "trim"\n\n'
                          + python_tool(PYTOOL, "long_answer"))
    filler = " ".join(f"Old fact number {i}." for i in range(60))
    body = forced(PYTOOL, max_tokens=40)
    older = [{"role": "user", "content": f"Remember: {filler}"},
             {"role": "assistant", "content": "Noted."}] * 3
    body["messages"] = [body["messages"][0], *older, *body["messages"][1:]]

    async def run_it() -> tuple[ChatRun, list[Any], int]:
        request = parse_chat_request(body, server_tools=pipeline.server_tools.names)
        first = await pipeline.count(request)
        # Room for the first round and its call, not for the tool's long answer too.
        request = dataclasses.replace(request, context_window=first + 40 + 60)
        prepared = await pipeline.prepare(request, "req-trim-" + uuid.uuid4().hex[:6])
        assert prepared.trimmed == 0  # the first round fits whole
        return (*await drain(pipeline, prepared), first)

    run, outputs, first = asyncio.run(run_it())
    last = run.round
    assert last.trimmed > 0
    assert [m.role for m in last.request.messages][-2:] == ["assistant", "tool"]
    assert "means 39." in (last.request.messages[-1].content or "")  # the output stays
    assert last.request.messages[0].role == "system"  # the instructions stay
    assert len(last.prompt) + last.max_tokens <= first + 100
    assert isinstance(outputs[-2], Finish) and run.finish_reason in ("stop", "length")


def test_calls_beyond_max_calls_in_one_round_get_a_budget_error(
    demo_model: LoadedModel, tmp_path: Path
) -> None:
    mark = tmp_path / "probe.jsonl"
    pipeline = in_process(demo_model, tmp_path, "[tools]\nmax_calls = 1\n\n" + command_tool(
        PROBE, "echo_tool.py", env={"MARK_FILE": str(mark), "TOOL_NONCE": NONCE}))

    async def three_parallel_calls() -> ChatRequest:
        request = parse_chat_request(forced(PROBE), server_tools=pipeline.server_tools.names)
        prepared = await pipeline.prepare(request, "req-budget")
        loop = toolloop.ToolLoop(pipeline.server_tools,
                                 max_rounds=pipeline.config.tools.max_rounds,
                                 max_calls=pipeline.config.tools.max_calls)
        calls = [ToolCall(f"call_{i}", PROBE, '{"word": "kumquat"}') for i in range(3)]
        return await loop.run(prepared.round.request, calls, prepared.max_tokens)

    next_request = asyncio.run(three_parallel_calls())
    assert len(marks(mark)) == 1
    outputs = [m.content for m in next_request.messages if m.role == "tool"]
    assert len(outputs) == 3
    assert NONCE in (outputs[0] or "")
    assert outputs[1:] == ['{"error": "tool call budget exhausted"}'] * 2
    assert next_request.tool_choice.mode == "none"


def test_instructions_come_before_the_client_system_message() -> None:
    messages = (Message(role="system", content="CLIENT-SYSTEM"),
                Message(role="user", content="hi"))
    rendered = template_messages(messages, instructions="OPERATOR-RULES")
    assert rendered[0]["role"] == "system"
    system = rendered[0]["content"]
    assert system.index("OPERATOR-RULES") < system.index("CLIENT-SYSTEM")
    # Without a client system message the instructions still become one.
    only_user = template_messages(messages[1:], instructions="OPERATOR-RULES")
    assert only_user[0] == {"role": "system", "content": "OPERATOR-RULES"}
    assert template_messages(messages[1:])[0]["role"] == "user"


def test_instructions_reach_the_rendered_prompt(
    demo_model: LoadedModel, tmp_path: Path
) -> None:
    extra = tmp_path / "extra.txt"
    extra.write_text("FILE-RULES apply.\n")
    plain = in_process(demo_model, tmp_path, "")
    ruled = in_process(
        demo_model, tmp_path,
        f'[server]\ninstructions = "OPERATOR-RULES apply."\ninstructions_file = {q(str(extra))}\n',
    )
    body = {"messages": [{"role": "system", "content": "CLIENT-SYSTEM here."},
                         {"role": "user", "content": "hi"}], "max_tokens": 4}

    async def prompts() -> tuple[list[int], list[int]]:
        a = await plain.prepare(parse_chat_request(body), "p1")
        b = await ruled.prepare(parse_chat_request(body), "p2")
        return a.prompt, b.prompt

    without, with_rules = asyncio.run(prompts())
    assert len(with_rules) > len(without)
    text = demo_model.tokenizer.decode(with_rules)
    assert "OPERATOR-RULES" in text and "FILE-RULES" in text
    assert text.index("OPERATOR-RULES") < text.index("FILE-RULES") < text.index("CLIENT-SYSTEM")
    assert "OPERATOR-RULES" not in demo_model.tokenizer.decode(without)
