"""Log-probabilities: the engine's numbers against mlx-lm's own, and chat's wire shape.

The reference is computed here, on the same demo model: the model run over the prompt and
the generated tokens in one forward pass, ``log_softmax`` of its logits. afmd's numbers
come from its batched decode step (and, for a prompt, from its own chunked pass), so they
must agree within float32 tolerance, top alternatives in the same order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from afmd.engine.batch import logprobs
from afmd.engine.batch.detokenize import ExactDetokenizer
from afmd.engine.batch.generation_thread import BatchWorker
from afmd.engine.batch.tokens import TokenTable, token_text
from afmd.engine.demo import builtin as demo
from afmd.engine.generation import (
    Finished,
    Generation,
    GenerationRequest,
    PromptLogprobs,
    SamplingParams,
    Text,
    TokenIdLogprob,
)

from conftest import parse_sse
from helpers.numerics import LOGIT_TOLERANCE, LOGPROB_TOLERANCE, assert_top_agrees
from helpers.openai_schemas import validate_chunk, validate_error, validate_response

TOLERANCE = LOGPROB_TOLERANCE  # the device's (tests/helpers/numerics.py)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return mlx_lm.load(str(demo.materialize("demo", tmp_path_factory.mktemp("lp-cache"))))


@pytest.fixture(scope="module")
def worker(loaded: tuple[Any, Any]) -> Iterator[BatchWorker]:
    model, tokenizer = loaded
    w = BatchWorker(model, tokenizer, name="logprobs-test", max_batch=4, prompt_cache_bytes=0)
    w.start()
    yield w
    w.stop()


def generate(worker: BatchWorker, *requests: GenerationRequest) -> list[list[Any]]:
    """Every request's engine events, all submitted to the running batch together."""

    async def one(request: GenerationRequest) -> list[Any]:
        generation = Generation(request, asyncio.get_running_loop())
        worker.submit(generation)
        events: list[Any] = []
        while not any(isinstance(e, Finished) for e in events):
            events += await generation.next_events()
        return events

    async def every() -> list[list[Any]]:
        return list(await asyncio.gather(*(one(r) for r in requests)))

    return asyncio.run(every())


def reference(model: Any, ids: list[int]) -> np.ndarray:
    """mlx-lm's log-probabilities at every position of ``ids``, in one forward pass."""
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def entries(events: list[Any]) -> list[TokenIdLogprob]:
    out = [e.logprobs for e in events if isinstance(e, Text) and e.logprobs]
    assert all(len(e) == 1 for e in out), "one token per event when logprobs are asked"
    return [e[0] for e in out]


def text_of(events: list[Any]) -> str:
    return "".join(e.text for e in events if isinstance(e, Text))


def assert_matches(lp: np.ndarray, position: int, entry: TokenIdLogprob, k: int) -> None:
    row = lp[position]
    assert entry.logprob == pytest.approx(float(row[entry.token]), abs=TOLERANCE)
    assert_top_agrees(entry.top, row, k)


def request(prompt: list[int], max_tokens: int = 12, **extra: Any) -> GenerationRequest:
    extra.setdefault("sampling", SamplingParams(temperature=0.0))
    return GenerationRequest(request_id=f"r{time.monotonic_ns()}", prompt=prompt,
                             max_tokens=max_tokens, **extra)


@pytest.mark.parametrize("on_host", [True, False], ids=["numpy", "mlx-graph"])
def test_generated_token_logprobs_equal_mlx_lm(loaded, worker, monkeypatch, on_host) -> None:
    """Both ways of normalising a row: numpy on the host (MLX's CPU backend) and the
    step's own MLX graph (a GPU), forced here whatever the device."""
    monkeypatch.setattr(logprobs, "_on_host", lambda: on_host)
    model, tokenizer = loaded
    prompt = tokenizer.encode("def fibonacci(n):\n    if n < 2:\n", add_special_tokens=False)
    (events,) = generate(worker, request(prompt, logprobs=5))
    got = entries(events)
    assert len(got) == 12
    ids = [e.token for e in got]
    lp = reference(model, prompt + ids)
    for i, entry in enumerate(got):
        assert_matches(lp, len(prompt) - 1 + i, entry, 5)
        row = lp[len(prompt) - 1 + i]
        assert row[entry.token] >= row.max() - LOGIT_TOLERANCE  # greedy (a near-tie off the CPU)


def test_rows_that_ask_and_rows_that_do_not_share_a_batch(loaded, worker) -> None:
    """Asking for logprobs changes no token, in greedy and seeded rows, whoever shares the
    batch; each asking row's numbers match the reference of its own sequence."""
    model, tokenizer = loaded
    prompts = [tokenizer.encode(t, add_special_tokens=False)
               for t in ("The quick brown fox", "import os\nimport sys\n", "Hello world")]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    alone = generate(worker, request(prompts[0]), request(prompts[1], sampling=seeded),
                     request(prompts[2]))
    mixed = generate(worker, request(prompts[0], logprobs=3),
                     request(prompts[1], sampling=seeded, logprobs=0), request(prompts[2]))
    for before, after in zip(alone, mixed, strict=True):
        assert text_of(before) == text_of(after)
    for prompt, events, k in ((prompts[0], mixed[0], 3), (prompts[1], mixed[1], 0)):
        got = entries(events)
        lp = reference(model, prompt + [e.token for e in got])
        for i, entry in enumerate(got):
            assert_matches(lp, len(prompt) - 1 + i, entry, k)
    assert entries(mixed[2]) == []


def test_prompt_logprobs_equal_mlx_lm_across_chunks(loaded, worker) -> None:
    model, tokenizer = loaded
    text = "".join(f"line {i}: value = {i * i}\n" for i in range(60))
    prompt = tokenizer.encode(text, add_special_tokens=False)
    assert len(prompt) > 300  # more than one chunk of the prompt pass
    (events,) = generate(worker, request(prompt, max_tokens=0, prompt_logprobs=4))
    assert not [e for e in events if isinstance(e, Text)]
    (finished,) = [e for e in events if isinstance(e, Finished)]
    assert finished.finish_reason == "length" and finished.completion_tokens == 0
    (echo,) = [e for e in events if isinstance(e, PromptLogprobs)]
    assert [e.token for e in echo.tokens] == prompt
    assert echo.tokens[0].logprob is None and echo.tokens[0].top == ()
    lp = reference(model, prompt)
    for i, entry in enumerate(echo.tokens[1:], start=1):
        assert_matches(lp, i - 1, entry, 4)


def test_a_scored_prompt_takes_a_short_turn_per_engine_step(loaded) -> None:
    """A scored position costs a row of logits over the whole vocabulary, a prefilled one
    none: scored a prefill step's worth at a time (2,048 positions), a long prompt held
    every stream beside it for seconds a step on this CPU, and its cancel waited as long.
    Each step now scores a few chunks, and the scores come out the same as one pass."""
    from afmd.engine.batch.admission import Admissions
    from afmd.engine.batch.stepper import Stepper

    model, tokenizer = loaded
    text = "".join(f"line {i}: value = {i * i}\n" for i in range(90))
    prompt = tokenizer.encode(text, add_special_tokens=False)

    async def scored() -> tuple[list[int], Any]:
        stepper = Stepper(model, tokenizer, name="score-steps", prompt_cache_bytes=0)
        stepper.reset()
        try:
            admissions = Admissions(stepper, prompt_lookup=False, draft_model=None,
                                    speculates=False)
            generation = Generation(request(prompt, max_tokens=0, prompt_logprobs=3),
                                    asyncio.get_running_loop())
            joining = admissions.prepare(generation)
            assert joining is not None
            warming = admissions.warming(joining)
            assert warming is not None and warming.scorer is not None
            done: list[int] = []
            while not admissions.advance(warming):
                done.append(warming.scorer.done)
            assert len(prompt) < stepper.prefill_step_size  # once, had it been a prefill
            events = await generation.next_events()
            return done, next(e for e in events if isinstance(e, PromptLogprobs))
        finally:
            stepper.close()

    done, echo = asyncio.run(scored())
    steps = [b - a for a, b in zip([0, *done], done, strict=False)]
    assert len(done) >= 4 and max(steps) <= logprobs.SCORE_STEP_POSITIONS, steps
    whole = logprobs.prompt_logprobs(model, prompt, 3)
    assert [e.token for e in echo.tokens] == prompt
    for got, want in zip(echo.tokens[1:], whole[1:], strict=True):
        assert got.logprob is not None and want.logprob is not None
        assert abs(got.logprob - want.logprob) <= TOLERANCE


def test_stop_ids_end_generation_unseen(loaded, worker) -> None:
    _, tokenizer = loaded
    prompt = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    (free,) = generate(worker, request(prompt, logprobs=0))
    ids = [e.token for e in entries(free)]
    cut = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    (stopped,) = generate(worker, request(prompt, logprobs=0, stop_ids=(ids[cut],),
                                          verbatim=True))
    (finished,) = [e for e in stopped if isinstance(e, Finished)]
    assert finished.finish_reason == "stop"
    assert [e.token for e in entries(stopped)] == ids[:cut]
    assert text_of(stopped) == tokenizer.decode(ids[:cut])


def test_verbatim_text_keeps_the_first_tokens_leading_space(loaded, worker) -> None:
    """mlx-lm's streaming detokenizer drops the first token's leading space; a completion's
    text is exactly ``tokenizer.decode`` of the generated ids."""
    _, tokenizer = loaded
    for text in ("x =", "for i in range(10):", "if", "return", "print(", "a, b ="):
        prompt = tokenizer.encode(text, add_special_tokens=False)
        (events,) = generate(worker, request(prompt, logprobs=0, verbatim=True))
        ids = [e.token for e in entries(events)]
        if tokenizer.decode(ids[:1]).startswith(" "):
            break
    else:
        pytest.fail("no prompt whose first generated token starts with a space")
    (chat,) = generate(worker, request(prompt))
    assert text_of(events) == tokenizer.decode(ids)
    assert text_of(chat) == tokenizer.decode(ids)[1:]  # what chat (rightly) shows


def test_hidden_tokens_are_counted_and_scored_but_add_no_text(loaded, worker) -> None:
    """A hidden token (a chat answer's special token no reader needs) is generated like any
    other: it counts, it has its log-probability, and what follows is unchanged; only its
    text is left out, before the streaming detokenizer, so the text around it is the
    text of the other tokens. The engine hides whatever ids it is given: here a plain
    token of the answer, so that it surely comes mid-answer."""
    _, tokenizer = loaded
    prompt = tokenizer.encode("def area(r):\n    return", add_special_tokens=False)
    (plain,) = generate(worker, request(prompt, 16, logprobs=0))
    ids = [e.token for e in entries(plain)]
    hidden = next(t for t in ids[2:-2] if t not in ids[:2])
    for top in (0, None):
        (events,) = generate(worker, request(prompt, 16, logprobs=top,
                                             hidden_ids=frozenset({hidden})))
        (finished,) = [e for e in events if isinstance(e, Finished)]
        assert finished.completion_tokens == len(ids)
        assert sum(e.tokens for e in events if isinstance(e, Text)) == len(ids)
        if top is not None:
            assert [e.token for e in entries(events)] == ids
        detokenizer = tokenizer.detokenizer
        for token in ids:
            if token != hidden:
                detokenizer.add_token(token)
        detokenizer.finalize()
        assert text_of(events) == detokenizer.text
        assert text_of(events) != text_of(plain)


@pytest.mark.parametrize("vocab", [100, 32768, 50257, 151936])
def test_host_normalisation_is_a_full_log_softmax(vocab: int) -> None:
    """The host path's shortcuts (alternatives found in the columns whose maximum can hold
    them, exp in a reused buffer) give the numbers of a plain log-softmax and a full
    sort, bit for bit: rows masked to a few tokens, vocabularies that are not a multiple
    of the column count, the fallback for small ones, and a tie cut at the k-th place."""
    rng = np.random.default_rng(vocab)
    for trial in range(40):
        row = (rng.standard_normal(vocab) * rng.uniform(0.5, 8.0)).astype(np.float32)
        if trial % 4 == 1:  # a grammar allowing a handful of tokens
            allowed = rng.choice(vocab, size=int(rng.integers(1, 12)), replace=False)
            masked = np.full(vocab, -np.inf, dtype=np.float32)
            masked[allowed] = row[allowed]
            row = masked
        if trial % 4 == 2:  # the best tokens at both ends, one of them in the last ids
            row[[0, vocab - 1]] = row.max() + 1.0
        k = int(rng.integers(0, logprobs.MAX_TOP + 1))
        token = int(rng.integers(0, vocab))
        got = logprobs._from_logits(row, token, k, normalised=False)
        top = float(row.max())
        lse = top + float(np.log(np.exp(row - top).sum(dtype=np.float64)))
        order = np.lexsort((np.arange(vocab), -row))[: min(k, vocab)]
        want = [(int(i), float(row[i]) - lse) for i in order if row[i] != -np.inf]
        assert got.token == token and got.logprob == float(row[token]) - lse
        assert list(got.top) == want
    tied = np.zeros(vocab, dtype=np.float32)  # every value equal: the lowest ids
    got = logprobs._from_logits(tied, 3, 5, normalised=False)
    assert [i for i, _ in got.top] == [0, 1, 2, 3, 4]


def test_exact_detokenizer_concatenates_to_decode(loaded) -> None:
    _, tokenizer = loaded
    text = "  indented\n\tdéjà vu 日本語 ✓ \U0001f600 end  "
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = ExactDetokenizer(tokenizer)
    segments = []
    for token in ids:
        detokenizer.add_token(token)
        segments.append(detokenizer.last_segment)
    detokenizer.finalize()
    segments.append(detokenizer.last_segment)
    assert "".join(segments) == tokenizer.decode(ids) == text
    assert "\ufffd" not in "".join(segments)


def test_token_table_bytes_rebuild_the_text(loaded) -> None:
    _, tokenizer = loaded
    text = "naïve café — 日本 <think>x</think>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    table = TokenTable(tokenizer)
    assert b"".join(table.bytes_of(t) for t in ids) == text.encode()
    partial = [t for t in ids if not _is_utf8(table.bytes_of(t))]
    assert partial, "the text should split some character across tokens"
    assert token_text(table.bytes_of(partial[0])).startswith("bytes:\\x")


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


# -- chat: logprobs and top_logprobs on /v1/chat/completions ---------------------------

MESSAGES = [{"role": "user", "content": "Name three colours."}]


def chat_reference(loaded: tuple[Any, Any], n: int) -> tuple[list[int], list[int], np.ndarray]:
    """The chat prompt as the server renders it, the model's greedy continuation (up to
    ``n`` tokens, not its EOS) and the log-probabilities at every position."""
    model, tokenizer = loaded
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt = list(tokenizer.encode(text, add_special_tokens=False))
    out: list[int] = []
    eos = set(tokenizer.eos_token_ids)
    while len(out) < n:
        lp = reference(model, prompt + out)
        token = int(np.argmax(lp[-1]))
        if token in eos:
            break
        out.append(token)
    return prompt, out, reference(model, prompt + out)


def assert_chat_entries(entries: list[dict[str, Any]], loaded: tuple[Any, Any],
                        prompt: list[int], out: list[int], lp: np.ndarray, k: int) -> None:
    table = TokenTable(loaded[1])
    assert [e["token"] for e in entries] == [table.text_of(t) for t in out]
    for i, (entry, token) in enumerate(zip(entries, out, strict=True)):
        row = lp[len(prompt) - 1 + i]
        assert bytes(entry["bytes"]) == table.bytes_of(token)
        assert entry["logprob"] == pytest.approx(float(row[token]), abs=TOLERANCE)
        expected = [int(t) for t in np.argsort(-row, kind="stable")[:k]]
        assert [a["token"] for a in entry["top_logprobs"]] == [table.text_of(t) for t in expected]
        for alt, t in zip(entry["top_logprobs"], expected, strict=True):
            assert alt["logprob"] == pytest.approx(float(row[t]), abs=TOLERANCE)
            assert bytes(alt["bytes"]) == table.bytes_of(t)


def test_chat_logprobs_with_top_logprobs(client, loaded) -> None:
    prompt, out, lp = chat_reference(loaded, 10)
    reply = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=10,
                                           temperature=0, logprobs=True, top_logprobs=3)
    body = reply.model_dump(exclude_unset=True)
    validate_response(body)
    entries = body["choices"][0]["logprobs"]["content"]
    assert body["choices"][0]["logprobs"]["refusal"] is None
    assert_chat_entries(entries, loaded, prompt, out, lp, 3)
    raw = b"".join(bytes(e["bytes"]) for e in entries).decode()
    assert reply.choices[0].message.content == raw.strip()  # the answer, trimmed as chat is


def test_chat_logprobs_streamed_match_the_whole(client, loaded) -> None:
    prompt, out, lp = chat_reference(loaded, 10)
    chunks = list(client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True,
        top_logprobs=2, stream=True))
    entries: list[dict[str, Any]] = []
    for chunk in chunks:
        data = chunk.model_dump(exclude_unset=True)
        validate_chunk(data)
        for choice in data["choices"]:
            if choice.get("logprobs"):
                entries += choice["logprobs"]["content"]
                # A token's numbers ride with the text it made.
                assert choice["delta"].get("content") is not None
    assert_chat_entries(entries, loaded, prompt, out, lp, 2)


def test_chat_logprobs_without_alternatives_and_not_asked(http) -> None:
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    r = http.post("/v1/chat/completions", json={**body, "logprobs": True})
    data = r.json()
    validate_response(data)
    entries = data["choices"][0]["logprobs"]["content"]
    assert len(entries) == data["usage"]["completion_tokens"]
    assert all(e["top_logprobs"] == [] for e in entries)
    for asked in ({}, {"logprobs": False}):
        r = http.post("/v1/chat/completions", json={**body, **asked})
        assert r.json()["choices"][0]["logprobs"] is None


def test_chat_logprobs_stop_at_a_stop_sequence(http, loaded) -> None:
    """A token whose text a stop sequence swallowed has no entry; the text before it
    does."""
    _, out, _ = chat_reference(loaded, 12)
    table = TokenTable(loaded[1])
    pieces = [table.text_of(t) for t in out]
    k = next(i for i in range(2, len(pieces)) if pieces[i].strip()
             and "".join(pieces).find(pieces[i]) == len("".join(pieces[:i])))
    r = http.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "logprobs": True,
        "stop": [pieces[k]]})
    data = r.json()
    validate_response(data)
    assert data["choices"][0]["finish_reason"] == "stop"
    assert [e["token"] for e in data["choices"][0]["logprobs"]["content"]] == pieces[:k]


def test_chat_usage_counts_through_the_token_completing_the_stop(http, loaded) -> None:
    """The stop is found on the event loop while the engine decodes on: the tokens it made
    before the stop reached it are not the answer's, and the count is the same every
    time, streamed or not, with log-probabilities or without."""
    _, out, _ = chat_reference(loaded, 12)
    table = TokenTable(loaded[1])
    pieces = [table.text_of(t) for t in out]
    k = next(i for i in range(2, len(pieces)) if pieces[i].strip()
             and "".join(pieces).find(pieces[i]) == len("".join(pieces[:i])))
    body = {"messages": MESSAGES, "max_tokens": 400, "temperature": 0, "stop": [pieces[k]]}
    for _ in range(3):
        for extra in ({}, {"logprobs": True}):
            whole = http.post("/v1/chat/completions", json={**body, **extra}).json()
            assert whole["choices"][0]["finish_reason"] == "stop"
            assert whole["usage"]["completion_tokens"] == k + 1, extra
            streamed = http.post("/v1/chat/completions", json={
                **body, **extra, "stream": True, "stream_options": {"include_usage": True}})
            usage = [e["usage"] for e in parse_sse(streamed.text)[:-1] if e.get("usage")]
            assert usage[-1]["completion_tokens"] == k + 1, extra


@pytest.mark.parametrize(("fields", "code", "param"), [
    ({"logprobs": True, "top_logprobs": 21}, "invalid_value", "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "invalid_value", "top_logprobs"),
    ({"logprobs": True, "top_logprobs": "3"}, "invalid_type", "top_logprobs"),
    ({"top_logprobs": 3}, "invalid_value", "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 3}, "invalid_value", "top_logprobs"),
    ({"logprobs": "yes"}, "invalid_type", "logprobs"),
])
def test_chat_logprobs_bad_input(http, fields: dict[str, Any], code: str, param: str) -> None:
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, **fields})
    assert r.status_code == 400, r.text
    validate_error(r.json())
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, param)
