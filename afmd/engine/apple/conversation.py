"""A chat request mapped onto what Apple's framework takes: plain data, made before a slot.

The framework keeps a conversation as a session: instructions, a transcript of earlier
turns, then a prompt it answers. A chat request carries the whole conversation every
time, so each request gets a fresh session built from it:

- every ``system`` and ``developer`` message, wherever it stands, joins the operator's
  instructions (in order) as the session's instructions;
- the user messages after the last assistant or tool message are the prompt (their text
  and ``data:`` images, in order); when the conversation ends with tool outputs, the prompt
  is empty and the model continues from them;
- everything before is the transcript: user turns, assistant turns (their text, then their
  tool calls as an entry of their own, with the client's call ids) and tool outputs (in the
  calls' order, which the request's validation already put them in), as the framework's
  own transcript JSON (``Transcript.from_dict``) has them;
- the request's tools become framework tools (:mod:`afmd.engine.apple.tools`), their
  parameters rewritten as the framework's schemas (:mod:`afmd.engine.apple.schemas`);
  ``tool_choice`` ``none`` gives the model none, ``allowed_tools`` only those, and
  ``required`` or a named function (on the request's first step only, as for every model)
  is a structured answer that must be calls, since the framework has no such choice;
- ``response_format`` ``json_schema`` is a structured answer to the converted schema,
  ``json_object`` an instruction, checked afterwards;
- ``temperature`` 0 is greedy decoding, anything else random sampling at that temperature,
  with ``top_p`` (or afmd's ``top_k``) and ``seed``; ``max_tokens`` is the response's limit.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from afmd.core.request import ChatRequest, Message
from afmd.engine.apple import schemas
from afmd.engine.generation import VANISHING
from afmd.errors import InvalidRequestError

#: What a ``json_object`` request adds to the instructions (the framework has no such mode).
JSON_OBJECT_INSTRUCTION = (
    "Answer with one JSON object and nothing else: no code fences, no text before or after it."
)


@dataclass(frozen=True, slots=True)
class PromptImage:
    """An image part of the prompt: its bytes (a ``data:`` URL's), where the client sent it."""

    data: bytes
    param: str


@dataclass(frozen=True, slots=True)
class ToolDef:
    """A tool as the framework is given it."""

    name: str
    description: str
    schema: dict[str, Any]  # the framework's schema of its arguments
    parameters: Any  # the client's schema, to read the arguments back (schemas.restore)
    server: bool = False  # the operator's: afmd runs it and the model goes on


@dataclass(frozen=True, slots=True)
class Sampling:
    greedy: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int | None


@dataclass(frozen=True, slots=True)
class Forced:
    """A first step that must call tools: the calls are the answer, to this schema."""

    schema: dict[str, Any]
    tools: tuple[ToolDef, ...]


@dataclass(frozen=True, slots=True)
class SystemTurn:
    """One generation of Apple's model: everything it is given, and how to read it back."""

    instructions: str
    history: tuple[dict[str, Any], ...]  # transcript entries before the prompt
    prompt: tuple[str | PromptImage, ...]  # in order; ("",): continue after tool outputs
    tools: tuple[ToolDef, ...] = ()  # what the model may call itself
    forced: Forced | None = None
    answer_schema: dict[str, Any] | None = None  # json_schema, as the framework's
    answer_parameters: Any = None  # the client's json_schema (schemas.restore)
    json_object: bool = False
    sampling: Sampling = field(default_factory=lambda: Sampling(False, 1.0, 1.0, 0, None))
    max_tokens: int | None = None
    #: ``max_tokens`` is a cap the context window may lower (Anthropic's), not a demand.
    max_tokens_shrinks: bool = False
    parallel_calls: bool = True
    downgraded: bool = False  # a schema feature is described, not enforced

    @property
    def prompt_text(self) -> str:
        return "".join(p for p in self.prompt if isinstance(p, str))

    @property
    def images(self) -> tuple[PromptImage, ...]:
        return tuple(p for p in self.prompt if isinstance(p, PromptImage))

    def transcript(self) -> dict[str, Any]:
        """The session's transcript as ``Transcript.from_dict`` takes it: the instructions
        entry (with the tools offered, as the framework writes them) and the history."""
        entry: dict[str, Any] = {"id": _id(), "role": "instructions",
                                 "contents": [_text(self.instructions)]
                                 if self.instructions else []}
        if self.tools:
            entry["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.schema}}
                for t in self.tools]
        return {"version": 1, "type": "FoundationModels.Transcript",
                "transcript": {"entries": [entry, *self.history]}}

    def estimate_text(self) -> str:
        """Everything the model reads, as text: what token estimates are made from."""
        parts = [self.instructions, self.prompt_text]
        parts += [json.dumps(entry) for entry in self.history]
        parts += [json.dumps(t.schema) for t in self.tools]
        if self.forced is not None:
            parts.append(json.dumps(self.forced.schema))
        if self.answer_schema is not None:
            parts.append(json.dumps(self.answer_schema))
        return "\n".join(p for p in parts if p)


def _id() -> str:
    return str(uuid.uuid4()).upper()


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "id": _id(), "text": text}


def sampling_of(request: ChatRequest) -> Sampling:
    return Sampling(greedy=(request.temperature < VANISHING or request.top_k == 1
                            or request.top_p < VANISHING),
                    temperature=request.temperature, top_p=request.top_p,
                    top_k=request.top_k, seed=request.seed)


def instructions_of(request: ChatRequest, operator: str) -> str:
    parts = [operator] if operator else []
    parts += [m.content for m in request.messages
              if m.role in ("system", "developer") and m.content]
    if request.response_format is not None and request.response_format.kind == "json_object":
        parts.append(JSON_OBJECT_INSTRUCTION)
    return "\n\n".join(parts)


def split_conversation(
    messages: tuple[Message, ...],
) -> tuple[list[tuple[int, Message]], list[tuple[int, Message]]]:
    """(history, prompt): the user messages after the last assistant or tool message are
    the prompt; none when it ends with tool outputs. System messages are neither."""
    turns = [(i, m) for i, m in enumerate(messages) if m.role not in ("system", "developer")]
    cut = len(turns)
    while cut > 0 and turns[cut - 1][1].role == "user":
        cut -= 1
    return turns[:cut], turns[cut:]


def history_entries(history: list[tuple[int, Message]]) -> tuple[dict[str, Any], ...]:
    """Earlier turns as transcript entries (a run of user messages is one entry; images
    of earlier turns are not in it: the transcript's JSON has no image content)."""
    entries: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for _, message in history:
        if message.role == "user":
            text = message.content or ""
            last = entries[-1] if entries else None
            if last is not None and last["role"] == "user":
                last["contents"][0]["text"] += "\n\n" + text
            else:
                entries.append({"id": _id(), "role": "user", "options": {},
                                "contents": [_text(text)]})
        elif message.role == "assistant":
            # The framework writes a turn's tool calls as an entry of their own (role
            # "response", its id and "toolCalls" only: Transcript.ToolCalls), apart from a
            # response's text: one entry holding both is a shape it never writes.
            if message.content or not message.tool_calls:
                entries.append({"id": _id(), "role": "response", "assets": [],
                                "contents": [_text(message.content)]
                                if message.content else []})
            if message.tool_calls:
                entries.append({"id": _id(), "role": "response", "toolCalls": [
                    {"id": c.id, "name": c.name, "arguments": c.arguments}
                    for c in message.tool_calls]})
                names.update((c.id, c.name) for c in message.tool_calls)
        elif message.role == "tool":
            call = message.tool_call_id or ""
            entries.append({"id": _id(), "role": "tool", "toolCallID": call,
                            "toolName": names.get(call, ""),
                            "contents": [_text(message.content or "")]})
    return tuple(entries)


def prompt_parts(prompt: list[tuple[int, Message]]) -> tuple[str | PromptImage, ...]:
    """The prompt's text and images in the order the client sent them."""
    parts: list[str | PromptImage] = []
    for n, (_, message) in enumerate(prompt):
        text = message.content or ""
        if n:
            parts.append("\n\n")
        at = 0
        for image in message.images:
            if image.offset > at:
                parts.append(text[at:image.offset])
                at = image.offset
            parts.append(PromptImage(image.data, image.param))
        if at < len(text):
            parts.append(text[at:])
    merged: list[str | PromptImage] = []
    for part in parts:
        if isinstance(part, str) and merged and isinstance(merged[-1], str):
            merged[-1] += part
        else:
            merged.append(part)
    return tuple(merged) or ("",)


def _tool_defs(request: ChatRequest, allowed: set[str] | None,
               server: frozenset[str]) -> tuple[tuple[ToolDef, ...], bool]:
    defs: list[ToolDef] = []
    downgraded = False
    for i, tool in enumerate(request.tools):
        if allowed is not None and tool.name not in allowed:
            continue
        try:
            converted = schemas.convert_parameters(tool.parameters,
                                                   title=schemas.type_name(tool.name))
        except schemas.SchemaError as exc:
            raise InvalidRequestError(f"Invalid JSON schema: {exc}", code="invalid_schema",
                                      param=tool.parameters_param(i)) from None
        downgraded = downgraded or converted.downgraded
        defs.append(ToolDef(tool.name, tool.description or "", converted.schema,
                            tool.parameters, server=tool.name in server))
    return tuple(defs), downgraded


def system_turn(
    request: ChatRequest,
    *,
    instructions: str,
    first_step: bool,
    server_tools: frozenset[str] = frozenset(),
) -> SystemTurn:
    """The framework's inputs for ``request`` (400 ``invalid_schema`` for a schema it
    cannot be given at all)."""
    history, prompt = split_conversation(request.messages)
    choice = request.tool_choice
    mode = choice.mode if first_step else "auto"
    allowed_names = choice.allowed if (first_step or not choice.named) else None
    allowed = set(allowed_names) if allowed_names is not None else None
    tools: tuple[ToolDef, ...] = ()
    forced: Forced | None = None
    downgraded = False
    if request.tools and choice.mode != "none":
        defs, downgraded = _tool_defs(request, allowed, server_tools)
        if mode == "required" and defs:
            calls = schemas.calls_schema([(d.name, d.parameters) for d in defs],
                                         parallel=request.parallel_tool_calls)
            forced = Forced(calls.schema, defs)
        else:
            tools = defs
    answer_schema = None
    answer_parameters = None
    response_format = request.response_format
    if response_format is not None and response_format.kind == "json_schema" \
            and forced is None:
        try:
            converted = schemas.convert(response_format.schema,
                                        title=response_format.name or "Response")
        except schemas.SchemaError as exc:
            raise InvalidRequestError(f"Invalid JSON schema: {exc}", code="invalid_schema",
                                      param="response_format.json_schema.schema") from None
        answer_schema = converted.schema
        answer_parameters = response_format.schema
        downgraded = downgraded or converted.downgraded
    return SystemTurn(
        instructions=instructions_of(request, instructions),
        history=history_entries(history),
        prompt=prompt_parts(prompt),
        tools=tools,
        forced=forced,
        answer_schema=answer_schema,
        answer_parameters=answer_parameters,
        json_object=response_format is not None and response_format.kind == "json_object"
        and forced is None,
        sampling=sampling_of(request),
        max_tokens=request.max_tokens,
        max_tokens_shrinks=request.max_tokens_shrinks,
        parallel_calls=request.parallel_tool_calls,
        downgraded=downgraded,
    )


__all__ = ["JSON_OBJECT_INSTRUCTION", "Forced", "PromptImage", "Sampling", "SystemTurn",
           "ToolDef", "history_entries", "instructions_of", "prompt_parts", "sampling_of",
           "split_conversation", "system_turn"]
