"""A special token no reader needs never reaches a chat answer's text, in every dialect.

The model is the demo's, its head changed so that ``<|im_start|>`` (special, neither a
marker of its call format or reasoning nor an end id) takes the place of a token its
greedy answer writes mid-way: every chat-style route leaves it out of the text yet counts
it, and chat's log-probabilities list it; ``/v1/completions`` and Ollama's raw
``/api/generate``, whose text is the decode of the ids, keep it.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import mlx.core as mx
import mlx_lm
import pytest

from afmd.engine.demo import builtin as demo

from conftest import parse_sse, start_server
from helpers.numerics import greedy

SPECIAL = "<|im_start|>"
USER = "Say something."
MESSAGES = [{"role": "user", "content": USER}]
N = 16  # tokens of answer (Responses takes no fewer): the special one comes half-way
GREEDY = {"temperature": 0, "num_predict": N}


@dataclass
class Served:
    http: httpx.Client
    tokenizer: Any
    prompt: str  # the chat prompt, as the model's template renders it
    answer: list[int]  # the greedy answer's tokens, the special one among them

    @property
    def shown(self) -> str:
        """The answer's text as chat shows it: every token but the special one."""
        return self.text(self.answer)

    def text(self, tokens: list[int]) -> str:
        """Tokens' text as chat shows it (through the model's streaming detokenizer, which
        drops the first token's leading space), the special one left out."""
        detokenizer = self.tokenizer.detokenizer
        for token in tokens:
            if token != self.tokenizer.get_vocab()[SPECIAL]:
                detokenizer.add_token(token)
        detokenizer.finalize()
        return str(detokenizer.text)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("specials")
    folder = root / "specials"
    shutil.copytree(demo.materialize("demo"), folder)
    model, tokenizer = mlx_lm.load(str(folder))
    special = tokenizer.get_vocab()[SPECIAL]
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    plain = greedy((model, tokenizer), ids, N)
    # The special token's row becomes that of a token of the answer's second half, a
    # little longer, so that it wins where that token would (its logit there the largest,
    # and positive): the first such token it does not win before, up to a near tie.
    weights = mx.load(str(folder / "model.safetensors"))
    head = weights["lm_head.weight"]
    for k in range(N // 2, len(plain) - 1):
        head[special] = head[plain[k]] * 1.05
        model.load_weights(list(weights.items()))
        answer = greedy((model, tokenizer), ids, N)
        if answer[:k] == plain[:k] and answer[k] == special and len(answer) > k + 1:
            break
    else:
        pytest.fail(f"no token of {plain} the special one can take the place of")
    mx.save_safetensors(str(folder / "model.safetensors"), weights,
                        metadata={"format": "mlx"})
    server = start_server(root, config=(
        f'[models]\ndefault = "specials"\n[[models.model]]\nid = "specials"\n'
        f'path = "{folder}"\n'))
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            yield Served(http, tokenizer, prompt, answer)
    finally:
        server.stop()


def post(served: Served, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = served.http.post(path, json={"model": "specials", **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_leaves_the_token_out_yet_counts_and_scores_it(served: Served) -> None:
    for stream in (False, True):
        body = {"messages": MESSAGES, "max_tokens": N, "temperature": 0, "logprobs": True}
        if stream:
            response = served.http.post("/v1/chat/completions", json={
                "model": "specials", **body, "stream": True,
                "stream_options": {"include_usage": True}})
            chunks = [c for c in parse_sse(response.text) if isinstance(c, dict)]
            deltas = [c["choices"][0] for c in chunks if c.get("choices")]
            content = "".join(d["delta"].get("content") or "" for d in deltas)
            scored = [e["token"] for d in deltas for e in
                      ((d.get("logprobs") or {}).get("content") or [])]
            usage = chunks[-1]["usage"]
        else:
            reply = post(served, "/v1/chat/completions", body)
            content = reply["choices"][0]["message"]["content"]
            scored = [e["token"] for e in reply["choices"][0]["logprobs"]["content"]]
            usage = reply["usage"]
        assert SPECIAL not in content
        assert content == served.shown.strip()
        assert usage["completion_tokens"] == len(served.answer)
        assert len(scored) == len(served.answer) and SPECIAL in scored


def test_completions_keep_every_token(served: Served) -> None:
    """A completion's text is the decode of the ids, special ones included; so is Ollama's
    raw generate's (a completion too: the prompt as given)."""
    prompt = served.tokenizer.encode(served.prompt, add_special_tokens=False)
    reply = post(served, "/v1/completions", {"prompt": prompt, "max_tokens": N,
                                             "temperature": 0})
    assert reply["choices"][0]["text"] == served.tokenizer.decode(served.answer)
    assert SPECIAL in reply["choices"][0]["text"]
    raw = post(served, "/api/generate", {"prompt": served.prompt, "raw": True,
                                         "stream": False, "options": GREEDY})
    assert raw["response"] == served.tokenizer.decode(served.answer)


def test_every_chat_dialect_leaves_it_out(served: Served) -> None:
    """Responses, Anthropic Messages, Ollama's chat and templated generate write what chat
    completions writes: the same tokens, counted, the special one not shown."""
    shown = served.shown.strip()
    n = len(served.answer)
    responses = post(served, "/v1/responses", {"input": USER, "max_output_tokens": N,
                                               "temperature": 0})
    text = "".join(part["text"] for item in responses["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")
    assert (text, responses["usage"]["output_tokens"]) == (shown, n)
    messages = post(served, "/v1/messages", {"messages": MESSAGES, "max_tokens": N,
                                             "temperature": 0})
    text = "".join(b["text"] for b in messages["content"] if b["type"] == "text")
    assert (text, messages["usage"]["output_tokens"]) == (shown, n)
    ollama_chat = post(served, "/api/chat", {"messages": MESSAGES, "stream": False,
                                             "options": GREEDY})
    assert (ollama_chat["message"]["content"], ollama_chat["eval_count"]) == (shown, n)
    generate = post(served, "/api/generate", {"prompt": USER, "stream": False,
                                              "options": GREEDY})
    assert (generate["response"], generate["eval_count"]) == (shown, n)


def test_a_stop_sequence_naming_the_token_still_ends_the_answer_there(served: Served) -> None:
    """A client that stops on ``<|im_start|>`` (ChatML clients do, against a run-on turn)
    gets its stop: a token a stop overlaps is kept for that request."""
    k = served.answer.index(served.tokenizer.get_vocab()[SPECIAL])
    reply = post(served, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": N, "temperature": 0, "stop": [SPECIAL]})
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"].strip() == served.text(served.answer[:k]).strip()
    assert reply["usage"]["completion_tokens"] == k + 1
