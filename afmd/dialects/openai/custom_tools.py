"""Chat Completions' ``custom`` tools: free-form text tools, as the Responses API has them.

Chat nests what Responses lays flat (``{"type": "custom", "custom": {"name", "format":
{"type": "grammar", "grammar": {"syntax", "definition"}}}}``), so only the shapes differ:
the format is checked and offered to the model as Responses does it
(:func:`afmd.dialects.responses.options.custom_parameters`, a grammar enforced by
llguidance), and a call comes back as ``{"type": "custom", "custom": {"name", "input"}}``.
The body parser (:mod:`afmd.dialects.openai.chat_body`) sits below the grammar layer, so it
is handed :func:`custom_tool_parameters` rather than importing it.
"""

from __future__ import annotations

from typing import Any

from afmd.dialects.fields.checks import not_one_of, reject_unknown, required, wrong_type
from afmd.dialects.responses.options import custom_format, custom_parameters
from afmd.dialects.responses.output_items import custom_input

#: The keys ``[api] strict`` admits in a format, as the openai SDK types them.
FORMAT_KEYS: dict[str, frozenset[str]] = {
    "text": frozenset({"type"}),
    "grammar": frozenset({"type", "grammar"}),
}
GRAMMAR_KEYS = frozenset({"syntax", "definition"})


def custom_tool_parameters(value: Any, p: str, strict: bool) -> dict[str, Any]:
    """A custom tool's ``format`` (at ``p``) as the one-string function the model is
    offered; absent, free text."""
    if value is None:
        return custom_parameters(None)
    if not isinstance(value, dict):
        raise wrong_type(p, "an object", value)
    kind = required(value, "type", f"{p}.type", str, "a string")
    if kind not in FORMAT_KEYS:
        raise not_one_of(f"{p}.type", kind, tuple(FORMAT_KEYS))
    if strict:
        reject_unknown(value, FORMAT_KEYS[kind], prefix=f"{p}.")
    if kind == "text":
        return custom_parameters(None)
    grammar = required(value, "grammar", f"{p}.grammar", dict, "an object")
    if strict:
        reject_unknown(grammar, GRAMMAR_KEYS, prefix=f"{p}.grammar.")
    flat = {"type": "grammar", "syntax": grammar.get("syntax"),
            "definition": grammar.get("definition")}
    return custom_parameters(custom_format(flat, f"{p}.grammar", False))


def custom_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A custom tool's call as chat returns it: the text the model wrote as the one
    string of the function it was offered as."""
    return {"id": call_id, "type": "custom",
            "custom": {"name": name, "input": custom_input(arguments)}}
