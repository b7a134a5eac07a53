"""Each family's calls as a lark grammar: the forced side of :mod:`afmd.output.formats`.

A family's :class:`CallGrammar` writes the rule ``calls`` (one call, or several when the
turn may make parallel calls) for a list of tools, each call naming one tool and holding
arguments that obey that tool's ``parameters`` (the grammar's closed copy). Families that
write arguments as one JSON object embed the schema as ``%json``; families that tag each
parameter get it key by key (:mod:`afmd.grammar.params`). The :class:`Frame` says what
surrounds the calls: a thinking block before them, and how a free answer or a JSON answer
is written (harmony puts both on its ``final`` channel). The layouts follow what each
family's chat template renders, which is what the model was trained to write.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from afmd.grammar.frames import Build, Frame, HarmonyFrame, Tool
from afmd.grammar.lark_input import NotEmbeddable, json_string, lark_of, lark_string, raw_text
from afmd.grammar.params import ANY_KEY, Inexact, Param, plan, raw_value, sequence, string_terminal
from afmd.grammar.schema_copy import reroot

# --------------------------------------------------------------------------- families


class CallGrammar:
    """A family's calls; ``opener`` is the markup the calls begin with."""

    frame: Frame = Frame()
    opener = ""

    def calls(self, b: Build, tools: Sequence[Tool], parallel: bool) -> str:
        raise NotImplementedError

    def text_or_calls(self, b: Build, calls: str) -> str:
        return self.frame.text_or_calls(b, calls, self.opener)

    @staticmethod
    def repeat(b: Build, call: str, parallel: bool, sep: str = "") -> str:
        if not parallel:
            return call
        glue = f"{json.dumps(sep)} " if sep else ""
        return b.rules.add(f"{call} ({glue}{call})*", "calls")


@dataclass(frozen=True)
class JsonObjectCalls(CallGrammar):
    """Hermes/Qwen: ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>``."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"
    key: str = "arguments"

    @property
    def opener(self) -> str:  # type: ignore[override]
        return self.start

    def calls(self, b: Build, tools: Sequence[Tool], parallel: bool) -> str:
        names = [b.rules.add(_named(b, t, self.key), "fn") for t in tools]
        call = b.rules.add(f'{b.m(self.start)} "\\n" ({" | ".join(names)}) "\\n" '
                           f'{b.m(self.end)}', "call")
        return self.repeat(b, call, parallel, "\n")


def _named(b: Build, tool: Tool, key: str) -> str:
    """``{"name": NAME, KEY: arguments}``: one ``%json``, or for a custom tool whose lark
    grammar recurses, its input's escaped rules inside the object's markup."""
    text = _custom_input(tool.parameters, json_string)
    if text is None:
        return b.json(_named_object(tool, key))
    head = lark_string('{"name":' + json.dumps(tool.name) + ',"' + key + '":{"input":')
    return f'{head} {text} "}}}}"'


def _arguments(b: Build, tool: Tool) -> str:
    """The arguments object: its ``%json``, or a custom tool's input rules inside it."""
    text = _custom_input(tool.parameters, json_string)
    if text is None:
        return b.json(tool.parameters)
    head = lark_string('{"input":')
    return f'{head} {text} "}}"'


def _custom_input(schema: Any, write: Callable[[str], str]) -> str | None:
    """A custom tool's recursive lark grammar as the rules ``write`` makes of it (None:
    not such a tool, or a grammar the rules cannot carry: its ``%json`` is then built,
    lenient, and the turn downgraded). ``schema`` is the parameters object or, for the
    families that take parameters one by one, the input's own schema."""
    if isinstance(schema, dict) and schema.get("type") == "object":
        properties = schema.get("properties")
        if not isinstance(properties, dict) or list(properties) != ["input"]:
            return None
        schema = properties["input"]
    definition = lark_of(schema)
    if definition is None:
        return None
    try:
        return write(definition)
    except NotEmbeddable:
        return None


def _named_object(tool: Tool, key: str) -> dict[str, Any]:
    """``{"name": NAME, KEY: parameters}`` with the parameters' pointers re-rooted."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name},
                       key: reroot(tool.parameters, ("properties", key))},
        "required": ["name", key],
        "additionalProperties": False,
    }


class LlamaCalls(CallGrammar):
    """Llama 3.1-3.3: the turn is ``{"name": …, "parameters": {…}}`` (``; `` between
    several); free text is anything that does not open with ``{``."""

    opener = "{"

    def calls(self, b: Build, tools: Sequence[Tool], parallel: bool) -> str:
        names = [b.rules.add(_named(b, t, "parameters"), "fn") for t in tools]
        call = b.rules.add(" | ".join(names), "call")
        return self.repeat(b, call, parallel, "; ")

    def text_or_calls(self, b: Build, calls: str) -> str:
        plain = b.rules.terminal(r"/[^{\s](.|\n)*/")
        return f"{plain} | {calls}"


class KimiK2Calls(CallGrammar):
    opener = "<|tool_calls_section_begin|>"

    def calls(self, b: Build, tools: Sequence[Tool], parallel: bool) -> str:
        alts = [b.rules.add(
            f'{b.m("<|tool_call_begin|>")} {json.dumps("functions." + t.name + ":")} '
            f'/[0-9]{{1,4}}/ {b.m("<|tool_call_argument_begin|>")} {_arguments(b, t)} '
            f'{b.m("<|tool_call_end|>")}', "call") for t in tools]
        call = b.rules.add(" | ".join(alts), "call")
        many = b.rules.add(f"{call}+", "calls") if parallel else call
        return b.rules.add(f'{b.m(self.opener)} {many} {b.m("<|tool_calls_section_end|>")}',
                           "section")


@dataclass(frozen=True)
class MistralCalls(CallGrammar):
    """``[TOOL_CALLS]name[ARGS]{…}`` per call, or (``array``) the older
    ``[TOOL_CALLS] [{"name": …, "arguments": {…}}, …]``."""

    array: bool = False
    opener = "[TOOL_CALLS]"

    def calls(self, b: Build, tools: Sequence[Tool], parallel: bool) -> str:
        if self.array:
            objects = b.rules.add(" | ".join(
                b.rules.add(_named(b, t, "arguments"), "fn") for t in tools), "obj")
            many = f'{objects} (", " {objects})*' if parallel else objects
            return b.rules.add(f'{b.m(self.opener)} " "? "[" {many} "]"', "calls")
        alts = [b.rules.add(f"{b.m(self.opener)} {json.dumps(t.name)} {b.m('[ARGS]')} "
                            f"{_arguments(b, t)}", "call") for t in tools]
        call = b.rules.add(" | ".join(alts), "call")
        return b.rules.add(f"{call}+", "calls") if parallel else call


class HarmonyCalls(CallGrammar):
    """gpt-oss: one call per turn (``<|call|>`` ends generation)."""

    frame = HarmonyFrame()
    opener = "<|channel|>"

    def calls(self, b: Build, tools: Sequence[Tool], parallel: bool) -> str:
        alts = [b.rules.add(
            f'{b.m("<|channel|>")} {json.dumps("commentary to=functions." + t.name + " ")} '
            f'{b.m("<|constrain|>")} "json" {b.m("<|message|>")} {_arguments(b, t)}',
            "call") for t in tools]
        return b.rules.add(" | ".join(alts), "call")


class PythonicCalls(CallGrammar):
    """``<|tool_call_start|>[f(a=1, b="x"), …]<|tool_call_end|>``, values as JSON."""

    opener = "<|tool_call_start|>"

    def calls(self, b: Build, tools: Sequence[Tool], parallel: bool) -> str:
        alts = []
        for tool in tools:
            params = plan(tool.parameters, b.lenient)
            items = [(b.rules.add(f"{json.dumps(p.key + '=')} {self._value(b, p)}", "kw"),
                      p.required) for p in params.params]
            if params.any_keys:
                any_kw = b.rules.add(f'{ANY_KEY} "=" {b.json({})}', "kw")
                args, empty = b.rules.add(f'{any_kw} (", " {any_kw})*', "kws"), True
            else:
                args, empty = sequence(b.rules, items, '", "')
            inner = f"({args})?" if args and empty else args
            alts.append(b.rules.add(f'{json.dumps(tool.name + "(")} {inner} ")"', "call"))
        call = b.rules.add(" | ".join(alts), "call")
        many = f'{call} (", " {call})*' if parallel else call
        return b.rules.add(f'{b.m(self.opener)} "[" {many} "]" {b.m("<|tool_call_end|>")}',
                           "calls")

    @staticmethod
    def _value(b: Build, p: Param) -> str:
        """A value as JSON: its ``%json``, or a custom tool's input as a JSON string."""
        text = _custom_input(p.raw, json_string) if p.string else None
        return text if text is not None else b.json(p.schema)


@dataclass(frozen=True)
class GemmaCalls(CallGrammar):
    """``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`` (and FunctionGemma's
    ``<escape>`` quotes)."""

    start: str = "<|tool_call>"
    end: str = "<tool_call|>"
    quote: str = '<|"|>'

    @property
    def opener(self) -> str:  # type: ignore[override]
        return self.start

    def calls(self, b: Build, tools: Sequence[Tool], parallel: bool) -> str:
        alts = []
        for tool in tools:
            params = plan(tool.parameters, b.lenient)
            items = [(self._pair(b, p, tool), p.required) for p in params.params]
            if params.any_keys:
                any_kv = b.rules.add(f'{ANY_KEY} ":" {b.json({})}', "kv")
                args, empty = b.rules.add(f'{any_kv} ("," {any_kv})*', "kvs"), True
            else:
                args, empty = sequence(b.rules, items, '","')
            inner = f"({args})?" if args and empty else args
            alts.append(b.rules.add(
                f'{b.m(self.start)} {json.dumps("call:" + tool.name + "{")} {inner} "}}" '
                f'{b.m(self.end)}', "call"))
        call = b.rules.add(" | ".join(alts), "call")
        return b.rules.add(f"{call}+", "calls") if parallel else call

    def _pair(self, b: Build, p: Param, tool: Tool) -> str:
        quote = "" if b.starts_with_token(self.quote) else self.quote
        if p.string and (text := _custom_input(p.raw, partial(raw_text, forbid=quote))):
            value = f"{b.m(self.quote)} {text} {b.m(self.quote)}"
        elif p.string:
            text = b.rules.terminal(raw_value(string_terminal(p.raw, tool.parameters,
                                                              b.lenient),
                                              forbid=(self.quote,), trimmed=False))
            value = f"{b.m(self.quote)} {text} {b.m(self.quote)}"
        else:
            value = b.json(p.schema)
        return b.rules.add(f"{json.dumps(p.key + ':')} {value}", "kv")


@dataclass(frozen=True)
class TaggedCalls(CallGrammar):
    """Formats that tag each parameter (see :mod:`afmd.output.formats.tagged`).

    ``head``: the call's markup before and after the name; ``tail``: after its
    parameters; ``key``: a parameter's markup before and after its key; ``value``: after
    the value, the layout, the closing tag and the layout after it. ``shared``: all calls
    sit in one section (else each in its own, ``sep`` between).
    """

    section: tuple[str, str]
    head: tuple[str, str]
    tail: str
    key: tuple[str, str]
    value: tuple[str, str, str]
    trimmed: bool
    shared: bool = False
    sep: str = "\n"
    cdata: bool = False
    typed: bool = False  # Kimi K3: the key header says type="…"
    indexed: bool = False  # Kimi K3: the call header carries index="N"

    @property
    def opener(self) -> str:  # type: ignore[override]
        return self.section[0]

    def calls(self, b: Build, tools: Sequence[Tool], parallel: bool) -> str:
        alts = [self._call(b, tool) for tool in tools]
        call = b.rules.add(" | ".join(alts), "call")
        open_, close = b.m(self.section[0]), b.m(self.section[1])
        if self.shared:
            many = b.rules.add(f"{call}+", "calls") if parallel else call
            return b.rules.add(f"{open_} {many} {close}", "section")
        one = b.rules.add(f"{open_} {call} {close}", "section")
        return self.repeat(b, one, parallel, self.sep)

    def _call(self, b: Build, tool: Tool) -> str:
        params = plan(tool.parameters, b.lenient)
        items = [(self._param(b, p, tool), p.required) for p in params.params]
        args, _ = sequence(b.rules, items, "")
        if params.any_keys:
            any_param = self._param(b, Param("", {}, False, False, {}), tool, any_key=True)
            args = f"{any_param}*"
        # Kimi K3 closes the tool attribute after its index attribute.
        index = f' {b.m(chr(34) + " index=" + chr(34))} /[0-9]{{1,3}}/ {b.m(chr(34))}' \
            if self.indexed else ""
        head = f"{b.m(self.head[0])} {json.dumps(tool.name)}{index} {b.m(self.head[1])}"
        return b.rules.add(f"{head} {args} {b.m(self.tail)}", "call")

    def _param(self, b: Build, p: Param, tool: Tool, any_key: bool = False) -> str:
        before, tag, after = self.value
        key = ANY_KEY if any_key else json.dumps(p.key)
        kind = ""
        if self.typed:  # the key's attribute closes, then the type attribute
            kind = '" type="string"' if p.string else '" type="json"'
        header = f"{b.m(self.key[0])} {key} {b.m(kind + self.key[1])}"
        if not p.string:
            return b.rules.add(f"{header} {b.json(p.schema)} {b.m(before + tag + after)}",
                               "param")
        # A custom tool's recursive grammar, raw, where the reader reads it back whole.
        write = partial(raw_text, forbid="" if b.starts_with_token(tag) else tag,
                        trimmed=self.trimmed and not self.cdata)  # CDATA keeps its text
        if (text := _custom_input(p.raw, write)) is not None:
            if self.cdata:
                text = f'"<![CDATA[" {text} "]]>" {json.dumps(tag)}'
                return b.rules.add(f"{header} {text} {b.m(after)}", "param")
            return b.rules.add(f"{header} {text} {b.m(before + tag + after)}", "param")
        expression = string_terminal(p.raw, tool.parameters, b.lenient)
        if self.cdata:
            value = b.rules.terminal(_cdata(expression, tag))
            return b.rules.add(f"{header} {value} {b.m(after)}", "param")
        if b.starts_with_token(tag):
            # Text never produces the token, so the value simply ends where it comes; it
            # must not spell the tag out either (readers see text).
            if before:
                raise Inexact("layout before a closing token")  # no family has one
            value = b.rules.terminal(raw_value(expression, forbid=(tag,),
                                               trimmed=self.trimmed))
            return b.rules.add(f"{header} {value} {b.m(tag + after)}", "param")
        value = b.rules.terminal(raw_value(expression, forbid=(tag,), close=before + tag,
                                           trimmed=self.trimmed))
        return b.rules.add(f"{header} {value} {b.m(after)}", "param")


def _cdata(expression: str, tag: str) -> str:
    """MiniCPM5: a plain value (no ``<``, ``&`` or newline, no padding) or a CDATA block."""
    plain = raw_value(f"({expression}) & /[^<&\\n]*/", trimmed=True)
    block = raw_value(expression, forbid=("]]>", tag), trimmed=False)
    return f'(({plain}) | ("<![CDATA[" ({block}) "]]>")) {json.dumps(tag)}'


QWEN3_CODER = TaggedCalls(
    section=("<tool_call>", "</tool_call>"), head=("\n<function=", ">\n"),
    tail="</function>\n", key=("<parameter=", ">\n"), value=("\n", "</parameter>", "\n"),
    trimmed=False,
)
GLM47 = TaggedCalls(
    section=("<tool_call>", "</tool_call>"), head=("", "\n"), tail="",
    key=("<arg_key>", "</arg_key>\n<arg_value>"), value=("", "</arg_value>", "\n"),
    trimmed=True,
)
LONGCAT = TaggedCalls(
    section=("<longcat_tool_call>", "</longcat_tool_call>"), head=("", "\n"), tail="",
    key=("<longcat_arg_key>", "</longcat_arg_key>\n<longcat_arg_value>"),
    value=("", "</longcat_arg_value>", "\n"), trimmed=True,
)
MINIMAX_M2 = TaggedCalls(
    section=("<minimax:tool_call>\n", "</minimax:tool_call>"), head=('<invoke name="', '">\n'),
    tail="</invoke>\n", key=('<parameter name="', '">'), value=("", "</parameter>", "\n"),
    trimmed=True, shared=True,
)
MUSE_SPARK = TaggedCalls(
    section=("<atem:function_calls>\n", "</atem:function_calls>"),
    head=('<atem:invoke name="', '">\n'), tail="</atem:invoke>\n",
    key=('<atem:parameter name="', '">'), value=("", "</atem:parameter>", "\n"),
    trimmed=True, shared=True,
)
MINICPM5 = TaggedCalls(
    section=("<function name=", "</function>"), head=('"', '">'), tail="",
    key=('<param name="', '">'), value=("", "</param>", ""), trimmed=True, cdata=True,
)
KIMI_K3 = TaggedCalls(
    section=("<|open|>tools<|sep|>", "<|close|>tools<|sep|>"),
    head=('<|open|>call tool="', "<|sep|>"), tail="<|close|>call<|sep|>",
    key=('<|open|>argument key="', "<|sep|>"), value=("", "<|close|>argument<|sep|>", ""),
    trimmed=False, shared=True, typed=True, indexed=True,
)

GRAMMARS: dict[str, CallGrammar] = {
    "json_tools": JsonObjectCalls(),
    "qwen3_coder": QWEN3_CODER,
    "glm47": GLM47,
    "laguna": GLM47,
    "longcat": LONGCAT,
    "minimax_m2": MINIMAX_M2,
    "muse_spark": MUSE_SPARK,
    "minicpm5": MINICPM5,
    "kimi_k3": KIMI_K3,
    "kimi_k2": KimiK2Calls(),
    "mistral": MistralCalls(),
    "pythonic": PythonicCalls(),
    "gemma4": GemmaCalls(),
    "function_gemma": GemmaCalls("<start_function_call>", "<end_function_call>", "<escape>"),
    "harmony": HarmonyCalls(),
    "llama3_json": LlamaCalls(),
}


def for_family(name: str | None, *, array_calls: bool = False) -> CallGrammar | None:
    """The family's call grammar (None: afmd cannot force its calls)."""
    if name == "mistral" and array_calls:
        return MistralCalls(array=True)
    return GRAMMARS.get(name) if name else None
