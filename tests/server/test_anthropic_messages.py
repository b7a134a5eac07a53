"""Anthropic's Messages API through the official ``anthropic`` client, on the real server
and the demo model: create, stream (text, thinking and tool use reassembled by the SDK),
count_tokens, the tool loop, sampling through extra_body, structured output, thinking."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from conftest import ServerProcess
from helpers.anthropic_cases import MESSAGES, NO_THINKING, SCHEMAS, THINKS, TOOLS
from helpers.smoke import Running

ALIAS = "gpt-4o-mini"  # the shared server's alias of demo (Claude Code's names work alike)
TOOL_USE_ID = re.compile(r"^toolu_[A-Za-z0-9]{24}$")
MESSAGE_ID = re.compile(r"^msg_[A-Za-z0-9]{24}$")


@pytest.fixture()
def claude(server: ServerProcess) -> anthropic.Anthropic:
    """The client as Claude Code sets it up: ANTHROPIC_BASE_URL is the server's root."""
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def create(claude: anthropic.Anthropic, **kwargs: Any) -> Any:
    body: dict[str, Any] = {"model": "demo", "max_tokens": 300, "messages": MESSAGES, **kwargs}
    return claude.messages.create(**body)


def forced(claude: anthropic.Anthropic, seed: int, **kwargs: Any) -> Any:
    """A turn that must call the tools (``tool_choice`` any unless ``kwargs`` says)."""
    return create(claude, **{"tools": TOOLS, "tool_choice": {"type": "any"},
                             "extra_body": {"seed": seed}, **kwargs})


def check_tool_use(block: Any, names: tuple[str, ...] = tuple(SCHEMAS)) -> None:
    assert block.type == "tool_use"
    assert TOOL_USE_ID.match(block.id), block.id
    assert block.name in names
    jsonschema.validate(block.input, SCHEMAS[block.name])


def blocks(message: Any) -> list[dict[str, Any]]:
    """A message's content blocks, tool_use ids left out (each request makes its own)."""
    return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in message.content]


def total_input(usage: Any) -> int:
    return (usage.input_tokens + usage.cache_read_input_tokens
            + usage.cache_creation_input_tokens)


# -- text -----------------------------------------------------------------------------------


def test_create_answers_a_message_under_the_alias(claude: anthropic.Anthropic) -> None:
    message = create(claude, model=ALIAS, max_tokens=12, extra_body={"temperature": 0})
    assert MESSAGE_ID.match(message.id)
    assert message.type == "message" and message.role == "assistant"
    assert message.model == ALIAS
    assert [b.type for b in message.content] == ["text"] and message.content[0].text
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    usage = message.usage
    assert usage.output_tokens == 12
    assert usage.cache_creation_input_tokens == 0
    assert total_input(usage) == claude.messages.count_tokens(
        model=ALIAS, messages=MESSAGES).input_tokens
    # The prompt again: the prefix cache holds it, and says so.
    again = create(claude, model=ALIAS, max_tokens=1, extra_body={"temperature": 0})
    assert again.usage.cache_read_input_tokens > 0
    assert total_input(again.usage) == total_input(usage)


def test_stream_reassembles_into_the_created_message(claude: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = {"max_tokens": 24, "extra_body": {"temperature": 0}}
    whole = create(claude, **kwargs)
    with claude.messages.stream(model="demo", messages=MESSAGES, **kwargs) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert "text" in types  # the SDK's own event for each text delta
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == 24
    assert total_input(final.usage) == total_input(whole.usage)
    with claude.messages.stream(model="demo", messages=MESSAGES, **kwargs) as stream:
        assert "".join(stream.text_stream) == whole.content[0].text


def test_max_tokens_0_fills_the_prompt_cache_and_answers_nothing(
        claude: anthropic.Anthropic) -> None:
    """Anthropic's cache pre-warming (the SDK: "Set to 0 to populate the prompt cache
    without generating a response"): the prompt goes into the prefix cache, and the next
    request that shares it reads it there. It was a 400 (``max_tokens`` at least 1)."""
    system = f"{uuid.uuid4()} You answer questions about the weather. " * 20
    warm = create(claude, max_tokens=0, system=system)
    assert warm.content == [] and warm.stop_reason == "max_tokens"
    assert warm.usage.output_tokens == 0
    prompt = claude.messages.count_tokens(model="demo", messages=MESSAGES, system=system)
    assert total_input(warm.usage) == prompt.input_tokens
    asked = create(claude, max_tokens=1, system=system,
                   messages=[{"role": "user", "content": "And in Rome?"}])
    assert asked.usage.cache_read_input_tokens > prompt.input_tokens // 2
    assert asked.usage.output_tokens == 1


def test_count_tokens_counts_system_and_tools(claude: anthropic.Anthropic) -> None:
    plain = claude.messages.count_tokens(model="demo", messages=MESSAGES).input_tokens
    system = claude.messages.count_tokens(
        model="demo", messages=MESSAGES,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
    ).input_tokens
    tools = claude.messages.count_tokens(model="demo", messages=MESSAGES, tools=TOOLS)
    assert 0 < plain < system
    assert tools.input_tokens > system
    message = create(claude, max_tokens=1, tools=TOOLS, tool_choice={"type": "auto"})
    assert total_input(message.usage) == tools.input_tokens
    # What the turn refuses, the count refuses alike (an image for a text-only model).
    image = [{"role": "user", "content": [
        {"type": "text", "text": "What is it?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}]}]
    with pytest.raises(anthropic.BadRequestError) as turn:
        create(claude, max_tokens=1, messages=image)
    with pytest.raises(anthropic.BadRequestError) as counted:
        claude.messages.count_tokens(model="demo", messages=image)
    assert counted.value.body == turn.value.body


def test_a_text_document_is_part_of_the_prompt(claude: anthropic.Anthropic) -> None:
    doc = {"type": "document", "title": "Plan", "source": {
        "type": "text", "media_type": "text/plain", "data": "Ship the release on Friday."}}
    with_doc = [{"role": "user", "content": [doc, {"type": "text", "text": "When?"}]}]
    plain = [{"role": "user", "content": "When?"}]
    counted = claude.messages.count_tokens(model="demo", messages=with_doc).input_tokens
    assert counted > claude.messages.count_tokens(model="demo", messages=plain).input_tokens
    message = create(claude, max_tokens=2, messages=with_doc)
    assert total_input(message.usage) == counted
    with pytest.raises(anthropic.BadRequestError) as caught:
        create(claude, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                            "data": "JVBERi0="}}]}])
    assert "no PDF reader" in caught.value.message


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_stop_sequence_is_reported(claude: anthropic.Anthropic, stream: bool) -> None:
    kwargs: dict[str, Any] = {"max_tokens": 40, "extra_body": {"temperature": 0}}
    text = create(claude, **kwargs).content[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    if stream:
        with claude.messages.stream(model="demo", messages=MESSAGES, stop_sequences=[stop],
                                    **kwargs) as events:
            message = events.get_final_message()
    else:
        message = create(claude, stop_sequences=["never-seen", stop], **kwargs)
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == stop
    assert message.content[0].text == text[: text.index(stop)]


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_a_stop_sequence_in_the_thinking_does_not_end_the_message(
    claude: anthropic.Anthropic, stream: bool
) -> None:
    """Only the visible text is matched, as Anthropic matches it: a stop sequence the
    thinking holds leaves the message whole; one in the text after it ends it there."""
    kwargs: dict[str, Any] = {
        "max_tokens": 300, "thinking": {"type": "enabled", "budget_tokens": 40},
        "extra_body": {"seed": THINKS[0]},
        "output_config": {"format": {"type": "json_schema", "schema": SCHEMAS["add"]}}}
    whole = create(claude, **kwargs)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    thought, text = whole.content[0].thinking, whole.content[1].text
    stop = next(thought[i:i + 3] for i in range(len(thought) - 2)
                if thought[i:i + 3].strip() and thought[i:i + 3] not in text)

    def run(stops: list[str]) -> Any:
        if not stream:
            return create(claude, stop_sequences=stops, **kwargs)
        with claude.messages.stream(model="demo", messages=MESSAGES, stop_sequences=stops,
                                    **kwargs) as events:
            return events.get_final_message()

    kept = run([stop])
    assert blocks(kept) == blocks(whole), stop
    assert (kept.stop_reason, kept.stop_sequence) == ("end_turn", None)
    cut = run([stop, '"b"'])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", '"b"')
    assert blocks(cut) == [blocks(whole)[0], {**blocks(whole)[1],
                                              "text": text[: text.index('"b"')]}]


def test_sampling_fields_go_in_extra_body(claude: anthropic.Anthropic) -> None:
    def sample(seed: int) -> str:
        message = create(claude, max_tokens=16, extra_body={
            "temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": seed})
        return message.content[0].text

    assert sample(3) == sample(3)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1
    with pytest.raises(anthropic.BadRequestError) as raised:
        create(claude, max_tokens=4, extra_body={"temperature": 1.5})
    assert raised.value.status_code == 400
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    assert raised.value.body["error"]["message"].startswith("temperature: ")


def test_fields_meaning_nothing_locally_are_ignored(claude: anthropic.Anthropic) -> None:
    message = create(
        claude, max_tokens=2, metadata={"user_id": "u-1"}, service_tier="auto",
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        extra_body={"container": None, "inference_geo": "us", "speed": "standard",
                    "cache_control": {"type": "ephemeral"}, "keep_alive": "5m",
                    "temperature": 0},
        extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"},
    )
    assert message.usage.output_tokens == 2


def test_unknown_model_is_not_found(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as raised:
        create(claude, model="claude-nonexistent", max_tokens=2)
    error = raised.value.body["error"]
    assert error["type"] == "not_found_error"
    assert "claude-nonexistent" in error["message"]


# -- tools ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [NO_THINKING, THINKS[0]])
def test_streamed_tool_use_and_thinking_reassemble(
    claude: anthropic.Anthropic, seed: int
) -> None:
    kwargs: dict[str, Any] = {"tools": TOOLS, "tool_choice": {"type": "any"},
                              "extra_body": {"seed": seed}}
    whole = create(claude, **kwargs)
    with claude.messages.stream(model="demo", max_tokens=300, messages=MESSAGES,
                                **kwargs) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_message()
    assert whole.stop_reason == final.stop_reason == "tool_use"
    assert blocks(final) == blocks(whole)
    thinking = [b for b in final.content if b.type == "thinking"]
    assert bool(thinking) == (seed in THINKS)
    if thinking:
        assert final.content[0] is thinking[0] and thinking[0].thinking
        assert thinking[0].signature == ""
        assert "thinking" in types  # the SDK's event for each thinking delta
        assert final.usage.output_tokens_details.thinking_tokens > 0
    calls = [b for b in final.content if b.type == "tool_use"]
    assert calls
    for call in calls:
        check_tool_use(call)
    assert types.count("input_json") > len(calls), "inputs stream fragment by fragment"


def test_disable_parallel_tool_use_and_a_named_tool(claude: anthropic.Anthropic) -> None:
    for seed in (1, 2):  # seeds with which the demo model makes several calls
        message = forced(claude, seed, tool_choice={"type": "any",
                                                    "disable_parallel_tool_use": True})
        assert [b.type for b in message.content if b.type != "thinking"] == ["tool_use"]
        assert message.stop_reason == "tool_use"
        check_tool_use(message.content[-1])
        named = forced(claude, seed, tool_choice={"type": "tool", "name": "add",
                                                  "disable_parallel_tool_use": True})
        assert [b.type for b in named.content if b.type != "thinking"] == ["tool_use"]
        check_tool_use(named.content[-1], ("add",))


def test_tool_choice_none_keeps_the_tools_in_the_prompt(claude: anthropic.Anthropic) -> None:
    auto = create(claude, max_tokens=1, tools=TOOLS)
    message = create(claude, max_tokens=60, tools=TOOLS, tool_choice={"type": "none"},
                     extra_body={"seed": 1})
    assert all(b.type != "tool_use" for b in message.content)
    assert message.stop_reason in ("end_turn", "max_tokens")
    # As Anthropic does: the tools stay listed (the call token is banned), and the
    # prompt's prefix cached by the auto turn serves this one.
    assert total_input(message.usage) == total_input(auto.usage)
    assert message.usage.cache_read_input_tokens >= total_input(auto.usage) - 1


def test_full_tool_loop(claude: anthropic.Anthropic) -> None:
    """tool_use, then tool_result (one of them an error), then an answer."""
    first = forced(claude, 3)
    calls = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and len(calls) > 1
    results = [{"type": "tool_result", "tool_use_id": call.id,
                "content": [{"type": "text", "text": json.dumps({"ok": i})}]}
               for i, call in enumerate(calls)]
    results[-1] = {"type": "tool_result", "tool_use_id": calls[-1].id, "is_error": True,
                   "content": "the service is down"}
    history = [*MESSAGES, first.to_param(),
               {"role": "user", "content": [*reversed(results),
                                            {"type": "text", "text": "Now answer."}]}]
    counted = claude.messages.count_tokens(model="demo", messages=history, tools=TOOLS)
    answer = claude.messages.create(model="demo", max_tokens=40, messages=history,
                                    tools=TOOLS, tool_choice={"type": "none"},
                                    extra_body={"seed": 1})
    assert all(b.type != "tool_use" for b in answer.content)
    assert answer.content and answer.content[-1].type == "text"
    assert answer.stop_reason in ("end_turn", "max_tokens")
    # tool_choice none leaves the tools in the prompt: as many tokens as counted.
    assert total_input(answer.usage) == counted.input_tokens

    # A tool_use the next user turn leaves unanswered is the client's error.
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(model="demo", max_tokens=4, tools=TOOLS, messages=[
            *MESSAGES, first.to_param(), {"role": "user", "content": results[:1]}])
    message = raised.value.body["error"]["message"]
    assert message.startswith("messages[1].content: tool_use ids were found without "
                              "tool_result blocks")


# -- output ---------------------------------------------------------------------------------


def test_output_config_format_is_enforced(claude: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer", "maximum": 9}},
              "required": ["city", "n"], "additionalProperties": False}
    for seed in (1, 2):
        message = create(claude, max_tokens=200, extra_body={"seed": seed},
                         output_config={"format": {"type": "json_schema", "schema": schema}})
        assert message.stop_reason == "end_turn"
        text = "".join(b.text for b in message.content if b.type == "text")
        jsonschema.validate(json.loads(text), schema)
    with pytest.raises(anthropic.BadRequestError) as raised:
        create(claude, max_tokens=8, output_config={"format": {
            "type": "json_schema", "schema": {"type": "object", "properties": 3}}})
    assert raised.value.body["error"]["message"].startswith("output_config.format.schema: ")


def test_thinking_disabled_and_effort(claude: anthropic.Anthropic) -> None:
    plain = create(claude, max_tokens=1)
    off = create(claude, max_tokens=1, thinking={"type": "disabled"})
    # The demo template closes an empty thinking block when thinking is off.
    assert total_input(off.usage) > total_input(plain.usage)
    for effort in ("low", "medium", "high", "xhigh", "max"):
        message = create(claude, max_tokens=1, output_config={"effort": effort})
        assert total_input(message.usage) == total_input(plain.usage)
    off_with_effort = create(claude, max_tokens=1, thinking={"type": "disabled"},
                             output_config={"effort": "high"})
    assert total_input(off_with_effort.usage) == total_input(off.usage)
    adaptive = create(claude, max_tokens=1, thinking={"type": "adaptive"})
    assert total_input(adaptive.usage) == total_input(plain.usage)
    with pytest.raises(anthropic.BadRequestError) as raised:
        create(claude, max_tokens=100, thinking={"type": "enabled", "budget_tokens": 100})
    assert raised.value.body["error"]["message"].startswith("thinking.budget_tokens: ")


@pytest.mark.parametrize("seed", THINKS)
def test_thinking_budget_bounds_the_thinking(claude: anthropic.Anthropic, seed: int) -> None:
    # A format, not a forced call: thinking on refuses a tool_choice that forces one.
    kwargs: dict[str, Any] = {"extra_body": {"seed": seed},
                              "output_config": {"format": {"type": "json_schema",
                                                           "schema": SCHEMAS["add"]}}}
    free = create(claude, **kwargs)
    bounded = create(claude, thinking={"type": "enabled", "budget_tokens": 2}, **kwargs)
    # The count includes the block's two markers.
    assert free.usage.output_tokens_details.thinking_tokens > 2 + 2
    assert 0 < bounded.usage.output_tokens_details.thinking_tokens <= 2 + 2
    assert [b.type for b in bounded.content] == ["thinking", "text"]
    jsonschema.validate(json.loads(bounded.content[1].text), SCHEMAS["add"])


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 20},
                                      {"type": "adaptive"}], ids=["enabled", "adaptive"])
def test_thinking_with_a_forced_tool_choice_is_refused(
    claude: anthropic.Anthropic, thinking: dict[str, Any]
) -> None:
    for choice in ({"type": "any"}, {"type": "tool", "name": "add"}):
        with pytest.raises(anthropic.BadRequestError) as raised:
            forced(claude, THINKS[0], tool_choice=choice, thinking=thinking)
        assert raised.value.body["error"] == {
            "type": "invalid_request_error",
            "message": "tool_choice.type: Thinking may not be enabled when tool_choice "
                       "forces tool use."}
    answered = forced(claude, THINKS[0], tool_choice={"type": "auto"}, thinking=thinking,
                      max_tokens=24)
    assert answered.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_images_need_a_vision_model(claude: anthropic.Anthropic) -> None:
    pixel = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA"
             "60e6kgAAAABJRU5ErkJggg==")
    with pytest.raises(anthropic.BadRequestError) as raised:
        create(claude, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": pixel}},
            {"type": "text", "text": "What is this?"}]}])
    assert raised.value.body["error"]["message"].startswith("messages[0].content[0].source: ")
    with pytest.raises(anthropic.BadRequestError) as raised:
        create(claude, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
    assert raised.value.body["error"]["message"].startswith("messages[0].content[0].source.type")


def test_an_image_of_another_media_type_is_refused(claude: anthropic.Anthropic) -> None:
    """PNG bytes declared as JPEG: Anthropic's 400, before any model is asked (the demo
    is text-only: a matching image is refused for that instead)."""
    pixel = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA"
             "60e6kgAAAABJRU5ErkJggg==")
    for count in (False, True):
        with pytest.raises(anthropic.BadRequestError) as raised:
            messages = [{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                             "data": pixel}}]}]
            if count:
                claude.messages.count_tokens(model="demo", messages=messages)
            else:
                create(claude, max_tokens=2, messages=messages)
        assert raised.value.body["error"] == {
            "type": "invalid_request_error",
            "message": "messages[0].content[1].source.media_type: The image was specified "
                       "using the image/jpeg media type, but the image appears to be a "
                       "image/png image."}


def test_thinking_blocks_sent_back_are_accepted(claude: anthropic.Anthropic) -> None:
    first = forced(claude, THINKS[0])
    assert first.content[0].type == "thinking"
    history = [*MESSAGES, first.to_param(), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": b.id, "content": "ok"}
        for b in first.content if b.type == "tool_use"]}]
    answer = claude.messages.create(model="demo", max_tokens=4, messages=history, tools=TOOLS)
    assert answer.usage.output_tokens > 0


def test_models_list_and_retrieve_in_anthropic_s_shape(claude: anthropic.Anthropic) -> None:
    """``/v1/models`` answers Anthropic's SDK too (one path for both APIs): each model's
    ``type``, ``display_name`` and ``created_at``, and the page's ``has_more`` and ids,
    which were all missing (None in the SDK's objects)."""
    page = claude.models.list()
    ids = [m.id for m in page.data]
    assert "demo" in ids and "gpt-4o-mini" in ids
    assert page.has_more is False
    assert (page.first_id, page.last_id) == (ids[0], ids[-1])
    for model in page.data:
        assert model.type == "model" and model.display_name == model.id
        assert model.lifecycle == "active"  # required by the SDK's type (it was None)
        assert model.created_at.tzinfo is not None and model.created_at.year >= 2026
    one = claude.models.retrieve("gpt-4o-mini")
    assert (one.id, one.type, one.display_name, one.lifecycle) == (
        "gpt-4o-mini", "model", "gpt-4o-mini", "active")


def test_a_warm_up_runs_beside_the_batch_and_ends_on_cancel(
        server: ServerProcess, claude: anthropic.Anthropic) -> None:
    """A ``max_tokens: 0`` prompt is run a chunk per step, as a joining prompt is: run
    whole at its admission, a long one held up every stream for as long as it took, and a
    cancel by its X-Request-ID (or its deadline) could not end it, so it answered
    ``max_tokens`` seconds after the client had given up on it."""
    rid = f"warm-{uuid.uuid4()}"
    long = f"{uuid.uuid4()} " + "the weather in Rome is mild today. " * 1500
    warming = Running(server.url, lambda: httpx.post(
        f"{server.url}/v1/messages", timeout=120,
        headers={"anthropic-version": "2023-06-01", "x-request-id": rid},
        json={"model": "demo", "max_tokens": 0,
              "messages": [{"role": "user", "content": long}]})).under_way()
    beside = create(claude, max_tokens=2)
    assert beside.usage.output_tokens == 2
    cancelled = httpx.post(f"{server.url}/v1/chat/completions/{rid}/cancel")
    answer = warming.answer(120)
    assert cancelled.json()["cancelled"] is True, "the warm-up ended before its cancel"
    assert answer.json()["stop_reason"] == "cancelled"
