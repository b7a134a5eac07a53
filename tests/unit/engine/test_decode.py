"""afmd's decode step against mlx-lm's own, on the real demo model, in process.

``DecodeBatch`` replaces mlx-lm's step for speed; it must not change a single token. Each
case runs the same batch through a plain ``BatchGenerator`` (mlx-lm's row-by-row
processors, full normalisation) and through one with ``DecodeBatch`` installed, and
compares every row's tokens.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_logits_processors

from afmd.engine.batch.admission import make_sampler
from afmd.engine.batch.decode import DecodeBatch
from afmd.engine.demo import builtin as demo
from afmd.engine.generation import Generation, GenerationRequest, SamplingParams, Text
from afmd.engine.reasoning_count import ReasoningMarkers
from afmd.grammar.batch_masks import BanTokens, GrammarProcessor, MaskBuilder
from afmd.grammar.compiler import json_schema_grammar, llg_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "n": {"type": "integer"},
    },
    "required": ["name", "tags", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    root = tmp_path_factory.mktemp("decode-cache")
    return mlx_lm.load(str(demo.materialize("demo", root)))


@pytest.fixture(scope="module")
def grammar(loaded: tuple[Any, Any]) -> Any:
    model, tokenizer = loaded
    vocab = model.args.vocab_size
    llg = llg_tokenizer(tokenizer, vocab, sorted(tokenizer.eos_token_ids))
    return json_schema_grammar(llg, SCHEMA, thinking=None, param="response_format")


def _prompts(tokenizer: Any, n: int) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"record number {i} please " * (1 + i % 3)}],
            add_generation_prompt=True,
        )
        for i in range(n)
    ]


def _run(
    loaded: tuple[Any, Any],
    rows: list[dict[str, Any]],
    *,
    ours: bool,
    max_tokens: int = 40,
    stagger: bool = False,
) -> list[list[int]]:
    """Every row's tokens. ``rows[i]`` may give ``processors`` (a factory) and ``sampler``."""
    model, tokenizer = loaded
    generator = BatchGenerator(
        model,
        stop_tokens=[[t] for t in tokenizer.eos_token_ids],
        completion_batch_size=len(rows),
        prefill_batch_size=len(rows),
    )
    if ours:
        DecodeBatch.install(generator)
        assert isinstance(generator._generation_batch, DecodeBatch)
    prompts = _prompts(tokenizer, len(rows))
    out: dict[int, list[int]] = {}
    order: list[int] = []

    def insert(i: int) -> None:
        row = rows[i]
        (uid,) = generator.insert(
            [prompts[i]],
            max_tokens=[max_tokens],
            samplers=[row.get("sampler", lambda: None)()],
            logits_processors=[row.get("processors", list)()],
        )
        out[uid] = []
        order.append(uid)

    pending = list(range(len(rows)))
    if not stagger:
        for i in pending:
            insert(i)
        pending = []
    else:  # rows join a running batch one step apart
        insert(pending.pop(0))
    finished = 0
    while finished < len(rows):
        _, responses = generator.next()
        for response in responses:
            out[response.uid].append(response.token)
            finished += response.finish_reason is not None
        if pending:
            insert(pending.pop(0))
    generator.close()
    return [out[uid] for uid in order]


def _both(loaded: tuple[Any, Any], rows: list[dict[str, Any]], **kw: Any) -> list[list[int]]:
    theirs = _run(loaded, rows, ours=False, **kw)
    mine = _run(loaded, rows, ours=True, **kw)
    assert mine == theirs
    return mine


def test_greedy_batch_is_token_for_token_mlx_lm(loaded: tuple[Any, Any]) -> None:
    tokens = _both(loaded, [{} for _ in range(6)], stagger=True)
    assert all(len(t) > 1 for t in tokens)


def test_constrained_rows_among_free_rows_match_and_parse(
    loaded: tuple[Any, Any], grammar: Any
) -> None:
    vocab = loaded[0].args.vocab_size

    def constrained() -> list[Any]:
        return [GrammarProcessor(grammar.matcher(), vocab)]

    rows = [{"processors": constrained}, {}, {"processors": constrained}, {}]
    tokens = _both(loaded, rows, max_tokens=120, stagger=True)
    tokenizer = loaded[1]
    for i in (0, 2):
        text = tokenizer.decode([t for t in tokens[i] if t not in tokenizer.eos_token_ids])
        value = json.loads(text)
        assert set(value) == {"name", "tags", "n"}


def test_banned_tokens_and_repetition_penalty_rows_match(loaded: tuple[Any, Any]) -> None:
    free = _run(loaded, [{}], ours=False)[0]
    banned = tuple(sorted(set(free[:5])))

    rows = [
        {"processors": lambda: [BanTokens(banned)]},
        {"processors": lambda: make_logits_processors(repetition_penalty=1.3)},
        {},
    ]
    tokens = _both(loaded, rows)
    assert not set(tokens[0][1:]) & set(banned)  # the first token is mlx-lm's step too


def test_seeded_sampling_matches(loaded: tuple[Any, Any]) -> None:
    def seeded(seed: int) -> Any:
        return lambda: make_sampler(SamplingParams(temperature=0.8, top_p=0.9, seed=seed))

    rows = [{"sampler": seeded(1)}, {}, {"sampler": seeded(2)}]
    _both(loaded, rows)
    # One sampler object shared by every row takes the batched call (it holds a PRNG
    # key, so each run gets its own).
    def shared_rows() -> list[dict[str, Any]]:
        shared = make_sampler(SamplingParams(temperature=0.7, seed=5))
        return [{"sampler": lambda: shared}, {"sampler": lambda: shared}]

    theirs = _run(loaded, shared_rows(), ours=False)
    assert _run(loaded, shared_rows(), ours=True) == theirs


def test_mask_builder_rows(loaded: tuple[Any, Any], grammar: Any) -> None:
    vocab = loaded[0].args.vocab_size
    processors = [GrammarProcessor(grammar.matcher(), vocab) for _ in range(2)]
    builder = MaskBuilder()
    padded = vocab + 40  # a model vocabulary padded beyond its tokenizer's
    rows = [(0, [processors[0]]), (2, [BanTokens((3, 64, padded - 1))]), (3, [processors[1]])]
    allowed = np.array(builder.build(rows, [0, 0, 0, 0], 4, padded))
    assert allowed.shape == (4, padded)
    assert allowed[1].all()  # unconstrained
    assert allowed[2].sum() == padded - 3 and not allowed[2, [3, 64, padded - 1]].any()
    for row in (0, 3):
        assert 0 < allowed[row].sum() < vocab
        assert not allowed[row, vocab:].any()  # padding ids are never valid under a grammar
    # The per-row call (a sequence's first token) masks the same tokens.
    single = GrammarProcessor(grammar.matcher(), vocab)
    logits = single(mx.array([[1]]), mx.zeros((1, padded)))
    assert (np.array(logits)[0] == 0).tolist() == allowed[0].tolist() == allowed[3].tolist()
    # A step later, each row's mask follows its own matcher (rows fed different tokens).
    options = np.flatnonzero(allowed[0])
    fed = [int(options[0]), 0, 0, int(options[-1])]
    later = np.array(builder.build(rows, fed, 4, padded))
    for row in (0, 3):
        alone = GrammarProcessor(grammar.matcher(), vocab)
        alone(mx.array([[1]]), mx.zeros((1, padded)))
        want = alone(mx.array([[fed[row]]]), mx.zeros((1, padded)))
        assert (np.array(want)[0] == 0).tolist() == later[row].tolist()


def test_worker_runs_the_decode_step(tmp_path: Path, loaded: tuple[Any, Any]) -> None:
    from afmd.engine.batch.generation_thread import BatchWorker

    worker = BatchWorker(loaded[0], loaded[1], name="t")
    generator = worker._stepper.reset()
    try:
        assert isinstance(generator._generation_batch, DecodeBatch)
    finally:
        generator.close()


def test_finished_rows_leave_a_cache_that_matches_their_tokens(
    loaded: tuple[Any, Any],
) -> None:
    """A row's first token is handed out before it is fed to the model (``_step``): a row
    that finishes then must leave with a KV cache and token list that agree, or the
    prefix cache would later serve KV states for tokens that were never computed."""
    model, tokenizer = loaded
    generator = BatchGenerator(model, stop_tokens=[], completion_batch_size=4,
                               prefill_batch_size=4)
    DecodeBatch.install(generator)
    prompts = _prompts(tokenizer, 3)
    budgets = [1, 2, 6]
    uids = generator.insert(prompts, max_tokens=budgets)
    got: dict[int, list[int]] = {uid: [] for uid in uids}
    finished: dict[int, Any] = {}
    while len(finished) < len(uids):
        _, responses = generator.next()
        for response in responses:
            got[response.uid].append(response.token)
            if response.finish_reason is not None:
                finished[response.uid] = response
    generator.close()
    for uid, prompt, budget in zip(uids, prompts, budgets, strict=True):
        response = finished[uid]
        assert len(got[uid]) == budget
        offset = response.prompt_cache[0].offset
        assert offset == len(response.all_tokens)
        assert response.all_tokens == [*prompt, *got[uid]][:offset]
        assert offset >= len(prompt) + budget - 1


def test_first_token_handoff_waits_for_the_consumer() -> None:
    """The engine thread's ack is set only after the woken consumer has run."""
    from afmd.engine.batch.handoff import _deliver

    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        generation = Generation(GenerationRequest("r", [1], 4), loop)
        order: list[str] = []

        async def consumer() -> None:
            events = await generation.next_events()
            order.append(f"consumer:{len(events)}")

        task = asyncio.create_task(consumer())
        await asyncio.sleep(0)
        ack = threading.Event()

        def engine() -> None:
            loop.call_soon_threadsafe(_deliver, [(generation, [Text("a", 1)])], ack)
            assert ack.wait(5)
            order.append("ack")

        await asyncio.gather(asyncio.to_thread(engine), task)
        return order

    assert asyncio.run(main()) == ["consumer:1", "ack"]


def test_matchers_of_one_grammar_are_independent(grammar: Any) -> None:
    """Matchers are copies of one prototype per grammar; none may see another's tokens."""
    first, second = grammar.matcher(), grammar.matcher()
    bitmask = np.zeros((1, (grammar.tokenizer.vocab_size + 31) // 32), dtype=np.int32)

    def allowed(matcher: Any) -> list[int]:
        bitmask.fill(0)
        matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
        bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")
        return np.flatnonzero(bits).tolist()

    start = allowed(first)
    assert first.consume_token(start[0])
    assert allowed(first) != start
    assert allowed(second) == start
    assert allowed(grammar.matcher()) == start  # a later copy starts at the start too


class _Force:
    """A logits processor that makes the model write ``ids``, one per step."""

    def __init__(self, ids: list[int]) -> None:
        self._ids = ids
        self._step = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        want = self._ids[min(self._step, len(self._ids) - 1)]
        self._step += 1
        return mx.where(mx.arange(logits.shape[-1]) == want, logits, float("-inf"))


class _Gate(_Force):
    """:class:`_Force` that, asked for the token at ``hold``, waits until ``seen`` is set
    (at most ``timeout`` seconds): the decode thread stops there until the client side
    has what came before, however slowly this machine runs the event loop."""

    def __init__(self, ids: list[int], hold: int, timeout: float = 20.0) -> None:
        super().__init__(ids)
        self.hold, self.timeout = hold, timeout
        self.seen = threading.Event()
        self.in_time: bool | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._step == self.hold:
            self.in_time = self.seen.wait(self.timeout)
        return super().__call__(tokens, logits)


def test_first_visible_token_goes_out_at_once(
    loaded: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reasoning model opens with its think marker, which the client never sees as
    text: the token after it is the client's first and must not wait for the next paced
    hand-off. With pacing stretched to a minute, only urgency can deliver it while the
    decode thread is held a few tokens later."""
    from afmd.engine.batch import generation_thread as worker_module
    from afmd.engine.batch import handoff

    monkeypatch.setattr(handoff, "FLUSH_INTERVAL_S", 60.0)
    model, tokenizer = loaded
    think = tokenizer.encode("<think>", add_special_tokens=False)
    end = tokenizer.encode("</think>", add_special_tokens=False)
    words = tokenizer.encode(" hello world again and again", add_special_tokens=False)
    assert len(think) == len(end) == 1 and len(words) >= 4
    forced = [think[0], *words]
    first_word = tokenizer.decode(words[:1]).strip()
    # Held at the fifth token: mlx-lm computes a step ahead of the one it returns, so the
    # first visible token (the second) has been handed to the worker well before.
    gate = _Gate(forced, hold=4)
    worker = worker_module.BatchWorker(model, tokenizer, name="visible")

    async def main() -> list[list[Any]]:
        request = GenerationRequest(
            "r", _prompts(tokenizer, 1)[0], len(forced),
            sampling=SamplingParams(temperature=0.0),
            logits_processors=[gate],
            reasoning=ReasoningMarkers("<think>", "</think>"),
        )
        generation = Generation(request, asyncio.get_running_loop())
        worker.start()
        worker.submit(generation)
        hops: list[list[Any]] = []
        while generation.finish is None or not hops or hops[-1][-1] is not generation.finish:
            hops.append(await generation.next_events())
            if any(isinstance(e, Text) and e.text.strip() == first_word for e in hops[-1]):
                gate.seen.set()
        return hops

    try:
        hops = asyncio.run(main())
    finally:
        worker.stop()
    texts = [[e for e in hop if isinstance(e, Text)] for hop in hops]
    # The first visible token reached the client while the thread was held: it did not
    # wait for the paced hand-off, which would have come with the finish.
    assert gate.in_time is True
    assert texts[0][0].text == "<think>"
    got = next(i for i, hop in enumerate(texts) if any(e.text.strip() == first_word
                                                        for e in hop))
    assert sum(e.tokens for hop in texts[:got + 1] for e in hop) < len(forced)
    assert hops[-1][-1] is not None and got < len(hops) - 1
    assert sum(e.tokens for hop in texts for e in hop) == len(forced)
