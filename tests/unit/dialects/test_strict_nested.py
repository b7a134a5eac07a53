"""``[api] strict`` inside the objects of a body: an unknown key is refused where it
stands, the param its path as the client sent it; without strict it is ignored unnamed.

Clients echo back fields of what they were sent (``refusal``, ``annotations``,
``reasoning_content``), so every key the official SDKs type, and every key afmd's own
answers carry, stays accepted under strict (tests/unit/dialects/test_sdk_fields.py holds
the known sets to the SDKs' TypedDicts).
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from afmd.dialects.anthropic.messages_api import ANTHROPIC_MESSAGES
from afmd.dialects.anthropic.messages_body import parse_messages_request
from afmd.dialects.openai.chat_body import parse_chat_request
from afmd.dialects.responses.responses_body import parse_responses_request
from afmd.errors import InvalidRequestError

IMAGE = "data:image/png;base64,iVBORw0KGgo="
USER = {"role": "user", "content": "Hello"}
FUNCTION = {"name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}
TOOL = {"type": "function", "function": FUNCTION}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def _refused(parse: Any, body: dict[str, Any], param: str) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        parse(body, strict=True)
    err = info.value
    assert (err.code, err.param, err.status) == ("unknown_parameter", param, 400), repr(err)
    assert param in err.message
    return err


# ---------------------------------------------------------------------------- chat


def _with(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [USER], **fields}


def _history(assistant: dict[str, Any], tool: dict[str, Any] | None = None) -> list[Any]:
    return [USER, {"role": "assistant", "content": None, "tool_calls": [CALL], **assistant},
            {"role": "tool", "tool_call_id": "c1", "content": "ok", **(tool or {})}, USER]


CHAT_REFUSED = [
    (_with(messages=[{**USER, "bogus": 1}]), "messages[0].bogus"),
    (_with(messages=[{"role": "system", "content": "s", "bogus": 1}, USER]),
     "messages[0].bogus"),
    # A key of another role is no key of this one.
    (_with(messages=[{**USER, "tool_call_id": "c1"}]), "messages[0].tool_call_id"),
    (_with(messages=_history({"bogus": 1})), "messages[1].bogus"),
    (_with(messages=_history({}, {"bogus": 1})), "messages[2].bogus"),
    (_with(messages=_history({"tool_calls": [{**CALL, "bogus": 1}]})),
     "messages[1].tool_calls[0].bogus"),
    (_with(messages=_history({"tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": "{}", "bogus": 1}}]})),
     "messages[1].tool_calls[0].function.bogus"),
    (_with(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b", "bogus": 1}]}]),
     "messages[0].content[1].bogus"),
    (_with(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": IMAGE}, "bogus": 1}]}]),
     "messages[0].content[0].bogus"),
    (_with(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": IMAGE, "bogus": 1}}]}]),
     "messages[0].content[0].image_url.bogus"),
    (_with(messages=[USER, {"role": "assistant", "content": [
        {"type": "refusal", "refusal": "no", "bogus": 1}]}, USER]),
     "messages[1].content[0].bogus"),
    (_with(tools=[TOOL, {"type": "function", "function": {"name": "g"}, "bogus": 1}]),
     "tools[1].bogus"),
    (_with(tools=[TOOL, {"type": "function", "function": {"name": "g", "bogus": 1}}]),
     "tools[1].function.bogus"),
    (_with(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"},
                                      "bogus": 1}), "tool_choice.bogus"),
    (_with(tools=[TOOL], tool_choice={"type": "function",
                                      "function": {"name": "f", "bogus": 1}}),
     "tool_choice.function.bogus"),
    (_with(tools=[TOOL], tool_choice={"type": "allowed_tools", "bogus": 1,
                                      "allowed_tools": {"mode": "auto", "tools": [TOOL]}}),
     "tool_choice.bogus"),
    (_with(tools=[TOOL], tool_choice={"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [TOOL], "bogus": 1}}), "tool_choice.allowed_tools.bogus"),
    (_with(response_format={"type": "json_object", "bogus": 1}), "response_format.bogus"),
    (_with(response_format={"type": "json_schema", "schema": {}, "json_schema": {
        "name": "n", "schema": {}}}), "response_format.schema"),
    (_with(response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": {}, "bogus": 1}}), "response_format.json_schema.bogus"),
]


@pytest.mark.parametrize(("body", "param"), CHAT_REFUSED,
                         ids=[param for _, param in CHAT_REFUSED])
def test_chat_strict_refuses_unknown_nested_keys(body: dict[str, Any], param: str) -> None:
    _refused(parse_chat_request, body, param)
    # The default ignores them without naming them: clients echo back what they were sent.
    assert parse_chat_request(body).ignored_fields == ()


def test_chat_strict_accepts_every_key_the_sdk_and_afmds_answers_carry() -> None:
    body = _with(
        messages=[
            {"role": "developer", "content": "d", "name": "n"},
            {"role": "user", "name": "n", "content": [
                {"type": "text", "text": "a", "prompt_cache_breakpoint": {"type": "x"}},
                {"type": "image_url", "image_url": {"url": IMAGE, "detail": "low"},
                 "prompt_cache_breakpoint": None}]},
            # An answer of afmd's sent back as it came.
            {"role": "assistant", "content": None, "refusal": None, "annotations": [],
             "reasoning_content": "hm", "audio": None, "name": "a", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            USER,
        ],
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "f"}},
        response_format={"type": "json_schema", "json_schema": {
            "name": "n", "description": "d", "schema": {}, "strict": True}})
    request = parse_chat_request(body, strict=True)
    assert request.tools[0].name == "f"
    # The SDK types allowed_tools' entries as any object: a whole tool stands for its name.
    assert parse_chat_request(_with(tools=[TOOL], tool_choice={
        "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [TOOL]}}),
        strict=True).tool_choice.allowed == ("f",)


# ---------------------------------------------------------------------------- Responses


def _responses(body: dict[str, Any], *, strict: bool = False) -> Any:
    return parse_responses_request(body, lookup=lambda _: None, strict=strict)


R_CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
R_OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
R_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
R_CUSTOM = {"type": "custom", "name": "patch", "format": {
    "type": "grammar", "syntax": "regex", "definition": "[a-z]+"}}


def _input(*items: Any, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": [*items] or "Hi", **fields}


HI = {"role": "user", "content": "Hi"}
RESPONSES_REFUSED = [
    (_input(HI, {**HI, "bogus": 1}), "input[1].bogus"),
    (_input({"type": "message", "role": "user", "bogus": 1, "content": "Hi"}),
     "input[0].bogus"),
    (_input(HI, {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                             {"type": "input_text", "text": "b",
                                              "bogus": 1}]}),
     "input[1].content[1].bogus"),
    (_input(HI, {"role": "user", "content": [
        {"type": "input_image", "image_url": IMAGE, "bogus": 1}]}),
     "input[1].content[0].bogus"),
    (_input(HI, {"role": "assistant", "content": [
        {"type": "output_text", "text": "a", "bogus": 1}]}, HI),
     "input[1].content[0].bogus"),
    (_input(HI, {**R_CALL, "bogus": 1}, R_OUTPUT), "input[1].bogus"),
    (_input(HI, R_CALL, {**R_OUTPUT, "bogus": 1}), "input[2].bogus"),
    (_input(HI, R_CALL, {**R_OUTPUT, "output": [{"type": "input_text", "text": "ok",
                                                 "bogus": 1}]}),
     "input[2].output[0].bogus"),
    (_input(HI, {"type": "reasoning", "summary": [], "bogus": 1}, HI), "input[1].bogus"),
    (_input(HI, {"type": "reasoning", "summary": [
        {"type": "summary_text", "text": "t", "bogus": 1}]}, HI),
     "input[1].summary[0].bogus"),
    (_input(HI, tools=[R_TOOL, {**R_TOOL, "name": "g", "bogus": 1}]), "tools[1].bogus"),
    (_input(HI, tools=[{**R_CUSTOM, "bogus": 1}]), "tools[0].bogus"),
    (_input(HI, tools=[{**R_CUSTOM, "format": {**R_CUSTOM["format"], "bogus": 1}}]),
     "tools[0].format.bogus"),
    (_input(HI, tools=[{"type": "namespace", "name": "ns", "tools": [R_TOOL],
                        "bogus": 1}]), "tools[0].bogus"),
    (_input(HI, tools=[{"type": "namespace", "name": "ns", "tools": [
        {**R_TOOL, "bogus": 1}]}]), "tools[0].tools[0].bogus"),
    (_input(HI, tools=[R_TOOL], tool_choice={"type": "function", "name": "f", "bogus": 1}),
     "tool_choice.bogus"),
    (_input(HI, tools=[R_TOOL], tool_choice={"type": "allowed_tools", "mode": "auto",
                                             "tools": [R_TOOL], "bogus": 1}),
     "tool_choice.bogus"),
    (_input(HI, text={"format": {"type": "json_schema", "name": "n", "schema": {},
                                 "bogus": 1}}), "text.format.bogus"),
    (_input(HI, text={"format": {"type": "json_object", "schema": {}}}),
     "text.format.schema"),
]


@pytest.mark.parametrize(("body", "param"), RESPONSES_REFUSED,
                         ids=[param for _, param in RESPONSES_REFUSED])
def test_responses_strict_refuses_unknown_nested_keys(body: dict[str, Any],
                                                      param: str) -> None:
    _refused(_responses, body, param)
    assert _responses(body).ignored_fields == ()


def test_responses_strict_accepts_every_key_the_sdk_and_afmds_items_carry() -> None:
    """Items as afmd lists them (``input_items``, a response's ``output``) go back as
    they came, and every key the SDK types passes."""
    body = _input(
        {"type": "message", "role": "user", "status": "completed", "id": "msg_1",
         "content": [
             {"type": "input_text", "text": "a", "prompt_cache_breakpoint": None},
             {"type": "input_image", "image_url": IMAGE, "detail": "auto",
              "prompt_cache_breakpoint": None}]},
        {"id": "rs_1", "type": "reasoning", "status": "completed", "encrypted_content": None,
         "summary": [{"type": "summary_text", "text": "s"}],
         "content": [{"type": "reasoning_text", "text": "t"}]},
        {"id": "msg_2", "type": "message", "role": "assistant", "status": "completed",
         "phase": "commentary", "content": [
             {"type": "output_text", "text": "x", "annotations": [], "logprobs": []}]},
        {**R_CALL, "id": "fc_1", "status": "completed", "namespace": None},
        {**R_OUTPUT, "id": "fco_1", "status": "completed"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "patch", "input": "ab",
         "id": "ctc_1", "status": "completed"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "ok",
         "id": "ctco_1", "status": "completed"},
        tools=[{**R_TOOL, "description": "d", "strict": False, "defer_loading": False},
               R_CUSTOM],
        tool_choice={"type": "allowed_tools", "mode": "auto", "tools": [R_TOOL]},
        text={"format": {"type": "json_schema", "name": "n", "schema": {}, "strict": True,
                         "description": "d"}, "verbosity": "low"})
    request = _responses(body, strict=True)
    assert [t.name for t in request.tools] == ["f", "patch"]


# ---------------------------------------------------------------------------- Anthropic


def _anthropic(body: dict[str, Any], *, strict: bool = False) -> Any:
    return parse_messages_request(orjson.dumps(body), strict=strict)


A_TOOL = {"name": "f", "input_schema": {"type": "object"}}
A_USE = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
A_RESULT = {"type": "tool_result", "tool_use_id": "t1", "content": "ok"}
A_IMAGE = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}


def _claude(*messages: Any, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 64, "messages": [*messages] or [HI], **fields}


def _calls(use: dict[str, Any], result: dict[str, Any]) -> list[Any]:
    return [HI, {"role": "assistant", "content": [use]},
            {"role": "user", "content": [result]}]


ANTHROPIC_REFUSED = [
    (_claude({**HI, "bogus": 1}), "messages[0].bogus"),
    (_claude({"role": "user", "content": [{"type": "text", "text": "a", "bogus": 1}]}),
     "messages[0].content[0].bogus"),
    (_claude({"role": "user", "content": [{"type": "image", "source": A_IMAGE,
                                           "bogus": 1}]}),
     "messages[0].content[0].bogus"),
    (_claude({"role": "user", "content": [{"type": "image",
                                           "source": {**A_IMAGE, "bogus": 1}}]}),
     "messages[0].content[0].source.bogus"),
    (_claude({"role": "user", "content": [{"type": "document", "bogus": 1, "source": {
        "type": "text", "media_type": "text/plain", "data": "d"}}]}),
     "messages[0].content[0].bogus"),
    (_claude({"role": "user", "content": [{"type": "document", "source": {
        "type": "content", "content": [{"type": "text", "text": "d", "bogus": 1}]}}]}),
     "messages[0].content[0].source.content[0].bogus"),
    (_claude(*_calls({**A_USE, "bogus": 1}, A_RESULT)), "messages[1].content[0].bogus"),
    (_claude(*_calls(A_USE, {**A_RESULT, "bogus": 1})), "messages[2].content[0].bogus"),
    (_claude(*_calls(A_USE, {**A_RESULT, "content": [
        {"type": "text", "text": "ok", "bogus": 1}]})),
     "messages[2].content[0].content[0].bogus"),
    (_claude(HI, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "t", "signature": "", "bogus": 1}]}, HI),
     "messages[1].content[0].bogus"),
    (_claude(system=[{"type": "text", "text": "s", "bogus": 1}]), "system[0].bogus"),
    (_claude(tools=[A_TOOL, {**A_TOOL, "name": "g", "bogus": 1}]), "tools[1].bogus"),
    (_claude(tools=[A_TOOL], tool_choice={"type": "tool", "name": "f", "bogus": 1}),
     "tool_choice.bogus"),
    (_claude(tool_choice={"type": "none", "disable_parallel_tool_use": True}),
     "tool_choice.disable_parallel_tool_use"),
    (_claude(thinking={"type": "enabled", "budget_tokens": 16, "bogus": 1}),
     "thinking.bogus"),
    (_claude(thinking={"type": "disabled", "budget_tokens": 16}), "thinking.budget_tokens"),
    (_claude(output_config={"effort": "low", "bogus": 1}), "output_config.bogus"),
    (_claude(output_config={"format": {"type": "json_schema", "schema": {}, "bogus": 1}}),
     "output_config.format.bogus"),
]


@pytest.mark.parametrize(("body", "param"), ANTHROPIC_REFUSED,
                         ids=[param for _, param in ANTHROPIC_REFUSED])
def test_anthropic_strict_refuses_unknown_nested_keys(body: dict[str, Any],
                                                      param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        _anthropic(body, strict=True)
    err = info.value
    assert (err.code, err.param) == ("unknown_parameter", param), repr(err)
    # Anthropic's words; its envelope puts the param first.
    assert ANTHROPIC_MESSAGES.error_envelope(err)["error"] == {
        "type": "invalid_request_error",
        "message": f"{param}: Extra inputs are not permitted"}
    assert _anthropic(body).ignored_fields == ()


def test_anthropic_strict_accepts_every_key_the_sdk_and_afmds_blocks_carry() -> None:
    cache = {"type": "ephemeral"}
    body = _claude(
        {"role": "user", "content": [
            {"type": "text", "text": "a", "cache_control": cache, "citations": None},
            {"type": "image", "source": A_IMAGE, "cache_control": cache},
            {"type": "document", "title": "t", "context": "c", "citations": {"enabled": True},
             "cache_control": cache, "source": {"type": "text", "media_type": "text/plain",
                                                "data": "d"}}]},
        # A reply of afmd's sent back as it came.
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": ""},
            {"type": "redacted_thinking", "data": "x"},
            {"type": "text", "text": "b", "citations": None},
            {**A_USE, "cache_control": cache, "caller": None}]},
        {"role": "user", "content": [
            {**A_RESULT, "is_error": False, "cache_control": cache,
             "content": [{"type": "text", "text": "ok"}]}]},
        system=[{"type": "text", "text": "s", "cache_control": cache}],
        tools=[{**A_TOOL, "type": "custom", "description": "d", "strict": True,
                "cache_control": cache, "input_examples": [], "defer_loading": False}],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        thinking={"type": "enabled", "budget_tokens": 16, "display": "summarized"},
        output_config={"effort": "low"})
    request = _anthropic(body, strict=True)
    assert request.tools[0].name == "f"
