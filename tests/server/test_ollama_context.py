"""``/api/generate``'s ``context``, as Ollama serves it: a templated generate's last object
gives the ids of the prompt it ran and of the answer it wrote, and a generate that sends
them back continues that conversation. Checked against the model itself (its tokenizer
renders the turns, mlx-lm's greedy decode writes the answers), through the official
``ollama`` client and raw HTTP, streamed and not; the continued prompt resumes from the
prefix cache; a context afmd cannot run is a 400 naming it.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import mlx_lm
import ollama
import pytest
from PIL import Image

from afmd.engine.demo import builtin as demo

from conftest import ServerProcess, start_server
from helpers.numerics import greedy

N = 8  # tokens of each answer
GREEDY = {"temperature": 0, "num_predict": N}
SYSTEM = "You answer in one short sentence about the weather and nothing else at all."
FIRST = "What is the weather like on a cold and windy day in the mountains in winter?"
SECOND = "And in summer?"
BLOCK = 16  # the test server's prefix-cache block


@dataclass
class Served:
    server: ServerProcess
    http: httpx.Client
    client: ollama.Client
    lm: tuple[Any, Any]  # the demo model and its tokenizer, as mlx-lm loads them

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation's prompt ids through the model's own chat template."""
        tokenizer = self.lm[1]
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("context")
    server = start_server(root, config=(
        f'[cache]\nblock_tokens = {BLOCK}\ndisk_dir = "{root / "kv"}"\ndisk_min_free = 0\n'))
    lm = mlx_lm.load(str(demo.materialize("demo")))
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            yield Served(server, http, ollama.Client(host=server.url, timeout=120), lm)
    finally:
        server.stop()


def generate(served: Served, **body: Any) -> httpx.Response:
    return served.http.post("/api/generate", json={"model": "demo", "stream": False,
                                                   "options": GREEDY, **body},
                            headers={"X-AFM-Profile": "true"})


def test_the_context_is_the_prompt_then_the_answer(served: Served) -> None:
    prompt = served.render([{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": FIRST}])
    answer = greedy(served.lm, prompt, N)
    got = served.client.generate(model="demo", system=SYSTEM, prompt=FIRST, options=GREEDY)
    assert got.prompt_eval_count == len(prompt) and got.eval_count == len(answer) == N
    assert got.context == [*prompt, *answer]

    parts = list(served.client.generate(model="demo", system=SYSTEM, prompt=FIRST,
                                        options=GREEDY, stream=True))
    assert parts[-1].done and parts[-1].context == got.context
    assert all(p.context is None for p in parts[:-1])


def test_a_context_sent_back_continues_the_conversation(served: Served) -> None:
    """The second prompt is the first run's ids, then the new turn rendered: the model
    answers what its greedy decode of exactly those ids writes, and the prefix cache
    resumes the first run instead of computing it again."""
    first = generate(served, system=SYSTEM, prompt=FIRST).json()
    turn = served.render([{"role": "user", "content": SECOND}])
    prompt = [*first["context"], *turn]
    answer = greedy(served.lm, prompt, N)
    response = generate(served, prompt=SECOND, context=first["context"])
    assert response.status_code == 200, response.text
    assert "X-AFM-Ignored-Fields" not in response.headers
    second = response.json()
    assert second["prompt_eval_count"] == len(prompt)
    assert second["context"] == [*prompt, *answer]
    # Resumed: every whole block of the first run's tokens but its last one (whose keys
    # its run never computed) came from the cache.
    assert second["afm_profile"]["cached_tokens"] >= (len(first["context"]) - 1) // BLOCK * BLOCK
    assert second["afm_profile"]["cached_tokens"] >= BLOCK

    # Streamed, through the official client: the same answer and context.
    parts = list(served.client.generate(model="demo", prompt=SECOND, options=GREEDY,
                                        context=first["context"], stream=True))
    assert "".join(p.response for p in parts) == second["response"]
    assert parts[-1].context == second["context"]


def test_an_empty_context_is_none(served: Served) -> None:
    plain = generate(served, prompt=FIRST).json()
    empty = generate(served, prompt=FIRST, context=[]).json()
    assert empty["response"] == plain["response"] and empty["context"] == plain["context"]


def test_a_context_too_long_for_the_window_is_left_out_whole_or_refused(
        served: Served) -> None:
    """``truncate`` (on by default) leaves the earlier turns out, as chat's oldest turns
    go, and says so; ``truncate: false`` makes it the context-length 400."""
    first = generate(served, system=SYSTEM, prompt=FIRST).json()
    turn = served.render([{"role": "user", "content": SECOND}])
    window = len(turn) + N + 4  # room for the new turn, not for the earlier one too
    options = {**GREEDY, "num_ctx": window}
    cut = generate(served, prompt=SECOND, context=first["context"], options=options)
    assert cut.status_code == 200, cut.text
    assert cut.headers["X-AFM-Trimmed-Context"] == str(len(first["context"]))
    assert cut.json()["prompt_eval_count"] == len(turn)
    assert cut.json()["context"][:len(turn)] == turn
    refused = generate(served, prompt=SECOND, context=first["context"], options=options,
                       truncate=False)
    assert refused.status_code == 400
    assert refused.json()["error"].startswith("options.num_ctx: the input length")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_an_id_out_of_the_vocabulary_is_named(served: Served, stream: bool) -> None:
    vocab = served.lm[0].args.vocab_size
    for bad in (vocab, -1):
        got = generate(served, prompt="x", context=[1, bad], stream=stream)
        assert got.status_code == 400, got.text
        assert got.json()["error"].startswith("context[1]: Invalid token id"), got.json()


def test_a_context_afmd_cannot_continue_is_refused(served: Served) -> None:
    """A vision model's prompt holds its pictures beside the ids, and a fill-in-the-middle
    prompt is a file, not a conversation: each names ``context``."""
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 30)).save(buf, "PNG")
    image = base64.b64encode(buf.getvalue()).decode()
    vision = generate(served, model="demo-vision", prompt="What is it?", images=[image],
                      context=[1, 2])
    assert vision.status_code == 400 and vision.json()["error"].startswith("context: ")
    fim = generate(served, prompt="def f():", suffix="\n", context=[1, 2])
    assert fim.status_code == 400 and "'context'" in fim.json()["error"]
    raw = generate(served, prompt="x", raw=True).json()
    assert "context" not in raw  # a raw prompt has none, as in Ollama
