"""The Responses API's conversation items: checked into one canonical form, then messages.

A Responses ``input`` is a list of typed items (messages with content parts, function
calls, their outputs, reasoning) rather than Chat Completions' messages. Each item is
checked here, every problem named by its exact param (``input[3].content[0].image_url``),
and rewritten in the form the API itself returns items in (ids, statuses, content parts),
which is what afmd stores, lists under ``input_items`` and reads back for
``previous_response_id``. :func:`to_messages` then groups the items into the internal
:class:`~afmd.core.request.Message` turns a chat template renders: reasoning, text and calls
of one assistant turn become one message, each output a tool message after it.
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from afmd.core.request import ImageInput, Message, ToolCall
from afmd.dialects.fields.checks import (
    invalid,
    missing,
    not_one_of,
    optional,
    quoted,
    reject_unknown,
    required,
    wrong_type,
)
from afmd.dialects.fields.messages import IMAGE_DETAILS
from afmd.dialects.responses import client_tools
from afmd.errors import InvalidRequestError, NotFoundError

Item = dict[str, Any]

ROLES = ("user", "assistant", "system", "developer")
#: Item types of the API that only OpenAI's hosted tools produce or consume.
HOSTED_ITEMS = frozenset({
    "file_search_call", "computer_call", "computer_call_output", "web_search_call",
    "image_generation_call", "code_interpreter_call", "mcp_list_tools",
    "mcp_approval_request", "mcp_approval_response", "mcp_call",
    "tool_search_call", "tool_search_output", "additional_tools", "compaction",
    "compaction_trigger", "program", "program_output",
})
#: The calls and their outputs: custom tools' and client-run tools' beside functions'.
CALLS = ("function_call", "custom_tool_call", *client_tools.KIND_OF_CALL)
OUTPUTS = ("function_call_output", "custom_tool_call_output", *client_tools.KIND_OF_OUTPUT)
ITEM_TYPES = ("message", *CALLS, *OUTPUTS, "reasoning", "item_reference")

# The keys ``[api] strict`` admits in each item and part, as OpenAI refuses any other: the
# openai SDK's (every variant of the item it types; tests/unit/dialects/test_sdk_fields.py
# holds these to its TypedDicts), and the ``status`` afmd's own items carry, which
# clients send back as listed.
_CALL_KEYS = frozenset({"type", "id", "call_id", "name", "namespace", "caller", "async",
                        "status"})
ITEM_KEYS: dict[str, frozenset[str]] = {
    "message": frozenset({"type", "id", "role", "content", "status", "phase"}),
    "function_call": _CALL_KEYS | {"arguments"},
    "custom_tool_call": _CALL_KEYS | {"input"},
    "function_call_output": _CALL_KEYS | {"output"},
    "custom_tool_call_output": _CALL_KEYS | {"output"},
    "reasoning": frozenset({"type", "id", "summary", "content", "encrypted_content",
                            "status"}),
    "item_reference": frozenset({"type", "id"}),
    **client_tools.ITEM_KEYS,
}
_INPUT_TEXT_KEYS = frozenset({"type", "text", "prompt_cache_breakpoint"})
_OUTPUT_TEXT_KEYS = frozenset({"type", "text", "annotations", "logprobs"})
PART_KEYS: dict[str, frozenset[str]] = {
    "input_text": _INPUT_TEXT_KEYS,
    "output_text": _OUTPUT_TEXT_KEYS,
    "text": _INPUT_TEXT_KEYS | _OUTPUT_TEXT_KEYS,
    "refusal": frozenset({"type", "refusal"}),
    "input_image": frozenset({"type", "image_url", "file_id", "detail",
                              "prompt_cache_breakpoint"}),
}
#: A reasoning item's summary and content parts.
TEXT_PART_KEYS = frozenset({"type", "text"})


def item_id(prefix: str) -> str:
    """An item id in OpenAI's shape: a type prefix and 48 hex digits."""
    return f"{prefix}_{secrets.token_hex(24)}"


def _unsupported(param: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(what, code="unsupported_value", param=param)


# RFC 2397: the scheme, media type and ``;base64`` are case-insensitive, and parameters
# (``;charset=utf-8``, ``;name=x.png``) may come before ``;base64``; only images, and only
# base64 payloads (the payload itself is case-sensitive, so it is matched apart).
_DATA_URL = re.compile(r"(?i:data:image/[a-z0-9.+-]+(?:;[^;,=]+=[^;,]*)*;base64),"
                       r"([A-Za-z0-9+/]*={0,2})", re.ASCII)


def _check_image_url(url: str, param: str) -> None:
    """Only inline ``data:`` images, as in chat: afmd never fetches a URL for a client."""
    if url[:5].lower() != "data:":
        raise InvalidRequestError(
            "Only base64 'data:' image URLs are accepted; afmd does not fetch remote URLs.",
            code="unsupported_image_url", param=param)
    match = _DATA_URL.fullmatch(url)
    try:
        if match is None or len(match.group(1)) % 4 != 0:
            raise binascii.Error
        base64.b64decode(match.group(1), validate=True)
    except binascii.Error:
        raise InvalidRequestError(
            "Malformed image data URL: expected 'data:image/<type>;base64,<data>'.",
            code="invalid_image_url", param=param) from None


# ---------------------------------------------------------------------------- content


def _input_part(part: Any, p: str, role: str, strict: bool) -> Item:
    if not isinstance(part, dict):
        raise wrong_type(p, "an object", part)
    kind = part.get("type")
    if kind is None:
        raise missing(f"{p}.type")
    if strict and type(kind) is str and kind in PART_KEYS:
        reject_unknown(part, PART_KEYS[kind], prefix=f"{p}.")
    if kind in ("input_text", "output_text", "text"):
        text = required(part, "text", f"{p}.text", str, "a string")
        if role == "assistant":
            return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": "input_text", "text": text}
    if kind == "refusal":
        refusal = required(part, "refusal", f"{p}.refusal", str, "a string")
        return {"type": "refusal", "refusal": refusal}
    if kind == "input_image":
        if part.get("file_id") is not None:
            raise _unsupported(f"{p}.file_id", "afmd has no Files API: send the image inline "
                               "as a base64 'data:' URL in 'image_url'.")
        url = required(part, "image_url", f"{p}.image_url", str, "a string")
        _check_image_url(url, f"{p}.image_url")
        detail = part.get("detail", "auto")
        if detail not in IMAGE_DETAILS:
            raise not_one_of(f"{p}.detail", detail, IMAGE_DETAILS)
        return {"type": "input_image", "image_url": url, "detail": detail}
    if kind == "input_file":
        raise _unsupported(f"{p}.type", "File inputs are not supported: afmd accepts text "
                           "and images.")
    raise not_one_of(f"{p}.type", kind, ("input_text", "input_image", "output_text", "refusal"))


def _content(value: Any, p: str, role: str, strict: bool) -> list[Item]:
    if isinstance(value, str):
        if role == "assistant":
            return [{"type": "output_text", "text": value, "annotations": [], "logprobs": []}]
        return [{"type": "input_text", "text": value}]
    if value is None:
        raise missing(p)
    if not isinstance(value, list):
        raise wrong_type(p, "a string or an array of content parts", value)
    return [_input_part(part, f"{p}[{i}]", role, strict) for i, part in enumerate(value)]


def _text_of(parts: Sequence[Item]) -> str:
    return "".join(part.get("text") or part.get("refusal") or "" for part in parts)


def _images(parts: Any, params: ItemParams, index: int, field: str) -> tuple[ImageInput, ...]:
    """The (checked) image parts' bytes, each placed in the parts' joined text (``field``:
    where the parts sit in item ``index``, for the image's param)."""
    if not isinstance(parts, list):
        return ()
    images: list[ImageInput] = []
    length = 0
    for j, part in enumerate(parts):
        if part.get("type") == "input_image":
            data = base64.b64decode(part["image_url"].partition(",")[2])
            images.append(ImageInput(data, params(index, f"{field}[{j}].image_url"), length))
        else:
            length += len(part.get("text") or part.get("refusal") or "")
    return tuple(images)


# ---------------------------------------------------------------------------- items


def _message(item: Item, p: str, strict: bool) -> Item:
    role = required(item, "role", f"{p}.role", str, "a string")
    if role not in ROLES:
        raise not_one_of(f"{p}.role", role, ROLES)
    parts = _content(item.get("content"), f"{p}.content", role, strict)
    return {"id": _given_id(item, p, "msg"), "type": "message", "role": role,
            "content": parts, "status": "completed"}


def _given_id(item: Item, p: str, prefix: str) -> str:
    value = item.get("id")
    if value is None:
        return item_id(prefix)
    if not isinstance(value, str) or not value:
        raise wrong_type(f"{p}.id", "a non-empty string", value)
    return value


def _call_id(item: Item, p: str) -> str:
    call_id = required(item, "call_id", f"{p}.call_id", str, "a string")
    if not call_id:
        raise invalid(f"{p}.call_id", "A call_id must not be empty.")
    return call_id


def _call(item: Item, p: str, kind: str) -> Item:
    """A function call (``arguments``, JSON text) or a custom tool's (``input``, free
    text), its ``namespace`` kept when a namespace tool's function made it."""
    call_id = _call_id(item, p)
    name = required(item, "name", f"{p}.name", str, "a string")
    if kind == "custom_tool_call":
        text = required(item, "input", f"{p}.input", str, "a string")
        out = {"id": _given_id(item, p, "ctc"), "type": kind, "call_id": call_id,
               "name": name, "input": text, "status": "completed"}
    else:
        arguments = item.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise wrong_type(f"{p}.arguments", "a string", arguments)
        out = {"id": _given_id(item, p, "fc"), "type": kind, "call_id": call_id,
               "name": name, "arguments": arguments, "status": "completed"}
    namespace = optional(item, "namespace", f"{p}.namespace", str, "a string")
    if namespace is not None:
        out["namespace"] = namespace
    # Kept as sent: an async call may wait for its output (:func:`to_messages`), and a
    # client reading the stored item back sends it again as it was.
    pending = optional(item, "async", f"{p}.async", bool, "a boolean")
    if pending is not None:
        out["async"] = pending
    return out


def _call_output(item: Item, p: str, kind: str, strict: bool) -> Item:
    call_id = _call_id(item, p)
    output = item.get("output")
    if output is None:
        raise missing(f"{p}.output")
    if not isinstance(output, str):
        output = _content(output, f"{p}.output", "tool", strict)
    prefix = "fco" if kind == "function_call_output" else "ctco"
    return {"id": _given_id(item, p, prefix), "type": kind,
            "call_id": call_id, "output": output, "status": "completed"}


def _client_call(item: Item, p: str, strict: bool) -> Item:
    kind = item["type"]
    return client_tools.parse_call(
        item, p, _given_id(item, p, client_tools.CALL_PREFIXES[kind]), _call_id(item, p),
        strict)


def _client_output(item: Item, p: str, strict: bool) -> Item:
    kind = item["type"]
    call_id = client_tools.output_call_id(item, p)
    return client_tools.parse_output(
        item, p, _given_id(item, p, client_tools.CALL_PREFIXES[kind]), call_id, strict)


def call_arguments(item: Item) -> str:
    """A call item as the model wrote it: a custom tool's text is the one string of the
    function it is offered as (:func:`afmd.dialects.responses.options.custom_parameters`),
    a client-run tool's action that function's arguments."""
    if item["type"] == "custom_tool_call":
        return orjson.dumps({"input": item["input"]}).decode()
    if item["type"] in client_tools.KIND_OF_CALL:
        return client_tools.call_arguments(item)
    return str(item["arguments"])


def call_name(item: Item) -> str:
    """The function a call item calls: a client-run tool's is the tool's type."""
    kind = item["type"]
    return client_tools.KIND_OF_CALL[kind] if kind in client_tools.KIND_OF_CALL else \
        str(item["name"])


def output_text(item: Item) -> str | list[Item]:
    """An output item's output: text, or content parts (images among them)."""
    if item["type"] in client_tools.KIND_OF_OUTPUT:
        return client_tools.output_text(item)
    output: str | list[Item] = item["output"]
    return output


def _text_parts(value: Any, p: str, kind: str, strict: bool) -> list[Item]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise wrong_type(p, "an array", value)
    parts: list[Item] = []
    for i, part in enumerate(value):
        if not isinstance(part, dict):
            raise wrong_type(f"{p}[{i}]", "an object", part)
        if strict:
            reject_unknown(part, TEXT_PART_KEYS, prefix=f"{p}[{i}].")
        text = required(part, "text", f"{p}[{i}].text", str, "a string")
        parts.append({"type": kind, "text": text})
    return parts


def _reasoning(item: Item, p: str, strict: bool) -> Item:
    # encrypted_content (OpenAI's own, which afmd cannot read) is dropped.
    return {"id": _given_id(item, p, "rs"), "type": "reasoning",
            "summary": _text_parts(item.get("summary"), f"{p}.summary", "summary_text",
                                   strict),
            "content": _text_parts(item.get("content"), f"{p}.content", "reasoning_text",
                                   strict)}


def canonical_items(value: Any, param: str = "input", *,
                    find_item: Callable[[str], Item | None] = lambda _: None,
                    strict: bool = False) -> list[Item]:
    """``input`` (a string or a list of items) checked into canonical items; an
    ``item_reference`` is the stored item it names (``find_item``), unknown: a 404.
    ``strict`` refuses a key the item's type does not have (:data:`ITEM_KEYS`), and in
    its parts."""
    if isinstance(value, str):
        return [{"id": item_id("msg"), "type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": value}], "status": "completed"}]
    if value is None:
        raise missing(param)
    if not isinstance(value, list):
        raise wrong_type(param, "a string or an array of input items", value)
    items: list[Item] = []
    for i, item in enumerate(value):
        p = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise wrong_type(p, "an object", item)
        kind = item.get("type")
        if kind is None:
            # The type may be left out of an EasyInputMessage, and out of an ItemReference
            # (there also null): an id alone, without a message's role and content.
            kind = "item_reference" if "id" in item and "role" not in item and (
                "content" not in item) else "message"
        if not isinstance(kind, str):  # an object or array: unhashable below
            raise wrong_type(f"{p}.type", "a string", kind)
        if strict and kind in ITEM_KEYS:
            reject_unknown(item, ITEM_KEYS[kind], prefix=f"{p}.")
        if kind == "message":
            items.append(_message(item, p, strict))
        elif kind in client_tools.KIND_OF_CALL:
            items.append(_client_call(item, p, strict))
        elif kind in client_tools.KIND_OF_OUTPUT:
            items.append(_client_output(item, p, strict))
        elif kind in CALLS:
            items.append(_call(item, p, kind))
        elif kind in OUTPUTS:
            items.append(_call_output(item, p, kind, strict))
        elif kind == "reasoning":
            items.append(_reasoning(item, p, strict))
        elif kind == "item_reference":
            ref = required(item, "id", f"{p}.id", str, "a string")
            found = find_item(ref)
            if found is None:
                raise NotFoundError(
                    f"Item with id {quoted(ref)} not found (no stored response or "
                    "conversation has it: it was never stored, was deleted, or expired).",
                    code="item_not_found",
                    param=f"{p}.id")
            items.append(dict(found))
        elif kind in HOSTED_ITEMS:
            raise _unsupported(f"{p}.type", f"Items of type {quoted(kind)} belong to "
                               "OpenAI's hosted tools, which afmd does not have.")
        else:
            raise not_one_of(f"{p}.type", kind, ITEM_TYPES)
    return items


def check_unique_ids(value: Any, items: Sequence[Item], param: str = "input") -> None:
    """No two of the items sent (``value``, as :func:`canonical_items` read it into
    ``items``) share an id, as OpenAI refuses: the id names one item in what is stored,
    listed after it (``after``) and referenced (``item_reference``)."""
    if not isinstance(value, list):
        return  # a string: one item, its id afmd's own
    seen: set[str] = set()
    for i, (sent, item) in enumerate(zip(value, items, strict=True)):
        if sent.get("id") is None and sent.get("type") != "item_reference":
            continue  # an id afmd made, unique
        if item["id"] in seen:
            raise InvalidRequestError(
                f"Duplicate item found with id {quoted(item['id'])}. Remove duplicate items "
                "from your input and try again.", code="duplicate_item",
                param=f"{param}[{i}].id")
        seen.add(item["id"])


# ---------------------------------------------------------------------------- messages


@dataclass(slots=True)
class _Turn:
    """An assistant turn being gathered: its thinking, text and calls."""

    index: int  # its first item, for errors
    reasoning: list[str]
    content: list[str]
    calls: list[tuple[ToolCall, int]]  # each with its item's index

    def message(self) -> Message:
        return Message(role="assistant", content="".join(self.content) or None,
                       tool_calls=tuple(c for c, _ in self.calls),
                       reasoning="".join(self.reasoning) or None)


def _reasoning_text(item: Item) -> str:
    """What the model thought: its reasoning text, else the summary of it."""
    return _text_of(item.get("content") or []) or "\n\n".join(
        part["text"] for part in item.get("summary") or [])


class ItemParams:
    """Names the param of an item by its index in the whole conversation: the stored
    items first (named by the field that brought them: ``previous_response_id`` or
    ``conversation``), then this request's ``input``."""

    def __init__(self, stored: int, source: str = "previous_response_id") -> None:
        self.stored = stored
        self.source = source

    def __call__(self, index: int, rest: str = "") -> str:
        if index < self.stored:
            return self.source
        return f"input[{index - self.stored}]{rest}"


def to_messages(items: Sequence[Item], params: ItemParams) -> tuple[Message, ...]:
    """The conversation as chat messages, its tool history checked (every call answered
    by exactly one output, outputs only for calls made before them). A call marked
    ``async`` may be unanswered: its tool's answer comes in a later request, as on
    OpenAI's API, and the model sees the call it made without an output yet."""
    messages: list[Message] = []
    turn: _Turn | None = None
    answered: dict[str, int] = {}  # call id -> the output's index
    open_calls: dict[str, tuple[int, int]] = {}  # call id -> (message index, item index)
    waiting = {item["call_id"] for item in items
               if item["type"] in CALLS and item.get("async") is True}
    pending: dict[int, dict[str, Message]] = {}  # message index -> outputs by call id

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            if turn.content or turn.calls:
                messages.append(turn.message())
                if turn.calls:
                    pending[len(messages) - 1] = {}
                    for call, index in turn.calls:
                        open_calls[call.id] = (len(messages) - 1, index)
            turn = None

    def assistant(index: int) -> _Turn:
        nonlocal turn
        if turn is None:
            turn = _Turn(index, [], [], [])
        return turn

    for index, item in enumerate(items):
        kind = item["type"]
        if kind == "reasoning":
            if turn is not None and (turn.content or turn.calls):
                flush()
            assistant(index).reasoning.append(_reasoning_text(item))
        elif kind == "message" and item["role"] == "assistant":
            # Text after calls whose outputs have not come yet is still their turn (a
            # model may write on after a call): as a turn of its own it would be rendered
            # after the outputs, the conversation ending on it instead of on them.
            if turn is not None and turn.content and not turn.calls:
                flush()
            assistant(index).content.append(_text_of(item["content"]))
        elif kind in CALLS:
            call_id = item["call_id"]
            if call_id in open_calls or call_id in answered or any(
                    c.id == call_id for c, _ in (turn.calls if turn else [])):
                raise InvalidRequestError(
                    f"The call_id {quoted(call_id)} is used by more than one function_call.",
                    code="duplicate_tool_call_id", param=params(index, ".call_id"))
            assistant(index).calls.append(
                (ToolCall(call_id, call_name(item), call_arguments(item)), index))
        elif kind in OUTPUTS:
            flush()
            call_id = item["call_id"]
            if call_id in answered:
                raise InvalidRequestError(
                    f"The function call {quoted(call_id)} is answered more than once.",
                    code="duplicate_tool_output", param=params(index, ".call_id"))
            if call_id not in open_calls:
                raise InvalidRequestError(
                    f"No function_call before this output has the call_id {quoted(call_id)}.",
                    code="unknown_tool_call_id", param=params(index, ".call_id"))
            output = output_text(item)
            text = output if isinstance(output, str) else _text_of(output)
            where = open_calls[call_id][0]
            images = _images(output, params, index, ".output")
            pending[where][call_id] = Message(role="tool", content=text,
                                              tool_call_id=call_id,
                                              has_images=bool(images), images=images)
            answered[call_id] = index
        else:  # a user, system or developer message
            flush()
            images = _images(item["content"], params, index, ".content")
            messages.append(Message(role=item["role"], content=_text_of(item["content"]),
                                    has_images=bool(images), images=images))
    flush()
    for call_id, (_, index) in open_calls.items():
        if call_id not in answered and call_id not in waiting:
            raise InvalidRequestError(
                f"The function call {quoted(call_id)} has no function_call_output answering "
                "it; add one to 'input'.", code="missing_tool_output", param=params(index))
    return _with_outputs(messages, pending)


def _with_outputs(
    messages: list[Message], pending: dict[int, dict[str, Message]]
) -> tuple[Message, ...]:
    """Each assistant message with calls followed by their outputs, in the calls' order
    (a chat template renders a call's answer right after it)."""
    out: list[Message] = []
    for i, message in enumerate(messages):
        out.append(message)
        if i in pending:
            outputs = pending[i]
            out.extend(outputs[call.id] for call in message.tool_calls if call.id in outputs)
    return tuple(out)
