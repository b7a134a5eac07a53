"""A prefilled answer: the conversation ends in the assistant's text and the answer
continues it (Anthropic's prefill, Ollama's last assistant message, vLLM's
``continue_final_message`` on Chat Completions), on the real server and the demo model,
through the official clients.

The reference is mlx-lm's: the chat template rendered with ``continue_final_message``
(the prompt ends inside the assistant's text, no end of turn, no new turn) and the
model's greedy continuation of it. Each dialect must give that continuation alone, and
count the prefill as prompt.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import mlx_lm
import ollama
import openai
import pytest

from afmd.engine.demo import builtin as demo

from conftest import ServerProcess
from helpers.numerics import greedy

QUESTION = "Write the config as JSON."
PREFILL = 'Here it is: {"name":'
CONVERSATION = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": PREFILL}]
TOKENS = 12
#: The current anthropic client passes sampling in extra_body (plain fields on the wire).
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def lm() -> tuple[Any, Any]:
    """The demo model the server runs (same cache folder), loaded here by mlx-lm."""
    return mlx_lm.load(str(demo.materialize("demo")))


@pytest.fixture(scope="module")
def reference(lm: tuple[Any, Any]) -> tuple[list[int], list[int]]:
    """The continued prompt's ids and mlx-lm's greedy continuation of it."""
    tokenizer = lm[1]
    text = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=False,
                                         continue_final_message=True, tokenize=False)
    answered = tokenizer.apply_chat_template(CONVERSATION[:1], add_generation_prompt=True,
                                             tokenize=False)
    assert text.endswith(PREFILL) and text.startswith(answered)  # the turn left open
    prompt = list(tokenizer.encode(text, add_special_tokens=False))
    return prompt, greedy(lm, prompt, TOKENS)


def _agrees(lm: tuple[Any, Any], reference: tuple[list[int], list[int]], text: str) -> None:
    want = lm[1].decode(reference[1])
    assert text == want, (text, want)


def test_anthropic_continues_the_prefill(server: ServerProcess, lm: Any,
                                         reference: tuple[list[int], list[int]]) -> None:
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    reply = claude.messages.create(model="demo", max_tokens=TOKENS, extra_body=GREEDY,
                                   messages=CONVERSATION)  # type: ignore[arg-type]
    (block,) = reply.content
    assert block.type == "text"
    _agrees(lm, reference, block.text)
    assert not block.text.startswith(PREFILL)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(reference[0])
    assert reply.usage.output_tokens == len(reference[1])
    # Streamed, the same text, and nothing of the prefill in it.
    with claude.messages.stream(model="demo", max_tokens=TOKENS, extra_body=GREEDY,
                                messages=CONVERSATION) as stream:  # type: ignore[arg-type]
        streamed = "".join(stream.text_stream)
    assert streamed == block.text


def test_an_empty_last_assistant_message_is_no_prefill(server: ServerProcess) -> None:
    """Anthropic accepts the last message empty: the answer is as without it."""
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    plain = claude.messages.create(model="demo", max_tokens=TOKENS, extra_body=GREEDY,
                                   messages=CONVERSATION[:1])  # type: ignore[arg-type]
    empty = claude.messages.create(
        model="demo", max_tokens=TOKENS, extra_body=GREEDY,
        messages=[CONVERSATION[0], {"role": "assistant", "content": ""}])
    assert empty.content == plain.content
    assert empty.usage.output_tokens == plain.usage.output_tokens


def test_ollama_continues_the_last_assistant_message(
        server: ServerProcess, lm: Any, reference: tuple[list[int], list[int]]) -> None:
    client = ollama.Client(host=server.url)
    reply = client.chat(model="demo", messages=CONVERSATION,
                        options={"temperature": 0, "num_predict": TOKENS})
    _agrees(lm, reference, reply.message.content or "")
    assert reply.prompt_eval_count == len(reference[0])
    streamed = "".join(part.message.content or "" for part in client.chat(
        model="demo", messages=CONVERSATION, stream=True,
        options={"temperature": 0, "num_predict": TOKENS}))
    assert streamed == reply.message.content


def test_chat_continue_final_message(server: ServerProcess, lm: Any,
                                     reference: tuple[list[int], list[int]]) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="demo", max_tokens=TOKENS, temperature=0, messages=CONVERSATION,  # type: ignore[arg-type]
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    _agrees(lm, reference, reply.choices[0].message.content or "")
    assert reply.usage is not None and reply.usage.prompt_tokens == len(reference[0])
    # Without the switch, a last assistant message is still refused, saying how.
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", max_tokens=TOKENS,
                                       messages=CONVERSATION)  # type: ignore[arg-type]
    body: Any = caught.value.body
    assert body["code"] == "invalid_last_message" and body["param"] == "messages[1].role"
    assert "continue_final_message" in body["message"]


@pytest.mark.parametrize(("path", "body", "param"), [
    # Anthropic's own rule: the answer would begin after the space.
    ("/v1/messages", {"messages": [CONVERSATION[0], {"role": "assistant", "content": "So "}]},
     "messages[1].content"),
    ("/v1/messages", {"messages": CONVERSATION, "thinking": {"type": "enabled",
                                                             "budget_tokens": 16}},
     "thinking"),
    ("/v1/messages", {"messages": CONVERSATION, "output_config": {"format": {
        "type": "json_schema", "schema": {"type": "object"}}}}, "output_config.format"),
    ("/v1/messages", {"messages": CONVERSATION, "tool_choice": {"type": "any"}, "tools": [
        {"name": "f", "input_schema": {"type": "object"}}]}, "tool_choice"),
    ("/v1/chat/completions", {"messages": CONVERSATION, "continue_final_message": True,
                              "response_format": {"type": "json_object"}},
     "response_format"),
    ("/v1/chat/completions", {"messages": CONVERSATION, "continue_final_message": True,
                              "add_generation_prompt": True}, "add_generation_prompt"),
    ("/v1/chat/completions", {"messages": CONVERSATION[:1], "continue_final_message": True},
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": CONVERSATION[:1], "add_generation_prompt": False},
     "add_generation_prompt"),
    ("/v1/chat/completions", {"messages": CONVERSATION, "continue_final_message": "yes"},
     "continue_final_message"),
    ("/api/chat", {"messages": CONVERSATION, "format": "json", "stream": False}, "format"),
])
def test_a_prefill_that_cannot_be_honoured_is_a_400_naming_its_field(
        server: ServerProcess, path: str, body: dict[str, Any], param: str) -> None:
    body = {"model": "demo", "max_tokens": 32, **body}
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if path == "/api/chat":
        assert error.startswith(f"{param}:") or param in error, error
    elif path == "/v1/messages":
        assert error["message"].startswith(f"{param}:"), error
    else:
        assert error["param"] == param, error
