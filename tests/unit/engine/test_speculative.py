"""Speculative decoding: proposed tokens verified several per forward pass, on the demo models.

Speculation must change no token. Each engine case runs the same request through a plain
``BatchGenerator`` with afmd's decode step and once more with a proposal source attached
(the client's prediction, prompt lookup, a draft model), and compares every token; the
sources must also have been used (verification passes that accepted tokens), or the
comparison would prove nothing. Both of the engine's paths are covered (forced, so on any
machine: afmd/engine/batch/backend.py): the CPU path's, numpy projecting a verification pass
(the ``host`` model), and the GPU path's, the whole pass in MLX (the ``device`` model).
Greedy outputs are compared with tests/helpers/numerics.py, which on the CPU asks for the
same tokens and on a GPU allows a divergence at a near-tie of the model's own logits. The
wire side (``prediction`` on each endpoint, usage, profile) is
tests/server/test_predicted_outputs.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator

from afmd.config.load import load_config
from afmd.config.sections import Config
from afmd.config.tables import ModelEntry
from afmd.engine.batch import logprobs
from afmd.engine.batch.cpu_layout import relayout_for_cpu
from afmd.engine.batch.decode import DecodeBatch
from afmd.engine.batch.generation_thread import BatchWorker
from afmd.engine.batch.penalties import sampling_processors
from afmd.engine.batch.sampler import RowSampler
from afmd.engine.demo import builtin as demo
from afmd.engine.generation import (
    Finished,
    Generation,
    GenerationRequest,
    SamplingParams,
    Text,
    TokenIdLogprob,
)
from afmd.engine.speculative.draft import DraftMismatch, load_draft
from afmd.engine.speculative.proposals import DraftSource, LookupSource, PredictionSource
from afmd.engine.speculative.verification import RowSpec, SourceState, Standing, grammar_prefix
from afmd.engine.speculative.verify_head import HostHead, VerifyHead
from afmd.grammar.batch_masks import GrammarProcessor
from afmd.grammar.compiler import json_schema_grammar, llg_tokenizer
from afmd.grammar.frames import Thinking

from helpers.numerics import (
    LOGPROB_TOLERANCE,
    assert_greedy_agrees,
    assert_top_agrees,
    first_difference,
    layout,
)

GREEDY = SamplingParams(temperature=0.0)
QUESTIONS = ("write me a story about a cat", "explain relativity to a child")


def _load(variant: str, root: Path, *, relayout: bool) -> tuple[Any, Any]:
    model, tokenizer = mlx_lm.load(str(demo.materialize(variant, root)))
    if relayout:
        with layout("cpu"):
            assert relayout_for_cpu(model)
    return model, tokenizer


#: The engine path each model fixture stands for.
PATHS = {"host": "cpu", "device": "gpu", "big_vocab": "cpu"}


@pytest.fixture(autouse=True)
def _path(request: pytest.FixtureRequest) -> Any:
    """The engine path of the model a test runs (its ``layout`` parameter's, else its
    model fixture's), forced while it runs."""
    callspec = getattr(request.node, "callspec", None)
    chosen = callspec.params.get("layout") if callspec is not None else None
    if chosen is None:
        chosen = next((f for f in ("host", "big_vocab", "device")
                       if f in request.fixturenames), None)
    if chosen is None:
        yield
        return
    with layout(PATHS[chosen]):
        yield


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spec-cache")


@pytest.fixture(scope="module")
def host(cache_root: Path) -> tuple[Any, Any]:
    """The demo model as the CPU path lays it out (numpy projects the passes)."""
    return _load("demo", cache_root, relayout=True)


@pytest.fixture(scope="module")
def device(cache_root: Path) -> tuple[Any, Any]:
    """The demo model as the GPU path loads it (MLX projects the passes)."""
    return _load("demo", cache_root, relayout=False)


@pytest.fixture(scope="module")
def big_vocab(cache_root: Path) -> tuple[Any, Any]:
    return _load("demo-32k", cache_root, relayout=True)


def _prompt(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True))


class Run:
    """One request through a fresh generator: its tokens, last response and speculation."""

    def __init__(self, loaded: tuple[Any, Any], prompt: list[int], max_tokens: int, *,
                 sampling: SamplingParams = GREEDY, prediction: str | None = None,
                 lookup: bool = False, draft: Any = None, processors: tuple[Any, ...] = (),
                 stop_ids: tuple[int, ...] = (), logprobs: int | None = None) -> None:
        model, tokenizer = loaded
        self.loaded = loaded
        eos = sorted(tokenizer.eos_token_ids)
        self.generator = BatchGenerator(model, stop_tokens=[[t] for t in eos],
                                        completion_batch_size=4, prefill_batch_size=4)
        self.batch = DecodeBatch.install(self.generator)
        self.sampler = RowSampler.of(sampling)
        stops = frozenset(eos).union(stop_ids)
        request = GenerationRequest("r", prompt, max_tokens, sampling=sampling,
                                    prediction=prediction, logprobs=logprobs)
        self.spec = RowSpec.for_request(request, processors, self.sampler, stops,
                                        tokenizer=tokenizer, prompt_lookup=lookup, draft=draft)
        self.uid = self.insert(prompt, max_tokens, list(processors), stop_ids, self.spec,
                               self.sampler)
        if logprobs is not None:
            self.batch.logprob_rows[self.uid] = logprobs
        self.tokens: dict[int, list[int]] = {self.uid: []}
        self.entries: dict[int, list[Any]] = {self.uid: []}
        self.last: dict[int, Any] = {}
        self.most_in_one_step = 0

    def insert(self, prompt: list[int], max_tokens: int, processors: list[Any],
               stop_ids: tuple[int, ...], spec: RowSpec | None, sampler: Any) -> int:
        eos = sorted(self.loaded[1].eos_token_ids)
        stops = [[t] for t in sorted(set(eos) | set(stop_ids))]
        from mlx_lm.generate import StopSequences

        (uid,) = self.generator.insert([prompt], max_tokens=[max_tokens], samplers=[sampler],
                                       logits_processors=[processors],
                                       stop_sequences=[StopSequences(stops)])
        if spec is not None:
            self.batch.spec_rows[uid] = spec
        return uid

    def step(self) -> None:
        _, responses = self.generator.next()
        count: dict[int, int] = {}
        for r in responses:
            self.tokens.setdefault(r.uid, []).append(r.token)
            self.entries.setdefault(r.uid, []).append(r.logprobs)
            count[r.uid] = count.get(r.uid, 0) + 1
            if r.finish_reason is not None:
                self.last[r.uid] = r
        self.most_in_one_step = max([self.most_in_one_step, *count.values()])

    def finish(self) -> list[int]:
        while len(self.last) < len(self.tokens):
            self.step()
        self.generator.close()
        return self.tokens[self.uid]

    def stats(self) -> dict[str, dict[str, int]]:
        return self.spec.stats() if self.spec is not None else {}

    def numbers(self, k: int, uid: int | None = None) -> list[TokenIdLogprob]:
        """The row's log-probabilities, as the worker resolves them token by token."""
        uid = self.uid if uid is None else uid
        return [logprobs.resolve(e, t, k)
                for e, t in zip(self.entries[uid], self.tokens[uid], strict=True)]


#: The plain runs so far: (model, budget, tokens) by model, engine path, prompt and
#: sampling. The model is kept so that its id names it for as long as the entry lives.
_PLAIN: dict[tuple[Any, ...], tuple[Any, int, list[int]]] = {}


def plain(loaded: tuple[Any, Any], prompt: list[int], max_tokens: int, **kw: Any) -> list[int]:
    """The request's tokens without speculation: what a speculating run must write.

    A reference many tests compare with is decoded once per model, engine path, prompt
    and sampling (the comparisons are what the tests are about, not the reference's
    decoding, which is the same computation each time); a greedy one shorter than one
    already decoded is that one's start, as greedy decoding writes the same first tokens
    whatever the budget. Runs with processors or stop tokens are decoded each time."""
    if kw.keys() - {"sampling"}:
        return Run(loaded, prompt, max_tokens, **kw).finish()
    sampling: SamplingParams = kw.get("sampling", GREEDY)
    key = (id(loaded[0]), logprobs._on_host(), tuple(prompt), sampling)
    known = _PLAIN.get(key)
    if known is not None and (known[1] == max_tokens
                              or (sampling.temperature == 0 and known[1] > max_tokens)):
        return known[2][:max_tokens]
    tokens = Run(loaded, prompt, max_tokens, **kw).finish()
    if known is None or max_tokens > known[1]:
        _PLAIN[key] = (loaded[0], max_tokens, list(tokens))
    return tokens


def _text(tokenizer: Any, tokens: list[int]) -> str:
    return tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids])


def _edited(tokenizer: Any, text: str) -> str:
    """``text`` with a few tokens in the middle replaced (an edit that rejoins)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    mid = len(ids) // 2
    return tokenizer.decode(ids[:mid] + tokenizer.encode(" banana split", add_special_tokens=False)
                            + ids[mid + 3:])


def _consistent(run: Run, prompt: list[int], uid: int | None = None) -> None:
    """A finished row's KV cache and token list agree with what was handed out."""
    uid = run.uid if uid is None else uid
    response = run.last[uid]
    offset = response.prompt_cache[0].offset
    assert offset == len(response.all_tokens)
    assert response.all_tokens == [*prompt, *run.tokens[uid]][:offset]
    assert offset >= len(prompt) + len(run.tokens[uid]) - 1


# -- greedy identity, each source --------------------------------------------------------


@pytest.mark.parametrize("layout", ["host", "device"])
@pytest.mark.parametrize("question", QUESTIONS)
def test_prediction_exact_and_edited_change_no_token(
    request: pytest.FixtureRequest, layout: str, question: str
) -> None:
    loaded = request.getfixturevalue(layout)
    tokenizer = loaded[1]
    prompt = _prompt(tokenizer, question)
    want = plain(loaded, prompt, 200)
    for prediction in (_text(tokenizer, want), _edited(tokenizer, _text(tokenizer, want))):
        run = Run(loaded, prompt, 200, prediction=prediction)
        assert_greedy_agrees(loaded[0], prompt, run.finish(), want)
        stats = run.stats()["prediction"]
        assert stats["verifications"] > 0 and stats["accepted"] > len(want) // 3, stats
        assert run.most_in_one_step > 4
        _consistent(run, prompt)
    assert isinstance(VerifyHead.of(loaded[0]), HostHead) == (layout == "host")
    assert logprobs._on_host() == (layout == "host")


def test_near_ties_are_projected_by_mlx_as_a_step_would(
    host: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the rounding bound made huge every position counts as a near-tie and is
    projected again by MLX alone: the path that keeps numpy's rounding out of the picks."""
    from afmd.engine.speculative import verify_head

    monkeypatch.setattr(verify_head, "_EPS32", 1.0)
    tokenizer = host[1]
    prompt = _prompt(tokenizer, QUESTIONS[0])
    for sampling in (GREEDY, SamplingParams(temperature=0.8, seed=2)):
        want = plain(host, prompt, 80, sampling=sampling)
        run = Run(host, prompt, 80, sampling=sampling, prediction=_text(tokenizer, want))
        assert run.finish() == want
        assert run.stats()["prediction"]["accepted"] > 20


class _Capped(nn.Module):
    """A model whose logits are soft-capped after the output projection (as Gemma 2's)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model, self.lm_head, self.args = model.model, model.lm_head, model.args

    @property
    def layers(self) -> Any:
        return self.model.layers

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return mx.tanh(self.lm_head(self.model(inputs, cache)) / 5.0) * 5.0


def test_a_head_with_something_after_it_stays_in_mlx(host: tuple[Any, Any]) -> None:
    model, tokenizer = host
    capped = _Capped(model)
    assert isinstance(VerifyHead.of(model), HostHead)
    assert not isinstance(VerifyHead.of(capped), HostHead)
    prompt = _prompt(tokenizer, QUESTIONS[0])
    loaded = (capped, tokenizer)
    want = plain(loaded, prompt, 60)
    run = Run(loaded, prompt, 60, prediction=_text(tokenizer, want))
    assert_greedy_agrees(capped, prompt, run.finish(), want)
    assert run.stats()["prediction"]["accepted"] > 10


def test_prediction_on_the_32k_vocabulary(big_vocab: tuple[Any, Any]) -> None:
    tokenizer = big_vocab[1]
    prompt = _prompt(tokenizer, QUESTIONS[0])
    want = plain(big_vocab, prompt, 160)
    run = Run(big_vocab, prompt, 160, prediction=_edited(tokenizer, _text(tokenizer, want)))
    assert_greedy_agrees(big_vocab[0], prompt, run.finish(), want)
    assert run.stats()["prediction"]["accepted"] > 80


def test_prediction_longer_than_max_tokens(host: tuple[Any, Any]) -> None:
    tokenizer = host[1]
    prompt = _prompt(tokenizer, QUESTIONS[1])
    full = plain(host, prompt, 120)
    for budget in (3, 4, 17, 40):
        run = Run(host, prompt, budget, prediction=_text(tokenizer, full))
        assert run.finish() == full[:budget]
        assert run.last[run.uid].finish_reason == "length"
        _consistent(run, prompt)


def test_prompt_lookup_changes_no_token(host: tuple[Any, Any]) -> None:
    tokenizer = host[1]
    # The model repeats itself (its greedy output loops): lookup finds the loop.
    for question in QUESTIONS:
        prompt = _prompt(tokenizer, question)
        want = plain(host, prompt, 200)
        run = Run(host, prompt, 200, lookup=True)
        assert_greedy_agrees(host[0], prompt, run.finish(), want)
        _consistent(run, prompt)
    assert run.stats()["prompt_lookup"]["accepted"] > 0


def test_draft_model_changes_no_token(host: tuple[Any, Any], device: tuple[Any, Any]) -> None:
    tokenizer = host[1]
    prompt = _prompt(tokenizer, QUESTIONS[0])
    want = plain(host, prompt, 120)
    # The same weights drafting: every proposal holds (the cache bookkeeping is exercised
    # over long accepted runs).
    run = Run(host, prompt, 120, draft=device[0])
    assert_greedy_agrees(host[0], prompt, run.finish(), want)
    stats = run.stats()["draft"]
    assert stats["accepted"] > 60 and stats["rejected"] <= stats["verifications"]
    _consistent(run, prompt)


def test_sources_are_tried_best_first(host: tuple[Any, Any]) -> None:
    tokenizer = host[1]
    prompt = _prompt(tokenizer, QUESTIONS[0])
    want = plain(host, prompt, 150)
    run = Run(host, prompt, 150, prediction=_text(tokenizer, want), lookup=True,
              draft=host[0])
    assert_greedy_agrees(host[0], prompt, run.finish(), want)
    stats = run.stats()
    assert stats["prediction"]["accepted"] > 100
    assert stats["prediction"]["verifications"] > stats["draft"]["verifications"]


# -- sampling ------------------------------------------------------------------------------


def test_seeded_sampling_is_the_same_with_and_without_speculation(
    host: tuple[Any, Any]
) -> None:
    tokenizer = host[1]
    prompt = _prompt(tokenizer, QUESTIONS[0])
    for sampling in (SamplingParams(temperature=0.7, seed=11),
                     SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=5)):
        want = plain(host, prompt, 120, sampling=sampling)
        assert Run(host, prompt, 120, sampling=sampling).finish() == want  # reproducible
        run = Run(host, prompt, 120, sampling=sampling, prediction=_text(tokenizer, want),
                  lookup=True)
        assert run.finish() == want
        assert run.stats()["prediction"]["accepted"] > 30


#: Each history-reading processor a request's sampling adds, alone and together; the
#: biased ids are ones the demo model writes in its answers.
PENALTIES = {
    "repetition": {"repetition_penalty": 1.3, "repetition_context": 16},
    "presence": {"presence_penalty": 0.9},
    "frequency": {"frequency_penalty": 0.6},
    "bias": {"logit_bias": ((701, -4.0), (1768, -2.0), (30, 2.5))},
    "all": {"repetition_penalty": 0.85, "presence_penalty": -0.4, "frequency_penalty": 0.3,
            "logit_bias": ((1, 1.5),)},
}


def _penalized(sampling: SamplingParams, loaded: tuple[Any, Any], prompt: list[int],
               max_tokens: int, **kw: Any) -> Run:
    """A run with the processors the engine gives those settings (fresh: they keep
    where the output starts)."""
    return Run(loaded, prompt, max_tokens, sampling=sampling,
               processors=tuple(sampling_processors(sampling, max_tokens)), **kw)


@pytest.mark.parametrize("layout", ["host", "device"])
@pytest.mark.parametrize("settings", PENALTIES, ids=str)
def test_penalties_and_biases_speculate_and_change_no_token(
    request: pytest.FixtureRequest, layout: str, settings: str
) -> None:
    """Each position of a pass is scored with the tokens before it, the proposal's
    included, so a penalized request speculates and writes what it writes alone."""
    loaded = request.getfixturevalue(layout)
    model, tokenizer = loaded
    prompt = _prompt(tokenizer, QUESTIONS[0])
    sampling = SamplingParams(temperature=0.0, **PENALTIES[settings])
    want = _penalized(sampling, loaded, prompt, 120).finish()
    assert want != plain(loaded, prompt, 120), "the settings change the output"
    run = _penalized(sampling, loaded, prompt, 120, prediction=_text(tokenizer, want),
                     lookup=True)
    assert_greedy_agrees(model, prompt, run.finish(), want)
    assert run.stats()["prediction"]["accepted"] > 40 and run.most_in_one_step > 4
    _consistent(run, prompt)


def test_seeded_penalized_sampling_and_its_numbers_are_the_same_with_speculation(
    host: tuple[Any, Any]
) -> None:
    tokenizer = host[1]
    prompt = _prompt(tokenizer, QUESTIONS[1])
    sampling = SamplingParams(temperature=0.8, seed=3, **PENALTIES["all"])
    alone = _penalized(sampling, host, prompt, 100, logprobs=3)
    want = alone.finish()
    run = _penalized(sampling, host, prompt, 100, logprobs=3,
                     prediction=_text(tokenizer, want), lookup=True)
    assert run.finish() == want
    assert run.stats()["prediction"]["accepted"] > 30
    for got, expected in zip(run.numbers(3), alone.numbers(3), strict=True):
        assert got.token == expected.token
        assert abs(got.logprob - expected.logprob) <= LOGPROB_TOLERANCE
        assert [t for t, _ in got.top] == [t for t, _ in expected.top]


def test_noise_positions_match_one_step_at_a_time() -> None:
    """The verification's noise for position i is what the sampler draws at step i."""
    params = SamplingParams(temperature=0.9, seed=3)
    one, many = RowSampler.of(params), RowSampler.of(params)
    assert one is not None and many is not None
    logits = mx.random.normal((5, 64), key=mx.random.key(1))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    stepwise = [int(one(logprobs[i : i + 1]).item()) for i in range(5)]
    noise, keys = many.noise(5, 64)
    together = mx.argmax(many.scores(logprobs) + noise, axis=-1).tolist()
    assert together == stepwise
    many.commit(keys, 2)
    again = RowSampler.of(params)
    assert again is not None
    again(logprobs[:1])
    again(logprobs[:1])
    assert mx.array_equal(many.key, again.key).item()


# -- ends: stop tokens, max_tokens, joins, cancellation -----------------------------------


def test_a_stop_token_inside_an_accepted_proposal_ends_there(host: tuple[Any, Any]) -> None:
    tokenizer = host[1]
    prompt = _prompt(tokenizer, QUESTIONS[1])
    full = plain(host, prompt, 150)
    stop = full[60]  # a token the request says ends it (as fill-in-the-middle's markers)
    want = plain(host, prompt, 150, stop_ids=(stop,))
    assert want == full[: full.index(stop) + 1]
    run = Run(host, prompt, 150, prediction=_text(tokenizer, full), stop_ids=(stop,))
    assert run.finish() == want
    assert run.last[run.uid].finish_reason == "stop"
    _consistent(run, prompt)


def test_a_row_joining_settles_the_pass_in_flight(host: tuple[Any, Any]) -> None:
    tokenizer = host[1]
    first, second = (_prompt(tokenizer, q) for q in QUESTIONS)
    want_first, want_second = plain(host, first, 150), plain(host, second, 60)
    run = Run(host, first, 150, prediction=_text(tokenizer, want_first))
    while run.batch._verify is None:
        run.step()
    other = run.insert(second, 60, [], (), None, None)
    run.tokens[other] = []
    run.finish()
    assert_greedy_agrees(host[0], first, run.tokens[run.uid], want_first)
    assert_greedy_agrees(host[0], second, run.tokens[other], want_second)
    _consistent(run, first)
    _consistent(run, second, other)


def test_cancelling_mid_verification_leaves_a_clean_batch(host: tuple[Any, Any]) -> None:
    tokenizer = host[1]
    prompt = _prompt(tokenizer, QUESTIONS[0])
    want = plain(host, prompt, 100)
    run = Run(host, prompt, 100, prediction=_text(tokenizer, want))
    while run.batch._verify is None:
        run.step()
    run.generator.remove([run.uid])  # what the worker does for a cancelled request
    assert run.batch._verify is None and not run.batch.uids
    # The generator carries on, and the next request is untouched by what was in flight.
    run.uid = run.insert(prompt, 100, [], (), None, None)
    run.tokens, run.last = {run.uid: []}, {}
    assert_greedy_agrees(host[0], prompt, run.finish(), want)


def test_cancel_through_the_worker_mid_verification(host: tuple[Any, Any]) -> None:
    model, tokenizer = host
    prompt = _prompt(tokenizer, QUESTIONS[0])
    want = plain(host, prompt, 400)
    worker = BatchWorker(model, tokenizer, name="spec-cancel", prompt_cache_bytes=0)

    async def main() -> Finished:
        loop = asyncio.get_running_loop()
        request = GenerationRequest("r", prompt, 400, sampling=GREEDY,
                                    prediction=_text(tokenizer, want))
        generation = Generation(request, loop)
        worker.start()
        worker.submit(generation)
        seen = 0
        while seen < 10:
            seen += sum(e.tokens for e in await generation.next_events() if isinstance(e, Text))
        generation.cancel()
        worker.wake()
        while generation.finish is None:
            await generation.next_events()
        return generation.finish

    try:
        finish = asyncio.run(main())
    finally:
        worker.stop()
    assert finish.finish_reason == "cancelled"
    assert finish.completion_tokens < 400
    assert finish.accepted_prediction_tokens > 0


# -- grammars ------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def grammar(host: tuple[Any, Any]) -> Any:
    model, tokenizer = host
    llg = llg_tokenizer(tokenizer, model.args.vocab_size, sorted(tokenizer.eos_token_ids))
    return json_schema_grammar(llg, SCHEMA, thinking=None, param="response_format")


def test_grammar_rows_speculate_and_keep_their_output(host: tuple[Any, Any], grammar: Any
                                                      ) -> None:
    model, tokenizer = host
    vocab = model.args.vocab_size
    prompt = _prompt(tokenizer, "a record please")

    def constrained() -> tuple[Any, ...]:
        return (GrammarProcessor(grammar.matcher(), vocab),)

    want = plain(host, prompt, 120, processors=constrained())
    value = json.loads(_text(tokenizer, want))
    assert set(value) == {"name", "tags"}
    run = Run(host, prompt, 120, processors=constrained(), prediction=_text(tokenizer, want))
    assert_greedy_agrees(model, prompt, run.finish(), want)
    assert run.stats()["prediction"]["accepted"] > len(want) // 3
    # A prediction the grammar refuses part-way: the proposals stop at the refusal.
    broken = _text(tokenizer, want).replace('"', "'", 3)
    run = Run(host, prompt, 120, processors=constrained(), prediction=broken)
    assert_greedy_agrees(model, prompt, run.finish(), want)
    _consistent(run, prompt)


def test_grammar_rows_with_penalties_speculate_and_keep_their_output(
        host: tuple[Any, Any], grammar: Any) -> None:
    """Masked first, then penalized, at every position, as a step does."""
    model, tokenizer = host
    vocab = model.args.vocab_size
    prompt = _prompt(tokenizer, "a record please")
    sampling = SamplingParams(temperature=0.0, repetition_penalty=1.6, presence_penalty=1.0,
                              logit_bias=((1, -2.0),))

    def constrained() -> tuple[Any, ...]:
        return (GrammarProcessor(grammar.matcher(), vocab),
                *sampling_processors(sampling, 120))

    want = plain(host, prompt, 120, sampling=sampling, processors=constrained())
    assert set(json.loads(_text(tokenizer, want))) == {"name", "tags"}
    assert want != plain(host, prompt, 120, processors=constrained()[:1])
    run = Run(host, prompt, 120, sampling=sampling, processors=constrained(),
              prediction=_text(tokenizer, want))
    assert_greedy_agrees(model, prompt, run.finish(), want)
    assert run.stats()["prediction"]["accepted"] > len(want) // 3
    _consistent(run, prompt)


def test_a_thinking_budget_grammar_keeps_its_state_under_speculation(
    host: tuple[Any, Any]
) -> None:
    """A thinking block bounded by a budget (a ``max_tokens`` lexeme) under a JSON answer:
    rejected proposals once left the matcher allowing end-of-sequence mid-thought (the
    answer never came: 500 invalid_json_output on the server). The budget is long enough
    for the lookup to propose inside the thought several times."""
    model, tokenizer = host
    llg = llg_tokenizer(tokenizer, model.args.vocab_size, sorted(tokenizer.eos_token_ids))
    grammar = json_schema_grammar(llg, SCHEMA, thinking=Thinking("<think>", "</think>",
                                                                  False, 120),
                                  param="response_format")
    prompt = _prompt(tokenizer, "Describe a person as JSON.")  # it thinks first
    passes = 0
    for sampling in (GREEDY, SamplingParams(temperature=1.0, seed=1)):
        def constrained() -> tuple[Any, ...]:
            return (GrammarProcessor(grammar.matcher(), grammar.tokenizer.vocab_size),)

        want = plain(host, prompt, 200, sampling=sampling, processors=constrained())
        run = Run(host, prompt, 200, sampling=sampling, processors=constrained(),
                  lookup=True)
        assert run.finish() == want
        passes += run.stats()["prompt_lookup"]["verifications"]
        thought, answer = _text(tokenizer, want).split("</think>", 1)
        assert thought.startswith("<think>")
        assert set(json.loads(answer)) == {"name", "tags"}
    assert passes > 2


def test_a_grammar_row_waits_for_its_token_only_for_a_proposal(
    host: tuple[Any, Any], grammar: Any
) -> None:
    """A constrained row's proposal must pass the grammar, so it waits for each token
    before proposing: at steps where the lookup has nothing, that wait cost the step its
    masks built while the model computes (constrained decode alone ran slower with prompt
    lookup on than off), so those steps are plain ones."""
    model, tokenizer = host
    prompt = _prompt(tokenizer, "a record please")

    def constrained() -> tuple[Any, ...]:
        return (GrammarProcessor(grammar.matcher(), model.args.vocab_size),)

    want = plain(host, prompt, 120, processors=constrained())
    run = Run(host, prompt, 120, processors=constrained(), lookup=True)
    plain_steps = 0
    step = run.batch.afmd_step

    def counted() -> tuple[list[int], list[Any]]:
        nonlocal plain_steps
        plain_steps += min(run.batch.generated) > 0
        return step()

    run.batch.afmd_step = counted  # type: ignore[method-assign]
    assert_greedy_agrees(model, prompt, run.finish(), want)
    assert plain_steps > 0  # steps after the first token taken the plain way
    assert run.stats()["prompt_lookup"]["verifications"] > 0  # and some speculated
    _consistent(run, prompt)


def test_who_would_propose_for_a_constrained_row() -> None:
    def row(history: list[int], *sources: Any) -> RowSpec:
        return RowSpec.of(history, sources, stop_ids=frozenset({9}), processors=(),
                          sampler=None)

    assert not row([1, 2, 3, 4], LookupSource()).would_propose(8)
    assert row([1, 2, 3, 1, 2], LookupSource()).would_propose(8)  # guesses 3, then 1 2
    assert not row([1, 2, 9, 1, 2], LookupSource()).would_propose(8)  # only a stop: the guess
    assert not row([1, 2, 3, 1, 2], LookupSource()).would_propose(0)
    paused = row([1, 2, 3, 1, 2], LookupSource())
    paused.sources[0].resume_at = 10
    assert not paused.would_propose(8)
    assert row([5], PredictionSource([7, 8])).would_propose(8)
    draft = object.__new__(DraftSource)  # never asked: a draft would run twice
    assert row([1, 2, 3, 4], LookupSource(), draft).would_propose(8)


def test_a_grammar_ends_a_proposal_at_the_first_token_it_refuses(
    host: tuple[Any, Any], grammar: Any
) -> None:
    model, tokenizer = host
    proc = GrammarProcessor(grammar.matcher(), model.args.vocab_size)
    proc.advance(-1)  # the first call sees the prompt, as mlx-lm's first step makes it
    good = tokenizer.encode('{"name":"x","tags":[]}', add_special_tokens=False)
    assert grammar_prefix([proc], good[0], good[1:]) == len(good) - 1
    bad = tokenizer.encode('{"name":"x","oops":1}', add_special_tokens=False)
    refused = grammar_prefix([proc], bad[0], bad[1:])
    text = tokenizer.decode(bad[: refused + 1])
    assert 0 < refused < len(bad) - 1 and "oops" not in text, text
    # Validating moved nothing: the matcher still takes the good tokens.
    assert grammar_prefix([proc], good[0], good[1:]) == len(good) - 1


# -- who speculates ------------------------------------------------------------------------


def _reference(model: Any, ids: list[int]) -> np.ndarray:
    """mlx-lm's log-probabilities at every position of ``ids``, in one forward pass."""
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def _assert_numbers(got: list[TokenIdLogprob], want: list[np.ndarray], k: int) -> None:
    """Each token's numbers within the device's tolerance of ``want`` (its position's
    row), the alternatives in the same order (tests/helpers/numerics.py)."""
    assert len(got) == len(want)
    for entry, row in zip(got, want, strict=True):
        assert abs(entry.logprob - float(row[entry.token])) <= LOGPROB_TOLERANCE
        assert_top_agrees(entry.top, row, k)


@pytest.mark.parametrize("layout", ["host", "device"])
def test_rows_with_logprobs_speculate_with_the_numbers_of_the_pass(
    request: pytest.FixtureRequest, layout: str
) -> None:
    """Each verified token's numbers come from the pass that verified it (numpy's
    projection on the host layout, MLX's otherwise) and match mlx-lm's own."""
    loaded = request.getfixturevalue(layout)
    model, tokenizer = loaded
    prompt = _prompt(tokenizer, QUESTIONS[0])
    want = plain(loaded, prompt, 80)
    run = Run(loaded, prompt, 80, prediction=_text(tokenizer, want), lookup=True, logprobs=3)
    assert run.spec is not None
    got = run.finish()
    assert_greedy_agrees(model, prompt, got, want)
    assert run.stats()["prediction"]["accepted"] > 20 and run.most_in_one_step > 4
    n = first_difference(got, want) or len(want)  # up to a near-tie, off the CPU
    lp = _reference(model, prompt + want)
    _assert_numbers(run.numbers(3)[:n], [lp[len(prompt) - 1 + i] for i in range(n)], 3)
    _consistent(run, prompt)


def test_logprobs_of_a_pass_settled_by_a_row_joining(host: tuple[Any, Any]) -> None:
    """The tokens a pass accepted go out with the next batched step, their numbers too."""
    model, tokenizer = host
    first, second = (_prompt(tokenizer, q) for q in QUESTIONS)
    want = plain(host, first, 120)
    run = Run(host, first, 120, prediction=_text(tokenizer, want), logprobs=2)
    while run.batch._verify is None:
        run.step()
    other = run.insert(second, 40, [], (), None, None)
    run.tokens[other] = []
    run.finish()
    got = run.tokens[run.uid]
    assert_greedy_agrees(model, first, got, want)
    assert run.most_in_one_step > 4
    n = first_difference(got, want) or len(want)
    lp = _reference(model, first + want)
    _assert_numbers(run.numbers(2)[:n], [lp[len(first) - 1 + i] for i in range(n)], 2)


def test_logprobs_of_grammar_rows_under_speculation(host: tuple[Any, Any], grammar: Any
                                                    ) -> None:
    """A constrained row's numbers (of the masked logits) are those of one step at a time."""
    model, tokenizer = host
    vocab = model.args.vocab_size
    prompt = _prompt(tokenizer, "a record please")

    def constrained() -> tuple[Any, ...]:
        return (GrammarProcessor(grammar.matcher(), vocab),)

    step = Run(host, prompt, 120, processors=constrained(), logprobs=4)
    want = step.finish()
    run = Run(host, prompt, 120, processors=constrained(), prediction=_text(tokenizer, want),
              logprobs=4)
    got_tokens = run.finish()
    assert_greedy_agrees(model, prompt, got_tokens, want)
    assert run.stats()["prediction"]["accepted"] > len(want) // 3
    n = first_difference(got_tokens, want) or len(want)
    for got, ref in zip(run.numbers(4)[:n], step.numbers(4)[:n], strict=True):
        assert got.token == ref.token
        assert abs(got.logprob - ref.logprob) <= LOGPROB_TOLERANCE
        row = np.full(vocab, -np.inf, dtype=np.float32)
        for token, value in ref.top:
            row[token] = value
        assert_top_agrees(got.top, row, len(ref.top))


def test_a_losing_source_backs_off_and_comes_back() -> None:
    state = SourceState(LookupSource())
    for _ in range(3):
        state.record(8, 0, 100)
    assert state.resume_at == 116 and state.pause == 32
    spec = RowSpec([1, 2, 3, 1, 2], 3, [state])
    spec.history += [3]  # 1 2 3 1 2 3: the lookup has a match
    assert spec.propose(4, guess=False) is None  # paused
    spec.history += [0] * 110
    spec.history += [1, 2, 3]
    assert spec.propose(4, guess=False) is not None
    state.record(8, 8, 200)
    assert state.pause == 16  # a good pass resets the back-off


def test_a_source_that_keeps_losing_starts_the_next_request_paused() -> None:
    standing: dict[str, Standing] = {}

    def row(prompt: list[int], *sources: Any) -> RowSpec:
        return RowSpec.of(prompt, sources, stop_ids=frozenset(), processors=(), sampler=None,
                          standing=standing)

    first = row([1, 2, 3], LookupSource()).sources[0]
    for _ in range(3):
        first.record(8, 0, 10)
    assert standing["prompt_lookup"].ewma < 0.2
    second = row([1, 2, 3, 1, 2], LookupSource()).sources[0]
    assert second.resume_at == 5 + 32  # paused from the start, as long as the last pause
    prediction = row([1], PredictionSource([1]), LookupSource()).sources
    assert prediction[0].standing is None and prediction[0].resume_at == 0
    second.record(8, 8, 40)  # it won once: the next request tries at once
    assert row([1, 2], LookupSource()).sources[0].resume_at == 0


def test_prediction_alignment_follows_edits() -> None:
    p = PredictionSource([10, 11, 12, 13, 14, 15, 16, 17, 18, 19])
    history = [1, 2]
    assert p.propose(history, 2, 3) == [10, 11, 12]
    history += [10, 11, 99]  # diverged
    assert p.propose(history, 2, 3) == []
    history += [15, 16]  # rejoined further on (the edit deleted 12-14)
    assert p.propose(history, 2, 3) == [17, 18, 19]
    assert p.matched == 4 and p.rejected == 6


def test_prediction_alignment_across_tokenizations() -> None:
    """The model writes "abc" as one token where the prediction has "a", "bc"."""
    pieces = {1: "a", 2: "bc", 3: "d", 4: "abc", 5: "e"}
    p = PredictionSource([1, 2, 3, 5], lambda ids: [pieces[i] for i in ids])
    assert p.propose([0, 4], 1, 2) == [3, 5]
    assert p.matched == 2


# -- draft models --------------------------------------------------------------------------


def test_a_draft_with_another_tokenizer_is_refused_at_load(tmp_path: Path) -> None:
    config = load_config(None, env={})
    entry = ModelEntry("demo-32k", "afmd:demo-32k", draft="demo")
    tokenizer = mlx_lm.load(str(demo.materialize("demo-32k")))[1]
    with pytest.raises(DraftMismatch, match="does not share the tokenizer of 'demo-32k'"):
        load_draft(entry, config, tokenizer)
    assert load_draft(ModelEntry("demo", "afmd:demo"), config, tokenizer) is None


def test_draft_config_names_a_model(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[[models.model]]\nid = "big"\npath = "afmd:demo"\ndraft = "dmeo"\n')
    with pytest.raises(Exception, match=r"models.model\[0\].draft: unknown model 'dmeo'"):
        load_config(path, env={})
    path.write_text('[[models.model]]\nid = "big"\npath = "afmd:demo"\ndraft = "big"\n')
    with pytest.raises(Exception, match="must name another model"):
        load_config(path, env={})
    assert not load_config(None, env={"AFMD_ENGINE_PROMPT_LOOKUP": "false"}).engine.prompt_lookup
    assert isinstance(Config().engine.prompt_lookup, bool)
