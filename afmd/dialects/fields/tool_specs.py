"""The tools a request offers, which of them the model may or must call, and the shape
its answer must take.

These become grammars: a tool name or schema that slipped through unchecked would fail
later, deep in grammar compilation, with an error naming nothing the client sent. Each
problem is named here by its exact param instead.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from afmd.core.request import ResponseFormat, ToolChoice, ToolSpec
from afmd.dialects.fields.checks import (
    invalid,
    missing,
    optional,
    quoted,
    reject_unknown,
    required,
    wrong_type,
)
from afmd.dialects.fields.messages import function_object
from afmd.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class ToolNames:
    """What a dialect takes as a tool's name, and how its refusal puts the rule."""

    pattern: re.Pattern[str]
    rule: str


#: OpenAI's rule for a function name: 1-64 of a-z, A-Z, 0-9, _ and -.
OPENAI_TOOL_NAMES = ToolNames(re.compile(r"[A-Za-z0-9_-]{1,64}", re.ASCII),
                              "1-64 characters among a-z, A-Z, 0-9, _ and -")

# The keys ``[api] strict`` admits in each object: the openai SDK's (held to its TypedDicts
# by tests/unit/dialects/test_sdk_fields.py), as OpenAI refuses any other.
TOOL_KEYS = frozenset({"type", "function"})
FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
CUSTOM_TOOL_KEYS = frozenset({"type", "custom"})
CUSTOM_KEYS = frozenset({"name", "description", "format"})
#: A named choice: chat's ``function`` object, or the flat Responses shape afmd also reads.
NAMED_CHOICE_KEYS = frozenset({"type", "function", "name"})
CHOICE_FUNCTION_KEYS = frozenset({"name"})
NAMED_CUSTOM_CHOICE_KEYS = frozenset({"type", "custom"})
ALLOWED_CHOICE_KEYS = frozenset({"type", "allowed_tools"})
ALLOWED_TOOLS_KEYS = frozenset({"mode", "tools"})
RESPONSE_FORMAT_KEYS: dict[str, frozenset[str]] = {
    "text": frozenset({"type"}),
    "json_object": frozenset({"type"}),
    "json_schema": frozenset({"type", "json_schema"}),
}
JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})

#: A custom tool's ``format`` (its value, its param, strict) -> the parameters of the
#: one-string function it is offered as; the dialect that serves custom tools supplies it
#: (reading a grammar is above this layer).
CustomFormat = Callable[[Any, str, bool], dict[str, Any]]


def _check_name(name: str, param: str, seen: set[str],
                names: ToolNames = OPENAI_TOOL_NAMES) -> None:
    if names.pattern.fullmatch(name) is None:
        raise invalid(param, f"Invalid tool name {quoted(name)}: use {names.rule}.")
    if name in seen:
        raise invalid(param, f"Duplicate tool name '{name}'.")
    seen.add(name)


def _custom_tool(tool: dict[str, Any], p: str, custom: CustomFormat, seen: set[str],
                 strict: bool) -> ToolSpec:
    """Chat's ``{"type": "custom", "custom": {"name", "description", "format"}}``."""
    if strict:
        reject_unknown(tool, CUSTOM_TOOL_KEYS, prefix=f"{p}.")
    spec = required(tool, "custom", f"{p}.custom", dict, "an object")
    if strict:
        reject_unknown(spec, CUSTOM_KEYS, prefix=f"{p}.custom.")
    name = required(spec, "name", f"{p}.custom.name", str, "a string")
    _check_name(name, f"{p}.custom.name", seen)
    description = optional(spec, "description", f"{p}.custom.description", str, "a string")
    parameters = custom(spec.get("format"), f"{p}.custom.format", strict)
    return ToolSpec(name, description, parameters, True,
                    declared_at=f"{p}.custom.format.grammar.definition",
                    named_at=f"{p}.custom.name", custom=True)


def parse_tools(
    value: Any, param: str = "tools", *, strict: bool = False,
    custom: CustomFormat | None = None, names: ToolNames = OPENAI_TOOL_NAMES,
) -> tuple[ToolSpec, ...]:
    """The client's function tools, each named once as ``names`` allows (``strict``: no
    unknown key in a tool or its function); with ``custom``, custom tools too."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise wrong_type(param, "an array", value)
    tools: list[ToolSpec] = []
    seen: set[str] = set()
    for i, tool in enumerate(value):
        p = f"{param}[{i}]"
        if not isinstance(tool, dict):
            raise wrong_type(p, "an object", tool)
        kind = tool.get("type")
        if kind is None:
            raise missing(f"{p}.type")
        if kind == "custom" and custom is not None:
            tools.append(_custom_tool(tool, p, custom, seen, strict))
            continue
        if kind != "function":
            supported = "'function' and 'custom'" if custom is not None else "'function'"
            raise invalid(
                f"{p}.type", f"Invalid tool type {quoted(kind)}; supported: {supported}."
            )
        if strict:
            reject_unknown(tool, TOOL_KEYS, prefix=f"{p}.")
        function, name = function_object(tool, p)
        if strict:
            reject_unknown(function, FUNCTION_KEYS, prefix=f"{p}.function.")
        _check_name(name, f"{p}.function.name", seen, names)
        description = optional(
            function, "description", f"{p}.function.description", str, "a string"
        )
        parameters = optional(
            function, "parameters", f"{p}.function.parameters", dict, "an object"
        )
        exact = optional(function, "strict", f"{p}.function.strict", bool, "a boolean")
        tools.append(ToolSpec(name, description, parameters, bool(exact)))
    return tuple(tools)


def _custom_name(value: dict[str, Any], param: str, strict: bool) -> str:
    """Chat's named custom tool: ``{"type": "custom", "custom": {"name"}}``."""
    if strict:
        reject_unknown(value, NAMED_CUSTOM_CHOICE_KEYS, prefix=f"{param}.")
    spec = required(value, "custom", f"{param}.custom", dict, "an object")
    if strict:
        reject_unknown(spec, CHOICE_FUNCTION_KEYS, prefix=f"{param}.custom.")
    return required(spec, "name", f"{param}.custom.name", str, "a string")


def _function_name(value: Any, param: str, strict: bool) -> str:
    if not isinstance(value, dict):
        raise wrong_type(param, "an object", value)
    if value.get("type") == "custom":
        return _custom_name(value, param, strict)
    if value.get("type", "function") != "function":
        raise invalid(f"{param}.type", "Only tools of type 'function' are supported.")
    if strict:
        reject_unknown(value, NAMED_CHOICE_KEYS, prefix=f"{param}.")
    if value.get("function") is None:
        # The Responses-style flat shape {"type": "function", "name": ...} is accepted too.
        if value.get("name") is None:
            raise missing(f"{param}.function")
        return required(value, "name", f"{param}.name", str, "a string")
    function, name = function_object(value, param)
    if strict:
        reject_unknown(function, CHOICE_FUNCTION_KEYS, prefix=f"{param}.function.")
    return name


def _unknown_tool(name: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"'{param}' names the tool {quoted(name)}, which is not in 'tools'.",
        code="unknown_tool",
        param=param,
    )


def parse_tool_choice(
    value: Any, tools: tuple[ToolSpec, ...], server_tools: Collection[str] = (), *,
    strict: bool = False,
) -> ToolChoice:
    """``tool_choice`` against the tools on offer: the client's and the server's own
    (which a choice may name although ``tools`` does not list them). ``strict`` refuses
    an unknown key in the choice's objects."""
    names = {t.name for t in tools} | set(server_tools)
    has_tools = bool(names)
    if value is None:
        return ToolChoice("auto" if has_tools else "none")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise invalid(
                "tool_choice",
                f"Invalid value for 'tool_choice': {quoted(value)}. Supported values are: "
                "'none', 'auto', 'required', or an object naming a function.",
            )
        if value == "required" and not has_tools:
            raise invalid("tool_choice", "'tool_choice' is 'required' but no 'tools' are given.")
        return ToolChoice(value if has_tools else "none")
    if not isinstance(value, dict):
        raise wrong_type("tool_choice", "a string or an object", value)
    kind = value.get("type")
    if kind is None:
        raise missing("tool_choice.type")
    if kind == "function":
        name = _function_name(value, "tool_choice", strict)
        param = "tool_choice.function.name" if "function" in value else "tool_choice.name"
        if name not in names:
            raise _unknown_tool(name, param)
        return ToolChoice("required", (name,), named=True)
    if kind == "custom":
        name = _custom_name(value, "tool_choice", strict)
        if name not in {t.name for t in tools if t.custom}:
            raise _unknown_tool(name, "tool_choice.custom.name")
        return ToolChoice("required", (name,), named=True)
    if kind == "allowed_tools":
        return _allowed_tools(value, names, strict)
    raise invalid(
        "tool_choice.type",
        f"Invalid value for 'tool_choice.type': {quoted(kind)}. Supported values are "
        "'function', 'custom' and 'allowed_tools'.",
    )


def _allowed_tools(value: dict[str, Any], names: set[str], strict: bool) -> ToolChoice:
    if strict:
        reject_unknown(value, ALLOWED_CHOICE_KEYS, prefix="tool_choice.")
    spec = required(
        value, "allowed_tools", "tool_choice.allowed_tools", dict, "an object"
    )
    if strict:
        reject_unknown(spec, ALLOWED_TOOLS_KEYS, prefix="tool_choice.allowed_tools.")
    mode = spec.get("mode", "auto")
    if mode not in ("auto", "required"):
        raise invalid(
            "tool_choice.allowed_tools.mode",
            f"Invalid value {quoted(mode)}; supported values are 'auto' and 'required'.",
        )
    listed = spec.get("tools")
    if listed is None:
        raise missing("tool_choice.allowed_tools.tools")
    if not isinstance(listed, list) or not listed:
        raise invalid("tool_choice.allowed_tools.tools", "'tools' must be a non-empty array.")
    allowed: list[str] = []
    for i, item in enumerate(listed):
        p = f"tool_choice.allowed_tools.tools[{i}]"
        # Typed as any object by the SDK (a whole tool definition may stand for its name):
        # read, not held to a key set.
        name = _function_name(item, p, False)
        if name not in names:
            where = next((k for k in ("function", "custom") if k in item), None)
            raise _unknown_tool(name, f"{p}.{where}.name" if where else f"{p}.name")
        allowed.append(name)
    return ToolChoice(mode, tuple(dict.fromkeys(allowed)))


def parse_response_format(value: Any, *, strict: bool = False) -> ResponseFormat | None:
    """``response_format``; None for plain text. ``strict`` refuses an unknown key in it
    and in its ``json_schema``."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise wrong_type("response_format", "an object", value)
    kind = value.get("type")
    if kind is None:
        raise missing("response_format.type")
    if strict and type(kind) is str and kind in RESPONSE_FORMAT_KEYS:
        reject_unknown(value, RESPONSE_FORMAT_KEYS[kind], prefix="response_format.")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind != "json_schema":
        raise invalid(
            "response_format.type",
            f"Invalid value for 'response_format.type': {quoted(kind)}. Supported values are: "
            "'text', 'json_object' and 'json_schema'.",
        )
    spec = required(value, "json_schema", "response_format.json_schema", dict, "an object")
    if strict:
        reject_unknown(spec, JSON_SCHEMA_KEYS, prefix="response_format.json_schema.")
    name = required(spec, "name", "response_format.json_schema.name", str, "a string")
    # OpenAI holds a schema's name to a tool's rule.
    if OPENAI_TOOL_NAMES.pattern.fullmatch(name) is None:
        raise invalid("response_format.json_schema.name",
                      f"Invalid name {quoted(name)}: use 1-64 characters among a-z, A-Z, "
                      "0-9, _ and -.")
    schema = spec.get("schema")
    if schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise wrong_type("response_format.json_schema.schema", "an object", schema)
    exact = optional(spec, "strict", "response_format.json_schema.strict", bool, "a boolean")
    # Typed as a tool's description is (and Responses' text.format.description), though
    # the grammar, not the prompt, carries the schema.
    optional(spec, "description", "response_format.json_schema.description", str,
             "a string")
    return ResponseFormat("json_schema", schema, name, bool(exact))
