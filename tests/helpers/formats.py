"""One spec per call format for the shared format suite: tokens, template, and writers.

A spec says how the family's model writes calls, reasoning and an answer (the writers
the parser cases are rendered with), which tokens its tokenizer has (so that mlx-lm
detects the format from vocabulary and template as it does on the real model), and which
token the thinking opener ties with (:mod:`helpers.format_models` gives both the same
output row, so a sampled model opens either about as often).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from helpers import format_templates as t

Calls = list[tuple[str, dict[str, Any]]]
CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINK = ("<think>", "</think>")


def _raw(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _python_str(value: Any) -> str:
    """Jinja's ``| string`` (Qwen3-Coder's scalars): Python's str."""
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


@dataclass(frozen=True)
class Spec:
    id: str
    parser: str | None  # mlx-lm's tool parser for it (None: afmd detects it: harmony)
    tokens: tuple[str, ...]  # added tokens, special, in id order
    eos: tuple[str, ...]
    template: str
    calls: Callable[[Calls], str]
    think: tuple[str, str] | None = None  # reasoning markers the model writes
    think_rival: str | None = None  # the token the thinking opener ties with
    parallel: bool = True  # several calls fit in one turn
    text_then_calls: bool = True  # calls may follow text in the same turn
    family: str | None = None  # afmd's reader (default: the parser's name)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def reader(self) -> str:
        return self.family or self.parser or ""

    def reasoning(self, text: str) -> str:
        if self.id == "harmony":
            return f"<|channel|>analysis<|message|>{text}<|end|><|start|>assistant"
        assert self.think is not None
        return f"{self.think[0]}{text}{self.think[1]}"

    def answer(self, text: str) -> str:
        return f"<|channel|>final<|message|>{text}" if self.id == "harmony" else text


def _hermes(calls: Calls) -> str:
    return "\n".join(
        "<tool_call>\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False)
        + "\n</tool_call>" for n, a in calls)


def _qwen3_coder(calls: Calls) -> str:
    return "\n".join(
        f"<tool_call>\n<function={n}>\n"
        + "".join(f"<parameter={k}>\n{_python_str(v)}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>" for n, a in calls)


def _glm(calls: Calls, prefix: str = "") -> str:
    return "\n".join(
        f"<{prefix}tool_call>{n}\n"
        + "".join(f"<{prefix}arg_key>{k}</{prefix}arg_key>\n<{prefix}arg_value>{_raw(v)}"
                  f"</{prefix}arg_value>\n" for k, v in a.items())
        + f"</{prefix}tool_call>" for n, a in calls)


def _invokes(section: str, invoke: str, parameter: str) -> Callable[[Calls], str]:
    def write(calls: Calls) -> str:
        body = "".join(
            f'<{invoke} name="{n}">\n'
            + "".join(f'<{parameter} name="{k}">{_raw(v)}</{parameter}>\n' for k, v in a.items())
            + f"</{invoke}>\n" for n, a in calls)
        return f"<{section}>\n{body}</{section}>"
    return write


def _minicpm5(calls: Calls) -> str:
    def value(v: Any) -> str:
        if isinstance(v, str) and any(c in v for c in "<&\n"):
            return f"<![CDATA[{v}]]>"
        return _raw(v)
    return "\n".join(
        f'<function name="{n}">'
        + "".join(f'<param name="{k}">{value(v)}</param>' for k, v in a.items())
        + "</function>" for n, a in calls)


def _pythonic(calls: Calls) -> str:
    inner = ", ".join(
        n + "(" + ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in a.items())
        + ")" for n, a in calls)
    return f"<|tool_call_start|>[{inner}]<|tool_call_end|>"


def _gemma(start: str, end: str, quote: str) -> Callable[[Calls], str]:
    def write(calls: Calls) -> str:
        return "".join(
            f"{start}call:{n}{{"
            + ",".join(f"{k}:{quote}{v}{quote}" if isinstance(v, str)
                       else f"{k}:{json.dumps(v, ensure_ascii=False)}" for k, v in a.items())
            + f"}}{end}" for n, a in calls)
    return write


def _kimi_k2(calls: Calls) -> str:
    return "<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>"
        + json.dumps(a, ensure_ascii=False) + "<|tool_call_end|>"
        for i, (n, a) in enumerate(calls)) + "<|tool_calls_section_end|>"


def _kimi_k3(calls: Calls) -> str:
    return "<|open|>tools<|sep|>" + "".join(
        f'<|open|>call tool="{n}" index="{i + 1}"<|sep|>'
        + "".join(f'<|open|>argument key="{k}" type="{"string" if isinstance(v, str) else "json"}"'
                  f"<|sep|>{_raw(v)}<|close|>argument<|sep|>" for k, v in a.items())
        + "<|close|>call<|sep|>" for i, (n, a) in enumerate(calls)) + "<|close|>tools<|sep|>"


def _mistral(calls: Calls) -> str:
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a, ensure_ascii=False)}"
                   for n, a in calls)


def _mistral_v3(calls: Calls) -> str:
    items = [json.dumps({"name": n, "arguments": a, "id": f"abcdefgh{i}"}, ensure_ascii=False)
             for i, (n, a) in enumerate(calls)]
    return "[TOOL_CALLS] [" + ", ".join(items) + "]"


def _llama3(calls: Calls) -> str:
    return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False)
                     for n, a in calls)


def _harmony(calls: Calls) -> str:
    assert len(calls) == 1, "harmony writes one call per turn"
    (n, a), = calls
    return (f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>"
            + json.dumps(a, ensure_ascii=False))


SPECS: dict[str, Spec] = {s.id: s for s in (
    Spec("hermes", "json_tools", (*CHATML, "<tool_call>", "</tool_call>", *THINK),
         ("<|im_end|>", "<|endoftext|>"), t.HERMES, _hermes, THINK, "<tool_call>"),
    Spec("qwen3_coder", "qwen3_coder", (*CHATML, "<tool_call>", "</tool_call>"),
         ("<|im_end|>", "<|endoftext|>"), t.QWEN3_CODER, _qwen3_coder),
    Spec("glm47", "glm47", (
        "<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
        "<|observation|>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
        "<arg_value>", "</arg_value>", *THINK),
         ("<|endoftext|>", "<|user|>", "<|observation|>"), t.GLM47, _glm, THINK, "<tool_call>"),
    Spec("longcat", "longcat", (
        *CHATML, "<longcat_tool_call>", "</longcat_tool_call>", "<longcat_arg_key>",
        "</longcat_arg_key>", "<longcat_arg_value>", "</longcat_arg_value>",
        "<longcat_think>", "</longcat_think>"),
         ("<|im_end|>", "<|endoftext|>"), t.LONGCAT, lambda c: _glm(c, "longcat_"),
         ("<longcat_think>", "</longcat_think>"), "<longcat_tool_call>"),
    Spec("minimax_m2", "minimax_m2", (*CHATML, "<minimax:tool_call>", "</minimax:tool_call>",
                                      *THINK),
         ("<|im_end|>", "<|endoftext|>"), t.MINIMAX_M2,
         _invokes("minimax:tool_call", "invoke", "parameter"), THINK, "<minimax:tool_call>"),
    Spec("muse_spark", "muse_spark", (*CHATML, "<atem:function_calls>",
                                      "</atem:function_calls>"),
         ("<|im_end|>", "<|endoftext|>"), t.MUSE_SPARK,
         _invokes("atem:function_calls", "atem:invoke", "atem:parameter")),
    Spec("minicpm5", "minicpm5", (*CHATML, *THINK), ("<|im_end|>", "<|endoftext|>"),
         t.MINICPM5, _minicpm5, THINK),
    Spec("pythonic", "pythonic", (
        *CHATML, "<|tool_list_start|>", "<|tool_list_end|>", "<|tool_call_start|>",
        "<|tool_call_end|>", "<|tool_response_start|>", "<|tool_response_end|>", *THINK),
         ("<|im_end|>", "<|endoftext|>"), t.PYTHONIC, _pythonic, THINK, "<|tool_call_start|>"),
    Spec("gemma4", "gemma4", (*CHATML, "<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>",
                              "<channel|>"),
         ("<|im_end|>", "<|endoftext|>"), t.GEMMA4, _gemma("<|tool_call>", "<tool_call|>",
                                                           '<|"|>'),
         ("<|channel>thought", "<channel|>"), "<|tool_call>"),
    Spec("function_gemma", "function_gemma", (*CHATML, "<start_function_call>",
                                              "<end_function_call>", "<escape>"),
         ("<|im_end|>", "<|endoftext|>"), t.FUNCTION_GEMMA,
         _gemma("<start_function_call>", "<end_function_call>", "<escape>")),
    Spec("kimi_k2", "kimi_k2", (
        "<|endoftext|>", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
        "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
        "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", *THINK),
         ("<|im_end|>", "<|endoftext|>"), t.KIMI_K2, _kimi_k2, THINK,
         "<|tool_calls_section_begin|>"),
    Spec("kimi_k3", "kimi_k3", ("<|endoftext|>", "<|open|>", "<|close|>", "<|sep|>",
                                "<|end_of_msg|>"),
         ("<|end_of_msg|>", "<|endoftext|>"), t.KIMI_K3, _kimi_k3,
         ("<|open|>think<|sep|>", "<|close|>think<|sep|>"), "<|open|>tools<|sep|>"),
    Spec("mistral", "mistral", (
        "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
        "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]",
        "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[THINK]", "[/THINK]"),
         ("</s>",), t.MISTRAL, _mistral, ("[THINK]", "[/THINK]"), "[TOOL_CALLS]"),
    Spec("mistral_v3", "mistral", (
        "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
        "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]"),
         ("</s>",), t.MISTRAL_V3, _mistral_v3),
    Spec("harmony", None, (
        "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
        "<|constrain|>", "<|return|>", "<|call|>"),
         ("<|return|>", "<|call|>", "<|endoftext|>"), t.HARMONY, _harmony, parallel=False,
         family="harmony"),
    Spec("llama3", None, (
        "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
        "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
         ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"), t.LLAMA3, _llama3,
         family="llama3_json", text_then_calls=False),
)}
