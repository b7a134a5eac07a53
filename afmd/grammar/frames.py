"""What surrounds a turn's calls in the grammar, and the grammar text being written.

:class:`Build` turns markup into lark (special tokens by id, since text can never produce
them) and hands out fresh rule names. A :class:`Frame` is what a family puts around its
calls: an optional (or, for gpt-oss, expected) thinking block before them, free text, or
a JSON answer; harmony writes the answer on its ``final`` channel and the reasoning on
``analysis``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llguidance import LLTokenizer

from afmd.grammar.params import Rules, json_value

THINK_TEXT = r"/(.|\n)*/"


@dataclass(frozen=True, slots=True)
class Thinking:
    start: str
    end: str
    in_reasoning: bool  # the prompt already opened the thinking block
    budget: int | None  # max tokens of thinking under this grammar (None: unbounded)
    required: bool = False  # the turn must think first (harmony, when reasoning is on)


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: dict[str, Any]  # the grammar's copy: closed, rooted at itself


class Build:
    """One grammar text being written: the tokenizer's markers, fresh rule names."""

    def __init__(self, tokenizer: LLTokenizer, lenient: bool) -> None:
        self.tokenizer = tokenizer
        self.lenient = lenient
        self.rules = Rules("g")

    def m(self, text: str) -> str:
        """Markup as lark: special tokens by id (text cannot produce them), the rest as
        string literals."""
        if not text:
            return ""
        ids = self.tokenizer.tokenize_str(text, parse_special=True)
        out: list[str] = []
        run: list[int] = []
        for token in ids:
            if self.tokenizer.is_special_token(token):
                if run:
                    out.append(json.dumps(self.tokenizer.decode_str(run)))
                    run = []
                out.append(f"<[{token}]>")
            else:
                run.append(token)
        if run:
            out.append(json.dumps(self.tokenizer.decode_str(run)))
        return " ".join(out)

    def is_token(self, text: str) -> bool:
        ids = self.tokenizer.tokenize_str(text, parse_special=True)
        return len(ids) == 1 and self.tokenizer.is_special_token(ids[0])

    def starts_with_token(self, text: str) -> bool:
        ids = self.tokenizer.tokenize_str(text, parse_special=True)
        return bool(ids) and self.tokenizer.is_special_token(ids[0])

    def json(self, schema: Any) -> str:
        return json_value(schema, self.lenient)


# --------------------------------------------------------------------------- frames


class Frame:
    """Plain turns: an optional thinking block, then text, a JSON answer or calls."""

    def prefix(self, b: Build, thinking: Thinking | None) -> str:
        if thinking is None:
            return ""
        attrs = f"[max_tokens={thinking.budget}]" if thinking.budget else ""
        b.rules.lines.append(f"think_text{attrs}: {THINK_TEXT}")
        end = b.m(thinking.end)
        if thinking.in_reasoning:
            b.rules.lines.append(f'think: think_text {end} "\\n"? "\\n"?')
            return "think "
        b.rules.lines.append(f'think: {b.m(thinking.start)} think_text {end} "\\n"? "\\n"?')
        return "think " if thinking.required else "think? "

    def text(self, b: Build) -> str:
        b.rules.lines.append("TEXT: /(.|\\n)+/")
        return "TEXT"

    def answer(self, b: Build, schema: Any) -> str:
        return b.rules.add(b.json(schema), "answer")

    def text_or_calls(self, b: Build, calls: str, opener: str) -> str:
        """Free text, or calls after optional text. Text cannot produce a special token,
        so where calls open with one the text simply stops there; where they open with
        text, a lazy lexeme runs the text up to the opener instead."""
        text = self.text(b)
        if b.starts_with_token(opener):
            return f"{text} | {text}? {calls}"
        plain = b.rules.terminal(
            "/(?s:.+)/ & ~/(?s:.*)" + _regex_escape(opener) + "(?s:.*)/")
        lead = b.rules.add("/(?s:.*)" + _regex_escape(opener) + "/", "lead")
        b.rules.lines[-1] = b.rules.lines[-1].replace(f"{lead}:", f"{lead}[lazy]:", 1)
        rest = b.rules.add(f"{lead} {calls}", "after")
        return f"{plain} | {rest} | {calls}"


class HarmonyFrame(Frame):
    """gpt-oss: reasoning on the analysis channel, the answer on final, calls in between."""

    def prefix(self, b: Build, thinking: Thinking | None) -> str:
        if thinking is None:
            return ""
        attrs = f"[max_tokens={thinking.budget}]" if thinking.budget else ""
        b.rules.lines.append(f"think_text{attrs}: {THINK_TEXT}")
        b.rules.lines.append(
            f'think: {b.m("<|channel|>")} "analysis" {b.m("<|message|>")} think_text '
            f'{b.m("<|end|>")} {b.m("<|start|>")} "assistant"')
        return "think " if thinking.required else "think? "

    def _final(self, b: Build) -> str:
        return f'{b.m("<|channel|>")} "final" {b.m("<|message|>")}'

    def text(self, b: Build) -> str:
        b.rules.lines.append("TEXT: /(.|\\n)+/")
        return b.rules.add(f"{self._final(b)} TEXT", "final")

    def answer(self, b: Build, schema: Any) -> str:
        return b.rules.add(f"{self._final(b)} {b.json(schema)}", "answer")

    def text_or_calls(self, b: Build, calls: str, opener: str) -> str:
        return f"{self.text(b)} | {calls}"


def _regex_escape(text: str) -> str:
    return "".join("\\" + ch if ch in r"\.+*?()|[]{}^$/" else ch for ch in text) \
        .replace("\n", r"\n")


__all__ = ["THINK_TEXT", "Build", "Frame", "HarmonyFrame", "Thinking", "Tool"]
