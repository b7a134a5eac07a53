"""An Anthropic Messages body's ``system`` and ``messages`` as afmd's messages.

Anthropic's conversation is blocks inside two roles: a user turn carries text, images and
the results of the previous turn's tool calls; an assistant turn carries thinking, text
and ``tool_use`` blocks. Inside afmd a tool result is its own ``tool`` message right after
the call it answers, so each user turn becomes its tool messages (in the order of the
calls) followed by its text; consecutive turns of one role are one turn, as Anthropic
merges them. Every problem is a 400 naming its param (``messages[2].content[0].source``).

A ``role: "system"`` message inside ``messages`` (Claude Code sends them, with the
``mid-conversation-system`` beta) is a string or text blocks, and stays where it stands: a
system turn there when the model's chat template has one, otherwise folded into the
nearest turn it accepts (:meth:`afmd.engine.models.loaded_model.LoadedModel.render_prompt`).

A last assistant message is a prefill: the answer continues its text (an empty one is as
none, and its text may not end in whitespace, as Anthropic requires).

A system message's ``output_config.effort`` (its content may then be empty or absent)
sets the effort of the answers from there on, over the body's; Claude Code changes effort
mid-conversation so, its cached prefix kept.

A system message with ``clear_at: "next_user_message"`` is shown only until a user
message follows it (the text of a turn-scoped reminder); ``clear_at`` on any other role
is Anthropic's 400.

A system message may also add or withdraw tools from that point on (``tool_addition``,
``tool_removal``: the ``mid-conversation-tool-changes`` beta Claude Code sends), and a
tool's result may load tools by name (``tool_reference`` blocks, what Claude Code's
ToolSearch answers, loading tools declared with ``defer_loading``): these are returned
as :class:`ToolChange` s in the conversation's order, for
:func:`afmd.dialects.anthropic.tools_body.offered_tools` to decide which tools the model
is offered. ``search_result`` blocks are read as text, like documents.

``thinking`` blocks sent back become that assistant turn's reasoning (templates that know
``reasoning_content`` render it, others drop it); their signatures are opaque to afmd, and
``redacted_thinking`` has no text.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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
from afmd.errors import InvalidRequestError

__all__ = ["EFFORT_LEVELS", "EXTRA_INPUTS", "Conversation", "ToolChange", "parse_messages",
           "parse_system"]

#: Anthropic's words for a key it does not define (``[api] strict``); its envelope puts
#: the param first: ``messages[0].bogus: Extra inputs are not permitted``.
EXTRA_INPUTS = "Extra inputs are not permitted"

# The keys ``[api] strict`` admits in each object, as Anthropic refuses any other: every
# key the anthropic SDK types there, its betas' too (a strict server must not break the
# official client; tests/unit/dialects/test_sdk_fields.py holds these to its TypedDicts).
MESSAGE_KEYS = frozenset({"role", "content", "clear_at", "output_config"})
_TEXT_KEYS = frozenset({"type", "text", "cache_control", "citations"})
BLOCK_KEYS: dict[str, frozenset[str]] = {
    "text": _TEXT_KEYS,
    "image": frozenset({"type", "source", "cache_control", "transformations"}),
    "document": frozenset({"type", "source", "cache_control", "citations", "context",
                           "title"}),
    "tool_use": frozenset({"type", "id", "name", "input", "cache_control", "caller",
                           "toolset_name"}),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error", "cache_control",
                              "toolset_name"}),
    "thinking": frozenset({"type", "thinking", "signature"}),
    "redacted_thinking": frozenset({"type", "data"}),
    "search_result": frozenset({"type", "source", "title", "content", "cache_control",
                                "citations"}),
    "tool_reference": frozenset({"type", "tool_name", "cache_control"}),
    "tool_addition": frozenset({"type", "tool", "cache_control"}),
    "tool_removal": frozenset({"type", "tool", "cache_control"}),
}
#: ``output_config.effort``'s values; a system message's ``output_config`` has no other
#: key (``[api] strict``).
EFFORT_LEVELS = ("low", "medium", "high", "xhigh", "max")
TURN_OUTPUT_KEYS = frozenset({"effort"})
#: A system message's ``clear_at``: ``never`` (the default) shows its text on every
#: request that has it; ``next_user_message`` only until a user message follows it.
CLEAR_AT = ("next_user_message", "never")
#: A tool_addition's or tool_removal's ``tool``: a reference by name, or (additions) a
#: definition by value.
TOOL_CHANGE_KEYS: dict[str, frozenset[str]] = {
    "tool_reference": frozenset({"type", "name"}),
    "tool_definition": frozenset({"type", "definition"}),
}
#: An image's base64 source, a document's text and content sources.
SOURCE_KEYS: dict[str, frozenset[str]] = {
    "base64": frozenset({"type", "media_type", "data"}),
    "text": frozenset({"type", "media_type", "data"}),
    "content": frozenset({"type", "content"}),
}


def _refuse_extra(obj: dict[str, Any], known: frozenset[str], prefix: str) -> None:
    reject_unknown(obj, known, prefix=prefix, message=EXTRA_INPUTS)

_IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}", re.ASCII)


@dataclass(frozen=True, slots=True)
class ToolChange:
    """A change to the tools offered, where the conversation makes it: ``add`` (a tool
    by ``name``, or one defined by value in ``definition``), ``remove`` or ``load`` (a
    ``tool_reference`` in a result: a deferred tool by name)."""

    kind: str  # "add", "remove" or "load"
    name: str | None
    param: str  # where the body says it, for errors about it
    definition: dict[str, Any] | None = None


@dataclass(slots=True)
class _Turn:
    """Consecutive messages of one role: one turn, its blocks with their params."""

    role: str
    index: int  # the first message's index, for errors about the turn as a whole
    blocks: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    #: A system message's text shown only until a user message follows it.
    until_user: bool = False
    #: A system message's ``output_config.effort``: the answers' from there on.
    effort: str | None = None


#: How Claude Code's attribution block starts: ``x-anthropic-billing-header: cc_version=
#: <version>.<3 hex>; cc_entrypoint=<name>;`` (and more fields), the hex a hash of the
#: conversation's first user message, a sub-agent's with ``cc_is_subagent=true;``.
_BILLING_HEADER = "x-anthropic-billing-header:"


def _without_billing_header(text: str) -> str:
    """``text`` less the attribution line it opens with, if any: attribution for
    Anthropic's billing, nothing the model is asked. Rendered first in the prompt, it
    differed between sessions and between a session and its sub-agents, and so kept each
    from the prefix cache of the system prompt and tools behind it."""
    if not text.startswith(_BILLING_HEADER):
        return text
    return text.partition("\n")[2].lstrip("\n")


def parse_system(value: Any, *, strict: bool = False) -> tuple[Message, ...]:
    """The system prompt: a string or text blocks (joined by blank lines), less a leading
    attribution line (``_BILLING_HEADER``); ``strict`` refuses a block's unknown key."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = _without_billing_header(value)
        return (Message("system", value),) if value else ()
    if not isinstance(value, list):
        raise wrong_type("system", "a string or an array of text blocks", value)
    texts = []
    for i, block in enumerate(value):
        p = f"system[{i}]"
        if not isinstance(block, dict):
            raise wrong_type(p, "an object", block)
        kind = required(block, "type", f"{p}.type", str, "a string")
        if kind != "text":
            raise invalid(f"{p}.type", f"Invalid system block type {quoted(kind)}; "
                          "the system prompt is text blocks.")
        if strict:
            _refuse_extra(block, _TEXT_KEYS, f"{p}.")
        texts.append(required(block, "text", f"{p}.text", str, "a string"))
    if texts:
        texts[0] = _without_billing_header(texts[0])
    text = "\n\n".join(t for t in texts if t)
    return (Message("system", text),) if text else ()


def _turns(value: Any, strict: bool) -> list[_Turn]:
    if value is None:
        raise missing("messages")
    if not isinstance(value, list):
        raise wrong_type("messages", "an array", value)
    if not value:
        raise invalid("messages", "'messages' must contain at least one message.")
    turns: list[_Turn] = []
    for i, message in enumerate(value):
        p = f"messages[{i}]"
        if not isinstance(message, dict):
            raise wrong_type(p, "an object", message)
        role = required(message, "role", f"{p}.role", str, "a string")
        if role not in ("user", "assistant", "system"):
            raise not_one_of(f"{p}.role", role, ("user", "assistant", "system"))
        if strict:
            _refuse_extra(message, MESSAGE_KEYS, f"{p}.")
        config = message.get("output_config") if role == "system" else None
        effort = _turn_effort(config, p, strict)
        content = message.get("content")
        if content is None and config is None:
            raise missing(f"{p}.content")
        if content is None:  # a system message that only sets the output (Claude Code's)
            blocks = []
        elif isinstance(content, str):
            blocks = [(f"{p}.content", {"type": "text", "text": content})]
        elif isinstance(content, list):
            if not content and config is None:
                raise invalid(f"{p}.content", f"'{p}.content' must not be empty.")
            blocks = [(f"{p}.content[{k}]", b) for k, b in enumerate(content)]
        else:
            raise wrong_type(f"{p}.content", "a string or an array of content blocks", content)
        clear_at = message.get("clear_at")
        if clear_at is not None:
            if role != "system":
                # Anthropic's words, which Claude Code reads to stop sending it.
                raise invalid(f"{p}.clear_at", "clear_at is only permitted on role: "
                              "\"system\" messages.")
            if clear_at not in CLEAR_AT:
                raise not_one_of(f"{p}.clear_at", clear_at, CLEAR_AT)
        if turns and turns[-1].role == role and role != "system":
            turns[-1].blocks.extend(blocks)
        else:
            turns.append(_Turn(role, i, blocks, clear_at == "next_user_message", effort))
    return turns


def _turn_effort(config: Any, p: str, strict: bool) -> str | None:
    """A system message's ``output_config``: its effort, or None (``format`` is the
    body's alone, as Anthropic's)."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise wrong_type(f"{p}.output_config", "an object", config)
    if "format" in config:
        raise invalid(f"{p}.output_config.format", "'format' is set in the top-level "
                      "'output_config' only.")
    if strict:
        _refuse_extra(config, TURN_OUTPUT_KEYS, f"{p}.output_config.")
    effort = optional(config, "effort", f"{p}.output_config.effort", str, "a string")
    if effort is not None and effort not in EFFORT_LEVELS:
        raise not_one_of(f"{p}.output_config.effort", effort, EFFORT_LEVELS)
    return effort


def _check_answered(calls: tuple[ToolCall, ...], results: Container[str],
                    calls_at: int) -> None:
    for call in calls:
        if call.id not in results:
            raise InvalidRequestError(
                f"tool_use ids were found without tool_result blocks immediately after: "
                f"{quoted(call.id)}. Each tool_use block must have a corresponding "
                "tool_result block in the next message.",
                code="missing_tool_output", param=f"messages[{calls_at}].content")


class Conversation(NamedTuple):
    """``messages`` read: afmd's messages and what else the conversation says."""

    messages: tuple[Message, ...]
    images: bool
    tool_changes: tuple[ToolChange, ...]
    #: The effort the last system message that sets one asks for (Claude Code's per-turn
    #: effort, which keeps the top-level ``output_config`` and its cached prefix as they
    #: were): the answer's, over the body's.
    effort: str | None


def parse_messages(value: Any, *, strict: bool = False) -> Conversation:
    """The conversation as afmd's messages, whether it holds images, the changes it makes
    to the tools offered, and the effort it sets. ``strict`` refuses an unknown key in a
    message, a block or a block's source."""
    out: list[Message] = []
    changes: list[ToolChange] = []
    effort: str | None = None
    images = False
    calls: tuple[ToolCall, ...] = ()  # the previous assistant turn's, to be answered now
    calls_at = 0
    held: list[Message] = []  # system messages sent between calls and their results
    turns = _turns(value, strict)
    last_user = max((at for at, turn in enumerate(turns) if turn.role == "user"), default=-1)
    for at, turn in enumerate(turns):
        if turn.role == "system":
            effort = turn.effort or effort
            text = _system_text(turn, strict, changes)
            if turn.until_user and at < last_user:
                text = ""  # a user message follows: shown no more (its tool changes hold)
            if text:  # between a call and its results it waits for them (templates
                # want a call's results right after it)
                (held if calls else out).append(Message("system", text, in_place=True))
            continue
        if turn.role == "assistant":
            # Two assistant turns are one unless a system message parts them: then the
            # first one's calls went unanswered.
            _check_answered(calls, (), calls_at)
            message = _assistant(turn, strict)
            out.append(message)
            calls, calls_at = message.tool_calls, turn.index
            continue
        texts: list[str] = []
        results: dict[str, Message] = {}
        pictures: list[ImageInput] = []  # this turn's images, placed in its text
        for p, block in turn.blocks:
            kind = _block_type(block, p, strict)
            if kind == "text":
                _add_text(texts, required(block, "text", f"{p}.text", str, "a string"))
            elif kind == "image":
                pictures.append(ImageInput(_image(block, p, strict), f"{p}.source",
                                           len("\n\n".join(texts))))
                images = True
            elif kind == "document":
                texts.append(_document(block, p, strict))
            elif kind == "search_result":
                texts.append(_search_result(block, p, strict))
            elif kind == "tool_result":
                call_id, message, has_image = _tool_result(block, p, strict, changes)
                if not any(c.id == call_id for c in calls):
                    raise InvalidRequestError(
                        f"{p} answers tool_use {quoted(call_id)}, which the assistant turn "
                        "right before it did not make.",
                        code="unknown_tool_call_id", param=f"{p}.tool_use_id")
                if call_id in results:
                    raise InvalidRequestError(
                        f"tool_use {quoted(call_id)} has more than one tool_result.",
                        code="duplicate_tool_output", param=f"{p}.tool_use_id")
                results[call_id] = message
                images = images or has_image
            else:
                raise _unsupported_block(kind, p, "user")
        _check_answered(calls, results, calls_at)
        out.extend(results[call.id] for call in calls)
        out.extend(held)
        held.clear()
        if texts or not results:
            out.append(Message("user", "\n\n".join(texts), has_images=bool(pictures),
                               images=tuple(pictures)))
        calls = ()
    spoken = [turn for turn in turns if turn.role != "system"]
    if not spoken:
        raise InvalidRequestError(
            "The conversation has no user message.", code="missing_user_message",
            param="messages")
    last = spoken[-1]
    if last.role == "assistant":
        if calls:
            raise InvalidRequestError(
                f"tool_use {quoted(calls[0].id)} of the last message has no tool_result; "
                "add a user message with its result.",
                code="missing_tool_output", param=f"messages[{last.index}].content")
        if out[-1].role != "assistant":  # a system message after it: nothing to continue
            raise InvalidRequestError(
                "A prefilled assistant message must be the last message; a system message "
                "follows it.", code="invalid_last_message",
                param=f"messages[{last.index}].role")
        text = out[-1].content or ""
        if text != text.rstrip():  # Anthropic's rule: the answer would start mid-space
            raise invalid(f"messages[{last.index}].content",
                          "final assistant content cannot end with trailing whitespace")
    if not any(m.role == "user" for m in out):
        raise InvalidRequestError(
            "The conversation has no user message.", code="missing_user_message",
            param="messages")
    return Conversation(tuple(out), images, tuple(changes), effort)


def _system_text(turn: _Turn, strict: bool, changes: list[ToolChange]) -> str:
    """A system message's text: its text blocks joined as the top-level ``system``'s are;
    its tool changes go to ``changes``."""
    texts = []
    for p, block in turn.blocks:
        kind = _block_type(block, p, strict)
        if kind == "text":
            texts.append(required(block, "text", f"{p}.text", str, "a string"))
        elif kind in ("tool_addition", "tool_removal"):
            changes.append(_tool_change(block, kind, p, strict))
        else:
            raise invalid(f"{p}.type", f"Content block type {quoted(kind)} is not supported "
                          "in a system message; supported: 'text', 'tool_addition' and "
                          "'tool_removal'.")
    return "\n\n".join(t for t in texts if t)


def _tool_change(block: dict[str, Any], kind: str, p: str, strict: bool) -> ToolChange:
    """A ``tool_addition`` (a tool by name, or defined by value) or ``tool_removal`` (by
    name). MCP references name tools of servers afmd does not connect to: refused."""
    tool = required(block, "tool", f"{p}.tool", dict, "an object")
    ref = required(tool, "type", f"{p}.tool.type", str, "a string")
    allowed = ("tool_reference", "tool_definition") if kind == "tool_addition" \
        else ("tool_reference",)
    if ref not in allowed:
        raise not_one_of(f"{p}.tool.type", ref, allowed)
    if strict:
        _refuse_extra(tool, TOOL_CHANGE_KEYS[ref], f"{p}.tool.")
    if ref == "tool_definition":
        definition = required(tool, "definition", f"{p}.tool.definition", dict, "an object")
        return ToolChange("add", None, f"{p}.tool.definition", definition)
    name = required(tool, "name", f"{p}.tool.name", str, "a string")
    return ToolChange("add" if kind == "tool_addition" else "remove", name,
                      f"{p}.tool.name")


def _block_type(block: Any, p: str, strict: bool) -> str:
    """A block's type (``strict``: its keys checked against the type's, every block of
    every place passing here)."""
    if not isinstance(block, dict):
        raise wrong_type(p, "an object", block)
    kind = block.get("type")
    if type(kind) is not str:
        kind = required(block, "type", f"{p}.type", str, "a string")
    if strict and kind in BLOCK_KEYS:
        _refuse_extra(block, BLOCK_KEYS[kind], f"{p}.")
    return kind


def _unsupported_block(kind: str, p: str, role: str) -> InvalidRequestError:
    supported = ("'text', 'image', 'document', 'search_result' and 'tool_result'"
                 if role == "user"
                 else "'text', 'thinking', 'redacted_thinking' and 'tool_use'")
    return invalid(f"{p}.type", f"Content block type {quoted(kind)} is not supported in "
                   f"{'an' if role == 'assistant' else 'a'} {role} message; supported: "
                   f"{supported}.")


def _assistant(turn: _Turn, strict: bool) -> Message:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for p, block in turn.blocks:
        kind = _block_type(block, p, strict)
        if kind == "text":
            texts.append(required(block, "text", f"{p}.text", str, "a string"))
        elif kind == "thinking":
            thoughts.append(required(block, "thinking", f"{p}.thinking", str, "a string"))
        elif kind == "tool_use":
            call_id = required(block, "id", f"{p}.id", str, "a string")
            if not call_id:
                raise invalid(f"{p}.id", "A tool_use id must not be empty.")
            if any(c.id == call_id for c in calls):
                raise InvalidRequestError(f"The tool_use id {quoted(call_id)} is used more "
                                          "than once.", code="duplicate_tool_call_id",
                                          param=f"{p}.id")
            name = required(block, "name", f"{p}.name", str, "a string")
            arguments = required(block, "input", f"{p}.input", dict, "an object")
            calls.append(ToolCall(call_id, name, orjson.dumps(arguments).decode()))
        elif kind == "redacted_thinking":
            continue  # see the module docstring
        else:
            raise _unsupported_block(kind, p, "assistant")
    text = "\n\n".join(t for t in texts if t)
    return Message("assistant", text or (None if calls else ""), tool_calls=tuple(calls),
                   reasoning="\n\n".join(t for t in thoughts if t) or None)


def _image(block: dict[str, Any], p: str, strict: bool) -> bytes:
    """The image's bytes; only inline base64 images: afmd never fetches a URL on a
    client's behalf."""
    source = required(block, "source", f"{p}.source", dict, "an object")
    kind = required(source, "type", f"{p}.source.type", str, "a string")
    if kind != "base64":
        raise InvalidRequestError(
            f"Image source type {quoted(kind)} is not supported: afmd accepts base64 images "
            "only and does not fetch URLs or files.",
            code="unsupported_image_url", param=f"{p}.source.type")
    if strict:
        _refuse_extra(source, SOURCE_KEYS[kind], f"{p}.source.")
    media = required(source, "media_type", f"{p}.source.media_type", str, "a string")
    if media not in _IMAGE_TYPES:
        raise not_one_of(f"{p}.source.media_type", media, _IMAGE_TYPES)
    data = required(source, "data", f"{p}.source.data", str, "a string")
    try:
        if not _BASE64.fullmatch(data) or len(data) % 4:
            raise binascii.Error
        image = base64.b64decode(data, validate=True)
    except binascii.Error:
        raise InvalidRequestError("The image data is not valid base64.",
                                  code="invalid_image_url", param=f"{p}.source.data") from None
    # Anthropic refuses a picture of another type than declared, whatever the model;
    # read from the header by the decoder a vision model uses (Pillow: only with images).
    from afmd.service import images as image_decoding

    actual = image_decoding.media_type(image)
    if actual is not None and actual != media:
        raise invalid(f"{p}.source.media_type", f"The image was specified using the {media} "
                      f"media type, but the image appears to be a {actual} image.")
    return image


def _document(block: dict[str, Any], p: str, strict: bool) -> str:
    """A document as the text the model reads: its title and context, then its text.

    Plain-text documents (a ``text`` source, or a ``content`` source of text blocks) are
    read; a PDF (``base64``, ``url``) or an uploaded file needs a reader and a fetch afmd
    does not do, and is refused by name rather than dropped. ``citations`` are accepted;
    the answer carries none."""
    source = required(block, "source", f"{p}.source", dict, "an object")
    kind = required(source, "type", f"{p}.source.type", str, "a string")
    if strict and kind in ("text", "content"):
        _refuse_extra(source, SOURCE_KEYS[kind], f"{p}.source.")
    if kind == "text":
        media = optional(source, "media_type", f"{p}.source.media_type", str, "a string")
        if media is not None and media != "text/plain":
            raise not_one_of(f"{p}.source.media_type", media, ("text/plain",))
        body = required(source, "data", f"{p}.source.data", str, "a string")
    elif kind == "content":
        content = source.get("content")
        if isinstance(content, str):
            body = content
        elif isinstance(content, list):
            body = _text_blocks(content, f"{p}.source.content", strict,
                                "A document's content holds text blocks only here ('text').")
        elif content is None:
            raise missing(f"{p}.source.content")
        else:
            raise wrong_type(f"{p}.source.content", "a string or an array of text blocks",
                             content)
    else:
        raise InvalidRequestError(
            f"Document source type {quoted(kind)} is not supported: afmd reads plain-text "
            "documents ('text' and 'content' sources); it has no PDF reader and does not "
            "fetch URLs or files.", code="unsupported_document", param=f"{p}.source.type")
    citations = block.get("citations")
    if citations is not None and not isinstance(citations, dict):
        raise wrong_type(f"{p}.citations", "an object", citations)
    title = optional(block, "title", f"{p}.title", str, "a string")
    context = optional(block, "context", f"{p}.context", str, "a string")
    head = [f"Document: {title}" if title else "Document:"]
    if context:
        head.append(context)
    return "\n".join(head) + "\n\n" + body


def _search_result(block: dict[str, Any], p: str, strict: bool) -> str:
    """A search result as the text the model reads: its title and source, then its text
    blocks (``citations`` accepted; the answer carries none)."""
    title = required(block, "title", f"{p}.title", str, "a string")
    source = required(block, "source", f"{p}.source", str, "a string")
    content = required(block, "content", f"{p}.content", list, "an array of text blocks")
    text = _text_blocks(content, f"{p}.content", strict,
                        "A search result's content holds text blocks only ('text').")
    return f"Search result: {title}\nSource: {source}\n\n" + text


def _text_blocks(content: list[Any], p: str, strict: bool, refusal: str) -> str:
    """Blocks (at ``p``) that may only be text, joined as paragraphs; another kind is a
    400 saying ``refusal``."""
    parts: list[str] = []
    for k, part in enumerate(content):
        q = f"{p}[{k}]"
        if _block_type(part, q, strict) != "text":
            raise invalid(f"{q}.type", refusal)
        _add_text(parts, required(part, "text", f"{q}.text", str, "a string"))
    return "\n\n".join(parts)


def _add_text(texts: list[str], text: str) -> None:
    """A text block joins the paragraphs unless it is blank. Anthropic refuses blank
    blocks, yet Claude Code sends them (an empty hook output or tool answer beside the
    real content): read as nothing, they neither fail its session nor leave an empty
    paragraph or a turn of spaces in the prompt."""
    if text.strip():
        texts.append(text)


def _tool_result(block: dict[str, Any], p: str, strict: bool,
                 changes: list[ToolChange]) -> tuple[str, Message, bool]:
    """A result as afmd's tool message (text only; an error says so first); the tools it
    loads by reference go to ``changes``."""
    call_id = required(block, "tool_use_id", f"{p}.tool_use_id", str, "a string")
    is_error = optional(block, "is_error", f"{p}.is_error", bool, "a boolean")
    content = block.get("content")
    images: list[ImageInput] = []
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts: list[str] = []
        for k, part in enumerate(content):
            q = f"{p}.content[{k}]"
            kind = _block_type(part, q, strict)
            if kind == "text":
                _add_text(texts, required(part, "text", f"{q}.text", str, "a string"))
            elif kind == "image":
                images.append(ImageInput(_image(part, q, strict), f"{q}.source",
                                         len("\n\n".join(texts))))
            elif kind == "document":
                texts.append(_document(part, q, strict))
            elif kind == "search_result":
                texts.append(_search_result(part, q, strict))
            elif kind == "tool_reference":
                # The tool is offered from here on (tools_body.offered_tools); the model
                # reads that it is.
                name = required(part, "tool_name", f"{q}.tool_name", str, "a string")
                changes.append(ToolChange("load", name, f"{q}.tool_name"))
                texts.append(f"Tool loaded: {name}")
            else:
                raise invalid(f"{q}.type", f"Content block type {quoted(kind)} is not "
                              "supported in a tool_result; supported: 'text', 'image', "
                              "'document', 'search_result' and 'tool_reference'.")
        text = "\n\n".join(texts)
    else:
        raise wrong_type(f"{p}.content", "a string or an array of content blocks", content)
    if is_error:
        prefix = "Error: " if text else "Error"
        text = prefix + text
        images = [ImageInput(i.data, i.param, i.offset + len(prefix)) for i in images]
    message = Message("tool", text, tool_call_id=call_id, has_images=bool(images),
                      images=tuple(images))
    return call_id, message, bool(images)
