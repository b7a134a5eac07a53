"""The Responses API on the raw wire: the stream's events, their order and numbering, the
error envelopes with their params, cancelling by X-Request-ID, the profile event."""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import httpx
import pytest

from helpers.openai_schemas import validate_error
from helpers.responses_schemas import validate_event, validate_request, validate_response

QUESTION = "What is the weather in Paris, and what is 2+3?"
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                      "b": {"type": "integer", "minimum": 0, "maximum": 999}}}
TOOLS = [{"type": "function", "name": "add", "description": "Add two integers.",
          "parameters": ADD, "strict": True}]
LONG = 8000  # tokens: far longer than any test waits


def sse_events(text: str) -> list[dict[str, Any]]:
    """The events of a Responses stream, each block's ``event:`` line checked against its
    data's ``type`` and every event against OpenAI's schema."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        head, _, data = block.partition("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: "):])
        assert head[len("event: "):] == event["type"]
        validate_event(event)
        events.append(event)
    return events


def stream(http: httpx.Client, body: dict[str, Any], **headers: str) -> httpx.Response:
    body = {"model": "demo", **body, "stream": True}
    response = http.post("/v1/responses", json=body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return response


def check_items(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each output item opens, grows by deltas and closes before the next one opens; the
    deltas add up to what its done events say. Returns the items as done."""
    items: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    text = ""
    for event in events:
        kind = event["type"]
        if kind == "response.output_item.added":
            assert current is None and event["output_index"] == len(items)
            current, text = event["item"], ""
            assert current["status"] == "in_progress"
        elif kind == "response.output_item.done":
            assert current is not None and event["item"]["id"] == current["id"]
            items.append(event["item"])
            current = None
        elif kind.endswith(".delta"):
            assert current is not None and event["item_id"] == current["id"]
            text += event["delta"]
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert event["text"] == text
        elif kind == "response.function_call_arguments.done":
            assert event["arguments"] == text and event["name"] == current["name"]
    assert current is None
    return items


def test_stream_events_in_order_and_numbered(http) -> None:
    """Reasoning, then calls, every event numbered 0, 1, 2, …; the terminal response holds
    the items exactly as their done events gave them."""
    body = {"input": QUESTION, "tools": TOOLS, "tool_choice": "required", "seed": 0,
            "max_output_tokens": 300}
    validate_request({k: v for k, v in body.items() if k != "seed"})
    response = stream(http, body, **{"X-Request-ID": "resp-wire-1"})
    assert response.headers["x-request-id"] == "resp-wire-1"
    assert "[DONE]" not in response.text
    events = sse_events(response.text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and kinds.count("response.completed") == 1
    created = events[0]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    items = check_items(events)
    assert items[0]["type"] == "reasoning"
    assert {i["type"] for i in items[1:]} == {"function_call"}
    reasoning_events = kinds[kinds.index("response.output_item.added"):][:3]
    assert reasoning_events == ["response.output_item.added", "response.content_part.added",
                                "response.reasoning_text.delta"]
    argument_deltas = kinds.count("response.function_call_arguments.delta")
    assert argument_deltas > 2 * (len(items) - 1), "arguments stream fragment by fragment"
    final = events[-1]["response"]
    assert final["id"] == created["id"] and final["output"] == items
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    stored = http.get(f"/v1/responses/{final['id']}").json()
    assert stored == final


def test_streamed_text_is_the_whole_text(http) -> None:
    body = {"input": "Tell me a story.", "max_output_tokens": 24, "temperature": 0}
    whole = http.post("/v1/responses", json=body).json()
    validate_response(whole)
    events = sse_events(stream(http, body).text)
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = check_items(events)
    assert item["status"] == "incomplete"
    assert item["content"] == whole["output"][0]["content"]
    assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"] == 24
    root = http.post("/responses", json=body)  # the root path, as chat's
    assert root.status_code == 200
    assert root.json()["output"][0]["content"] == whole["output"][0]["content"]


def test_profile_event_comes_before_the_end(http, client) -> None:
    body = {"input": "Hi.", "max_output_tokens": 16, "temperature": 0}
    events = sse_events(stream(http, body, **{"X-AFM-Profile": "true"}).text)
    assert events[-2]["type"] == "afm_profile"
    profile = events[-2]["afm_profile"]
    assert profile["completion_tokens"] == 16 and profile["prompt_tokens"] > 0
    assert events[-2]["sequence_number"] == len(events) - 2
    # The openai client passes it by.
    kinds = [e.type for e in client.responses.create(
        model="demo", stream=True, extra_headers={"X-AFM-Profile": "true"}, **body)]
    assert kinds[-1] == "response.incomplete"


# -- errors ---------------------------------------------------------------------------------

IMAGE = "data:image/png;base64,iVBORw0KGgo="

BAD_FUNCTION = {"type": "function", "name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}},
    "required": ["x"]}}
NAMESPACE = {"type": "namespace", "name": "n", "tools": [
    {"type": "function", "name": "a", "parameters": {"type": "object"}},
    {"type": "function", "name": "b", "parameters": {"type": "object"}}]}

BAD: list[tuple[dict[str, Any], str, str | None]] = [
    ({"input": "x", "tools": [{"type": "function"}]}, "missing_required_parameter",
     "tools[0].name"),
    ({"input": "x", "tools": [{"type": "custom", "name": "c", "format": {
        "type": "grammar", "syntax": "regex", "definition": "("}}]}, "invalid_value",
     "tools[0].format.definition"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": [
        {"type": "web_search"}]}]}, "invalid_value", "tools[0].tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "invalid_value",
     "tools[0].name"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "unknown_tool", "tool_choice.name"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "web_search_preview"}},
     "unsupported_tool", "tool_choice.type"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                                    "tools": [{"type": "function"}]}},
     "missing_required_parameter", "tool_choice.tools[0].name"),
    ({"input": "x", "tool_choice": "required"}, "invalid_value", "tool_choice"),
    ({}, "missing_required_parameter", "input"),
    ({"input": 3}, "invalid_type", "input"),
    ({"input": [{"role": "user"}]}, "missing_required_parameter", "input[0].content"),
    ({"input": [{"role": "robot", "content": "x"}]}, "invalid_value", "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "invalid_value",
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "unsupported_value", "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                              "image_url": "https://x/y.png"}]}]},
     "unsupported_image_url", "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": IMAGE,
                                              "detail": "huge"}]}]},
     "invalid_value", "input[0].content[0].detail"),
    ({"input": [{"type": "web_search_call", "id": "ws", "status": "completed"}]},
     "unsupported_value", "input[0].type"),
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call_output", "call_id": "c1", "output": "1"}]},
     "unknown_tool_call_id", "input[1].call_id"),
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"}]},
     "missing_tool_output", "input[1]"),
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "1"},
                {"type": "function_call_output", "call_id": "c1", "output": "2"}]},
     "duplicate_tool_output", "input[3].call_id"),
    ({"input": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "invalid_last_message", "input[1]"),
    # Two items of one id, as OpenAI refuses: both were stored under it, and paging
    # input_items after it or referencing it found only the first.
    ({"input": [{"id": "msg_1", "role": "user", "content": "x"},
                {"id": "msg_1", "type": "message", "role": "user", "content": "y"}]},
     "duplicate_item", "input[1].id"),
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "add",
                 "arguments": "{}"},
                {"type": "function_call_output", "id": "fc_1", "call_id": "c1",
                 "output": "1"}]},
     "duplicate_item", "input[2].id"),
    ({"input": [{"role": "developer", "content": "x"}]}, "missing_user_message", "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": IMAGE}]}]},
     "image_input_not_supported", "input[0].content[0].image_url"),  # demo reads text only
    ({"input": "x", "max_output_tokens": 8}, "invalid_value", "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "invalid_value", "temperature"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}},
     "missing_required_parameter", "text.format.name"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n",
                                        "schema": {"type": "nope"}}}},
     "invalid_schema", "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "invalid_value", "text.format.type"),
    ({"input": "x", "tools": [{"type": "function", "name": "f",
                               "parameters": {"type": "nope"}}]},
     "invalid_schema", "tools[0].parameters"),
    # A hosted tool left out, or a namespace's members offered one by one, shifted the
    # index the error named: it named the tool the body has at that index, or none.
    ({"input": "x", "tools": [{"type": "web_search"}, BAD_FUNCTION]},
     "invalid_schema", "tools[1].parameters"),
    ({"input": "x", "tools": [NAMESPACE, BAD_FUNCTION]}, "invalid_schema",
     "tools[1].parameters"),
    ({"input": "x", "tools": [{**BAD_FUNCTION, "name": "g", "parameters": {"type": "object"}},
                              {**NAMESPACE, "tools": [NAMESPACE["tools"][0], BAD_FUNCTION]}]},
     "invalid_schema", "tools[1].tools[1].parameters"),
    ({"input": "x", "tools": [NAMESPACE, {**BAD_FUNCTION, "parameters": {
        "type": "object", "properties": {"x": {"enum": [-9223372036854775809]}}}}]},
     "invalid_schema", "tools[1].parameters.properties.x.enum[0]"),
    ({"input": "x", "tools": [NAMESPACE, {"type": "custom", "name": "c", "format": {
        "type": "grammar", "syntax": "regex", "definition": "(a)\\1"}}]},
     "invalid_schema", "tools[1].format.definition"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "invalid_value", "reasoning.effort"),
    ({"input": "x", "reasoning": {"budget": 3}}, "unknown_parameter", "reasoning.budget"),
    ({"input": "x", "include": ["reasoning.plaintext"]}, "invalid_value", "include[0]"),
    ({"input": "x", "metadata": {"k": 1}}, "invalid_type", "metadata.k"),
    ({"input": "x", "truncation": "middle"}, "invalid_value", "truncation"),
    ({"input": "x", "background": True, "store": False}, "invalid_value", "background"),
    ({"input": "x", "conversation": "resp_1"}, "invalid_value", "conversation"),
    ({"input": "x", "conversation": {"id": 1}}, "invalid_type", "conversation.id"),
    ({"input": "x", "conversation": "conv_1", "previous_response_id": "resp_1"},
     "mutually_exclusive_parameters", None),
    ({"input": "x", "stream_options": {"include_obfuscation": False}}, "invalid_value",
     "stream_options"),
    ({"input": "x", "stream": True, "stream_options": {"include_obfuscation": "no"}},
     "invalid_type", "stream_options.include_obfuscation"),
]


@pytest.mark.parametrize(("body", "code", "param"), BAD, ids=[b[2] or "-" for b in BAD])
def test_bad_input_is_a_400_naming_the_param(http, body: dict[str, Any], code: str,
                                             param: str | None) -> None:
    response = http.post("/v1/responses", json={"model": "demo", **body})
    assert response.status_code == 400, response.text
    validate_error(response.json())
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error


def test_a_regex_llguidance_refuses_says_why(http) -> None:
    """llguidance's regex errors announce themselves on one line and say what is wrong on
    the last: the message kept only "regex parse error:"."""
    response = http.post("/v1/responses", json={"model": "demo", "input": "x", "tools": [
        {"type": "custom", "name": "c", "format": {
            "type": "grammar", "syntax": "regex", "definition": "(?=a)a"}}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools[0].format.definition"
    assert "look-around" in error["message"], error


def test_unknown_model_and_previous_response(http) -> None:
    """An unknown model is a 404; an unknown ``previous_response_id`` is OpenAI's 400
    ``previous_response_not_found``, which clients (Codex's proxies among them) read to
    send the whole conversation again instead."""
    model = http.post("/v1/responses", json={"model": "nope", "input": "x"})
    assert model.status_code == 404 and model.json()["error"]["param"] == "model"
    previous = http.post("/v1/responses", json={"input": "x", "previous_response_id": "r"})
    assert previous.status_code == 400
    assert previous.json()["error"] == {
        "message": "Previous response with id 'r' not found (it was never stored, was "
                   "deleted, or expired).",
        "type": "invalid_request_error", "param": "previous_response_id",
        "code": "previous_response_not_found"}
    # Not a field of a count: ignored and named ([api] strict refuses it).
    counted = http.post("/v1/responses/input_tokens", json={"input": "x", "stream": True})
    assert counted.status_code == 200, counted.text
    assert counted.headers["X-AFM-Ignored-Fields"] == "stream"


def test_counting_refuses_what_the_turn_refuses(http) -> None:
    """An image for a model that reads text only: the count is the turn's 400, not a
    number for a prompt without it."""
    body = {"model": "demo", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "what is it?"},
                                     {"type": "input_image", "image_url": IMAGE}]}]}
    turn = http.post("/v1/responses", json=body)
    counted = http.post("/v1/responses/input_tokens", json=body)
    assert turn.status_code == counted.status_code == 400, counted.text
    assert counted.json()["error"] == turn.json()["error"]
    assert counted.json()["error"]["code"] == "image_input_not_supported"


# -- cancel ---------------------------------------------------------------------------------


class Background(threading.Thread):
    """One Responses request on its own thread."""

    def __init__(self, url: str, body: dict[str, Any], request_id: str) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.request_id = url, body, request_id
        self.text = ""
        self.first = threading.Event()
        self.start()

    def run(self) -> None:
        with httpx.Client(timeout=120) as c, c.stream(
                "POST", self.url + "/v1/responses", json=self.body,
                headers={"X-Request-ID": self.request_id}) as r:
            for chunk in r.iter_text():
                self.text += chunk
                self.first.set()
        self.first.set()


def cancel(url: str, request_id: str) -> httpx.Response:
    for _ in range(100):  # findable once the request reached the server
        response = httpx.post(f"{url}/v1/responses/{request_id}/cancel", timeout=10)
        if response.status_code != 404:
            return response
        time.sleep(0.05)
    return response


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "whole"])
def test_cancel_by_request_id_ends_it_cancelled(server, streamed: bool) -> None:
    rid = f"resp-cancel-{uuid.uuid4().hex[:8]}"
    run = Background(server.url, {"input": "Tell me a long story.", "stream": streamed,
                                  "max_output_tokens": LONG, "temperature": 0}, rid)
    if streamed:
        assert run.first.wait(30)
    answer = cancel(server.url, rid)
    assert answer.status_code == 200
    assert answer.json() == {"id": rid, "object": "response.cancellation", "cancelled": True}
    run.join(30)
    if streamed:
        events = sse_events(run.text)
        assert events[-1]["type"] == "response.incomplete"
        response = events[-1]["response"]
    else:
        response = json.loads(run.text)
        validate_response(response)
    assert response["status"] == "cancelled" and response["incomplete_details"] is None
    # A whole response may be cancelled before its first token (then it has no output).
    assert response["output"] or not streamed
    assert all(item["status"] == "incomplete" for item in response["output"])
    assert (0 if response["output"] else -1) < response["usage"]["output_tokens"] < LONG
    gone = httpx.post(f"{server.url}/v1/responses/{rid}/cancel", timeout=10)
    assert gone.status_code == 404 and gone.json()["cancelled"] is False


def test_a_stream_its_client_left_is_stored_cancelled(server) -> None:
    """The id ``response.created`` gave the client finds the response after the client
    left: ``cancelled``, with what it had written, and ``previous_response_id`` continues
    from it. It was never stored, so the id the client held was a 404."""
    body = {"input": "Tell me a long story.", "stream": True, "max_output_tokens": LONG,
            "temperature": 0}
    text = ""
    with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/responses",
                                                 json=body) as r:
        for chunk in r.iter_text():
            text += chunk
            if "response.output_text.delta" in text:
                break  # the client leaves mid-answer
    rid = next(e for e in sse_events(text) if e["type"] == "response.created")["response"]["id"]
    for _ in range(200):  # stored once the server sees the connection gone
        got = httpx.get(f"{server.url}/v1/responses/{rid}", timeout=10)
        if got.status_code != 404:
            break
        time.sleep(0.05)
    assert got.status_code == 200, got.text
    stored = got.json()
    validate_response(stored)
    assert stored["id"] == rid and stored["status"] == "cancelled"
    assert stored["output"] and all(i["status"] == "incomplete" for i in stored["output"])
    after = httpx.post(f"{server.url}/v1/responses", timeout=60, json={
        "input": "Go on.", "previous_response_id": rid, "max_output_tokens": 16})
    assert after.status_code == 200, after.text
    assert after.json()["previous_response_id"] == rid
