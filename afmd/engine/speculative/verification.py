"""Speculative verification: several proposed tokens checked in one forward pass.

A sequence's next token ``a`` (known, or still being computed) is fed together with ``k``
proposed tokens ``d1..dk``; the pass yields the model's own choice after each of them,
``t1..t(k+1)``. The proposal holds while ``d(i) == t(i)``: those tokens and the model's
token after the last of them are the output, exactly as one step at a time would have
written it, and the KV cache is rolled back past the first rejection.

"The model's own choice" is the token the decode step would have picked: the argmax for
greedy rows; for sampled rows, the argmax of the same scores plus the same Gumbel noise,
drawn from the request's own key chain for that position (:mod:`afmd.engine.batch.sampler`).
So speculation changes no token, greedy or seeded, and sampled output keeps the model's
distribution exactly. Grammar masks are computed for every position, the matcher walked
through the proposal first: a proposal ends at the first token the grammar refuses. The
other processors (logit bias, repetition, presence and frequency penalties) read the tokens
before the position they score, so each position's logits go through them with its own
context, the tokens fed so far and the proposal up to it (:class:`Replay`), as the step
that would have scored that position alone hands them the tokens it was fed. A row
that reports log-probabilities takes each verified token's numbers from the pass that
verified it (the logits the model computed for that position, masked as a step masks them).

On MLX's CPU backend the output projection over the k+1 positions runs on numpy's BLAS
(:mod:`afmd.engine.speculative.verify_head`): the reference BLAS MLX ships there costs a whole
decode
step per extra row, which would eat what speculation saves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import numpy as np

from afmd.engine.batch.logprobs import RowLogprobs
from afmd.engine.batch.sampler import RowSampler
from afmd.engine.generation import GenerationRequest
from afmd.engine.speculative.proposals import DraftSource, LookupSource, PredictionSource
from afmd.engine.speculative.verify_head import VerifyHead
from afmd.grammar.batch_masks import MASKING, BanTokens, GrammarProcessor

# A source whose recent acceptance (a moving average of accepted / proposed) falls under
# this stops proposing for a while, the pause doubling each time it loses again.
_THRESHOLD = 0.2
_EWMA = 0.3
_PAUSE_MIN, _PAUSE_MAX = 16, 1024  # tokens of output


@dataclass(slots=True)
class Standing:
    """How a kind of source has fared on a model lately, across requests (the worker
    keeps one per kind): a request starts where the last ones left it, so a source that
    keeps losing (a draft that never agrees) starts paused instead of losing again."""

    ewma: float = 0.5
    pause: int = _PAUSE_MIN


@dataclass(slots=True)
class SourceState:
    """One proposal source of a row, with what it earned and its back-off."""

    source: Any
    ewma: float = 0.5
    pause: int = _PAUSE_MIN
    resume_at: int = 0  # history length from which it may propose again
    accepted: int = 0
    rejected: int = 0
    verifications: int = 0
    standing: Standing | None = None

    @classmethod
    def starting(cls, source: Any, standing: Standing | None, now: int) -> SourceState:
        state = cls(source, standing=standing)
        if standing is not None and standing.ewma < _THRESHOLD:
            state.ewma, state.pause = standing.ewma, standing.pause
            state.resume_at = now + standing.pause
        return state

    def record(self, proposed: int, accepted: int, now: int) -> None:
        self.verifications += 1
        self.accepted += accepted
        self.rejected += proposed - accepted
        rate = accepted / proposed if proposed else 0.0
        self.ewma = (1 - _EWMA) * self.ewma + _EWMA * rate
        if rate >= 0.5:
            self.pause = _PAUSE_MIN
        if self.ewma < _THRESHOLD:
            self.resume_at = now + self.pause
            self.pause = min(2 * self.pause, _PAUSE_MAX)
            self.ewma = 0.5
        if self.standing is not None:
            self.standing.ewma = (1 - _EWMA) * self.standing.ewma + _EWMA * rate
            self.standing.pause = self.pause


@dataclass(slots=True)
class RowSpec:
    """A sequence's speculation: its history, its sources (best first) and its numbers."""

    history: list[int]
    start: int  # where the output begins in the history
    sources: list[SourceState]
    stop_ids: frozenset[int] = frozenset()
    processors: Sequence[Any] = ()
    sampler: RowSampler | None = None
    prediction: PredictionSource | None = field(default=None)
    #: How much the replayed processors can widen a difference between two logits (a
    #: repetition penalty divides or multiplies some by itself), for the host projection's
    #: rounding bound.
    spread: float = 1.0

    @classmethod
    def of(cls, prompt: Sequence[int], sources: Sequence[Any], *, stop_ids: frozenset[int],
           processors: Sequence[Any], sampler: RowSampler | None,
           standing: dict[str, Standing] | None = None) -> RowSpec:
        prediction = next((s for s in sources if isinstance(s, PredictionSource)), None)
        states = [
            SourceState.starting(
                s, None if standing is None or s is prediction
                else standing.setdefault(s.name, Standing()), len(prompt))
            for s in sources
        ]
        return cls(list(prompt), len(prompt), states, stop_ids, tuple(processors), sampler,
                   prediction)

    @classmethod
    def for_request(cls, request: GenerationRequest, processors: Sequence[Any],
                    sampler: RowSampler | None, stop_ids: frozenset[int], *,
                    tokenizer: Any, prompt_lookup: bool, draft: Any = None,
                    standing: dict[str, Standing] | None = None) -> RowSpec | None:
        """The row's speculation, or None when it has no source."""
        sources: list[Any] = []
        if request.prediction:
            tokens = tokenizer.encode(request.prediction, add_special_tokens=False)
            if tokens:
                sources.append(PredictionSource(tokens, _pieces(tokenizer)))
        if prompt_lookup:
            sources.append(LookupSource())
        if draft is not None:
            sources.append(DraftSource(draft))
        if not sources:
            return None
        spec = cls.of(request.prompt, sources, stop_ids=stop_ids, processors=processors,
                      sampler=sampler, standing=standing)
        penalty = request.sampling.repetition_penalty
        if penalty:
            spec.spread = max(penalty, 1.0 / penalty)
        return spec

    @property
    def constrained(self) -> bool:
        """Whether a grammar (or a ban) decides which proposed tokens may stand."""
        return any(isinstance(p, MASKING) for p in self.processors)

    @property
    def replayed(self) -> list[Any]:
        """The processors that read the row's past tokens, replayed at every position."""
        return [p for p in self.processors if not isinstance(p, MASKING)]

    def propose(self, budget: int, *, guess: bool
                ) -> tuple[SourceState, list[int] | mx.array] | None:
        """The first unpaused source's proposal of up to ``budget`` tokens after the
        history; with ``guess``, led by its guess of the token still being computed."""
        now = len(self.history)
        for state in self.sources:
            if now < state.resume_at:
                continue
            k = min(budget, state.source.k_max) + guess
            proposal = state.source.propose(self.history, self.start, k)
            if isinstance(proposal, list):
                proposal = _until_stop(proposal, self.stop_ids)
            if len(proposal) > guess:
                return state, proposal
        return None

    def would_propose(self, budget: int) -> bool:
        """Whether a constrained row should wait for its token to propose after it.

        Its proposal must pass the grammar, so it is made once the token is known, and
        that wait costs the step its overlap of the forward pass with the grammar's masks.
        A source that guesses cheaply (the prediction, the prompt's n-grams) is asked
        first, led by its guess of the token; a draft model, which would run twice, is
        taken to propose."""
        now = len(self.history)
        if any(isinstance(s.source, DraftSource) and now >= s.resume_at for s in self.sources):
            return True
        return self.propose(budget, guess=True) is not None

    def usage(self) -> tuple[int, int]:
        """(accepted, rejected) prediction tokens, as OpenAI counts them: the
        prediction's tokens that appeared in the output, and the others."""
        p = self.prediction
        if p is None:
            return 0, 0
        p.propose(self.history, self.start, 0)  # walk the output's last tokens
        return p.matched, p.rejected

    def stats(self) -> dict[str, dict[str, int]]:
        return {s.source.name: {"accepted": s.accepted, "rejected": s.rejected,
                                "verifications": s.verifications} for s in self.sources}


def _pieces(tokenizer: Any) -> Callable[[Sequence[int]], Sequence[str]] | None:
    """The tokenizer's text piece of each id (byte-level or SentencePiece pieces, whose
    concatenation spells the text), when it has them."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is None:
        return None
    return lambda ids: [p or "" for p in convert(list(ids))]


def _until_stop(tokens: list[int], stop_ids: frozenset[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens


def grammar_prefix(processors: Sequence[Any], first: int, proposal: list[int]) -> int:
    """How many proposed tokens every grammar accepts after ``first``."""
    n = len(proposal)
    for proc in processors:
        if isinstance(proc, GrammarProcessor) and n:
            # validate_tokens counts the valid prefix; ``first`` was sampled under the mask.
            n = min(n, max(proc.matcher.validate_tokens([first, *proposal[:n]]) - 1, 0))
        elif isinstance(proc, BanTokens):
            banned = set(proc.ids)
            n = next((i for i, t in enumerate(proposal[:n]) if t in banned), n)
    return n


def grammar_masks(processors: Sequence[Any], first: int, proposal: list[int], vocab: int
                  ) -> np.ndarray:
    """``(k+1, vocab)`` booleans: what each position may be. The matchers consume
    ``first``; the proposal is walked on copies (:func:`consume` takes what held): llguidance
    1.9's ``rollback`` corrupts a matcher inside a lexeme bounded by ``max_tokens`` (a
    thinking budget), which made end-of-sequence legal in the middle of thinking."""
    rows = len(proposal) + 1
    allowed = np.ones((rows, vocab), dtype=np.bool_)
    for proc in processors:
        if isinstance(proc, GrammarProcessor):
            proc.advance(first)
            scratch = proc.matcher.deep_copy()
            words = (proc.vocab_size + 31) // 32
            bitmask = np.zeros((rows, words), dtype=np.int32)
            for i in range(rows):
                scratch.unsafe_compute_mask_ptr(bitmask[i].ctypes.data, words * 4)
                if i < len(proposal):
                    scratch.consume_token(proposal[i])
            width = min(vocab, words * 32)
            bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=width,
                                 bitorder="little").astype(np.bool_)
            allowed[:, :width] &= bits
            allowed[:, width:] = False  # padding ids are never valid under a grammar
        elif isinstance(proc, BanTokens):
            allowed[:, list(proc.ids)] = False
    return allowed


def consume(processors: Sequence[Any], tokens: Sequence[int]) -> None:
    """The proposed tokens that held, fed to the row's matchers."""
    for proc in processors:
        if isinstance(proc, GrammarProcessor):
            for token in tokens:
                proc.advance(token)


class Replay:
    """A pass's logits through the row's history-reading processors, position by
    position: position ``i`` scores the token after ``first`` and the proposal's first
    ``i`` tokens, so its processors see the tokens fed before the pass (the row's token
    context) followed by those."""

    __slots__ = ("_base", "_inputs", "_processors")

    def __init__(self, processors: Sequence[Any], context: mx.array, inputs: mx.array) -> None:
        self._processors = processors
        self._base = context.shape[0]
        self._inputs = mx.concatenate([context, inputs.astype(context.dtype)])

    def row(self, i: int, logits: mx.array) -> mx.array:
        """Position ``i``'s ``(1, vocab)`` logits as a step would score them."""
        context = self._inputs[: self._base + i + 1]
        for proc in self._processors:
            logits = proc(context, logits)
        return logits

    def __call__(self, logits: mx.array) -> mx.array:
        return mx.concatenate([self.row(i, logits[i : i + 1]) for i in range(logits.shape[0])])


class Verification:
    """One verification pass in flight: ``first`` plus a ``k``-token proposal."""

    __slots__ = ("_head", "_keys", "_mask", "first", "k", "logprobs", "proposal", "spec",
                 "state")

    def __init__(self, spec: RowSpec, state: SourceState, first: mx.array,
                 proposal: mx.array, k: int, logprobs: int | None = None) -> None:
        """``logprobs``: the alternatives the row reports, if it reports log-probabilities."""
        self.spec, self.state, self.first, self.proposal, self.k = (
            spec, state, first, proposal, k)
        self.logprobs = logprobs
        self._mask: np.ndarray | None = None
        self._keys: list[mx.array] = []
        self._head: VerifyHead | None = None

    @property
    def inputs(self) -> mx.array:
        """What the pass feeds the model: ``first`` and the proposal."""
        return mx.concatenate([self.first.astype(mx.uint32), self.proposal.astype(mx.uint32)])

    def launch(self, model: Any, cache: list[Any], mask: np.ndarray | None,
               context: mx.array | None = None) -> None:
        """Start the pass (lazily: :meth:`resolve` waits for it). ``context``: the tokens
        fed to the model so far, as the row's history-reading processors see them (needed
        when it has any)."""
        inputs = self.inputs
        self._mask = mask
        replayed = self.spec.replayed
        replay = None
        if replayed:
            assert context is not None, "a row with penalties verifies with its context"
            replay = Replay(replayed, context, inputs)
        head = VerifyHead.of(model)
        head.start(model, inputs[None], cache, mask, self.spec.sampler, self._noise,
                   self.logprobs, replay, self.spec.spread)
        self._head = head

    def _noise(self, vocab: int) -> mx.array:
        """The sampled row's noise for the pass's positions (the keys kept to commit)."""
        assert self.spec.sampler is not None
        noise, self._keys = self.spec.sampler.noise(self.k + 1, vocab)
        return noise

    def resolve(self) -> tuple[list[int], list[int]]:
        """(the proposal's tokens, the model's k+1 tokens), waiting for the pass."""
        assert self._head is not None
        targets = self._head.targets()
        if self.spec.sampler is not None:
            accepted = accepted_count(cast("list[int]", self.proposal.tolist()), targets)
            self.spec.sampler.commit(self._keys, accepted + 1)
        return cast("list[int]", self.proposal.tolist()), targets

    def entries(self, n: int) -> list[RowLogprobs | None]:
        """What :func:`afmd.engine.batch.logprobs.resolve` reads for the tokens of the pass's
        first ``n`` positions (after :meth:`resolve`); None each when the row does not
        report log-probabilities."""
        if self.logprobs is None:
            return [None] * n
        assert self._head is not None
        step = self._head.logprobs()
        return [RowLogprobs(step, i, self.logprobs) for i in range(n)]


def accepted_count(proposal: list[int], targets: list[int]) -> int:
    """How many proposed tokens are the model's own choices, in order."""
    n = 0
    while n < len(proposal) and proposal[n] == targets[n]:
        n += 1
    return n
