"""Speculation in afmd's decode step: a row decoding alone verifies proposed tokens.

Functions over :class:`~afmd.engine.decode.DecodeBatch` (its state stays on the batch:
the pass in flight, the tokens a settled pass accepted), kept apart from the plain step
they replace when a batch of one row may speculate (see the batch's module docstring).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache

from afmd.engine import handout
from afmd.engine.speculative import (
    RowSpec,
    Verification,
    accepted_count,
    consume,
    grammar_masks,
    grammar_prefix,
)

if TYPE_CHECKING:
    from afmd.engine.decode import DecodeBatch


def may_speculate(self: DecodeBatch) -> bool:
    if len(self.uids) != 1 or not self.spec_rows:
        return False
    spec = self.spec_rows.get(self.uids[0])
    if spec is None or not spec.enabled or self._num_tokens[0] == 0:
        return False
    if self.max_tokens[0] - self._num_tokens[0] < 3:
        return False
    if self._trimmable is None:
        self._trimmable = all(c.is_trimmable() for c in self.prompt_cache)
    return self._trimmable

def speculate(self: DecodeBatch) -> list[Any] | None:
    """One step of the lone row: settle the pass in flight (hand out what held), then
    start the next; ``None``: nothing to propose, take the plain step."""
    spec = self.spec_rows[self.uids[0]]
    if self._verify is not None:
        accepted, pending, entries = resolve(self)
        responses = handout.account(self, [[*accepted, pending]], [entries])
        if self.uids:
            launch_after(self, spec, pending)
        return responses
    self._launch_deferred()
    if spec.constrained:
        # The proposal must go through the grammar first: wait for the token.
        pending = int(self._next_tokens)
        responses = handout.account(self, [[pending]], [self._next_logprobs[:1]])
        if self.uids:
            launch_after(self, spec, pending)
        return responses
    # The token is still being computed: propose after the model's likely choice
    # (the source's guess), verified with it, so this step need not wait for it.
    budget = self.max_tokens[0] - self._num_tokens[0] - 2
    got = spec.propose(budget, guess=True)
    if got is None:
        return None
    state, proposal = got
    first = self._next_tokens
    rest = proposal[1:]
    verify = Verification(spec, state, first, _as_array(rest), len(rest),
                          _wanted(self))
    verify.launch(self.model, self.prompt_cache, None)
    self._verify = verify
    return handout.account(self, [[int(first)]], [self._next_logprobs[:1]])

def launch_after(self: DecodeBatch, spec: RowSpec, pending: int) -> None:
    """Feed ``pending`` (handed out, not yet in the cache) with a proposal, or alone."""
    budget = self.max_tokens[0] - self._num_tokens[0] - 1
    got = spec.propose(budget, guess=False) if budget > 0 else None
    if got is not None:
        state, proposal = got
        mask = None
        if spec.constrained:
            proposal = _as_list(proposal)
            proposal = proposal[: grammar_prefix(spec.processors, pending, proposal)]
            if proposal:
                mask = grammar_masks(spec.processors, pending, proposal,
                                     int(self.model.args.vocab_size))
        if len(proposal):
            first = mx.array([pending], dtype=mx.uint32)
            verify = Verification(spec, state, first, _as_array(proposal), len(proposal),
                                  _wanted(self))
            verify.launch(self.model, self.prompt_cache, mask)
            self._verify = verify
            return
    self._launch(mx.array([pending], dtype=mx.uint32))

def resolve(self: DecodeBatch) -> tuple[list[int], int, list[Any]]:
    """Wait for the pass in flight: the proposed tokens that held (now in the cache),
    the model's token after them (not yet in it), and what resolves the
    log-probabilities of each of those tokens."""
    verify, self._verify = self._verify, None
    assert verify is not None
    started = time.perf_counter()
    proposal, targets = verify.resolve()
    self.waited += time.perf_counter() - started
    n = accepted_count(proposal, targets)
    rejected = verify.k - n
    if rejected:
        trim_prompt_cache(self.prompt_cache, rejected)
    consume(verify.spec.processors, proposal[:n])
    self.tokens[0] += [int(verify.first), *proposal[:n]]
    verify.state.record(verify.k, n, len(verify.spec.history))
    return proposal[:n], targets[n], verify.entries(n + 1)

def _wanted(self: DecodeBatch) -> int | None:
    """The alternatives the lone row reports, if it reports log-probabilities."""
    rows = getattr(self, "logprob_rows", None)
    return rows.get(self.uids[0]) if rows else None


def _as_array(tokens: list[int] | mx.array) -> mx.array:
    return tokens if isinstance(tokens, mx.array) else mx.array(tokens, dtype=mx.uint32)


def _as_list(tokens: list[int] | mx.array) -> list[int]:
    return cast("list[int]", tokens.tolist()) if isinstance(tokens, mx.array) else list(tokens)
