"""An Anthropic Messages body's ``tools`` and ``tool_choice`` as afmd's.

Only custom tools (a name, a description, an ``input_schema``) exist locally: the tools
Anthropic runs or defines itself are refused by name, so a client learns to declare them
as its own rather than getting a model that never calls them.

Which of them the model is offered follows Anthropic: a tool declared with
``defer_loading`` is not, until a ``tool_reference`` in a tool's result loads it (Claude
Code's ToolSearch); system messages add tools (by name or defined by value) and withdraw
them from their point on (:class:`~afmd.dialects.anthropic.history.ToolChange`). The
tools offered when the answer begins are the ones its prompt shows and its grammar allows.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

from afmd.core.request import ToolChoice, ToolSpec
from afmd.dialects.anthropic.history import EXTRA_INPUTS, ToolChange
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

__all__ = ["TOOL_CHOICES", "offered_tools", "parse_tool_choice", "parse_tools"]

#: Anthropic's rule for a tool name.
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}", re.ASCII)
TOOL_CHOICES = ("auto", "any", "tool", "none")

# The keys ``[api] strict`` admits, as Anthropic refuses any other: the anthropic SDK's,
# its betas' too (tests/unit/dialects/test_sdk_fields.py holds them to its TypedDicts).
TOOL_KEYS = frozenset({"type", "name", "description", "input_schema", "strict",
                       "cache_control", "allowed_callers", "defer_loading",
                       "eager_input_streaming", "input_examples"})
CHOICE_KEYS: dict[str, frozenset[str]] = {
    "auto": frozenset({"type", "disable_parallel_tool_use"}),
    "any": frozenset({"type", "disable_parallel_tool_use"}),
    "tool": frozenset({"type", "name", "disable_parallel_tool_use"}),
    "none": frozenset({"type"}),
}


def parse_tools(value: Any, *, strict: bool = False) -> tuple[ToolSpec, ...]:
    """The client's custom tools (``strict``: no unknown key in one)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise wrong_type("tools", "an array", value)
    tools: list[ToolSpec] = []
    seen: set[str] = set()
    for i, tool in enumerate(value):
        spec = _tool(tool, f"tools[{i}]", strict)
        if spec.name in seen:
            raise invalid(f"tools[{i}].name", f"Duplicate tool name '{spec.name}'.")
        seen.add(spec.name)
        tools.append(spec)
    return tuple(tools)


def _tool(tool: Any, p: str, strict: bool) -> ToolSpec:
    """One custom tool, declared at ``p``: errors about its schema and name say where
    (its index among the tools offered need not: deferred ones are left out, and tools
    defined in ``messages`` come after)."""
    if not isinstance(tool, dict):
        raise wrong_type(p, "an object", tool)
    kind = optional(tool, "type", f"{p}.type", str, "a string")
    if kind not in (None, "custom"):
        raise InvalidRequestError(
            f"The tool type {quoted(kind)} is one Anthropic runs or defines itself; afmd "
            "has no such tool. Declare it as a custom tool (name, description, "
            "input_schema) and run it in your client.",
            code="unsupported_tool", param=f"{p}.type")
    if strict:
        reject_unknown(tool, TOOL_KEYS, prefix=f"{p}.", message=EXTRA_INPUTS)
    name = required(tool, "name", f"{p}.name", str, "a string")
    if _TOOL_NAME.fullmatch(name) is None:
        raise invalid(f"{p}.name", f"Invalid tool name {quoted(name)}: use 1-128 "
                      "characters among a-z, A-Z, 0-9, _ and -.")
    description = optional(tool, "description", f"{p}.description", str, "a string")
    schema = required(tool, "input_schema", f"{p}.input_schema", dict, "an object")
    if schema.get("type") != "object":
        # A call's ``input`` is an object: a schema of anything else has no call to
        # answer with (Anthropic requires the same).
        if "type" not in schema:
            raise missing(f"{p}.input_schema.type")
        raise invalid(f"{p}.input_schema.type", "Input should be 'object'.")
    exact = optional(tool, "strict", f"{p}.strict", bool, "a boolean")
    optional(tool, "defer_loading", f"{p}.defer_loading", bool, "a boolean")
    return ToolSpec(name, description, schema, bool(exact),
                    declared_at=f"{p}.input_schema", named_at=f"{p}.name")


def offered_tools(value: Any, tools: tuple[ToolSpec, ...],
                  changes: tuple[ToolChange, ...], *, strict: bool = False
                  ) -> tuple[tuple[ToolSpec, ...], frozenset[str]]:
    """The tools offered for the answer: ``tools`` (parsed from ``value``) less the
    deferred ones, then the conversation's changes in order; and the names of those
    declared but not offered. A change naming a tool neither declared nor defined before
    it is a 400 naming it; a ``tool_reference`` to one is left as the text it is (the
    client's search found a tool it no longer sends)."""
    known = {tool.name: tool for tool in tools}
    deferred = {tool["name"] for tool in value or ()
                if isinstance(tool, dict) and tool.get("defer_loading") is True}
    offered = {tool.name for tool in tools if tool.name not in deferred}
    for change in changes:
        if change.definition is not None:
            spec = _tool(change.definition, change.param, strict)
            known[spec.name] = spec  # the latest definition holds
            offered.add(spec.name)
            continue
        name = change.name
        assert name is not None
        if name not in known:
            if change.kind == "load":
                continue
            raise InvalidRequestError(
                f"{quoted(name)} names no tool in 'tools' or defined earlier in "
                "'messages'.", code="unknown_tool", param=change.param)
        if change.kind == "remove":
            offered.discard(name)
        else:
            offered.add(name)
    return (tuple(tool for tool in known.values() if tool.name in offered),
            frozenset(known.keys() - offered))


def parse_tool_choice(
    value: Any, tools: tuple[ToolSpec, ...], server_tools: Collection[str], *,
    strict: bool = False, withheld: Collection[str] = (),
) -> tuple[ToolChoice, bool]:
    """``tool_choice`` as afmd's choice, and whether parallel calls are allowed
    (``strict``: no key its type does not have). ``withheld``: tools declared but not
    offered (deferred and not loaded, or withdrawn), which a choice may not name."""
    names = {t.name for t in tools} | set(server_tools)
    if value is None:
        return ToolChoice("auto" if names else "none"), True
    if not isinstance(value, dict):
        raise wrong_type("tool_choice", "an object", value)
    kind = required(value, "type", "tool_choice.type", str, "a string")
    if kind not in TOOL_CHOICES:
        raise not_one_of("tool_choice.type", kind, TOOL_CHOICES)
    if strict:
        reject_unknown(value, CHOICE_KEYS[kind], prefix="tool_choice.", message=EXTRA_INPUTS)
    single = optional(value, "disable_parallel_tool_use",
                      "tool_choice.disable_parallel_tool_use", bool, "a boolean")
    parallel = not single
    if kind == "none" or (kind == "auto" and not names):
        return ToolChoice("none"), parallel
    if kind == "auto":
        return ToolChoice("auto"), parallel
    if not names and not (kind == "tool" and value.get("name") in withheld):
        raise invalid("tool_choice.type", f"'tool_choice' is {quoted(kind)} but no 'tools' "
                      + ("are offered at this point of the conversation." if withheld
                         else "are given."))
    if kind == "any":
        return ToolChoice("required"), parallel
    name = required(value, "name", "tool_choice.name", str, "a string")
    if name in withheld and name not in names:
        raise InvalidRequestError(
            f"'tool_choice.name' names the tool {quoted(name)}, which is not offered at "
            "this point of the conversation: it is deferred ('defer_loading') and no "
            "tool_reference has loaded it, or a tool_removal withdrew it.",
            code="unknown_tool", param="tool_choice.name")
    if name not in names:
        raise InvalidRequestError(f"'tool_choice.name' names the tool {quoted(name)}, which "
                                  "is not in 'tools'.", code="unknown_tool",
                                  param="tool_choice.name")
    return ToolChoice("required", (name,), named=True), parallel
