"""A request joining the running batch: its row, the prefix it resumes from, its sampler.

In two phases, because a sharded model's rank 0 must say what joins before it does
(:class:`~afmd.engine.sharded.lockstep.StepPlan`): :meth:`Admissions.prepare` builds the row and
fetches the cached prefix (what the plan tells the other ranks), :meth:`Admissions.admit`
then runs the model work and inserts the row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from afmd.engine.batch import backend
from afmd.engine.batch.detokenize import ExactDetokenizer
from afmd.engine.batch.handoff import flush
from afmd.engine.batch.logprobs import SCORE_STEP_POSITIONS, PromptScorer, prompt_logprobs
from afmd.engine.batch.penalties import sampling_processors
from afmd.engine.batch.sampler import RowSampler
from afmd.engine.batch.sequence import Row
from afmd.engine.batch.stepper import Stepper
from afmd.engine.generation import Generation, PromptLogprobs, SamplingParams
from afmd.engine.reasoning_count import ReasoningCount
from afmd.engine.sharded.lockstep import Admission
from afmd.engine.speculative.verification import RowSpec, Standing


def make_sampler(params: SamplingParams) -> RowSampler | None:
    """A per-request sampler with its own PRNG key (:class:`RowSampler`); ``None``
    means greedy: the batch then samples all greedy rows with one shared argmax."""
    return RowSampler.of(params)


@dataclass(slots=True)
class Joining:
    """A request about to join: its row, what the plan says of it, and the cached prefix
    it resumes from (fetched when the plan was made, so the plan can say so)."""

    row: Row
    plan: Admission
    cache: Any
    rest: list[int]


@dataclass(slots=True)
class Warming:
    """A request's prompt run a chunk per iteration of the generation thread, beside the
    batch's steps: a request with no tokens to write whose prompt goes into the prefix
    cache, or one that asked for the prompt's own log-probabilities (``echo``), which
    then joins the batch or ends. Run whole at its admission, a long prompt held up
    every stream in the batch for as long as it took, and neither a cancel nor the
    request's deadline could end it."""

    row: Row
    prompt: list[int]
    rest: list[int]
    cache: Any
    done: int = 0
    #: Scoring the prompt rather than keeping it.
    scorer: PromptScorer | None = None
    plan: Admission | None = None
    #: The scored row, once in the batch.
    joined: Row | None = None


class Admissions:
    """Builds and inserts the rows of the requests that arrive (thread-owned)."""

    def __init__(
        self,
        stepper: Stepper,
        *,
        prompt_lookup: bool,
        draft_model: Any,
        speculates: bool,
    ) -> None:
        self._stepper = stepper
        self._tokenizer = stepper.tokenizer
        self._eos = frozenset(stepper.eos)
        # Where a verification pass costs a new attention plan, a proposal guessed from
        # the prompt rarely holds long enough to pay for it (a prediction or draft, asked
        # for, still speculates).
        self._prompt_lookup = prompt_lookup and not backend.verify_builds_plans(stepper.model)
        self._draft_model = draft_model
        self._speculates = speculates
        # How each kind of proposal source fared lately.
        self._standing: dict[str, Standing] = {}

    def prepare(self, generation: Generation) -> Joining | None:
        """A request's row and the model work it needs (``None``: none, it ended)."""
        request = generation.request
        row = Row(
            generation=generation,
            uid=-1,
            detokenizer=(
                ExactDetokenizer(self._tokenizer) if request.verbatim
                else self._tokenizer.detokenizer
            ),
            prompt_tokens=len(request.prompt),
            started_at=time.perf_counter(),
            reasoning=(None if request.reasoning is None else
                       ReasoningCount(request.reasoning, inside=request.starts_in_reasoning)),
            logprobs=request.logprobs,
            stop_ids=self._eos.union(request.stop_ids),
            hidden_ids=request.hidden_ids,
        )
        if generation.cancel_requested:
            row.finish("cancelled")
            flush([row])
            return None
        cache, rest = (None, request.prompt)
        # A scored prompt runs whole (every position's logits), and a row that writes
        # tokens after it resumes from that pass; a sharded model's ranks score it at
        # admission and then resume from the prefix cache, as the plan says.
        if request.prompt_logprobs is None or (
                request.max_tokens > 0 and self._stepper.lockstep is not None):
            resume = self._stepper.resume(request.prompt)
            cache, rest = resume.cache, request.prompt[resume.tokens:]
            row.cached_disk_tokens = resume.disk_tokens
        row.cached_tokens = len(request.prompt) - len(rest)
        plan = Admission(
            prompt=list(request.prompt),
            cached=row.cached_tokens,
            max_tokens=request.max_tokens,
            stop_ids=sorted(request.stop_ids),
            prompt_logprobs=request.prompt_logprobs,
        )
        return Joining(row, plan, cache, rest)

    def warming(self, joining: Joining) -> Warming | None:
        """The request as a warm-up run a chunk at a time (``None``: it is not one, or
        there is no model work to it: :meth:`admit` ends it)."""
        plan = joining.plan
        if plan.prompt_logprobs is not None:
            return Warming(joining.row, plan.prompt, joining.rest, None, plan=plan,
                           scorer=PromptScorer(self._stepper.model, plan.prompt,
                                               plan.prompt_logprobs))
        if plan.max_tokens > 0 or not joining.rest or not self._stepper.keeps_prompts:
            return None
        cache = joining.cache if joining.cache is not None else self._stepper.new_cache()
        return Warming(joining.row, plan.prompt, joining.rest, cache)

    def advance(self, warming: Warming) -> bool:
        """Run the warm-up's next chunk; whether it has ended (its prompt kept, or it was
        cancelled, the chunks run so far thrown away)."""
        row = warming.row
        if row.generation.cancel_requested:
            row.finish("cancelled")
            flush([row])
            return True
        if warming.scorer is not None:
            return self._score(warming, SCORE_STEP_POSITIONS)
        step = self._stepper.prefill_step_size
        self._stepper.prefill(warming.rest[warming.done : warming.done + step], warming.cache)
        warming.done += step
        if warming.done < len(warming.rest):
            return False
        self._stepper.remember(warming.prompt, warming.cache)
        row.first_token_at = time.perf_counter()
        row.finish("length")
        flush([row])
        return True

    def _score(self, warming: Warming, step: int) -> bool:
        scorer, plan, row = warming.scorer, warming.plan, warming.row
        assert scorer is not None and plan is not None
        scorer.advance(step)
        if not scorer.finished:
            return False
        row.pending.append(PromptLogprobs(tuple(scorer.scores)))
        if plan.max_tokens <= 0:
            row.first_token_at = time.perf_counter()
            row.finish("length")
            flush([row])
            return True
        cache, rest = ((scorer.cache, plan.prompt[scorer.done:]) if scorer.done
                       else (None, plan.prompt))
        warming.joined = self._insert(row, plan, cache, rest)
        return True

    def admit(self, joining: Joining) -> Row | None:
        """Run the request's model work; its row, now in the batch (``None``: it asked for
        no tokens, only the prompt's numbers or the prompt in the prefix cache, and has
        ended)."""
        row, plan = joining.row, joining.plan
        if plan.prompt_logprobs is not None:  # a sharded model's: whole, in step
            row.pending.append(PromptLogprobs(
                prompt_logprobs(self._stepper.model, plan.prompt, plan.prompt_logprobs)
            ))
        if plan.max_tokens <= 0:
            if plan.prompt_logprobs is None:  # the prompt alone: into the prefix cache
                self._stepper.warm(plan.prompt, joining.rest, joining.cache)
            row.first_token_at = time.perf_counter()
            row.finish("length")
            flush([row])
            return None
        return self._insert(row, plan, joining.cache, joining.rest)

    def _insert(self, row: Row, plan: Admission, cache: Any, rest: list[int]) -> Row:
        request = row.generation.request
        processors = [*request.logits_processors,
                      *sampling_processors(request.sampling, plan.max_tokens)]
        sampler = make_sampler(request.sampling)
        if self._speculates:
            row.spec = RowSpec.for_request(
                request, processors, sampler, row.stop_ids, tokenizer=self._tokenizer,
                prompt_lookup=self._prompt_lookup, draft=self._draft_model,
                standing=self._standing,
            )
        row.uid = self._stepper.insert(
            plan.prompt, rest, cache, max_tokens=plan.max_tokens,
            sampler=sampler, processors=processors, stop_ids=plan.stop_ids,
        )
        batch = self._stepper.batch
        if row.logprobs is not None and batch is not None:
            batch.logprob_rows[row.uid] = row.logprobs
        if row.spec is not None and batch is not None:
            batch.spec_rows[row.uid] = row.spec
        return row
