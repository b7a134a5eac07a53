"""The Responses API (``/v1/responses``) through the official ``openai`` client, against the
real server on the real demo model; every body sent, response object and event checked
against OpenAI's published schemas."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from helpers.responses_schemas import (
    validate,
    validate_event,
    validate_item_list,
    validate_request,
    validate_response,
)

CALL_ID = re.compile(r"^call_[A-Za-z0-9]{24}$")
RESP_ID = re.compile(r"^resp_[0-9a-f]{48}$")
QUESTION = "What is the weather in Paris, and what is 2+3?"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                   "b": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
     "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "add", "description": "Add two integers.", "parameters": ADD,
     "strict": True},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


def create(client: Any, **body: Any) -> tuple[Any, dict[str, Any]]:
    """One ``responses.create``: the SDK's object and the JSON on the wire, both checked."""
    body = {"model": "demo", **body}
    extra = body.pop("extra_body", {})
    validate_request({**body, **extra})
    raw = client.responses.with_raw_response.create(**body, extra_body=extra or None)
    wire = raw.http_response.json()
    validate_response(wire)
    response = raw.parse()
    assert RESP_ID.match(response.id)
    assert wire["id"] == response.id and wire["object"] == "response"
    return response, wire


def usage_consistent(usage: Any) -> None:
    assert usage.input_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 <= usage.output_tokens_details.reasoning_tokens <= usage.output_tokens
    assert 0 <= usage.input_tokens_details.cached_tokens <= usage.input_tokens


def test_plain_text_is_the_chat_answer(client) -> None:
    """``instructions`` + a string ``input`` is the system + user chat: same greedy text."""
    response, wire = create(client, instructions="You are terse.", input="Say something.",
                            max_output_tokens=16, temperature=0)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert wire["completed_at"] is None and wire["error"] is None
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "incomplete" and message.id.startswith("msg_")
    (part,) = message.content
    assert part.type == "output_text" and part.annotations == []
    assert response.output_text == part.text and part.text
    assert response.instructions == "You are terse." and response.model == "demo"
    assert response.max_output_tokens == 16 and response.store is True
    usage_consistent(response.usage)
    assert response.usage.output_tokens == 16
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    chat = client.chat.completions.create(
        model="demo", max_tokens=16, temperature=0,
        messages=[{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Say something."}])
    assert chat.choices[0].message.content == part.text
    assert chat.usage.prompt_tokens == response.usage.input_tokens


def test_compact_is_a_clear_404_through_the_sdk(client) -> None:
    """``responses.compact`` (OpenAI's server-side compaction) is not served: a 404 saying
    so, where the path read as a stored response's id answered 405."""
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.compact(model="demo", input="Say something.")
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "not_served", error
    assert "does not compact" in error["message"]


def test_function_call_loop_codex_style(client) -> None:
    """``store: false``, the whole history sent back each turn with the reasoning item,
    ``include: ["reasoning.encrypted_content"]``: a call, its output, then the answer."""
    codex = {"tools": TOOLS, "store": False, "include": ["reasoning.encrypted_content"],
             "temperature": 1.0, "max_output_tokens": 300}
    user = {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": QUESTION}]}
    first, wire = create(client, input=[user], tool_choice="required",
                         extra_body={"seed": 0}, **codex)
    assert first.status == "completed" and wire["completed_at"] >= wire["created_at"]
    kinds = [item.type for item in first.output]
    assert kinds[0] == "reasoning" and set(kinds[1:]) == {"function_call"}, kinds
    reasoning = wire["output"][0]
    assert reasoning["summary"] == [] and reasoning["encrypted_content"] is None
    assert reasoning["content"][0]["type"] == "reasoning_text"
    assert reasoning["content"][0]["text"]
    assert first.usage.output_tokens_details.reasoning_tokens > 0
    usage_consistent(first.usage)
    outputs = []
    for call in first.output[1:]:
        assert CALL_ID.match(call.call_id) and call.id.startswith("fc_")
        assert call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        outputs.append({"type": "function_call_output", "call_id": call.call_id,
                        "output": json.dumps({"ok": True})})
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)  # store: false keeps nothing

    history = [user, *wire["output"], *outputs]
    second, _ = create(client, input=history, tool_choice="none", **codex)
    assert [item.type for item in second.output][-1] == "message"
    assert second.output_text
    # The whole first turn is the second's prompt prefix (tools shown in both).
    third, _ = create(client, input=history, tool_choice="auto", max_output_tokens=16,
                      tools=TOOLS, store=False)
    assert third.usage.input_tokens > first.usage.input_tokens + len(outputs)
    assert third.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1


def test_named_and_allowed_tool_choices_bind_the_call(client) -> None:
    allowed = {"type": "allowed_tools", "mode": "required",
               "tools": [{"type": "function", "name": "add"}]}
    for choice in ({"type": "function", "name": "add"}, allowed):
        response, wire = create(client, input=QUESTION, tools=TOOLS, tool_choice=choice,
                                parallel_tool_calls=False, max_output_tokens=300,
                                extra_body={"seed": 2})
        assert wire["tool_choice"] == choice
        (call,) = [item for item in response.output if item.type == "function_call"]
        assert call.name == "add"
        jsonschema.validate(json.loads(call.arguments), ADD)


def test_previous_response_id_through_a_function_call(client) -> None:
    """The stored turn ends in calls; the next request sends only their outputs."""
    first, _ = create(client, input=QUESTION, tools=TOOLS, tool_choice="required",
                      parallel_tool_calls=False, max_output_tokens=300,
                      extra_body={"seed": 1})
    (call,) = [item for item in first.output if item.type == "function_call"]
    second, _ = create(client, previous_response_id=first.id, tools=TOOLS,
                       max_output_tokens=16, input=[
                           {"type": "function_call_output", "call_id": call.call_id,
                            "output": "5"}])
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    with pytest.raises(openai.BadRequestError) as unanswered:
        client.responses.create(model="demo", previous_response_id=first.id, tools=TOOLS,
                                input="What now?")
    assert unanswered.value.body["code"] == "missing_tool_output"
    assert unanswered.value.body["param"] == "previous_response_id"


def test_previous_response_id_continues_from_the_prefix_cache(client) -> None:
    kwargs = {"instructions": "You are terse.", "max_output_tokens": 16, "temperature": 0}
    first, first_wire = create(client, input="Tell me about Paris.", **kwargs)
    second, _ = create(client, input="And Rome?", previous_response_id=first.id, **kwargs)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    # The stored conversation is exactly what a client would have sent itself.
    stateless, _ = create(client, input=[
        {"role": "user", "content": "Tell me about Paris."}, *first_wire["output"],
        {"role": "user", "content": "And Rome?"}], **kwargs)
    assert stateless.usage.input_tokens == second.usage.input_tokens
    assert stateless.output_text == second.output_text
    items = client.responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["And Rome?"]
    with pytest.raises(openai.BadRequestError) as missing:
        client.responses.create(model="demo", input="Hi", previous_response_id="resp_nope")
    assert missing.value.body["code"] == "previous_response_not_found"
    assert missing.value.body["param"] == "previous_response_id"


def test_retrieve_list_input_items_and_delete(client, http) -> None:
    items = [
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "input_text", "text": "First question."}]},
        {"type": "message", "role": "user", "content": "Second question."},
    ]
    response, wire = create(client, input=items, max_output_tokens=16,
                            metadata={"run": "retrieve"}, user="tester")
    assert response.metadata == {"run": "retrieve"}
    got = http.get(f"/v1/responses/{response.id}")
    assert got.status_code == 200 and got.json() == wire
    assert client.responses.retrieve(response.id).output_text == response.output_text

    page = http.get(f"/v1/responses/{response.id}/input_items").json()
    validate_item_list(page)
    texts = [item["content"][0]["text"] for item in page["data"]]
    assert texts == ["Second question.", "First question.", "Answer in one word."]  # desc
    assert page["has_more"] is False and page["first_id"] == page["data"][0]["id"]
    roles = [item["role"] for item in page["data"]]
    assert roles == ["user", "user", "developer"]
    # The SDK pages through them, one item a page.
    paged = list(client.responses.input_items.list(response.id, limit=1, order="asc"))
    assert [i.id for i in paged] == [i["id"] for i in reversed(page["data"])]
    one = http.get(f"/v1/responses/{response.id}/input_items",
                   params={"limit": 1, "after": page["data"][0]["id"]}).json()
    validate_item_list(one)
    assert one["data"] == [page["data"][1]] and one["has_more"] is True

    for limit in ("0", "101", "-1", "1.5", "\u00b2", "\uff11"):
        refused = http.get(f"/v1/responses/{response.id}/input_items", params={"limit": limit})
        assert refused.status_code == 400, (limit, refused.text)
        assert refused.json()["error"]["param"] == "limit"
    # include is checked as a conversation's items check it: a value OpenAI does not
    # know was taken silently here (the SDK sends include[]).
    kept = ["message.output_text.logprobs", "reasoning.encrypted_content"]
    assert client.responses.retrieve(response.id, include=kept).id == response.id
    assert len(client.responses.input_items.list(response.id, include=kept).data) == 3
    for path in ("", "/input_items"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.get(f"/responses/{response.id}{path}", cast_to=object,
                       options={"params": {"include": ["everything"]}})
        assert caught.value.body["param"] == "include[0]", path
        refused = http.get(f"/v1/responses/{response.id}{path}?include[]=everything")
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "include[0]"

    deleted = http.delete(f"/v1/responses/{response.id}")
    assert deleted.json() == {"id": response.id, "object": "response.deleted", "deleted": True}
    for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/input_items")):
        gone = http.request(method, f"/v1/responses/{response.id}{path}")
        assert gone.status_code == 404
        assert gone.json()["error"]["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_identifiers_and_max_tool_calls_are_checked_and_echoed(client, http) -> None:
    """OpenAI's response object repeats ``safety_identifier``, ``prompt_cache_key`` and
    ``max_tool_calls`` as sent, and refuses them of another type: afmd dropped them (the
    stored response said ``max_tool_calls: null``) and took a number as an identifier."""
    response, wire = create(client, input="Hi", max_output_tokens=16,
                            safety_identifier="user-hash", prompt_cache_key="thread-7",
                            max_tool_calls=3)
    assert (response.safety_identifier, response.prompt_cache_key,
            response.max_tool_calls) == ("user-hash", "thread-7", 3)
    assert http.get(f"/v1/responses/{response.id}").json() == wire
    with client.responses.stream(model="demo", input="Hi", max_output_tokens=16,
                                 safety_identifier="user-hash") as stream:
        created = next(iter(stream))
        assert created.type == "response.created"
        assert created.response.safety_identifier == "user-hash"
        for _ in stream:
            pass
    # top_logprobs too, which the response said was 0 whatever was sent.
    echoed, _ = create(client, input="Hi", max_output_tokens=16, top_logprobs=4)
    assert echoed.top_logprobs == 4
    assert create(client, input="Hi", max_output_tokens=16)[0].top_logprobs == 0
    for key, value in (("safety_identifier", 5), ("prompt_cache_key", ["a"]),
                       ("max_tool_calls", "3"), ("max_tool_calls", 1.5)):
        refused = http.post("/v1/responses", json={"model": "demo", "input": "Hi", key: value})
        assert refused.status_code == 400, (key, refused.text)
        assert refused.json()["error"]["param"] == key
        assert refused.json()["error"]["code"] == "invalid_type"
    # It bounds the calls of the tools the server runs (tests/server/test_server_tools.py):
    # as OpenAI, less than one is refused.
    for value in (0, -1):
        refused = http.post("/v1/responses", json={"model": "demo", "input": "Hi",
                                                   "max_tool_calls": value})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "max_tool_calls"
        assert refused.json()["error"]["code"] == "invalid_value"


def test_an_unknown_id_of_any_length_is_quoted_short(http) -> None:
    """Every id afmd does not know was quoted whole in its 404: a 100,000-character
    ``previous_response_id`` came back as a message that long, where other fields are
    cut short."""
    long_id = "resp_" + "a" * 100_000
    gone = http.post("/v1/responses", json={"model": "demo", "input": "Hi",
                                            "previous_response_id": long_id})
    assert gone.status_code == 400
    assert gone.json()["error"]["code"] == "previous_response_not_found"
    assert len(gone.json()["error"]["message"]) < 300
    path_id = "resp_" + "b" * 3000
    for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/input_items"),
                         ("POST", "/cancel")):
        gone = http.request(method, f"/v1/responses/{path_id}{path}")
        assert gone.status_code == 404, (method, path, gone.text[:200])
        assert len(gone.json()["error"]["message"]) < 300, (method, path)


class Address(BaseModel):
    street: str = Field(max_length=10)
    number: int = Field(ge=1, le=999)


class Person(BaseModel):
    name: str = Field(max_length=12)
    mood: Literal["happy", "sad", "calm"]
    address: Address


def test_json_schema_format_parses_and_streams_the_same(client) -> None:
    parsed = client.responses.parse(model="demo", input="Describe someone.",
                                    text_format=Person, max_output_tokens=300, temperature=0)
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, Person)
    assert parsed.text.format.type == "json_schema"
    with client.responses.stream(model="demo", input="Describe someone.", text_format=Person,
                                 max_output_tokens=300, temperature=0) as stream:
        events = list(stream)  # their wire form is checked in tests/server/test_responses_wire.py
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed
    assert final.output_text == parsed.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 3 and "".join(deltas) == parsed.output_text
    # json_object: some JSON object, by the grammar.
    obj, _ = create(client, input="Some JSON.", text={"format": {"type": "json_object"}},
                    max_output_tokens=200, temperature=0)
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


def test_streamed_calls_reassemble_into_the_sdk_final_response(client) -> None:
    """Arguments stream fragment by fragment; the SDK's final response is the whole one."""
    kwargs = {"model": "demo", "input": QUESTION, "tools": TOOLS, "tool_choice": "required",
              "max_output_tokens": 300, "temperature": 1.0, "extra_body": {"seed": 0}}
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    for event in events:
        validate_event(event.model_dump(mode="json", exclude={"snapshot"}, by_alias=True,
                                        exclude_unset=True))
    assert final.status == whole.status == "completed"
    calls = [(c.name, c.arguments) for c in whole.output if c.type == "function_call"]
    assert [(c.name, c.arguments) for c in final.output if c.type == "function_call"] == calls
    for index, item in enumerate(final.output):
        if item.type != "function_call":
            continue
        fragments = [e.delta for e in events if e.type ==
                     "response.function_call_arguments.delta" and e.output_index == index]
        assert len(fragments) > 2 and "".join(fragments) == item.arguments
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_reasoning_effort_maps_like_chat(client, http) -> None:
    plain = http.post("/v1/responses", json={"input": QUESTION, "max_output_tokens": 16})
    base = plain.json()["usage"]["input_tokens"]
    for effort in ("none", "minimal", "low", "medium", "high", "xhigh", "max"):
        response, wire = create(client, input=QUESTION, max_output_tokens=16,
                                reasoning={"effort": effort, "summary": "auto"})
        assert wire["reasoning"] == {"effort": effort, "summary": "auto"}
        # "none"/"minimal" switch the template's thinking off: it closes an empty block.
        assert (response.usage.input_tokens > base) == (effort in ("none", "minimal"))


def test_input_tokens_counts_what_create_uses(client) -> None:
    kwargs = {"input": QUESTION, "instructions": "Be brief.", "tools": TOOLS}
    validate("TokenCountsBody", {"model": "demo", **kwargs})
    raw = client.responses.input_tokens.with_raw_response.count(model="demo", **kwargs)
    validate("TokenCountsResource", raw.http_response.json())
    counted = raw.parse()
    assert counted.object == "response.input_tokens"
    response, _ = create(client, max_output_tokens=16, **kwargs)
    assert counted.input_tokens == response.usage.input_tokens
    chained = client.responses.input_tokens.count(
        model="demo", input="And then?", previous_response_id=response.id)
    follow, _ = create(client, input="And then?", previous_response_id=response.id,
                       max_output_tokens=16)
    assert chained.input_tokens == follow.usage.input_tokens


def test_output_text_logprobs_when_include_asks(client) -> None:
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: the message's
    tokens in its part, and in its deltas when streamed, the numbers chat gives the same
    greedy answer. They were always ``[]``."""
    body = {"input": "Hi", "max_output_tokens": 16, "temperature": 0,
            "reasoning": {"effort": "none"}, "top_logprobs": 2,
            "include": ["message.output_text.logprobs"]}
    response, _ = create(client, **body)
    (message,) = [item for item in response.output if item.type == "message"]
    tokens = message.content[0].logprobs
    assert tokens and all(len(t.top_logprobs) == 2 for t in tokens)
    chat = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=16,
        temperature=0, reasoning_effort="none", logprobs=True, top_logprobs=2)
    assert [(t.token, t.logprob) for t in tokens] == [
        (t.token, t.logprob) for t in chat.choices[0].logprobs.content]

    streamed, done = [], None
    with client.responses.stream(model="demo", **body) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                streamed += [(t.token, t.logprob) for t in event.logprobs]
            elif event.type == "response.output_text.done":
                done = [(t.token, t.logprob) for t in event.logprobs]
    assert streamed == done == [(t.token, t.logprob) for t in tokens]

    plain, _ = create(client, input="Hi", max_output_tokens=16, top_logprobs=2)
    assert all(item.content[0].logprobs == [] for item in plain.output
               if item.type == "message")


def test_an_input_past_the_window_is_openais_responses_error(client, http) -> None:
    """OpenAI's Responses API words a prompt over the window its own way (agents show it,
    and key on its code); afmd's numbers follow, and streamed or not it is the same 400."""
    words = "hello world " * 40_000  # far past the demo model's window
    for stream in (False, True):
        answer = http.post("/v1/responses", json={"model": "demo", "input": words,
                                                  "stream": stream})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["code"], error["param"], error["type"]) == (
            "context_length_exceeded", "input", "invalid_request_error")
        assert error["message"].startswith(
            "Your input exceeds the context window of this model. Please adjust your input "
            "and try again. ("), error
        assert "tokens" in error["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model="demo", input=words)
    assert raised.value.code == "context_length_exceeded"


def test_text_after_a_call_before_its_output_is_that_turn(client) -> None:
    """A model may write text after its call ([function_call, message], as afmd returns it
    too); the client sends that back with the call's output after both, as OpenAI takes
    it. The text was read as a second assistant turn rendered after the output, and the
    request refused as ending with an assistant message; it is the call's turn, as chat
    holds content and calls in one message."""
    call = {"type": "function_call", "call_id": "call_1", "name": "add",
            "arguments": '{"a": 2, "b": 3}'}
    response, _ = create(client, tools=TOOLS, max_output_tokens=16, temperature=0, input=[
        {"role": "user", "content": "What is 2+3?"}, call,
        {"role": "assistant", "content": "Let me add them."},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"}])
    chat = client.chat.completions.create(
        model="demo", max_tokens=16, temperature=0,
        tools=[{"type": "function", "function": {k: tool[k] for k in (
            "name", "description", "parameters", "strict")}} for tool in TOOLS],
        messages=[{"role": "user", "content": "What is 2+3?"},
                  {"role": "assistant", "content": "Let me add them.", "tool_calls": [
                      {"id": "call_1", "type": "function", "function": {
                          "name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "5"}])
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content


def test_an_item_reference_may_leave_its_type_out(client) -> None:
    """The SDK types an ``item_reference``'s ``type`` as optional (and nullable): an item
    of an ``id`` alone names a stored item, as OpenAI reads it. It was read as a message
    and refused for its missing ``role``."""
    first, _ = create(client, input="Tell me about Paris.", max_output_tokens=16)
    (message,) = first.output
    follow = {"role": "user", "content": "And Rome?"}
    typed, _ = create(client, max_output_tokens=16, temperature=0, input=[
        {"type": "item_reference", "id": message.id}, follow])
    for reference in ({"id": message.id}, {"id": message.id, "type": None}):
        response, _ = create(client, max_output_tokens=16, temperature=0,
                             input=[reference, follow])
        assert response.usage.input_tokens == typed.usage.input_tokens
        assert response.output_text == typed.output_text
