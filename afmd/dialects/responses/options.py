"""The fields of a Responses body that shape the turn beyond its input: tools and
``tool_choice``, ``text.format``, ``reasoning``, ``include`` and ``metadata``, each checked
and also returned in the form the response object echoes.

Tools as OpenAI defines them: ``function`` tools (flat), ``namespace`` tools (a group of
function and custom tools, offered to the model as their functions; a call names its
namespace), ``custom`` tools (free-form text input, e.g. Codex's ``apply_patch``: offered
as a function of one string, its call returned as the text), and the tools OpenAI's models
call for the client to run (``shell``, ``local_shell``, ``apply_patch``: offered as fixed
functions, :mod:`afmd.dialects.responses.client_tools`). Hosted tools afmd cannot run are left
out of the prompt and named (``tools[i]``), refused only under ``[api] strict``.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from afmd.core.request import ResponseFormat, ToolChoice, ToolSpec
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
from afmd.dialects.responses import client_tools
from afmd.dialects.responses.client_tools import ClientTool
from afmd.errors import InvalidRequestError
from afmd.grammar.lark_input import LARK_KEY
from afmd.grammar.lark_regex import NotRegular, check_lark, lark_regex

#: OpenAI's hosted tools (and any other type that is not a function, a namespace of
#: functions, a custom tool or a client-run tool; and a ``shell`` in OpenAI's container):
#: afmd cannot run them, so they are left out of the prompt and named in
#: ``X-AFM-Ignored-Fields`` as ``tools[i]`` (``[api] strict``: a 400).
HOSTED_TOOLS = frozenset({
    "file_search", "computer", "computer_use_preview", "web_search", "web_search_2025_08_26",
    "web_search_preview", "web_search_preview_2025_03_11", "mcp", "code_interpreter",
    "programmatic_tool_calling", "image_generation", "tool_search",
})
TOOL_TYPES = ("function", "namespace", "custom", *client_tools.KINDS)
GRAMMAR_SYNTAXES = ("lark", "regex")
#: The string format that marks a custom tool's input as a recursive lark grammar (held
#: under ``LARK_KEY``): the call grammars write it as rules; a path that does not knows no
#: such format, so the turn is built lenient there (downgraded).
LARK_FORMAT = "x-afmd-lark"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
SUMMARIES = ("auto", "concise", "detailed")
#: The ``include`` entry that asks for output text's log-probabilities.
LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs", "reasoning.encrypted_content",
    "message.output_text.logprobs",
)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}", re.ASCII)

# The keys ``[api] strict`` admits in each object, as OpenAI refuses any other: the openai
# SDK's (tests/unit/dialects/test_sdk_fields.py holds them to its TypedDicts). A hosted
# tool is never read, so never held to a set.
_TOOL_KEYS = frozenset({"type", "name", "description", "allowed_callers", "async",
                        "defer_loading"})
TOOL_KEYS: dict[str, frozenset[str]] = {
    "function": _TOOL_KEYS | {"parameters", "strict", "output_schema"},
    "custom": _TOOL_KEYS | {"format"},
    "namespace": frozenset({"type", "name", "description", "tools"}),
    **client_tools.TOOL_KEYS,
}
CUSTOM_FORMAT_KEYS: dict[str, frozenset[str]] = {
    "text": frozenset({"type"}),
    "grammar": frozenset({"type", "syntax", "definition"}),
}
#: A named choice (``function`` or ``custom``) and ``allowed_tools``; the latter's entries
#: the SDK types as any object, so they are read, not held to a set.
CHOICE_KEYS = frozenset({"type", "name"})
#: A client-run tool's choice (``{"type": "shell"}``), named by its type.
CLIENT_CHOICE_KEYS = frozenset({"type"})
ALLOWED_CHOICE_KEYS = frozenset({"type", "mode", "tools"})
TEXT_FORMAT_KEYS: dict[str, frozenset[str]] = {
    "text": frozenset({"type"}),
    "json_object": frozenset({"type"}),
    "json_schema": frozenset({"type", "name", "schema", "strict", "description"}),
}


def _unsupported_tool(param: str, kind: object) -> InvalidRequestError:
    return InvalidRequestError(
        f"The tool type {quoted(kind)} is a hosted tool, which afmd cannot run; 'function', "
        "'namespace', 'custom' and the client-run 'shell' (without a container), "
        "'local_shell' and 'apply_patch' tools are supported (without [api] strict, other "
        "tools are left out and named in X-AFM-Ignored-Fields).", code="unsupported_tool",
        param=param)


@dataclass(frozen=True, slots=True)
class Tools:
    """A body's ``tools``: what the model is offered (each namespace's, custom and
    client-run tool as a function), the echo, the hosted tools left out, and how each
    offered name is called back (a custom tool's call is its text, a namespaced function's
    names its namespace, a client-run tool's is its own item)."""

    specs: tuple[ToolSpec, ...] = ()
    echo: tuple[dict[str, Any], ...] = ()
    ignored: tuple[str, ...] = ()
    custom: frozenset[str] = frozenset()
    namespaces: dict[str, str] = field(default_factory=dict)
    client: dict[str, ClientTool] = field(default_factory=dict)


def custom_parameters(format_: dict[str, Any] | None) -> dict[str, Any]:
    """A custom tool as the function the model is offered: one string, its free-form
    input. A ``regex`` grammar is that string's pattern, enforced as any schema is; so is a
    ``lark`` grammar, as the regex of its language (:mod:`afmd.grammar.lark_regex`). A
    lark grammar that is not regular (it recurses) has no regex: the string carries the
    grammar itself, which each family's call grammar writes as rules
    (:mod:`afmd.grammar.lark_input`); what those rules cannot carry is generated
    best-effort, and the turn says ``X-Grammar-Constraints: downgraded``."""
    text: dict[str, Any] = {"type": "string"}
    if format_ is not None and format_.get("syntax") == "regex":
        # A JSON schema pattern searches; a custom tool's regex is the whole input.
        text["pattern"] = f"^(?:{format_['definition']})$"
    elif format_ is not None and format_.get("syntax") == "lark":
        definition = format_["definition"]
        try:
            pattern = lark_regex(definition)
        except NotRegular:
            # The grammar once: the model reads it where the call grammar does.
            text.update({"description": f"Text in the lark grammar {LARK_KEY}.",
                         "format": LARK_FORMAT, LARK_KEY: definition})
        else:
            text.update({"description": "Text in this lark grammar:\n" + definition,
                         "pattern": f"^(?:{pattern})$"})
    return {"type": "object", "properties": {"input": text}, "required": ["input"],
            "additionalProperties": False}


def custom_format(value: Any, p: str, strict: bool) -> dict[str, Any] | None:
    """A custom tool's ``format`` checked, in the Responses API's flat shape (chat's nests
    its grammar, :mod:`afmd.dialects.openai.custom_tools`); None for free text."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise wrong_type(p, "an object", value)
    kind = required(value, "type", f"{p}.type", str, "a string")
    if strict and kind in CUSTOM_FORMAT_KEYS:
        reject_unknown(value, CUSTOM_FORMAT_KEYS[kind], prefix=f"{p}.")
    if kind == "text":
        return None
    if kind != "grammar":
        raise not_one_of(f"{p}.type", kind, ("text", "grammar"))
    syntax = required(value, "syntax", f"{p}.syntax", str, "a string")
    if syntax not in GRAMMAR_SYNTAXES:
        raise not_one_of(f"{p}.syntax", syntax, GRAMMAR_SYNTAXES)
    definition = required(value, "definition", f"{p}.definition", str, "a string")
    if syntax == "regex":
        try:
            re.compile(definition)
        except re.error as exc:
            raise invalid(f"{p}.definition", f"The regex does not compile: {exc}.") from None
    elif (complaint := check_lark(definition)) is not None:
        raise invalid(f"{p}.definition", f"The lark grammar does not compile: {complaint}")
    return {"type": "grammar", "syntax": syntax, "definition": definition}


def _client_name_taken(name: str, client_at: str, param: str) -> InvalidRequestError:
    """A function or custom tool (its name at ``param``) named as a client-run tool offered
    beside it (its type at ``client_at``): the model calls both by that name, so the calls
    could not be told apart."""
    return invalid(param, f"The tool name '{name}' is the name the '{name}' tool "
                   f"({client_at.removesuffix('.type')}) is offered to the model under; "
                   "rename this tool.")


def _function_or_custom(tool: dict[str, Any], p: str, kind: str, specs: list[ToolSpec],
                        client: Collection[str], strict: bool
                        ) -> tuple[ToolSpec, dict[str, Any]]:
    if strict:
        reject_unknown(tool, TOOL_KEYS[kind], prefix=f"{p}.")
    name = required(tool, "name", f"{p}.name", str, "a string")
    if _NAME.fullmatch(name) is None:
        raise invalid(f"{p}.name", f"Invalid tool name {quoted(name)}: use 1-64 "
                      "characters among a-z, A-Z, 0-9, _ and -.")
    taken = next((s for s in specs if s.name == name), None)
    if taken is not None:
        if name in client:
            raise _client_name_taken(name, taken.name_param(0), f"{p}.name")
        raise invalid(f"{p}.name", f"Duplicate tool name '{name}'.")
    description = optional(tool, "description", f"{p}.description", str, "a string")
    if kind == "custom":
        format_ = custom_format(tool.get("format"), f"{p}.format", strict)
        echo: dict[str, Any] = {"type": "custom", "name": name, "description": description,
                                "format": format_ or {"type": "text"}}
        return ToolSpec(name, description, custom_parameters(format_), True,
                        declared_at=f"{p}.format.definition", named_at=f"{p}.name",
                        custom=True), echo
    parameters = optional(tool, "parameters", f"{p}.parameters", dict, "an object")
    exact = optional(tool, "strict", f"{p}.strict", bool, "a boolean")
    exact = True if exact is None else exact  # the Responses API's default
    return ToolSpec(name, description, parameters, exact,
                    declared_at=f"{p}.parameters", named_at=f"{p}.name"), {
        "type": "function", "name": name, "description": description,
        "parameters": parameters, "strict": exact}


def parse_tools(value: Any, *, strict: bool = False) -> Tools:
    """Function tools (flat, as Responses defines them), namespaces of them, custom tools;
    hosted tools left out (``strict``: refused, as is an unknown key in the others)."""
    if value is None:
        return Tools()
    if not isinstance(value, list):
        raise wrong_type("tools", "an array", value)
    specs: list[ToolSpec] = []
    echo: list[dict[str, Any]] = []
    ignored: list[str] = []
    custom: set[str] = set()
    namespaces: dict[str, str] = {}
    client: dict[str, ClientTool] = {}
    for i, tool in enumerate(value):
        p = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise wrong_type(p, "an object", tool)
        kind = tool.get("type")
        if kind is None:
            raise missing(f"{p}.type")
        if not isinstance(kind, str):
            raise wrong_type(f"{p}.type", "a string", kind)
        if kind not in TOOL_TYPES or client_tools.is_hosted(tool):
            if strict:
                raise _unsupported_tool(p, kind)
            ignored.append(p)
            continue
        if kind in client_tools.KINDS:
            if kind in client:
                raise invalid(f"{p}.type", f"Duplicate tool '{kind}'.")
            spec, offered, shown = client_tools.parse_tool(tool, p, strict)
            taken = next((s for s in specs if s.name == spec.name), None)
            if taken is not None:
                raise _client_name_taken(spec.name, f"{p}.type", taken.name_param(0))
            specs.append(spec)
            echo.append(shown)
            client[spec.name] = offered
            continue
        if kind != "namespace":
            spec, shown = _function_or_custom(tool, p, kind, specs, client, strict)
            specs.append(spec)
            echo.append(shown)
            if kind == "custom":
                custom.add(spec.name)
            continue
        if strict:
            reject_unknown(tool, TOOL_KEYS["namespace"], prefix=f"{p}.")
        namespace = required(tool, "name", f"{p}.name", str, "a string")
        if _NAME.fullmatch(namespace) is None:
            raise invalid(f"{p}.name", f"Invalid namespace name {quoted(namespace)}: use "
                          "1-64 characters among a-z, A-Z, 0-9, _ and -.")
        inner = required(tool, "tools", f"{p}.tools", list, "an array")
        members = []
        for k, member in enumerate(inner):
            q = f"{p}.tools[{k}]"
            if not isinstance(member, dict):
                raise wrong_type(q, "an object", member)
            member_kind = required(member, "type", f"{q}.type", str, "a string")
            if member_kind not in ("function", "custom"):
                raise not_one_of(f"{q}.type", member_kind, ("function", "custom"))
            spec, shown = _function_or_custom(member, q, member_kind, specs, client,
                                              strict)
            specs.append(spec)
            members.append(shown)
            namespaces[spec.name] = namespace
            if member_kind == "custom":
                custom.add(spec.name)
        echo.append({"type": "namespace", "name": namespace,
                     "description": optional(tool, "description", f"{p}.description", str,
                                             "a string") or "",
                     "tools": members})
    return Tools(tuple(specs), tuple(echo), tuple(ignored), frozenset(custom), namespaces,
                 client)


def _choice_name(value: Any, param: str, names_: set[str], client: Collection[str],
                 strict: bool) -> str:
    if not isinstance(value, dict):
        raise wrong_type(param, "an object", value)
    # A string before any lookup: an object or array here is unhashable.
    kind = required(value, "type", f"{param}.type", str, "a string")
    if kind in client_tools.KINDS:  # named by its type alone
        if strict:
            reject_unknown(value, CLIENT_CHOICE_KEYS, prefix=f"{param}.")
        if kind not in client:
            raise InvalidRequestError(
                f"'{param}' names the {quoted(kind)} tool, which is not in 'tools'.",
                code="unknown_tool", param=f"{param}.type")
        return kind
    if kind not in ("function", "custom"):
        if kind in HOSTED_TOOLS:
            raise _unsupported_tool(f"{param}.type", kind)
        raise not_one_of(f"{param}.type", kind, ("function", "custom"))
    if strict:
        reject_unknown(value, CHOICE_KEYS, prefix=f"{param}.")
    name = required(value, "name", f"{param}.name", str, "a string")
    if name not in names_:
        raise InvalidRequestError(
            f"'{param}' names the tool {quoted(name)}, which is not in 'tools'.",
            code="unknown_tool", param=f"{param}.name")
    return name


def parse_tool_choice(
    value: Any, tools: tuple[ToolSpec, ...], server_tools: Collection[str], *,
    strict: bool = False, left_out: Sequence[str] = (), client: Collection[str] = (),
) -> tuple[ToolChoice, str | dict[str, Any]]:
    """``tool_choice`` against the tools on offer, and its echo (``strict``: no unknown
    key in it; ``left_out``: the params of the hosted tools not offered, which a
    ``required`` choice cannot call; ``client``: the client-run tools offered, which a
    choice names by type)."""
    names_ = {t.name for t in tools} | set(server_tools)
    custom = {t.name for t in tools if t.custom}
    if value is None:
        return ToolChoice("auto" if names_ else "none"), "auto"
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise not_one_of("tool_choice", value, ("none", "auto", "required"))
        if value == "required" and not names_:
            if left_out:
                raise invalid("tool_choice", "'tool_choice' is 'required' but afmd can call "
                              "none of 'tools': hosted tools are left out ("
                              + ", ".join(left_out) + ").")
            raise invalid("tool_choice", "'tool_choice' is 'required' but no 'tools' are given.")
        return ToolChoice(value if names_ else "none"), value
    if not isinstance(value, dict):
        raise wrong_type("tool_choice", "a string or an object", value)
    kind = required(value, "type", "tool_choice.type", str, "a string")
    if kind == "allowed_tools":
        if strict:
            reject_unknown(value, ALLOWED_CHOICE_KEYS, prefix="tool_choice.")
        mode = required(value, "mode", "tool_choice.mode", str, "a string")
        if mode not in ("auto", "required"):
            raise not_one_of("tool_choice.mode", mode, ("auto", "required"))
        listed = value.get("tools")
        if listed is None:
            raise missing("tool_choice.tools")
        if not isinstance(listed, list) or not listed:
            raise invalid("tool_choice.tools", "'tool_choice.tools' must be a non-empty array.")
        allowed = [_choice_name(t, f"tool_choice.tools[{i}]", names_, client, False)
                   for i, t in enumerate(listed)]
        return ToolChoice(mode, tuple(dict.fromkeys(allowed))), {
            "type": "allowed_tools", "mode": mode,
            "tools": [_choice_echo(t["type"], n, custom) for t, n in zip(listed, allowed,
                                                                          strict=True)]}
    name = _choice_name(value, "tool_choice", names_, client, strict)
    echo = {"type": value["type"]} if value["type"] in client_tools.KINDS else \
        {"type": value["type"], "name": name}
    return ToolChoice("required", (name,), named=True), echo


def _choice_echo(kind: str, name: str, custom: Collection[str]) -> dict[str, Any]:
    if kind in client_tools.KINDS:
        return {"type": kind}
    return {"type": "custom" if name in custom else "function", "name": name}


def parse_text(
    value: Any, *, strict: bool = False
) -> tuple[ResponseFormat | None, dict[str, Any]]:
    """``text`` (its ``format`` enforced by the grammar, as chat's ``response_format``);
    ``strict`` refuses an unknown key in ``text.format`` too."""
    if value is None:
        return None, {"format": {"type": "text"}, "verbosity": "medium"}
    if not isinstance(value, dict):
        raise wrong_type("text", "an object", value)
    reject_unknown(value, frozenset({"format", "verbosity"}), prefix="text.")
    verbosity = value.get("verbosity") or "medium"
    if verbosity not in ("low", "medium", "high"):
        raise not_one_of("text.verbosity", verbosity, ("low", "medium", "high"))
    spec = value.get("format")
    if spec is None:
        return None, {"format": {"type": "text"}, "verbosity": verbosity}
    if not isinstance(spec, dict):
        raise wrong_type("text.format", "an object", spec)
    kind = spec.get("type")
    if kind is None:
        raise missing("text.format.type")
    if strict and type(kind) is str and kind in TEXT_FORMAT_KEYS:
        reject_unknown(spec, TEXT_FORMAT_KEYS[kind], prefix="text.format.")
    if kind == "text":
        return None, {"format": {"type": "text"}, "verbosity": verbosity}
    if kind == "json_object":
        return ResponseFormat("json_object"), {"format": {"type": "json_object"},
                                               "verbosity": verbosity}
    if kind != "json_schema":
        raise not_one_of("text.format.type", kind, ("text", "json_object", "json_schema"))
    name = required(spec, "name", "text.format.name", str, "a string")
    if _NAME.fullmatch(name) is None:
        raise invalid("text.format.name", f"Invalid name {quoted(name)}: use 1-64 characters "
                      "among a-z, A-Z, 0-9, _ and -.")
    schema = required(spec, "schema", "text.format.schema", dict, "an object")
    exact = optional(spec, "strict", "text.format.strict", bool, "a boolean")
    description = optional(spec, "description", "text.format.description", str, "a string")
    echo: dict[str, Any] = {"type": "json_schema", "name": name, "schema": schema,
                            "strict": bool(exact)}
    if description is not None:
        echo["description"] = description
    return (ResponseFormat("json_schema", schema, name, bool(exact)),
            {"format": echo, "verbosity": verbosity})


def parse_reasoning(value: Any) -> dict[str, Any]:
    """``reasoning``: ``effort`` maps like chat's ``reasoning_effort``; the rest is echoed."""
    if value is None:
        return {"effort": None, "summary": None}
    if not isinstance(value, dict):
        raise wrong_type("reasoning", "an object", value)
    reject_unknown(value, frozenset({"effort", "summary", "generate_summary", "context",
                                     "mode"}), prefix="reasoning.")
    effort = value.get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise not_one_of("reasoning.effort", effort, REASONING_EFFORTS)
    summary = value.get("summary")
    for key in ("summary", "generate_summary"):
        given = value.get(key)
        if given is not None and given not in SUMMARIES:
            raise not_one_of(f"reasoning.{key}", given, SUMMARIES)
    for key in ("context", "mode"):
        optional(value, key, f"reasoning.{key}", str, "a string")
    return {"effort": effort, "summary": summary or value.get("generate_summary")}


def parse_include(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise wrong_type("include", "an array", value)
    for i, entry in enumerate(value):
        if entry not in INCLUDABLE:
            if not isinstance(entry, str):
                raise wrong_type(f"include[{i}]", "a string", entry)
            raise not_one_of(f"include[{i}]", entry, INCLUDABLE)
    return tuple(value)
