"""``/api/generate`` bodies refused where Ollama refuses them: a raw prompt with a
``template`` or ``context`` (Ollama's "raw mode does not support template, system, or
context"), a ``context`` that is no token list, and Ollama's no-op options of the wrong
type, each a 400 naming its field rather than a value accepted unseen. A templated
prompt's ``context`` is the earlier answer's ids it continues, given back in its last
object.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson
import pytest

from afmd.core.events import Content, Finish, Usage
from afmd.core.request import ChatRequest, CompletionRequest
from afmd.dialects.dialect import ReturnsTokens
from afmd.dialects.ollama.ollama_api import OLLAMA_GENERATE, error_body
from afmd.dialects.ollama.ollama_body import parse_generate
from afmd.errors import InvalidRequestError


def generate(**fields: Any) -> Any:
    return parse_generate(json.dumps({"model": "demo", "prompt": "Hi", **fields}).encode())


@pytest.mark.parametrize("fields", [{"template": "{{ .Prompt }}"}, {"context": [1, 2]}])
def test_raw_refuses_a_template_or_context(fields: dict[str, Any]) -> None:
    (name,) = fields
    with pytest.raises(InvalidRequestError, match=f"'{name}' cannot be combined with raw"):
        generate(raw=True, **fields)
    assert generate(raw=True, **{name: type(fields[name])()}).prompts == ("Hi",)  # empty


def test_a_template_is_ignored_and_named() -> None:
    assert generate(template="{{ .Prompt }}").ignored_fields == ("template",)


def test_a_context_is_the_prompts_prefix_and_not_ignored() -> None:
    request = generate(context=[5, 6, 7])
    assert isinstance(request, ChatRequest)
    assert request.prompt_prefix == (5, 6, 7) and request.ignored_fields == ()
    assert generate(context=[]).prompt_prefix == ()
    strict = parse_generate(json.dumps({"model": "demo", "prompt": "Hi",
                                        "context": [5]}).encode(), strict=True)
    assert isinstance(strict, ChatRequest) and strict.prompt_prefix == (5,)


def test_a_context_with_a_suffix_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="'context' cannot be combined with a "
                                                  "'suffix'") as caught:
        generate(suffix="\n", context=[1])
    assert caught.value.param == "context"
    assert isinstance(generate(suffix="\n", context=[]), CompletionRequest)


def test_an_id_the_model_lacks_is_named_as_the_body_names_it() -> None:
    error = InvalidRequestError("Invalid token id 9: the model 'demo' has ids 0-8.",
                                param="prompt_prefix[3]")
    assert error_body(error) == {"error": "context[3]: " + error.message}
    assert OLLAMA_GENERATE.error_param(error) == "context[3]"


def _templated() -> ReturnsTokens:
    reply = OLLAMA_GENERATE.reply(generate(), model="demo", fingerprint="fp")
    assert isinstance(reply, ReturnsTokens)
    return reply


def test_the_last_object_carries_the_context() -> None:
    events = [Content("Hello"), Finish("stop"), Usage(2, 1)]
    reply: Any = _templated()
    reply.tokens_ran([1, 2, 3])
    assert orjson.loads(reply.body(events))["context"] == [1, 2, 3]
    reply = _templated()
    assert reply.stream([Content("He")]).count(b"context") == 0
    reply.tokens_ran([1, 2, 3])
    lines = [orjson.loads(line) for line in reply.stream(events).splitlines()]
    assert [line.get("context") for line in lines] == [None, [1, 2, 3]]
    # A raw prompt's answer has none, as in Ollama.
    raw = OLLAMA_GENERATE.reply(generate(raw=True), model="demo", fingerprint="fp")
    assert not isinstance(raw, ReturnsTokens)


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
