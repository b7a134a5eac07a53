"""OpenAI's client-run Responses tools (``shell``, ``local_shell``, ``apply_patch``) on the
shared demo server, through the official ``openai`` client: the model's call comes back as
the tool's own item (parsed as the SDK's type, its action in the tool's fixed schema),
streamed with its events, stored, and answered by the output item in the next request,
with ``previous_response_id`` and without; bad items are 400s naming their param."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import pytest
from openai.types.responses import (
    ResponseApplyPatchToolCall,
    ResponseApplyPatchToolCallOutput,
    ResponseFunctionShellToolCall,
    ResponseFunctionShellToolCallOutput,
    response_item,
)
from openai.types.responses.response_output_item import LocalShellCall

from afmd.dialects.responses.client_tools import PARAMETERS
from afmd.dialects.responses.responses_body import parse_responses_request
from afmd.errors import InvalidRequestError

from helpers.responses_schemas import validate_event, validate_response

#: Per tool: its SDK call type, the call item's type and id prefix. A random model does
#: not stop a free string by itself: the seed is one whose call closes within the budget.
KINDS = {
    "shell": (ResponseFunctionShellToolCall, "shell_call", "sh_"),
    "local_shell": (LocalShellCall, "local_shell_call", "lsh_"),
    "apply_patch": (ResponseApplyPatchToolCall, "apply_patch_call", "apc_"),
}
ADD = {"type": "function", "name": "add", "strict": True,
       "parameters": {"type": "object", "required": ["a"], "additionalProperties": False,
                      "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}}


def body(kind: str, **extra: Any) -> dict[str, Any]:
    """A request forcing one call of the tool (``local_shell`` has no choice of its own in
    the SDK: ``required`` with it alone)."""
    choice = "required" if kind == "local_shell" else {"type": kind}
    return {"model": "demo", "input": "List the files.", "tools": [{"type": kind}],
            "tool_choice": choice, "temperature": 1.0, "parallel_tool_calls": False,
            "max_output_tokens": 300, "reasoning": {"effort": "none"},
            "extra_body": {"seed": 1}, **extra}


def arguments(item: dict[str, Any]) -> dict[str, Any]:
    """What the model wrote for the call, read back from its item."""
    if item["type"] == "apply_patch_call":
        return {"operation": item["operation"]}
    action = {k: v for k, v in item["action"].items()
              if v is not None and k != "type" and v != {}}
    return action


def check_call(item: dict[str, Any], kind: str) -> Any:
    """The item parses as the SDK's type, whole, its values in the tool's schema."""
    sdk_type, item_type, prefix = KINDS[kind]
    call = sdk_type.model_validate(item)
    assert call.type == item_type and call.id.startswith(prefix)
    assert call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(arguments(item), PARAMETERS[kind])
    if kind == "shell":
        assert item["environment"] is None and call.action.commands
    return call


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_call_is_the_tools_own_item(client: Any, kind: str) -> None:
    raw = client.responses.with_raw_response.create(**body(kind))
    wire = raw.http_response.json()
    validate_response(wire)
    response = raw.parse()
    assert response.status == "completed"
    (item,) = wire["output"]
    call = check_call(item, kind)
    assert isinstance(response.output[0], KINDS[kind][0])
    assert wire["tools"] == [{"type": kind, **({"environment": None} if kind == "shell" else {})}]
    if kind != "local_shell":
        assert wire["tool_choice"] == {"type": kind}
    # Stored: retrieved as the same item, and listed by id for an item_reference.
    again = client.responses.retrieve(response.id)
    assert again.output[0] == call


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_streamed_call_has_the_apis_events(client: Any, http: httpx.Client,
                                             kind: str) -> None:
    request = body(kind)
    with client.responses.stream(**request) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    (call,) = final.output
    assert isinstance(call, KINDS[kind][0]) and call.status == "completed"
    assert types[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert types[-2:] == ["response.output_item.done", "response.completed"]
    if kind == "shell":  # each command added, written as it goes, done
        event = r"response\.shell_call_command\."
        command = rf"({event}added,({event}delta,)*{event}done,)"
        assert re.fullmatch(f"{command}{{{len(call.action.commands)}}}",
                            ",".join(types[3:-2]) + ",")
    else:
        assert len(types) == 5
    # On the wire, every event in OpenAI's published schema.
    sent = {**{k: v for k, v in request.items() if k != "extra_body"}, **request["extra_body"],
            "stream": True}
    events = [json.loads(block.partition("data: ")[2])
              for block in http.post("/v1/responses", json=sent).text.split("\n\n")
              if block.strip()]
    for event in events:
        validate_event(event)
    (done,) = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    check_call(done, kind)
    added = next(e["item"] for e in events if e["type"] == "response.output_item.added")
    assert added["status"] == "in_progress" and added["id"] == done["id"]
    if kind == "shell":
        finished = [e["command"] for e in events
                    if e["type"] == "response.shell_call_command.done"]
        assert finished == done["action"]["commands"]
        for index, command in enumerate(finished):
            assert "".join(e["delta"] for e in events
                           if e["type"] == "response.shell_call_command.delta"
                           and e["command_index"] == index) == command
        assert {e["output_index"] for e in events if "command_index" in e} == {0}


def answer(kind: str, call: Any, by_id: bool = False) -> dict[str, Any]:
    """The client's output for the call, as the SDK types it."""
    if kind == "shell":
        return {"type": "shell_call_output", "call_id": call.call_id,
                "max_output_length": call.action.max_output_length,
                "output": [{"stdout": "notes.txt\n", "stderr": "",
                            "outcome": {"type": "exit", "exit_code": 0}}]}
    if kind == "local_shell":  # the SDK names the call by ``id``; OpenAI's schema by call_id
        key = "id" if by_id else "call_id"
        return {"type": "local_shell_call_output", key: call.call_id,
                "output": json.dumps({"output": "notes.txt\n", "exit_code": 0})}
    return {"type": "apply_patch_call_output", "call_id": call.call_id,
            "status": "completed", "output": "notes.txt updated"}


OUTPUT_TYPES = {"shell": ResponseFunctionShellToolCallOutput,
                "apply_patch": ResponseApplyPatchToolCallOutput,
                "local_shell": response_item.LocalShellCallOutput}


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_output_goes_back_and_the_loop_goes_on(client: Any, kind: str) -> None:
    first = client.responses.create(**body(kind))
    (call,) = first.output
    step = {"model": "demo", "tools": [{"type": kind}], "max_output_tokens": 16,
            "temperature": 0}
    # With previous_response_id: only the output is sent.
    second = client.responses.create(previous_response_id=first.id,
                                     input=[answer(kind, call, by_id=True)], **step)
    assert second.status in ("completed", "incomplete") and second.output
    listed = client.responses.input_items.list(second.id).data
    assert [item.type for item in listed] == [f"{KINDS[kind][1]}_output"]
    assert isinstance(listed[0], OUTPUT_TYPES[kind])
    # Without: the whole history sent back, the call as the SDK dumps it (store off, as
    # Codex does).
    history = [{"role": "user", "content": "List the files."},
               call.model_dump(mode="json"), answer(kind, call)]
    third = client.responses.create(input=history, store=False, **step)
    assert third.status in ("completed", "incomplete") and third.output
    counted = client.post("/responses/input_tokens", cast_to=object, body={
        "model": "demo", "input": history, "tools": [{"type": kind}]})
    assert counted["input_tokens"] > 10
    # The prompt has the call as the function the model was offered, then its result.
    parsed = parse_responses_request({"model": "demo", "input": history,
                                      "tools": [{"type": kind}]}, lookup=lambda _: None)
    assistant, result = parsed.messages[-2:]
    (written,) = assistant.tool_calls
    assert (written.id, written.name) == (call.call_id, kind)
    assert json.loads(written.arguments) == arguments(call.model_dump(mode="json"))
    assert result.role == "tool" and result.tool_call_id == call.call_id
    assert "notes.txt" in (result.content or "")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_cut_call_carries_only_whole_values(client: Any, http: httpx.Client, kind: str,
                                              stream: bool) -> None:
    """Cut by max_output_tokens: still the SDK's type, in the published schema, its status
    not ``completed`` (``apply_patch_call`` has no ``incomplete``), and each value it
    carries one the same call, written to its end, carries whole: none cut mid-way."""
    whole = client.responses.with_raw_response.create(**body(kind)).http_response.json()
    (full,) = whole["output"]
    used = whole["usage"]["output_tokens"]
    assert used > 32  # room to cut it inside its values
    request = body(kind, max_output_tokens=used // 2)
    sent = {**{k: v for k, v in request.items() if k != "extra_body"},
            **request["extra_body"], "stream": stream}
    response = http.post("/v1/responses", json=sent)
    assert response.status_code == 200, response.text
    if stream:
        events = [json.loads(block.partition("data: ")[2])
                  for block in response.text.split("\n\n") if block.strip()]
        for event in events:
            validate_event(event)
        wire = events[-1]["response"]
    else:
        wire = response.json()
    validate_response(wire)
    assert wire["status"] == "incomplete"
    (item,) = wire["output"]
    call = KINDS[kind][0].model_validate(item)
    assert call.status == ("in_progress" if kind == "apply_patch" else "incomplete")
    carried = "operation" if kind == "apply_patch" else "action"
    assert item[carried] != full[carried]  # something was cut
    if kind == "apply_patch":
        cut, done = item["operation"], full["operation"]
        assert cut["path"] in ("", done["path"]) and cut.get("diff", "") in (
            "", done.get("diff"))
    else:
        key = "commands" if kind == "shell" else "command"
        cut_commands = item["action"][key]
        assert cut_commands == full["action"][key][:len(cut_commands)]


def test_allowed_tools_and_a_named_choice_force_them(client: Any, http: httpx.Client) -> None:
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "apply_patch"}]}
    raw = client.responses.with_raw_response.create(
        **body("apply_patch", tools=[ADD, {"type": "apply_patch"}, {"type": "shell"}],
               tool_choice=choice))
    wire = raw.http_response.json()
    assert wire["tool_choice"] == choice
    (item,) = wire["output"]
    check_call(item, "apply_patch")
    # A choice of a tool not offered names it.
    refused = http.post("/v1/responses", json={
        "model": "demo", "input": "Hi.", "tools": [ADD], "tool_choice": {"type": "shell"}})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("unknown_tool", "tool_choice.type")


@pytest.mark.parametrize(("tools", "param"), [
    ([{"type": "function", "name": "shell"}, {"type": "shell"}], "tools[0].name"),
    ([{"type": "apply_patch"}, {"type": "custom", "name": "apply_patch"}], "tools[1].name"),
    ([{"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "local_shell"}]},
      {"type": "local_shell"}], "tools[0].tools[0].name"),
    ([{"type": "shell"}, {"type": "shell", "environment": {"type": "local"}}], "tools[1].type"),
], ids=["function-first", "custom-after", "namespaced", "twice"])
def test_a_client_function_of_the_same_name_is_refused(http: httpx.Client, tools: list[Any],
                                                       param: str) -> None:
    """The model calls both by one name: the client's own tool is the one to rename."""
    response = http.post("/v1/responses", json={"model": "demo", "input": "Hi.",
                                                 "tools": tools, "max_output_tokens": 16})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_value", param)


def test_a_local_environment_is_named_in_the_call(client: Any) -> None:
    tool = {"type": "shell", "environment": {"type": "local"}}
    response = client.responses.create(**body("shell", tools=[tool]))
    (call,) = response.output
    assert call.environment is not None and call.environment.type == "local"
    assert response.tools[0].environment.type == "local"


SHELL_CALL = {"type": "shell_call", "call_id": "call_1", "action": {"commands": ["ls"]}}
SHELL_OUTPUT = {"type": "shell_call_output", "call_id": "call_1",
                "output": [{"stdout": "", "stderr": "", "outcome": {"type": "timeout"}}]}
PATCH_CALL = {"type": "apply_patch_call", "call_id": "call_1", "status": "completed",
              "operation": {"type": "delete_file", "path": "a.py"}}
PATCH_OUTPUT = {"type": "apply_patch_call_output", "call_id": "call_1", "status": "failed"}
EXEC_CALL = {"type": "local_shell_call", "id": "lsh_1", "call_id": "call_1",
             "status": "completed",
             "action": {"type": "exec", "command": ["ls"], "env": {}}}
EXEC_OUTPUT = {"type": "local_shell_call_output", "id": "call_1", "output": "{}"}
USER = {"role": "user", "content": "Go."}


def _without(item: dict[str, Any], path: str) -> dict[str, Any]:
    copy = json.loads(json.dumps(item))
    *parents, last = path.split(".")
    node = copy
    for key in parents:
        node = node[key]
    del node[last]
    return copy


def _with(item: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    copy = json.loads(json.dumps(item))
    *parents, last = path.split(".")
    node = copy
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value
    return copy


BAD_INPUTS = [
    ([_without(SHELL_CALL, "action"), SHELL_OUTPUT], "input[1].action",
     "missing_required_parameter"),
    ([_with(SHELL_CALL, "action.commands", "ls"), SHELL_OUTPUT], "input[1].action.commands",
     "invalid_type"),
    ([_with(SHELL_CALL, "action.commands", ["ls", 3]), SHELL_OUTPUT],
     "input[1].action.commands[1]", "invalid_type"),
    ([_with(SHELL_CALL, "action.timeout_ms", "soon"), SHELL_OUTPUT],
     "input[1].action.timeout_ms", "invalid_type"),
    ([SHELL_CALL, _with(SHELL_OUTPUT, "output.0.outcome", {"type": "crash"})],
     "input[2].output[0].outcome.type", "invalid_value"),
    ([SHELL_CALL, _with(SHELL_OUTPUT, "output.0.outcome", {"type": "exit"})],
     "input[2].output[0].outcome.exit_code", "missing_required_parameter"),
    ([SHELL_CALL, _with(SHELL_OUTPUT, "output", "done")], "input[2].output", "invalid_type"),
    ([SHELL_CALL, _with(SHELL_OUTPUT, "call_id", "call_2")], "input[2].call_id",
     "unknown_tool_call_id"),
    ([SHELL_CALL, SHELL_OUTPUT, SHELL_OUTPUT], "input[3].call_id", "duplicate_tool_output"),
    ([SHELL_CALL, USER], "input[1]", "missing_tool_output"),
    ([SHELL_CALL, SHELL_CALL, SHELL_OUTPUT], "input[2].call_id", "duplicate_tool_call_id"),
    ([_with(PATCH_CALL, "operation.type", "rename_file"), PATCH_OUTPUT],
     "input[1].operation.type", "invalid_value"),
    ([_with(PATCH_CALL, "operation", {"type": "update_file", "path": "a.py"}), PATCH_OUTPUT],
     "input[1].operation.diff", "missing_required_parameter"),
    ([_without(PATCH_CALL, "operation"), PATCH_OUTPUT], "input[1].operation",
     "missing_required_parameter"),
    ([_with(PATCH_CALL, "status", "incomplete"), PATCH_OUTPUT], "input[1].status",
     "invalid_value"),
    ([PATCH_CALL, _with(PATCH_OUTPUT, "status", "done")], "input[2].status", "invalid_value"),
    ([PATCH_CALL, _with(PATCH_OUTPUT, "output", 1)], "input[2].output", "invalid_type"),
    ([_with(EXEC_CALL, "action.type", "spawn"), EXEC_OUTPUT], "input[1].action.type",
     "invalid_value"),
    ([_with(EXEC_CALL, "action.env", {"A": 1}), EXEC_OUTPUT], "input[1].action.env.A",
     "invalid_type"),
    ([EXEC_CALL, _without(EXEC_OUTPUT, "id")], "input[2].call_id",
     "missing_required_parameter"),
    ([EXEC_CALL, _with(EXEC_OUTPUT, "output", ["x"])], "input[2].output", "invalid_type"),
]


@pytest.mark.parametrize(("items", "param", "code"), BAD_INPUTS,
                         ids=[f"{p}-{c}" for _, p, c in BAD_INPUTS])
def test_bad_items_name_their_param(http: httpx.Client, items: list[Any], param: str,
                                    code: str) -> None:
    response = http.post("/v1/responses", json={"model": "demo", "input": [USER, *items],
                                                 "max_output_tokens": 16})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error


@pytest.mark.parametrize(("item", "param"), [
    (_with(SHELL_CALL, "action.bogus", 1), "input[1].action.bogus"),
    (_with(SHELL_CALL, "bogus", 1), "input[1].bogus"),
    (_with(PATCH_CALL, "operation.bogus", 1), "input[1].operation.bogus"),
    (_with(EXEC_CALL, "action.bogus", 1), "input[1].action.bogus"),
])
def test_strict_refuses_unknown_keys_inside_them(item: dict[str, Any], param: str) -> None:
    output = {"shell_call": SHELL_OUTPUT, "apply_patch_call": PATCH_OUTPUT,
              "local_shell_call": EXEC_OUTPUT}[item["type"]]
    with pytest.raises(InvalidRequestError) as info:
        parse_responses_request({"model": "demo", "input": [USER, item, output]},
                                lookup=lambda _: None, strict=True)
    assert (info.value.code, info.value.param) == ("unknown_parameter", param)
    # Every key the SDK sends back is admitted: the call as listed, with its nulls.
    listed = {**item, "id": "sh_1", "status": "completed", "caller": None,
              "created_by": None}
    listed.pop("bogus", None)
    for key in ("action", "operation"):
        if key in listed:
            listed[key] = {k: v for k, v in listed[key].items() if k != "bogus"}
    parse_responses_request({"model": "demo", "input": [USER, listed, output]},
                            lookup=lambda _: None, strict=True)
