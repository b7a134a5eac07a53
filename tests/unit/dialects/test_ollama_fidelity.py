"""Ollama's answers where afmd read a body or worded an error otherwise than Ollama's
server does (its server/routes.go and api/types.go): ``seed: -1`` is no seed, a role is
read in any case, ``think`` asks for thinking, and an error names the field it is about
(``options.num_ctx``, ``images[0]``, ``messages[1].images[0]``) in Ollama's one message.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from afmd.core.request import CONTEXT_WINDOW_PARAM, context_limit
from afmd.dialects.ollama.ollama_api import OLLAMA_CHAT, OLLAMA_GENERATE, error_body
from afmd.dialects.ollama.ollama_body import parse_chat, parse_generate, wants_thinking
from afmd.errors import ContextLengthError, InvalidRequestError
from afmd.output.formats.detect import HARMONY_TOKENS
from afmd.service.output_plan import template_kwargs
from afmd.service.pipeline import thinking_not_supported


def chat(**fields: Any) -> Any:
    body = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], **fields}
    return parse_chat(json.dumps(body).encode())


def generate(**fields: Any) -> Any:
    return parse_generate(json.dumps({"model": "demo", "prompt": "Hi", **fields}).encode())


def test_seed_minus_one_is_no_seed_and_other_seeds_are_kept() -> None:
    """Ollama's default seed is -1, which llama.cpp and Ollama's samplers read as "a fresh
    one": afmd made it the fixed seed -1, every answer the same."""
    assert chat(options={"seed": -1, "temperature": 1}).seed is None
    assert generate(options={"seed": -1}).seed is None
    assert generate(raw=True, options={"seed": -1}).seed is None
    assert chat(options={"seed": -5}).seed == -5  # a seed, as Ollama casts it
    assert chat(options={"seed": 0}).seed == 0
    assert chat(options={"seed": 42}).seed == 42


def test_a_role_is_read_in_any_case() -> None:
    """Ollama lowercases a message's role as it decodes it."""
    request = chat(messages=[{"role": "System", "content": "Be brief."},
                             {"role": "USER", "content": "Hi"}])
    assert [m.role for m in request.messages] == ["system", "user"]
    with pytest.raises(InvalidRequestError, match="Invalid role"):
        chat(messages=[{"role": "Robot", "content": "Hi"}])


@pytest.mark.parametrize(("think", "wants"), [
    (True, True), ("low", True), ("medium", True), ("high", True), ("max", True),
    (False, False), (None, False)])
def test_think_asks_for_thinking_as_ollamas_think_value(think: Any, wants: bool) -> None:
    assert wants_thinking(think) is wants
    assert chat(think=think).require_thinking is wants
    assert generate(think=think).require_thinking is wants
    assert generate(think=think, raw=True).require_thinking is wants


def test_a_bad_think_is_refused_in_raw_mode_too() -> None:
    """Ollama decodes ``think`` before it looks at ``raw``."""
    with pytest.raises(InvalidRequestError, match="'think'"):
        generate(raw=True, think="extreme")


class _HarmonyTokenizer:
    def get_vocab(self) -> dict[str, int]:
        return {token: i for i, token in enumerate(HARMONY_TOKENS)}


class _HarmonyModel:
    """What the output plan reads of a gpt-oss model: its vocabulary's channel tokens."""

    tool_format = None
    thinking = None
    eos_ids: tuple[int, ...] = ()

    def __init__(self) -> None:
        self.tokenizer = _HarmonyTokenizer()


@pytest.mark.parametrize(("think", "level"), [
    (True, "medium"), ("low", "low"), ("high", "high"), ("max", "high"), (False, "low")])
def test_think_levels_reach_gpt_oss_as_ollama_maps_them(think: Any, level: str) -> None:
    """gpt-oss has no level above high, which Ollama maps ``max`` to: afmd's ``xhigh``
    fell through to medium, less reasoning than ``high`` asked for."""
    model: Any = _HarmonyModel()
    assert template_kwargs(chat(think=think), model) == {"reasoning_effort": level}


def test_a_model_without_thinking_is_refused_in_ollamas_words() -> None:
    error = thinking_not_supported("qwen2.5:latest")
    assert error_body(error) == {"error": '"qwen2.5:latest" does not support thinking'}
    assert OLLAMA_CHAT.error_param(error) == "think"


def test_the_context_window_is_the_smaller_one() -> None:
    assert context_limit(4096, None) == (4096, False)
    assert context_limit(4096, 100) == (100, True)
    assert context_limit(4096, 10**7) == (4096, False)  # a larger one is the model's
    assert context_limit(4096, 4096) == (4096, False)


def test_a_prompt_too_long_for_num_ctx_names_it() -> None:
    own = ContextLengthError("x", prompt_tokens=610, limit=20, param=CONTEXT_WINDOW_PARAM)
    message = error_body(own)["error"]
    assert message.startswith("options.num_ctx: ")
    assert "610 tokens" in message and "20 tokens" in message
    assert OLLAMA_CHAT.error_param(own) == OLLAMA_GENERATE.error_param(own) == "options.num_ctx"
    model = ContextLengthError("x", prompt_tokens=5000, limit=4096)
    assert error_body(model) == {"error": "the input length (5000 tokens) exceeds the "
                                          "model's maximum context length (4096 tokens)"}


@pytest.mark.parametrize(("param", "chat_says", "generate_says"), [
    ("messages[1].images[0]", "messages[1].images[0]", "messages[1].images[0]"),
    ("images[0]", "images[0]", "images[0]"),
])
def test_an_image_error_starts_with_its_field(param: str, chat_says: str,
                                              generate_says: str) -> None:
    error = InvalidRequestError("The image data is not a PNG, JPEG, WebP or GIF image.",
                                code="invalid_image", param=param)
    assert OLLAMA_CHAT.error_envelope(error)["error"].startswith(f"{chat_says}: ")
    assert OLLAMA_GENERATE.error_envelope(error)["error"].startswith(f"{generate_says}: ")


@pytest.mark.parametrize("param", ["messages[1].images[0]", "images[0]"])
def test_images_for_a_model_that_cannot_see_name_the_image(param: str) -> None:
    """The pipeline names the first image as the body named it: a message's
    ``images[0]``, or a generate body's own ``images[0]`` (it has no messages)."""
    error = InvalidRequestError("The model 'demo' does not accept image input.",
                                code="image_input_not_supported", param=param)
    for dialect in (OLLAMA_CHAT, OLLAMA_GENERATE):
        assert dialect.error_envelope(error)["error"].startswith(f"{param}: ")
        assert dialect.error_param(error) == param


def test_a_field_the_message_names_or_afmds_own_is_not_prefixed() -> None:
    named = InvalidRequestError("'messages[0].images[0]' is not base64-encoded image data.",
                                param="messages[0].images[0]")
    assert error_body(named)["error"] == named.message
    foreign = InvalidRequestError("The model samples by itself.", param="logit_bias")
    assert error_body(foreign)["error"] == foreign.message  # no field of Ollama's body
