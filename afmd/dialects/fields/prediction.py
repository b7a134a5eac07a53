"""OpenAI's ``prediction`` (Predicted Outputs): the text the client expects the output to be.

An editor that asks for a file rewritten with a small change knows most of the answer
already; sent as ``{"type": "content", "content": "…"}`` (a string or text parts), it lets
afmd verify many tokens per forward pass where the output agrees with it
(:mod:`afmd.engine.speculative.verification`). It changes no token of the output, only its speed.
"""

from __future__ import annotations

from typing import Any

from afmd.dialects.fields.checks import missing, not_one_of, reject_unknown, required, wrong_type

_KEYS = frozenset({"type", "content"})
_PART_KEYS = frozenset({"type", "text"})


def parse_prediction(value: Any, param: str = "prediction") -> str | None:
    """The prediction's text (parts joined), or None when absent or null."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise wrong_type(param, "an object", value)
    reject_unknown(value, _KEYS, prefix=f"{param}.")
    kind = value.get("type")
    if kind is None:
        raise missing(f"{param}.type")
    if kind != "content":
        raise not_one_of(f"{param}.type", kind, ("content",))
    content = value.get("content")
    if content is None:
        raise missing(f"{param}.content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise wrong_type(f"{param}.content", "a string or an array of text parts", content)
    texts: list[str] = []
    for i, part in enumerate(content):
        where = f"{param}.content[{i}]"
        if not isinstance(part, dict):
            raise wrong_type(where, "an object", part)
        reject_unknown(part, _PART_KEYS, prefix=f"{where}.")
        part_type = part.get("type")
        if part_type is None:
            raise missing(f"{where}.type")
        if part_type != "text":
            raise not_one_of(f"{where}.type", part_type, ("text",))
        texts.append(required(part, "text", f"{where}.text", str, "a string"))
    return "".join(texts)
