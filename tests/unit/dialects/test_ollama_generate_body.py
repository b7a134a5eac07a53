"""``/api/generate`` bodies refused where Ollama refuses them: a raw prompt with a
``template`` or ``context`` (Ollama's "raw mode does not support template, system, or
context"), a ``context`` that is no token list, and Ollama's no-op options of the wrong
type, each a 400 naming its field rather than a value accepted unseen.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from afmd.dialects.ollama.ollama_body import parse_generate
from afmd.errors import InvalidRequestError


def generate(**fields: Any) -> Any:
    return parse_generate(json.dumps({"model": "demo", "prompt": "Hi", **fields}).encode())


@pytest.mark.parametrize("fields", [{"template": "{{ .Prompt }}"}, {"context": [1, 2]}])
def test_raw_refuses_a_template_or_context(fields: dict[str, Any]) -> None:
    (name,) = fields
    with pytest.raises(InvalidRequestError, match=f"'{name}' cannot be combined with raw"):
        generate(raw=True, **fields)
    assert name in generate(**fields).ignored_fields  # without raw: ignored, and named


@pytest.mark.parametrize(("context", "param"), [("x", "context"), ([1, "a"], "context[1]"),
                                                ([True], "context[0]")])
def test_a_context_must_be_tokens(context: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(f"'{param}'")):
        generate(context=context)


@pytest.mark.parametrize(("option", "value"), [
    ("typical_p", "x"), ("mirostat", "2"), ("mirostat_tau", [5]), ("penalize_newline", "no"),
    ("use_mmap", 1), ("num_gpu", {}), ("num_thread", True)])
def test_a_no_op_option_of_the_wrong_type_is_refused(option: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError, match=rf"'options\.{option}'"):
        generate(options={option: value})


def test_no_op_options_of_ollamas_types_pass() -> None:
    request = generate(options={"typical_p": 0.7, "mirostat": 1.5, "mirostat_tau": -1,
                                "penalize_newline": False, "use_mmap": True, "num_gpu": 99,
                                "tfs_z": 1, "num_keep": -1})
    assert request.ignored_fields == ()
