"""OpenAI's client-run tools of the Responses API: ``shell``, ``local_shell``, ``apply_patch``.

OpenAI's models call these tools and the client runs them (the Agents SDK's ``ShellTool``,
``LocalShellTool`` and ``ApplyPatchTool``, Codex): the tool carries no schema of its own,
and a call comes back as an item of its own type (``shell_call`` with an ``action``,
``local_shell_call`` with an ``exec`` action, ``apply_patch_call`` with an ``operation``),
answered by the matching output item in the next request's ``input``. A local model has
no such training, so each is offered to it as a function under the tool's own name with
the fixed JSON schema of what its call carries, enforced by the grammar like any
function; the call's arguments are then read back into the API's item, and items sent
back are written into the prompt as that function's call and its result.

The names are the tools' own (``shell``, ``local_shell``, ``apply_patch``), which a model
reads best; a client function or custom tool of the same name in the same request is a
400 at its ``name``, since the two calls could not be told apart. A ``shell`` tool whose
``environment`` is a container (``container_auto``, ``container_reference``) is OpenAI's
hosted shell, which afmd cannot run: it is left out like any hosted tool.

A call cut short (``max_output_tokens``, a cancel) carries only the values its arguments
wrote whole: a command or path cut mid-string is dropped, never run truncated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from afmd.core.request import ToolSpec
from afmd.dialects.fields.checks import (
    as_int,
    invalid,
    missing,
    not_one_of,
    optional,
    reject_unknown,
    required,
    wrong_type,
)

Item = dict[str, Any]

#: The client-run tool types, each offered to the model as a function of this name.
KINDS = ("shell", "local_shell", "apply_patch")
#: A ``shell`` tool's environments run by the client; the others are OpenAI's containers.
LOCAL_ENVIRONMENTS = ("local",)
#: Each tool's call item and output item types.
CALL_TYPES = {"shell": "shell_call", "local_shell": "local_shell_call",
              "apply_patch": "apply_patch_call"}
OUTPUT_TYPES = {"shell": "shell_call_output", "local_shell": "local_shell_call_output",
                "apply_patch": "apply_patch_call_output"}
KIND_OF_CALL = {call: kind for kind, call in CALL_TYPES.items()}
KIND_OF_OUTPUT = {output: kind for kind, output in OUTPUT_TYPES.items()}
#: Item id prefixes in the shape of OpenAI's (``apc_`` is its own; the others alike).
CALL_PREFIXES = {"shell_call": "sh", "local_shell_call": "lsh", "apply_patch_call": "apc",
                 "shell_call_output": "sho", "local_shell_call_output": "lsho",
                 "apply_patch_call_output": "apco"}
OPERATIONS = ("create_file", "update_file", "delete_file")

# The keys ``[api] strict`` admits, the openai SDK's (tests/unit/dialects/test_sdk_fields.py).
TOOL_KEYS: dict[str, frozenset[str]] = {
    "shell": frozenset({"type", "allowed_callers", "environment"}),
    "local_shell": frozenset({"type"}),
    "apply_patch": frozenset({"type", "allowed_callers"}),
}
_CALLER_KEYS = frozenset({"type", "id", "call_id", "status", "caller", "created_by"})
ITEM_KEYS: dict[str, frozenset[str]] = {
    "shell_call": _CALLER_KEYS | {"action", "environment"},
    "shell_call_output": _CALLER_KEYS | {"output", "max_output_length"},
    "local_shell_call": _CALLER_KEYS | {"action"},
    "local_shell_call_output": _CALLER_KEYS | {"output"},
    "apply_patch_call": _CALLER_KEYS | {"operation"},
    "apply_patch_call_output": _CALLER_KEYS | {"output"},
}
SHELL_ACTION_KEYS = frozenset({"type", "commands", "timeout_ms", "max_output_length"})
EXEC_ACTION_KEYS = frozenset({"type", "command", "env", "timeout_ms", "user",
                              "working_directory"})
OPERATION_KEYS = frozenset({"type", "path", "diff"})
SHELL_OUTPUT_KEYS = frozenset({"stdout", "stderr", "outcome", "created_by"})
OUTCOME_KEYS = frozenset({"type", "exit_code"})

_COMMANDS = {"type": "array", "items": {"type": "string"}, "minItems": 1}
_MILLISECONDS = {"type": "integer", "minimum": 1}
#: What each tool's call carries, as the function the model is offered takes it.
PARAMETERS: dict[str, dict[str, Any]] = {
    "shell": {
        "type": "object",
        "properties": {
            "commands": {**_COMMANDS, "description": "Shell commands, run in order."},
            "timeout_ms": {**_MILLISECONDS, "description": "Time limit for the commands."},
            "max_output_length": {"type": "integer", "minimum": 1, "description":
                                  "Most characters of output to return per command."},
        },
        "required": ["commands"],
        "additionalProperties": False,
    },
    "local_shell": {
        "type": "object",
        "properties": {
            "command": {**_COMMANDS, "description": "The program and its arguments."},
            "timeout_ms": {**_MILLISECONDS, "description": "Time limit for the command."},
            "working_directory": {"type": "string"},
            "env": {"type": "object", "additionalProperties": {"type": "string"},
                    "description": "Environment variables to set."},
            "user": {"type": "string"},
        },
        "required": ["command"],
        "additionalProperties": False,
    },
    "apply_patch": {
        "type": "object",
        "properties": {"operation": {"anyOf": [
            {"type": "object",
             "properties": {"type": {"const": kind}, "path": {"type": "string"},
                            **({} if kind == "delete_file" else {"diff": {"type": "string"}})},
             "required": ["type", "path"] + ([] if kind == "delete_file" else ["diff"]),
             "additionalProperties": False}
            for kind in OPERATIONS]}},
        "required": ["operation"],
        "additionalProperties": False,
    },
}
DESCRIPTIONS = {
    "shell": "Run shell commands on the user's machine; each command's output and exit "
             "code come back.",
    "local_shell": "Run one command (a program and its arguments) on the user's machine; "
                   "its output comes back.",
    "apply_patch": "Create, update or delete one file. 'path' is relative to the "
                   "workspace. 'diff' is a V4A diff: for create_file the file's lines, each "
                   "prefixed with '+'; for update_file hunks headed by '@@' with context "
                   "lines prefixed ' ', removed lines '-' and added lines '+'.",
}


@dataclass(frozen=True, slots=True)
class ClientTool:
    """A client-run tool as offered: its type, and for ``shell`` the environment its calls
    name (``{"type": "local"}``, or None when the tool named none)."""

    kind: str
    environment: dict[str, Any] | None = None


def is_hosted(tool: Mapping[str, Any]) -> bool:
    """A ``shell`` tool in one of OpenAI's containers: OpenAI runs it, afmd cannot."""
    environment = tool.get("environment")
    return (tool.get("type") == "shell" and isinstance(environment, dict)
            and environment.get("type") not in LOCAL_ENVIRONMENTS)


def parse_tool(tool: dict[str, Any], p: str, strict: bool) -> tuple[ToolSpec, ClientTool,
                                                                  dict[str, Any]]:
    """A client-run tool (at ``p``) as the function the model is offered, what its calls
    need, and its echo."""
    kind = tool["type"]
    if strict:
        reject_unknown(tool, TOOL_KEYS[kind], prefix=f"{p}.")
    echo: dict[str, Any] = {"type": kind}
    environment = None
    if kind == "shell":
        given = optional(tool, "environment", f"{p}.environment", dict, "an object")
        echo["environment"] = given
        # The call names its environment as OpenAI's does: the type alone.
        environment = None if given is None else {"type": given.get("type")}
    spec = ToolSpec(kind, DESCRIPTIONS[kind], PARAMETERS[kind], True,
                    declared_at=f"{p}.type", named_at=f"{p}.type")
    return spec, ClientTool(kind, environment), echo


# ---------------------------------------------------------------------------- output items


def whole_values(arguments: str) -> Any:
    """Arguments as JSON; cut short, the values they wrote whole (a string, number or
    key cut mid-way is dropped, the open arrays and objects closed), so a cut call never
    carries a truncated command or path."""
    try:
        return orjson.loads(arguments)
    except orjson.JSONDecodeError:
        pass
    stack: list[str] = []
    expect_key = False
    safe, closers = 0, ""
    i, n = 0, len(arguments)
    while i < n:
        c = arguments[i]
        if c == '"':
            j = i + 1
            while j < n and arguments[j] != '"':
                j += 2 if arguments[j] == "\\" else 1
            if j >= n:
                break  # cut inside the string
            i = j + 1
            if stack and stack[-1] == "{" and expect_key:
                expect_key = False  # a key: its value follows
                continue
        elif c in "{[":
            stack.append(c)
            expect_key = c == "{"
            i += 1
        elif c in "}]":
            if stack:
                stack.pop()
            expect_key = False
            i += 1
        elif c in ", \t\r\n:":
            if c == ",":
                expect_key = bool(stack) and stack[-1] == "{"
            i += 1
            continue
        else:  # a number or a literal: whole only once something follows it
            j = i
            while j < n and arguments[j] not in ",]} \t\r\n":
                j += 1
            if j >= n:
                break
            i = j
        safe, closers = i, "".join("}" if s == "{" else "]" for s in reversed(stack))
    try:
        return orjson.loads(arguments[:safe] + closers)
    except orjson.JSONDecodeError:
        return {}


def _strings(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def shell_action(values: Mapping[str, Any]) -> dict[str, Any]:
    return {"commands": _strings(values.get("commands")),
            "timeout_ms": _int(values.get("timeout_ms")),
            "max_output_length": _int(values.get("max_output_length"))}


def exec_action(values: Mapping[str, Any]) -> dict[str, Any]:
    env = values.get("env")
    return {"type": "exec", "command": _strings(values.get("command")),
            "env": {k: v for k, v in env.items() if isinstance(v, str)}
            if isinstance(env, dict) else {},
            "timeout_ms": _int(values.get("timeout_ms")),
            "working_directory": _str(values.get("working_directory")),
            "user": _str(values.get("user"))}


def operation(values: Mapping[str, Any]) -> dict[str, Any]:
    """The patch's operation; one cut before its type was written is an empty update,
    which changes nothing."""
    op = values.get("operation")
    op = op if isinstance(op, dict) else {}
    kind = op.get("type") if op.get("type") in OPERATIONS else "update_file"
    out = {"type": kind, "path": _str(op.get("path")) or ""}
    if kind != "delete_file":
        out["diff"] = _str(op.get("diff")) or ""
    return out


def call_item(call_type: str, item_id: str, call_id: str, arguments: str | None, status: str,
              tool: ClientTool | None) -> Item:
    """The API's item for a call of a client-run tool from the arguments the model wrote
    (None: none yet, the item as it opens). ``apply_patch_call`` has no ``incomplete``
    status: a cut one stays ``in_progress``."""
    values = whole_values(arguments) if arguments else {}
    values = values if isinstance(values, dict) else {}
    item: Item = {"id": item_id, "type": call_type, "status": status, "call_id": call_id}
    if call_type == "shell_call":
        item["action"] = shell_action(values)
        item["environment"] = None if tool is None else tool.environment
    elif call_type == "local_shell_call":
        item["action"] = exec_action(values)
    else:
        item["operation"] = operation(values)
        if status == "incomplete":
            item["status"] = "in_progress"
    return item


def _decoded(raw: str) -> str:
    """A JSON string's text as far as it was written: decoded up to its last whole escape,
    never ending in half of a surrogate pair."""
    for cut in range(min(len(raw), 11) + 1):
        try:
            text = orjson.loads('"' + raw[:len(raw) - cut] + '"')
        except orjson.JSONDecodeError:
            continue
        return str(text)
    return ""


#: A command's events as :class:`CommandStream` reads them: ``(kind, index, text)``, kind
#: ``added``, ``delta`` or ``done``.
CommandEvent = tuple[str, int, str]


class CommandStream:
    """A shell call's commands read from its arguments as the model writes them, for the
    API's ``shell_call_command`` events: a command is added when its string opens, grows
    by what each fragment wrote of it, and is done when the string closes. The grammar
    holds the arguments to the shell schema, so a string inside the top-level
    ``commands`` array is a command."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.expect_key = False
        self.key = ""  # the top-level key whose value is being written
        self.role = ""  # the open string's: "key", "command" or "" (another value)
        self.raw: list[str] = []  # the open key's or command's text, as escaped JSON
        self.sent = ""  # what deltas sent of the open command
        self.added = 0
        self.done: list[str] = []

    def feed(self, fragment: str) -> list[CommandEvent]:
        events: list[CommandEvent] = []
        for c in fragment:
            if self.in_string:
                if self.escape or c not in '"\\':
                    self.escape = False
                    if self.role:
                        self.raw.append(c)
                elif c == "\\":
                    self.escape = True
                    if self.role:
                        self.raw.append(c)
                else:
                    self.in_string = False
                    self._closed(events)
            elif c == '"':
                self.in_string = True
                self.raw = []
                if self.depth == 1 and self.expect_key:
                    self.role = "key"
                elif self.depth == 2 and self.key == "commands":
                    self.role = "command"
                    self.sent = ""
                    events.append(("added", self.added, ""))
                    self.added += 1
                else:
                    self.role = ""
            elif c in "{[":
                self.depth += 1
                self.expect_key = c == "{" and self.depth == 1
            elif c in "}]":
                self.depth -= 1
            elif c == ":" and self.depth == 1:
                self.expect_key = False
            elif c == "," and self.depth == 1:
                self.expect_key = True
        if self.in_string and self.role == "command":
            self._grown(_decoded("".join(self.raw)), events)
        return events

    def _grown(self, text: str, events: list[CommandEvent]) -> None:
        if len(text) > len(self.sent) and text.startswith(self.sent):
            events.append(("delta", len(self.done), text[len(self.sent):]))
            self.sent = text

    def _closed(self, events: list[CommandEvent]) -> None:
        text = _decoded("".join(self.raw))
        if self.role == "key":
            self.key = text
        elif self.role == "command":
            self._grown(text, events)
            events.append(("done", len(self.done), text))
            self.done.append(text)
        self.role = ""

    def finish(self, commands: list[str]) -> list[CommandEvent]:
        """The events the call's whole commands still need (none where the arguments
        streamed as they were written)."""
        events: list[CommandEvent] = []
        for index in range(len(self.done), len(commands)):
            if index >= self.added:
                events.append(("added", index, ""))
                self.added += 1
                self.sent = ""
            self._grown(commands[index], events)
            events.append(("done", index, commands[index]))
            self.done.append(commands[index])
        return events


# ---------------------------------------------------------------------------- input items


def _check_status(item: Item, p: str, choices: tuple[str, ...]) -> None:
    status = item.get("status")
    if status is not None and status not in choices:
        raise not_one_of(f"{p}.status", status, choices)


def _given_int(obj: Mapping[str, Any], key: str, p: str) -> int | None:
    value = obj.get(key)
    return None if value is None else as_int(value, f"{p}.{key}")


def _string_array(obj: Mapping[str, Any], key: str, p: str) -> list[str]:
    value = obj.get(key)
    if value is None:
        raise missing(f"{p}.{key}")
    if not isinstance(value, list):
        raise wrong_type(f"{p}.{key}", "an array of strings", value)
    for k, entry in enumerate(value):
        if not isinstance(entry, str):
            raise wrong_type(f"{p}.{key}[{k}]", "a string", entry)
    return list(value)


def _shell_action(value: Any, p: str, strict: bool) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise wrong_type(p, "an object", value)
    if strict:
        reject_unknown(value, SHELL_ACTION_KEYS, prefix=f"{p}.")
    return {"commands": _string_array(value, "commands", p),
            "timeout_ms": _given_int(value, "timeout_ms", p),
            "max_output_length": _given_int(value, "max_output_length", p)}


def _exec_action(value: Any, p: str, strict: bool) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise wrong_type(p, "an object", value)
    if strict:
        reject_unknown(value, EXEC_ACTION_KEYS, prefix=f"{p}.")
    kind = value.get("type", "exec")
    if kind != "exec":
        raise not_one_of(f"{p}.type", kind, ("exec",))
    env = optional(value, "env", f"{p}.env", dict, "an object") or {}
    for key, text in env.items():
        if not isinstance(text, str):
            raise wrong_type(f"{p}.env.{key}", "a string", text)
    return {"type": "exec", "command": _string_array(value, "command", p), "env": env,
            "timeout_ms": _given_int(value, "timeout_ms", p),
            "working_directory": optional(value, "working_directory",
                                          f"{p}.working_directory", str, "a string"),
            "user": optional(value, "user", f"{p}.user", str, "a string")}


def _operation(value: Any, p: str, strict: bool) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise wrong_type(p, "an object", value)
    if strict:
        reject_unknown(value, OPERATION_KEYS, prefix=f"{p}.")
    kind = required(value, "type", f"{p}.type", str, "a string")
    if kind not in OPERATIONS:
        raise not_one_of(f"{p}.type", kind, OPERATIONS)
    out = {"type": kind, "path": required(value, "path", f"{p}.path", str, "a string")}
    if kind != "delete_file":
        diff = value.get("diff")
        if not isinstance(diff, str):
            raise missing(f"{p}.diff") if diff is None else wrong_type(f"{p}.diff",
                                                                       "a string", diff)
        out["diff"] = diff
    return out


def _shell_output(value: Any, p: str, strict: bool) -> list[dict[str, Any]]:
    if value is None:
        raise missing(p)
    if not isinstance(value, list):
        raise wrong_type(p, "an array of shell outputs", value)
    out = []
    for k, entry in enumerate(value):
        q = f"{p}[{k}]"
        if not isinstance(entry, dict):
            raise wrong_type(q, "an object", entry)
        if strict:
            reject_unknown(entry, SHELL_OUTPUT_KEYS, prefix=f"{q}.")
        stdout = entry.get("stdout", "")
        stderr = entry.get("stderr", "")
        for key, text in (("stdout", stdout), ("stderr", stderr)):
            if not isinstance(text, str):
                raise wrong_type(f"{q}.{key}", "a string", text)
        outcome = required(entry, "outcome", f"{q}.outcome", dict, "an object")
        if strict:
            reject_unknown(outcome, OUTCOME_KEYS, prefix=f"{q}.outcome.")
        kind = required(outcome, "type", f"{q}.outcome.type", str, "a string")
        if kind == "exit":
            code = outcome.get("exit_code")
            if code is None:
                raise missing(f"{q}.outcome.exit_code")
            ended: dict[str, Any] = {"type": "exit",
                                     "exit_code": as_int(code, f"{q}.outcome.exit_code")}
        elif kind == "timeout":
            ended = {"type": "timeout"}
        else:
            raise not_one_of(f"{q}.outcome.type", kind, ("exit", "timeout"))
        out.append({"stdout": stdout, "stderr": stderr, "outcome": ended})
    return out


def parse_call(item: Item, p: str, item_id: str, call_id: str, strict: bool) -> Item:
    """A client-run tool's call sent back (``item_id`` and ``call_id`` checked by the
    caller), in the form the API returns it."""
    kind = item["type"]
    carried = "operation" if kind == "apply_patch_call" else "action"
    if item.get(carried) is None:
        raise missing(f"{p}.{carried}")
    out: Item = {"id": item_id, "type": kind, "status": "completed", "call_id": call_id}
    if kind == "shell_call":
        _check_status(item, p, ("in_progress", "completed", "incomplete"))
        out["action"] = _shell_action(item.get("action"), f"{p}.action", strict)
        environment = optional(item, "environment", f"{p}.environment", dict, "an object")
        out["environment"] = environment
    elif kind == "local_shell_call":
        _check_status(item, p, ("in_progress", "completed", "incomplete"))
        out["action"] = _exec_action(item.get("action"), f"{p}.action", strict)
    else:
        _check_status(item, p, ("in_progress", "completed"))
        out["operation"] = _operation(item.get("operation"), f"{p}.operation", strict)
    return out


def parse_output(item: Item, p: str, item_id: str, call_id: str, strict: bool) -> Item:
    """A client-run tool's output, in the form the API returns it."""
    kind = item["type"]
    out: Item = {"id": item_id, "type": kind, "call_id": call_id}
    if kind == "shell_call_output":
        _check_status(item, p, ("in_progress", "completed", "incomplete"))
        out["output"] = _shell_output(item.get("output"), f"{p}.output", strict)
        out["max_output_length"] = _given_int(item, "max_output_length", p)
        out["status"] = "completed"
    elif kind == "local_shell_call_output":
        _check_status(item, p, ("in_progress", "completed", "incomplete"))
        out["output"] = required(item, "output", f"{p}.output", str, "a string")
        out["status"] = "completed"
    else:
        status = item.get("status", "completed")
        if status not in ("completed", "failed"):
            raise not_one_of(f"{p}.status", status, ("completed", "failed"))
        out["output"] = optional(item, "output", f"{p}.output", str, "a string")
        out["status"] = status
    return out


def output_call_id(item: Item, p: str) -> str:
    """The call an output answers: its ``call_id``; a ``local_shell_call_output`` may name
    it by ``id`` alone, which the openai SDK types as the call's id."""
    value = item.get("call_id")
    if value is None and item["type"] == "local_shell_call_output":
        value = item.get("id")
        if value is None:
            raise missing(f"{p}.call_id")
        p = f"{p}.id"
    else:
        p = f"{p}.call_id"
    if value is None:
        raise missing(p)
    if not isinstance(value, str):
        raise wrong_type(p, "a string", value)
    if not value:
        raise invalid(p, "A call_id must not be empty.")
    return value


# ---------------------------------------------------------------------------- the prompt


def _present(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None and v != {}}


def call_arguments(item: Item) -> str:
    """A call sent back as the arguments of the function the model is offered."""
    kind = item["type"]
    if kind == "shell_call":
        values = _present(item["action"])
    elif kind == "local_shell_call":
        values = _present({k: v for k, v in item["action"].items() if k != "type"})
    else:
        values = {"operation": item["operation"]}
    return orjson.dumps(values).decode()


def output_text(item: Item) -> str:
    """An output as the function's result the model reads: a shell's outputs as JSON (a
    command's stdout, stderr and how it ended), a patch's status and message."""
    kind = item["type"]
    if kind == "shell_call_output":
        return orjson.dumps(item["output"]).decode()
    if kind == "local_shell_call_output":
        return str(item["output"])
    return orjson.dumps(_present({"status": item["status"],
                                  "output": item.get("output")})).decode()
