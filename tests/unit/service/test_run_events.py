"""A run's output events: the one sequence every dialect adapter encodes.

In process on the demo model (whose calls the tool grammar forces well formed), and
through a round's reader fed a model's text directly where calls must arrive together in
one engine batch: each call starts, streams its arguments and ends (its ToolCall exactly
the concatenation of what streamed) before the next call starts; server calls vanish
with their ends and the client's are renumbered; a run ends with Finish, then Usage.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from mlx_lm.tool_parsers import json_tools

from afmd.config.tables import ServerTool
from afmd.core.events import (
    Content,
    Event,
    Finish,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from afmd.dialects.openai.chat import OPENAI_CHAT
from afmd.engine.generation import Finished, Text
from afmd.engine.models.loaded_model import LoadedModel
from afmd.output.processor import ToolFormat
from afmd.service.output_plan import OutputPlan
from afmd.service.pipeline import ChatPipeline
from afmd.service.round_reader import RoundReader
from afmd.service.scheduler import Scheduler
from afmd.service.servertools import ServerTools
from afmd.service.toolloop import ClientView

from helpers.one_model import SharedRegistry, loaded
from helpers.openai_schemas import validate_response

SMALL = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                "maximum": 9}},
         "required": ["n"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": SMALL}}
         for name in ("first", "second")]
HERMES = ToolFormat(json_tools.tool_call_start, json_tools.tool_call_end,
                    json_tools.parse_tool_call)


def check_calls(events: list[Event]) -> list[ToolCallEnd]:
    """Every call: start, fragments, end, in order, before the next call starts."""
    ends: list[ToolCallEnd] = []
    open_call: tuple[ToolCallStart, str] | None = None
    for event in events:
        if isinstance(event, ToolCallStart):
            assert open_call is None, "a call starts before the previous one ended"
            assert event.index == len(ends)
            open_call = (event, event.arguments)
        elif isinstance(event, ToolCallArguments):
            assert open_call is not None and event.index == open_call[0].index
            open_call = (open_call[0], open_call[1] + event.fragment)
        elif isinstance(event, ToolCallEnd):
            assert open_call is not None and event.index == open_call[0].index
            start, arguments = open_call
            assert (event.call.id, event.call.name, event.call.arguments) == (
                start.id, start.name, arguments)
            ends.append(event)
            open_call = None
    assert open_call is None, "a call never ended"
    return ends


# --------------------------------------------------------------------------- a round's reader


def plan() -> OutputPlan:
    return OutputPlan(tool_format=HERMES, thinking=("<think>", "</think>"),
                    tools=[dict(t) for t in TOOLS])


def call_text(name: str, n: int) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": {"n": n}})}\n</tool_call>'


TWO_CALLS = "Let me see." + call_text("first", 1) + "\n" + call_text("second", 2)


@pytest.mark.parametrize("split", ["one batch", "per character"])
def test_each_call_ends_before_the_next_starts(split: str) -> None:
    reader = RoundReader(plan(), None, stop=lambda: None)
    chunks = [TWO_CALLS] if split == "one batch" else list(TWO_CALLS)
    events: list[Event] = []
    for chunk in chunks:
        out, finished = reader.read([Text(chunk, 1)])
        assert finished is None
        events += out
    out, finished = reader.read([Finished("stop", 5, len(chunks))])
    assert finished is not None
    events += out
    ends = check_calls(events)
    assert [(e.call.name, json.loads(e.call.arguments)) for e in ends] == [
        ("first", {"n": 1}), ("second", {"n": 2})]
    assert "".join(e.text for e in events if isinstance(e, Content)) == "Let me see."
    assert [e.call for e in ends] == reader.output.tool_calls


def test_server_calls_vanish_and_client_calls_are_renumbered() -> None:
    server = ServerTools((ServerTool(name="first", command=("true",), parameters=SMALL),))
    reader = RoundReader(plan(), ClientView(server), stop=lambda: None)
    events, _ = reader.read([Text(TWO_CALLS, 1), Finished("stop", 5, 1)])
    ends = check_calls(events)
    assert [(e.index, e.call.name) for e in ends] == [(0, "second")]
    assert not any(isinstance(e, ToolCallStart) and e.name == "first" for e in events)


def read_tokens(plan: OutputPlan, tokens: list[str],
                end: Finished) -> tuple[RoundReader, str, Finished, bool]:
    """The reader, the answer, the round's end and whether generation was stopped, one
    token per event."""
    stopped: list[bool] = []
    reader = RoundReader(plan, None, stop=lambda: stopped.append(True))
    events: list[Event] = []
    for token in tokens:
        out, finished = reader.read([Text(token, 1)])
        events += out
    out, finished = reader.read([end])
    assert finished is not None
    events += out
    answer = "".join(e.text for e in events if isinstance(e, Content))
    return reader, answer, finished, bool(stopped)


@pytest.mark.parametrize("thinking", [None, ("<think>", "</think>")], ids=["plain", "thinking"])
def test_usage_counts_through_the_token_that_completed_the_stop(
    thinking: tuple[str, str] | None,
) -> None:
    """A stop ending in what could open a thinking block ("<") is only known to be one a
    token later; the answer's tokens are still those through the one that completed it."""
    reader, answer, finished, stopped = read_tokens(
        OutputPlan(stops=("<",), thinking=thinking), ["a", "<", "b", "c"], Finished("stop", 3, 4))
    assert (answer, stopped, finished.completion_tokens) == ("a", True, 2)
    assert reader.reason(finished, cancelled=False) == "stop"
    assert reader.output.stop_sequence == "<"


@pytest.mark.parametrize("thinking", [None, ("<think>", "</think>")], ids=["plain", "thinking"])
def test_a_stop_completed_by_the_last_token_allowed_ends_with_stop(
    thinking: tuple[str, str] | None,
) -> None:
    """A stop sequence wins over the token limit when its last token was the limit's, even
    when the chain could only tell at the end (the stop's tail could open a thinking
    block)."""
    reader, answer, finished, _ = read_tokens(
        OutputPlan(stops=("<",), thinking=thinking), ["a", "<"], Finished("length", 3, 2))
    assert (answer, finished.completion_tokens) == ("a", 2)
    assert reader.reason(finished, cancelled=False) == "stop"
    assert reader.output.stop_sequence == "<"


# --------------------------------------------------------------------------- a whole run


@pytest.fixture(scope="module")
def demo_model() -> Iterator[LoadedModel]:
    yield from loaded("demo")


def run_events(model: LoadedModel, body: dict[str, Any]) -> list[list[Event]]:
    pipeline = ChatPipeline(SharedRegistry(model), Scheduler(2, 2), request_timeout=60)

    async def go() -> list[list[Event]]:
        request = OPENAI_CHAT.parse(orjson.dumps(body))
        run = await pipeline.start(await pipeline.prepare(request, uuid.uuid4().hex))
        try:
            return [batch async for batch in run]
        finally:
            pipeline.release(run)

    return asyncio.run(go())


@pytest.mark.parametrize("parallel", [True, False])
def test_a_forced_run_ends_its_calls_then_finishes(demo_model: LoadedModel,
                                                   parallel: bool) -> None:
    body = {"messages": [{"role": "user", "content": "Use the tools."}], "tools": TOOLS,
            "tool_choice": "required", "parallel_tool_calls": parallel,
            "reasoning_effort": "none", "max_tokens": 300, "seed": 7}
    batches = run_events(demo_model, body)
    assert all(batches), "no empty batch"
    events = [e for batch in batches for e in batch]
    ends = check_calls(events)
    *_, finish, usage = events
    assert isinstance(finish, Finish) and isinstance(usage, Usage)
    assert not any(isinstance(e, Finish | Usage) for e in events[:-2])
    assert finish.reason in ("tool_calls", "length")
    if finish.reason == "tool_calls":
        assert ends and (parallel or len(ends) == 1)
    # The JSON answer is built from the same events: its calls are the ends'.
    reply = OPENAI_CHAT.reply(OPENAI_CHAT.parse(orjson.dumps(body)), model="demo",
                              fingerprint="fp_test")
    response = orjson.loads(reply.body(events))
    validate_response(response)
    sent = response["choices"][0]["message"].get("tool_calls") or []
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in sent] == [
        (e.call.id, e.call.name, e.call.arguments) for e in ends]
    assert response["usage"]["completion_tokens"] == usage.completion_tokens


def test_a_structured_answer_is_checked_off_the_event_loop(
        demo_model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The schema check is pure Python at a cost per value: a long answer against a large
    ``enum`` held the event loop, and every other request, for seconds."""
    threads: list[threading.Thread] = []
    check = OutputPlan.check_answer

    def recorded(plan: OutputPlan, content: str | None) -> None:
        threads.append(threading.current_thread())
        check(plan, content)

    monkeypatch.setattr(OutputPlan, "check_answer", recorded)
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
            "temperature": 0, "reasoning_effort": "none",
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}
    events = [e for batch in run_events(demo_model, body) for e in batch]
    assert any(isinstance(e, Finish) and e.reason == "stop" for e in events)
    assert threads and threading.main_thread() not in threads
