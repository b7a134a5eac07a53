"""A whole answer's body is built off the event loop when it is large.

Built on the loop, an answer of eight choices with twenty alternatives a token (or
thousands of long embeddings) held every other client for as long as it took; through
the real server that shows only at the end of a long run, so these drive the bodies'
seam itself with a run's events, and watch the loop tick while it builds.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import orjson
import pytest

from afmd.core.embedding_request import EmbeddingRequest, Embeddings
from afmd.core.events import (
    Choice,
    Content,
    Event,
    Finish,
    Logprobs,
    Reasoning,
    TokenLogprob,
    ToolCallEnd,
    TopLogprob,
    Usage,
)
from afmd.core.request import ToolCall
from afmd.dialects.anthropic.messages_api import MessageReply
from afmd.dialects.ollama.embed_body import embed_body
from afmd.dialects.openai.chat import ChatCompletionReply
from afmd.dialects.openai.embeddings import encode_response
from afmd.dialects.responses.conversation_store import ConversationStore
from afmd.dialects.responses.output_items import ResponseBuilder
from afmd.dialects.responses.responses_api import OpenAIResponses, ResponsesReply
from afmd.dialects.responses.store import ResponseStore
from afmd.http.routes.large_bodies import (
    LARGE_ANSWER,
    answer_body,
    answer_weight,
    built_off_loop,
)


def _tokens(count: int, top: int) -> tuple[TokenLogprob, ...]:
    alternatives = tuple(TopLogprob(f"t{j}", f"t{j}".encode(), -1.0 - j) for j in range(top))
    return tuple(TokenLogprob("ab", b"ab", -0.5, alternatives) for _ in range(count))


def _choices(n: int, tokens: int, top: int) -> list[Event]:
    logprobs = Logprobs(_tokens(tokens, top))
    events: list[Event] = [Choice(i, (Content("ab" * tokens), logprobs, Finish("length")))
                           for i in range(n)]
    return [*events, Usage(5, n * tokens)]


class _Recorded(ChatCompletionReply):
    """A chat reply that notes the thread its body is built on."""

    def __init__(self, **fields: Any) -> None:
        super().__init__(**fields)
        self.threads: list[str] = []

    def body(self, events: Any) -> bytes:
        self.threads.append(threading.current_thread().name)
        return super().body(events)


def _while_ticking(build: Callable[[], Awaitable[bytes]]) -> tuple[bytes, float, float]:
    """What ``build`` made, how long it took, and the longest the loop went without a
    turn meanwhile."""

    async def run() -> tuple[bytes, float, float]:
        gaps: list[float] = []
        done = asyncio.Event()

        async def tick() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        started = time.perf_counter()
        body = await build()
        took = time.perf_counter() - started
        done.set()
        await ticker
        return body, took, max(gaps)

    return asyncio.run(run())


def test_weight_counts_every_choice_and_its_alternatives() -> None:
    assert answer_weight(_choices(2, 10, 3)) == 2 * (1 + 10 * 4 + 1) + 1
    assert answer_weight([Content("a"), Finish("stop")]) == 2


def test_n_choices_with_top_logprobs_are_built_off_the_loop() -> None:
    events = _choices(8, 1_500, 20)
    assert answer_weight(events) >= LARGE_ANSWER
    reply = _Recorded(model="m", fingerprint="f", include_usage=False, logprobs=True, n=8)
    body, took, gap = _while_ticking(lambda: answer_body(reply, events))
    assert reply.threads == ["afmd-bodies_0"]
    assert body == reply.body(events)  # the same body as built where it is
    answer = orjson.loads(body)
    assert [len(c["logprobs"]["content"]) for c in answer["choices"]] == [1_500] * 8
    # Built on the loop, it waits the whole build; off it, for the longest single call
    # that holds the GIL, a larger share on a loaded machine (CI saw a third).
    assert gap < took / 2, f"the loop waited {gap:.3f} s of the build's {took:.3f} s"


def test_a_small_answer_is_built_where_it_is() -> None:
    reply = _Recorded(model="m", fingerprint="f", include_usage=False)
    events: list[Event] = [Content("hi"), Finish("stop"), Usage(1, 1)]
    body, _, _ = _while_ticking(lambda: answer_body(reply, events))
    assert reply.threads == ["MainThread"]
    assert orjson.loads(body)["choices"][0]["message"]["content"] == "hi"


def test_a_responses_answer_is_built_apart_and_kept_on_the_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its builder is what a GET of the running response reads, on the loop: the answer
    is built in a builder of its own on the thread, a GET meanwhile sees the response
    ``in_progress``, and the stores keep it once built."""
    dialect = OpenAIResponses(ResponseStore(10, 0), ConversationStore(10, 0))
    request = dialect.parse(orjson.dumps({
        "model": "demo", "input": "hi", "store": True, "top_logprobs": 20,
        "include": ["message.output_text.logprobs"]}))
    reply = dialect.reply(request, model="m", fingerprint="f")
    assert isinstance(reply, ResponsesReply)
    events: list[Event] = []
    for _ in range(3_000):
        events += [Content("ab"), Logprobs(_tokens(1, 20))]
    events += [Finish("length"), Usage(1, 3_000)]
    assert answer_weight(events) >= LARGE_ANSWER
    fed: list[str] = []
    feed = ResponseBuilder.feed

    def noted(builder: ResponseBuilder, batch: Any) -> None:
        fed.append(threading.current_thread().name)
        feed(builder, batch)

    monkeypatch.setattr(ResponseBuilder, "feed", noted)
    seen: list[str] = []

    async def build() -> bytes:
        async def look() -> None:
            while True:  # what a GET of the running response reads, on the loop
                seen.append(reply.current("in_progress")["status"])
                await asyncio.sleep(0)

        looking = asyncio.create_task(look())
        try:
            return await answer_body(reply, events)
        finally:
            looking.cancel()

    body, _, _ = _while_ticking(build)
    assert fed == ["afmd-bodies_0"]
    assert seen and set(seen) == {"in_progress"}
    answer = orjson.loads(body)
    assert answer["id"] == reply.id and answer["status"] == "incomplete"
    assert len(answer["output"][0]["content"][0]["logprobs"]) == 3_000
    stored = dialect.store.get(reply.id)
    assert stored is not None and stored.response["status"] == "incomplete"
    assert reply.current("completed")["output"] == answer["output"]


def test_many_long_embeddings_let_the_loop_in_while_built() -> None:
    """orjson holds the interpreter for a whole call: each vector is a call of its own."""
    vectors = np.random.default_rng(0).random((1_024, 8_192), dtype=np.float32)
    result = Embeddings(vectors, prompt_tokens=2_048, model="m")
    request = EmbeddingRequest(inputs=("a",) * 1_024, params=("input",) * 1_024)
    body, took, gap = _while_ticking(lambda: built_off_loop(
        lambda: encode_response(result, request), weight=vectors.size))
    # Built on the loop, it waits the whole build; off it, for the longest single call
    # that holds the GIL, a larger share on a loaded machine (CI saw a third).
    assert gap < took / 2, f"the loop waited {gap:.3f} s of the build's {took:.3f} s"
    answer = orjson.loads(body)
    assert list(answer) == ["object", "data", "model", "usage"]
    assert answer["usage"] == {"prompt_tokens": 2_048, "total_tokens": 2_048}
    got = np.array([d["embedding"] for d in answer["data"]], dtype=np.float32)
    assert [d["index"] for d in answer["data"]] == list(range(1_024))
    assert np.array_equal(got, vectors)


def test_embedding_bodies_read_back_as_their_vectors() -> None:
    vectors = np.random.default_rng(1).random((3, 5), dtype=np.float32)
    result = Embeddings(vectors, prompt_tokens=7, model="m")
    base64_request = EmbeddingRequest(inputs=("a", "b", "c"), params=("input",) * 3,
                                      encoding_format="base64")
    data = orjson.loads(encode_response(result, base64_request))["data"]
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data]
    assert np.array_equal(np.stack(decoded), vectors)
    ollama = orjson.loads(embed_body(result, "m", total=1.5, load=0.25))
    assert list(ollama) == ["model", "embeddings", "total_duration", "load_duration",
                            "prompt_eval_count"]
    assert np.array_equal(np.array(ollama["embeddings"], dtype=np.float32), vectors)
    assert (ollama["total_duration"], ollama["load_duration"],
            ollama["prompt_eval_count"]) == (1_500_000_000, 250_000_000, 7)
    empty = orjson.loads(embed_body(None, "m", total=0.0, load=0.0))
    assert empty["embeddings"] == [] and empty["prompt_eval_count"] == 0


def test_anthropic_blocks_are_joined_once() -> None:
    """A long answer's text block was copied again at every token."""
    events: list[Event] = [Content("abcd")] * 200_000 + [Finish("stop"), Usage(1, 200_000)]
    reply = MessageReply(model="m")
    started = time.perf_counter()
    answer = orjson.loads(reply.body(events))
    took = time.perf_counter() - started
    assert answer["content"] == [{"type": "text", "text": "abcd" * 200_000}]
    assert took < 0.5, f"{took:.2f} s for 200,000 pieces"


def test_anthropic_blocks_keep_their_order_and_kinds() -> None:
    call = ToolCall("call_1", "look", '{"q": "x"}')
    events: list[Event] = [
        Reasoning("th"), Reasoning("ink"), Content("one "), Content("two"),
        ToolCallEnd(0, call), Content("after"), Finish("tool_calls"), Usage(3, 9)]
    answer = orjson.loads(MessageReply(model="m").body(events))
    assert answer["content"] == [
        {"type": "thinking", "thinking": "think", "signature": ""},
        {"type": "text", "text": "one two"},
        {"type": "tool_use", "id": answer["content"][2]["id"], "name": "look",
         "input": {"q": "x"}},
        {"type": "text", "text": "after"},
    ]
