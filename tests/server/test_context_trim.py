"""``[context] policy``: fail with context_length_exceeded, or trim the oldest turns.

The invariants of trimming (system instructions kept, the last user message and all after
it kept, a tool call never separated from its outputs) are checked on
:mod:`afmd.service.context_trim` directly, on the pipeline's own trimming with a real model's chat
template, and end to end on a server whose model has a 300-token window.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afmd.config.load import load_config
from afmd.core.request import ChatRequest, Message, ToolCall
from afmd.dialects.openai.chat_body import parse_chat_request
from afmd.engine.models.loaded_model import LoadedModel
from afmd.engine.models.model_registry import ModelRegistry
from afmd.engine.models.residency import Lease
from afmd.errors import GatewayTimeoutError, InvalidRequestError
from afmd.service.context_trim import droppable_units, without_units
from afmd.service.pipeline import ChatPipeline
from afmd.service.scheduler import Scheduler

from conftest import ServerProcess, parse_sse, start_server
from helpers.openai_schemas import validate_error, validate_response
from helpers.responses_schemas import validate_response as validate_responses_object

CHAT = "/v1/chat/completions"
LIMIT = 300
MAX_TOKENS = 40
SMALL_MODEL = f"""
[[models.model]]
id = "small"
path = "afmd:demo"
context_length = {LIMIT}
"""


# --------------------------------------------------------------------------- units


def sys_(text: str = "rules") -> Message:
    return Message(role="system", content=text)


def user(text: str = "question") -> Message:
    return Message(role="user", content=text)


def assistant(text: str = "answer") -> Message:
    return Message(role="assistant", content=text)


def call(*ids: str) -> Message:
    return Message(role="assistant", content=None,
                   tool_calls=tuple(ToolCall(i, "f", "{}") for i in ids))


def tool(call_id: str) -> Message:
    return Message(role="tool", content="out", tool_call_id=call_id)


def check_invariants(original: tuple[Message, ...], kept: tuple[Message, ...]) -> None:
    """What trimming must preserve, whatever it dropped."""
    # Kept messages are the original ones, in order (identity, not equality).
    it = iter(original)
    assert all(any(k is m for m in it) for k in kept), "order changed or message invented"
    kept_ids = {id(m) for m in kept}
    for m in original:
        if m.role in ("system", "developer"):
            assert id(m) in kept_ids, "system/developer instructions dropped"
    users = [i for i, m in enumerate(original) if m.role == "user"]
    if users:
        assert id(original[users[-1]]) in kept_ids, "the last user message dropped"
        # The current turn's last round: its last assistant message and all after it.
        answers = [i for i, m in enumerate(original) if m.role == "assistant"
                   and i > users[-1]]
        for m in original[answers[-1] if answers else users[-1]:]:
            assert id(m) in kept_ids, "the current turn lost its last round"
        # The current turn loses rounds only once every older turn is gone.
        if any(id(m) not in kept_ids for m in original[users[-1]:]):
            assert not any(id(m) in kept_ids for m in original[:users[-1]]
                           if m.role not in ("system", "developer")), \
                "a round of the current turn went before an older turn"
    # Calls and outputs together: every kept output's call is kept, and vice versa.
    calls = {c.id: m for m in original for c in m.tool_calls}
    outputs: dict[str, list[Message]] = {}
    for m in original:
        if m.role == "tool" and m.tool_call_id is not None:
            outputs.setdefault(m.tool_call_id, []).append(m)
    for call_id, message in calls.items():
        present = [id(o) in kept_ids for o in outputs.get(call_id, [])]
        if id(message) in kept_ids:
            assert all(present), f"call {call_id} kept without its outputs"
        else:
            assert not any(present), f"output of {call_id} kept without its call"


CONVERSATION = (
    sys_("S"),                      # 0
    user("u1"),                     # 1
    assistant("a1"),                # 2
    user("u2"),                     # 3
    call("c1", "c2"),               # 4
    tool("c1"),                     # 5
    tool("c2"),                     # 6
    assistant("a2"),                # 7
    Message(role="developer", content="D"),  # 8
    user("u3"),                     # 9
    call("c3"),                     # 10
    tool("c3"),                     # 11
    assistant("a3"),                # 12
    user("u4 (last)"),              # 13
    call("c4"),                     # 14
    tool("c4"),                     # 15
)


def test_units_of_a_conversation() -> None:
    units = droppable_units(CONVERSATION)
    assert units == [[1, 2], [3, 4, 5, 6, 7], [9, 10, 11, 12]]


@pytest.mark.parametrize("count", range(4))
def test_without_units_keeps_the_invariants(count: int) -> None:
    units = droppable_units(CONVERSATION)
    kept, dropped = without_units(CONVERSATION, units, count)
    assert dropped == sum(len(u) for u in units[:count])
    assert len(kept) == len(CONVERSATION) - dropped
    check_invariants(CONVERSATION, kept)
    # The oldest go first: what is dropped is exactly the first `count` units.
    gone = {i for u in units[:count] for i in u}
    assert kept == tuple(m for i, m in enumerate(CONVERSATION) if i not in gone)


def test_the_current_turns_older_rounds_go_last() -> None:
    """An agent's loop: one user message, then only calls. Its older rounds may go once
    every older turn has, never the user message nor the latest round."""
    loop = (sys_(), user("u1"), assistant("a1"), user("task"), call("c1"), tool("c1"),
            Message(role="developer", content="D"), call("c2", "c3"), tool("c2"), tool("c3"),
            assistant("so far"), call("c4"), tool("c4"))
    assert droppable_units(loop) == [[1, 2], [4, 5], [7, 8, 9], [10]]
    kept, dropped = without_units(loop, droppable_units(loop), 4)
    assert dropped == 8
    assert [m.content for m in kept] == ["rules", "task", "D", None, "out"]
    check_invariants(loop, kept)


def test_nothing_droppable_without_history() -> None:
    assert droppable_units((sys_(), user())) == []
    assert droppable_units((user(),)) == []
    assert droppable_units(()) == []
    # Before the only user message only non-instruction messages are droppable.
    assert droppable_units((sys_(), assistant(), user(), assistant())) == [[1]]


@st.composite
def conversations(draw: st.DrawFn) -> tuple[Message, ...]:
    """Well-formed conversations: tool outputs directly follow their call."""
    messages: list[Message] = []
    n = 0
    for kind in draw(st.lists(st.sampled_from(["sys", "dev", "user", "asst", "call"]),
                              max_size=14)):
        if kind == "sys":
            messages.append(sys_())
        elif kind == "dev":
            messages.append(Message(role="developer", content="d"))
        elif kind == "user":
            messages.append(user())
        elif kind == "asst":
            messages.append(assistant())
        else:
            ids = [f"c{n + i}" for i in range(draw(st.integers(1, 3)))]
            n += len(ids)
            messages.append(call(*ids))
            messages.extend(tool(i) for i in ids)
    return tuple(messages)


@settings(max_examples=200, deadline=None)
@given(conversations(), st.integers(0, 20))
def test_invariants_hold_for_any_conversation(
    messages: tuple[Message, ...], count: int
) -> None:
    units = droppable_units(messages)
    flat = [i for u in units for i in u]
    assert flat == sorted(set(flat)), "units overlap or are out of order"
    kept, dropped = without_units(messages, units, count)
    assert dropped == len(messages) - len(kept)
    check_invariants(messages, kept)
    # Dropping every unit leaves exactly the protected messages.
    all_kept, _ = without_units(messages, units, len(units))
    check_invariants(messages, all_kept)


# --------------------------------------------------------------------------- pipeline


def long_conversation(turns: int = 8, words: int = 3,
                      tool_turn: int = 6) -> list[dict[str, Any]]:
    """A system message, ``turns`` old exchanges (one with a tool call), a last question."""
    filler = " ".join(["lorem ipsum dolor"] * (words // 3))
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {t}: {filler}"})
        if t == tool_turn:
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_a", "type": "function",
                 "function": {"name": "lookup", "arguments": '{"q": "x"}'}},
                {"id": "call_b", "type": "function",
                 "function": {"name": "lookup", "arguments": '{"q": "y"}'}},
            ]})
            messages.append({"role": "tool", "tool_call_id": "call_a", "content": filler})
            messages.append({"role": "tool", "tool_call_id": "call_b", "content": filler})
        messages.append({"role": "assistant", "content": f"Answer {t}: {filler}"})
    messages.append({"role": "user", "content": "And finally, the last question?"})
    return messages


def body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "small", "messages": messages, "max_tokens": MAX_TOKENS,
            "temperature": 0, **extra}


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoadedModel]:
    path = tmp_path_factory.mktemp("trim") / "c.toml"
    path.write_text(SMALL_MODEL)
    registry = ModelRegistry(load_config(path, env={}))
    entry = registry.resolve("small")

    async def load() -> LoadedModel:
        return await registry.begin_load(entry)

    model = asyncio.run(load())
    assert model.context_length == LIMIT
    yield model
    registry.close()


def pipeline_for(model: LoadedModel, tmp_path: Path, policy: str,
                 timeout: float = 60) -> ChatPipeline:
    path = tmp_path / f"{policy}.toml"
    path.write_text(f'[context]\npolicy = "{policy}"\n' + SMALL_MODEL)

    class Registry(ModelRegistry):
        async def lease(self, entry: Any, *args: Any, **kwargs: Any) -> Lease:
            return Lease.detached(model)

    return ChatPipeline(Registry(load_config(path, env={})), Scheduler(2, 2),
                        request_timeout=timeout)


def trim_round(model: LoadedModel, tmp_path: Path, messages: list[dict[str, Any]],
               **extra: Any) -> tuple[ChatRequest, Any, ChatPipeline]:
    pipeline = pipeline_for(model, tmp_path, "trim")
    request = parse_chat_request(body(messages, **extra))

    async def go() -> Any:
        return await pipeline.prepare(request, "trim-test")

    return request, asyncio.run(go()), pipeline


def test_pipeline_trims_the_fewest_oldest_units(small_model: LoadedModel, tmp_path: Path) -> None:
    request, prepared, _ = trim_round(small_model, tmp_path, long_conversation())
    original = request.messages
    kept = prepared.round.request.messages
    assert prepared.trimmed > 0
    assert prepared.trimmed == len(original) - len(kept)
    assert len(prepared.prompt) + MAX_TOKENS <= LIMIT
    assert prepared.round.max_tokens == MAX_TOKENS
    check_invariants(original, kept)
    # What went is a prefix of the units, and one unit fewer would not have fitted.
    units = droppable_units(original)
    count = next(n for n in range(len(units) + 1)
                 if without_units(original, units, n)[0] == kept)
    assert count >= 1
    fewer, _ = without_units(original, units, count - 1)

    fewer_prompt = prepared.rounds.render(dataclasses.replace(request, messages=fewer))
    assert len(fewer_prompt) + MAX_TOKENS > LIMIT
    # The rendered prompt is the kept conversation, the last question included.
    text = small_model.tokenizer.decode(prepared.prompt)
    assert "Be brief." in text and "the last question?" in text
    assert "Question 0:" not in text
    # At this budget the recent tool call survives, with both its outputs.
    assert any(m.tool_calls for m in kept)
    assert [m.tool_call_id for m in kept if m.role == "tool"] == ["call_a", "call_b"]


def test_trimming_stops_at_the_deadline(small_model: LoadedModel, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Trimming renders the conversation once per step of its search: a body of hundreds
    of thousands of short turns was answered its 504 tens of seconds past the deadline,
    on a slower template past the response timeout as a 500. It is the 504 at the
    deadline, and the renders stop."""
    pipeline = pipeline_for(small_model, tmp_path, "trim", timeout=0.5)
    messages: list[dict[str, Any]] = []
    for t in range(20_000):
        messages += [{"role": "user", "content": f"q{t}"}, {"role": "assistant", "content": "a"}]
    request = parse_chat_request(body([*messages, {"role": "user", "content": "last?"}]))
    renders = 0
    render = LoadedModel.render_prompt

    def counted(model: LoadedModel, *args: Any, **kwargs: Any) -> list[int]:
        nonlocal renders
        renders += 1
        return render(model, *args, **kwargs)

    monkeypatch.setattr(LoadedModel, "render_prompt", counted)

    async def go() -> tuple[float, int]:
        started = time.monotonic()
        with pytest.raises(GatewayTimeoutError, match="request_timeout"):
            await pipeline.prepare(request, "trim-deadline")
        took = time.monotonic() - started
        at_answer = renders
        await asyncio.sleep(1.5)  # the render in progress ends, and no other starts
        return took, renders - at_answer

    took, after = asyncio.run(go())
    assert took < 0.5 + 0.5, took
    assert after <= 1, after


def test_pipeline_keeps_a_tool_call_with_its_outputs(
    small_model: LoadedModel, tmp_path: Path
) -> None:
    # Every budget between "nothing to drop" and "drop everything" keeps the pairing.
    messages = long_conversation()
    seen: set[int] = set()
    call_kept: set[bool] = set()
    for max_tokens in range(10, 200, 10):
        request, prepared, _ = trim_round(small_model, tmp_path, messages,
                                          max_tokens=max_tokens)
        kept = prepared.round.request.messages
        check_invariants(request.messages, kept)
        assert len(prepared.prompt) + max_tokens <= LIMIT
        seen.add(prepared.trimmed)
        call_kept.add(any(m.tool_calls for m in kept))
    assert len(seen) >= 3, seen  # the budgets really cut at different places
    assert call_kept == {True, False}, call_kept  # around the call, too


def test_pipeline_without_max_tokens_trims_to_leave_room(
    small_model: LoadedModel, tmp_path: Path
) -> None:
    messages = long_conversation()
    request = parse_chat_request({"model": "small", "messages": messages})
    pipeline = pipeline_for(small_model, tmp_path, "trim")

    async def go() -> Any:
        return await pipeline.prepare(request, "no-max")

    prepared = asyncio.run(go())
    assert prepared.trimmed > 0
    assert prepared.round.max_tokens >= 1
    assert len(prepared.prompt) + prepared.round.max_tokens == LIMIT
    check_invariants(request.messages, prepared.round.request.messages)


def test_pipeline_fail_policy_does_not_trim(small_model: LoadedModel, tmp_path: Path) -> None:
    pipeline = pipeline_for(small_model, tmp_path, "fail")
    request = parse_chat_request(body(long_conversation()))

    async def go() -> Any:
        return await pipeline.prepare(request, "fail-test")

    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(go())
    assert info.value.code == "context_length_exceeded"
    assert info.value.param == "messages"


# --------------------------------------------------------------------------- e2e


@pytest.fixture(scope="module")
def trim_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("trim-server")
    proc = start_server(tmp, config='[context]\npolicy = "trim"\n' + SMALL_MODEL)
    yield proc
    proc.stop()


def test_trim_policy_end_to_end(
    trim_server: ServerProcess, small_model: LoadedModel, tmp_path: Path
) -> None:
    messages = long_conversation()
    response = httpx.post(trim_server.url + CHAT, json=body(messages), timeout=60)
    assert response.status_code == 200, response.text
    validate_response(response.json())
    trimmed = int(response.headers["X-AFM-Trimmed-Messages"])
    assert trimmed > 0
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] + MAX_TOKENS <= LIMIT
    assert usage["completion_tokens"] <= MAX_TOKENS
    # The server dropped exactly what the pipeline (checked above) drops in-process.
    _, prepared, _ = trim_round(small_model, tmp_path, messages)
    assert trimmed == prepared.trimmed
    assert usage["prompt_tokens"] == len(prepared.prompt)


def test_trim_policy_end_to_end_stream(trim_server: ServerProcess) -> None:
    response = httpx.post(
        trim_server.url + CHAT,
        json=body(long_conversation(), stream=True, stream_options={"include_usage": True}),
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert int(response.headers["X-AFM-Trimmed-Messages"]) > 0
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    usage = [e for e in events if isinstance(e, dict) and e.get("usage")][-1]["usage"]
    assert usage["prompt_tokens"] + MAX_TOKENS <= LIMIT


def test_counting_endpoints_count_what_the_turn_renders(trim_server: ServerProcess) -> None:
    """Under trim, Anthropic's count_tokens refused with a context error a conversation
    its create serves trimmed; both counting endpoints count the trimmed prompt."""
    words = " ".join(["lorem ipsum dolor"] * 12)
    turns: list[dict[str, Any]] = []
    for i in range(10):
        turns += [{"role": "user", "content": f"{i}: {words}"},
                  {"role": "assistant", "content": f"{i}: {words}"}]
    turns.append({"role": "user", "content": "hi"})
    url = trim_server.url
    counted = httpx.post(url + "/v1/messages/count_tokens",
                         json={"model": "small", "messages": turns}, timeout=60)
    assert counted.status_code == 200, counted.text
    tokens = counted.json()["input_tokens"]
    assert 0 < tokens < LIMIT
    made = httpx.post(url + "/v1/messages", timeout=60, json={
        "model": "small", "messages": turns, "max_tokens": 4})
    assert made.status_code == 200, made.text
    assert int(made.headers["X-AFM-Trimmed-Messages"]) > 0
    usage = made.json()["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == tokens
    items = httpx.post(url + "/v1/responses/input_tokens", timeout=60, json={
        "model": "small", "input": turns})
    assert items.status_code == 200, items.text
    assert items.json()["input_tokens"] < LIMIT
    whole = httpx.post(url + "/v1/responses/input_tokens", timeout=60, json={
        "model": "small", "input": turns, "truncation": "disabled"})
    assert whole.json()["input_tokens"] > LIMIT


def test_no_header_when_nothing_was_trimmed(trim_server: ServerProcess) -> None:
    response = httpx.post(trim_server.url + CHAT,
                          json=body(long_conversation(turns=1)), timeout=60)
    assert response.status_code == 200, response.text
    assert "X-AFM-Trimmed-Messages" not in response.headers


@pytest.mark.parametrize("stream", [False, True])
def test_protected_part_too_long_fails_even_with_trim(
    trim_server: ServerProcess, stream: bool
) -> None:
    messages = long_conversation()
    messages[-1] = {"role": "user", "content": " ".join(["lorem ipsum dolor"] * 120)}
    response = httpx.post(trim_server.url + CHAT, json=body(messages, stream=stream),
                          timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()
    validate_error(error)
    assert error["error"]["code"] == "context_length_exceeded"
    assert error["error"]["param"] == "messages"
    assert "X-AFM-Trimmed-Messages" not in response.headers


def test_fail_policy_is_the_default(http: httpx.Client) -> None:
    # The shared default server: the demo model's 131,072-token window, policy unset.
    messages = long_conversation()
    ok = http.post(CHAT, json={"messages": messages, "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200, ok.text
    response = http.post(CHAT, json={"messages": messages, "max_tokens": 131070})
    assert response.status_code == 400, response.text
    error = response.json()
    validate_error(error)
    assert error["error"]["code"] == "context_length_exceeded"
    assert error["error"]["param"] == "messages"
    assert "X-AFM-Trimmed-Messages" not in response.headers


# ------------------------------------------------------ Responses' own truncation


@pytest.fixture(scope="module")
def fail_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("fail-server"), config=SMALL_MODEL)
    yield proc
    proc.stop()


def long_input(turns: int = 8) -> list[dict[str, Any]]:
    """Responses input items: old exchanges, then the last question."""
    filler = " ".join(["lorem ipsum dolor"] * 3)
    items: list[dict[str, Any]] = []
    for t in range(turns):
        items.append({"role": "user", "content": f"Question {t}: {filler}"})
        items.append({"role": "assistant", "content": f"Answer {t}: {filler}"})
    items.append({"role": "user", "content": "And now?"})
    return items


@pytest.mark.parametrize(("policy", "truncation", "trims"), [
    ("fail", "auto", True), ("fail", "disabled", False), ("fail", None, False),
    ("trim", "disabled", False), ("trim", None, True),
], ids=["auto", "disabled", "absent-fail", "disabled-over-trim", "absent-trim"])
def test_responses_truncation_decides_per_request(
    fail_server: ServerProcess, trim_server: ServerProcess, policy: str,
    truncation: str | None, trims: bool,
) -> None:
    """OpenAI's ``truncation``: "auto" drops items to fit, "disabled" fails with 400;
    a request that sends neither follows the server's ``[context] policy``."""
    server = trim_server if policy == "trim" else fail_server
    request: dict[str, Any] = {"model": "small", "input": long_input(),
                               "max_output_tokens": MAX_TOKENS, "temperature": 0,
                               "store": False}
    if truncation is not None:
        request["truncation"] = truncation
    response = httpx.post(server.url + "/v1/responses", json=request, timeout=60)
    if trims:
        assert response.status_code == 200, response.text
        assert int(response.headers["X-AFM-Trimmed-Messages"]) > 0
        answer = response.json()
        validate_responses_object(answer)
        assert answer["usage"]["input_tokens"] + MAX_TOKENS <= LIMIT
        # What was applied: a body that names none gets the server's policy, "auto".
        assert answer["truncation"] == (truncation or "auto")
    else:
        assert response.status_code == 400, response.text
        validate_error(response.json())
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "input")


def agent_loop(rounds: int = 10) -> list[dict[str, Any]]:
    """Responses input items as an agent sends them: one task, then only its calls (each
    after a reasoning item) and their outputs."""
    items: list[dict[str, Any]] = [{"role": "user", "content": "Look it all up."}]
    for k in range(rounds):
        items += [
            {"type": "reasoning", "id": f"rs_{k}", "summary": [
                {"type": "summary_text", "text": f"Step {k}."}]},
            {"type": "function_call", "call_id": f"call_{k}", "name": "lookup",
             "arguments": json.dumps({"q": k})},
            {"type": "function_call_output", "call_id": f"call_{k}",
             "output": "lorem ipsum dolor"},
        ]
    return items


@pytest.mark.parametrize("stream", [False, True])
def test_responses_truncation_auto_trims_an_agents_loop(
    fail_server: ServerProcess, stream: bool
) -> None:
    """Everything after the one user message is calls: "auto" drops the oldest of them
    (each with its output), keeps the task, the instructions and the latest call, where
    before it refused the loop as too long whatever ``truncation`` said. (No tools: the
    demo template's tool prompt alone would fill the small window.)"""
    budget = 16
    request: dict[str, Any] = {
        "model": "small", "input": agent_loop(), "instructions": "Be brief.",
        "truncation": "auto", "max_output_tokens": budget, "temperature": 0,
        "store": False, "stream": stream}
    response = httpx.post(fail_server.url + "/v1/responses", json=request, timeout=60)
    assert response.status_code == 200, response.text
    assert int(response.headers["X-AFM-Trimmed-Messages"]) > 0
    if stream:
        events = [json.loads(block.partition("data: ")[2])
                  for block in response.text.split("\n\n") if block.strip()]
        answer = events[-1]["response"]
    else:
        answer = response.json()
        validate_responses_object(answer)
    assert answer["usage"]["input_tokens"] + budget <= LIMIT
    count = {key: request[key] for key in ("model", "input", "instructions", "truncation")}
    counted = httpx.post(fail_server.url + "/v1/responses/input_tokens", json=count,
                         timeout=60)
    assert counted.status_code == 200, counted.text
    # The count leaves room for one token, the turn for max_output_tokens: it may keep more.
    assert answer["usage"]["input_tokens"] <= counted.json()["input_tokens"] < LIMIT
    disabled = httpx.post(fail_server.url + "/v1/responses",
                          json={**request, "truncation": "disabled"}, timeout=60)
    assert disabled.status_code == 400, disabled.text
    error = disabled.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "input")
