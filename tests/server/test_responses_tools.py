"""/v1/responses tools as OpenAI defines them, on the shared demo server: namespace tools
(offered as their functions, calls naming the namespace), custom tools (free text, a regex
grammar enforced), hosted tools left out and named, and ``item_reference`` items resolved
from the store, as Codex and the AI SDK send them."""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote

import httpx
import pytest

from afmd.dialects.responses.responses_body import parse_responses_request
from afmd.errors import InvalidRequestError

from helpers.responses_schemas import validate_event, validate_response

ADD = {"type": "function", "name": "add", "description": "Add two integers.", "strict": True,
       "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                      "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 999}}}}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Agents.",
             "tools": [{**ADD, "name": "spawn_agent"}, {"type": "custom", "name": "note"}]}
PICK = {"type": "custom", "name": "pick", "description": "Say yes or no.",
        "format": {"type": "grammar", "syntax": "regex", "definition": "(yes|no)"}}
HOSTED = [{"type": "web_search", "external_web_access": False},
          {"type": "image_generation"}, {"type": "tool_search"}, {"type": "mcp"},
          {"type": "shell", "environment": {"type": "container_auto"}}]  # OpenAI's container


def sse_events(text: str) -> list[dict[str, Any]]:
    """A stream's events, each checked against OpenAI's schema."""
    events = [json.loads(block.partition("data: ")[2])
              for block in text.split("\n\n") if block.strip()]
    for event in events:
        validate_event(event)
    return events


def post(http: httpx.Client, **body: Any) -> dict[str, Any]:
    # One call at most, and a bound: a random model never stops calling by itself.
    response = http.post("/v1/responses", json={
        "model": "demo", "temperature": 0, "parallel_tool_calls": False,
        "max_output_tokens": 120, "reasoning": {"effort": "none"}, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_hosted_tools_are_left_out_and_named(http: httpx.Client) -> None:
    body = {"model": "demo", "input": "Hi.", "max_output_tokens": 16,
            "tools": [HOSTED[0], ADD, *HOSTED[1:]]}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    # The header percent-encodes what is not a token character (tests/test_tolerant_requests).
    assert unquote(response.headers["X-AFM-Ignored-Fields"]) == ", ".join(
        f"tools[{i}]" for i in (0, 2, 3, 4, 5))
    assert [t["name"] for t in response.json()["tools"]] == ["add"]
    with pytest.raises(InvalidRequestError) as info:  # [api] strict refuses them
        parse_responses_request(body, lookup=lambda _: None, strict=True)
    assert (info.value.code, info.value.param) == ("unsupported_tool", "tools[0]")


def test_a_namespace_tools_call_names_its_namespace(http: httpx.Client) -> None:
    first = post(http, input="Spawn one.", tools=[NAMESPACE],
                 tool_choice={"type": "function", "name": "spawn_agent"})
    (call,) = [item for item in first["output"] if item["type"] == "function_call"]
    assert (call["namespace"], call["name"]) == ("multi_agent_v1", "spawn_agent")
    assert set(re.findall(r'"(\w+)"', call["arguments"])) <= {"a", "b"}
    echoed = first["tools"][0]
    assert echoed["type"] == "namespace" and [t["name"] for t in echoed["tools"]] == [
        "spawn_agent", "note"]
    # Sent back (as Codex does, store false), with its output.
    again = post(http, store=False, tools=[NAMESPACE], max_output_tokens=16, input=[
        {"role": "user", "content": "Spawn one."}, call,
        {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}])
    assert again["status"] == "incomplete"  # ran to max_output_tokens


def test_a_custom_tools_call_is_its_text_in_its_grammar(http: httpx.Client) -> None:
    body = {"model": "demo", "input": "Yes or no?", "tools": [PICK, ADD],
            "tool_choice": {"type": "custom", "name": "pick"}, "stream": True,
            "parallel_tool_calls": False, "max_output_tokens": 120,
            "reasoning": {"effort": "none"}}
    events = sse_events(http.post("/v1/responses", json=body).text)
    done = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
    assert len(done) == 1 and done[0]["input"] in ("yes", "no")
    final = events[-1]["response"]
    (call,) = [item for item in final["output"] if item["type"] == "custom_tool_call"]
    assert call["input"] == done[0]["input"] and call["id"].startswith("ctc_")
    assert final["tool_choice"] == {"type": "custom", "name": "pick"}
    # The call and its output go back in input; plain text input (no grammar) too.
    again = post(http, tools=[PICK, {"type": "custom", "name": "free"}],
                 max_output_tokens=16, input=[
                     {"role": "user", "content": "Yes or no?"}, call,
                     {"type": "custom_tool_call_output", "call_id": call["call_id"],
                      "output": "noted"}])
    assert again["output"] and again["status"] == "incomplete"
    validate_event({"type": "response.custom_tool_call_input.done", "item_id": "ctc_1",
                    "output_index": 0, "input": "yes", "sequence_number": 1})


def test_item_references_resolve_to_stored_items(http: httpx.Client) -> None:
    """The AI SDK's second step: earlier items by id, the call's output beside them."""
    first = post(http, input="Add 2 and 3.", tools=[ADD],
                 tool_choice={"type": "function", "name": "add"})
    (call,) = [item for item in first["output"] if item["type"] == "function_call"]
    listed = http.get(f"/v1/responses/{first['id']}/input_items").json()["data"]
    references = [{"type": "item_reference", "id": listed[0]["id"]},
                  *({"type": "item_reference", "id": item["id"]} for item in first["output"])]
    step = {"input": [*references, {"type": "function_call_output",
                                    "call_id": call["call_id"], "output": "5"}],
            "tools": [ADD], "max_output_tokens": 16}
    second = post(http, **step)
    assert second["status"] == "incomplete"
    items = http.get(f"/v1/responses/{second['id']}/input_items?order=asc").json()["data"]
    assert [item["type"] for item in items][:2] == ["message", "function_call"]
    counted = http.post("/v1/responses/input_tokens", json={"model": "demo", **step})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 10
    missing = http.post("/v1/responses", json={"model": "demo", "input": [
        {"type": "item_reference", "id": "rs_nowhere"}]})
    assert missing.status_code == 404, missing.text
    error = missing.json()["error"]
    assert "rs_nowhere" in error["message"]
    assert (error["code"], error["param"]) == ("item_not_found", "input[0].id")


def test_an_async_call_may_wait_for_its_output(http: httpx.Client) -> None:
    """A call marked ``async`` (its tool's answer may come after the next response, as
    OpenAI defines ``async`` on function and custom tools and their calls) needs no output
    yet: the Agents SDK (0.25) keeps such a pending call in the history it sends. The flag
    is kept on the stored item, the output may come in a later request, and a call not
    marked async still needs its output there and then."""
    user = {"role": "user", "content": "Look it up, and tell me a joke meanwhile."}
    calls = [{"type": "function_call", "call_id": "call_a1", "name": "add",
              "arguments": '{"a": 1, "b": 2}', "async": True},
             {"type": "custom_tool_call", "call_id": "call_a2", "name": "pick",
              "input": "yes", "async": True}]
    tools = [{**ADD, "async": True}, {**PICK, "async": True}]
    first = post(http, tools=tools, max_output_tokens=16,
                 input=[user, *calls, {"role": "user", "content": "And?"}])
    listed = http.get(f"/v1/responses/{first['id']}/input_items?order=asc").json()["data"]
    assert [(i["type"], i.get("async")) for i in listed] == [
        ("message", None), ("function_call", True), ("custom_tool_call", True),
        ("message", None)]
    later = post(http, tools=tools, max_output_tokens=16, previous_response_id=first["id"],
                 input=[{"type": "function_call_output", "call_id": "call_a1", "output": "3"},
                        {"role": "user", "content": "Done?"}])
    assert later["output"]
    for flag in (False, None):
        call = {**calls[0], "async": flag}
        refused = http.post("/v1/responses", json={
            "model": "demo", "tools": tools, "input": [user, call, user]})
        assert refused.status_code == 400, refused.text
        assert (refused.json()["error"]["code"], refused.json()["error"]["param"]) == (
            "missing_tool_output", "input[1]")
    wrong = http.post("/v1/responses", json={"model": "demo", "tools": tools, "input": [
        user, {**calls[0], "async": "yes"}, user]})
    assert wrong.status_code == 400, wrong.text
    assert wrong.json()["error"]["param"] == "input[1].async"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_call_the_output_ended_inside_is_incomplete(http: httpx.Client, stream: bool) -> None:
    """A function call cut short (here by max_output_tokens; a cancel cuts alike) is an
    ``incomplete`` item, its arguments as far as they were written: it was ``completed``,
    with arguments that are not whole JSON."""
    long_text = {"type": "object", "required": ["text"],
                 "properties": {"text": {"type": "string", "minLength": 2000}}}
    response = http.post("/v1/responses", json={
        "model": "demo", "input": "Write.", "max_output_tokens": 20, "stream": stream,
        "reasoning": {"effort": "none"}, "parallel_tool_calls": False,
        "tools": [{"type": "function", "name": "write", "parameters": long_text}],
        "tool_choice": {"type": "function", "name": "write"}})
    assert response.status_code == 200, response.text
    if stream:
        events = sse_events(response.text)
        (done,) = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert done["status"] == "incomplete"
        body = events[-1]["response"]
    else:
        body = response.json()
    validate_response(body)
    assert body["status"] == "incomplete"
    (call,) = body["output"]
    assert call["type"] == "function_call" and call["status"] == "incomplete"
    assert call["arguments"].startswith('{"text":"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(call["arguments"])


def test_required_with_only_hosted_tools_says_they_are_left_out(http: httpx.Client) -> None:
    """The 400 said no 'tools' were given, to a client that had given some."""
    response = http.post("/v1/responses", json={
        "model": "demo", "input": "Hi.", "tools": HOSTED[:2], "tool_choice": "required"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tool_choice"
    assert "tools[0], tools[1]" in error["message"] and "hosted" in error["message"]


def test_an_allowed_custom_tool_is_echoed_as_custom(http: httpx.Client) -> None:
    """The echo of an ``allowed_tools`` choice typed every entry ``function``."""
    choice = {"type": "allowed_tools", "mode": "required",
              "tools": [{"type": "custom", "name": "pick"}, {"type": "function", "name": "add"}]}
    answer = post(http, input="Yes or no?", tools=[PICK, ADD], tool_choice=choice,
                  max_output_tokens=16)
    assert answer["tool_choice"] == choice
