"""afmd's decode step for mlx-lm's batched generation.

mlx-lm's decode step (``GenerationBatch._step``) is right for a generic library and slower
than it needs to be for a server; this subclass (through :mod:`afmd.engine.mlx_compat`)
changes only the step, keeping its bookkeeping (insert, extend, filter, stop matching) as
is. Outputs are token-for-token those of the per-row processors it replaces. What it
changes, as measured by bench/run.py:

- **Constrained rows are masked together.** mlx-lm slices every row that has a logits
  processor out of the batch, runs its processors and concatenates the rows back, and our
  grammar processor then had to read its row's last token with ``.item()``. Here the
  forward pass is started first, then all grammar matchers advance and fill their masks in
  one llguidance call while MLX computes, and one ``where`` applies every mask.
- **No normalisation nobody reads.** mlx-lm computes ``logsumexp`` over the whole
  vocabulary for every row, every step, to return log-probabilities most requests never
  ask for. Greedy rows take the argmax of the raw logits (the same token: the
  normalisation shifts a row by one constant); only sampled rows normalise, and only the
  rows that asked for log-probabilities (:attr:`DecodeBatch.logprob_rows`) get them, read
  back from the same evaluation as their tokens (:mod:`afmd.engine.batch.logprobs`).

- **A first token goes out before the next step starts.** mlx-lm launches a step's
  successor before returning its tokens; a step that hands out some row's first token
  returns it first and launches the successor on the next call (or before rows join).
  Building and starting a forward pass costs the calling thread a few milliseconds on
  MLX's CPU backend, and the time to first token paid for it.

- **A row decoding alone speculates.** When its request allows it (:attr:`spec_rows`)
  and no other row shares the batch, proposed tokens are verified several per forward
  pass (:mod:`afmd.engine.speculative.verification`) and one step hands out every token that held,
  with the numbers of that pass when the row reports log-probabilities.
  Rows joining end it (a pass in flight is settled first, its tokens handed out with the
  next step); a batch of one is where it pays, and where the single user of a local
  server is.

A sequence's first token is still sampled by mlx-lm's own step when it joins the batch
(``PromptProcessingBatch.generate``), which is why processors also work one row at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from afmd.engine.batch.logprobs import RowLogprobs, step_logprobs
from afmd.engine.mlx_compat import GenerationRows
from afmd.engine.speculative.verification import (
    RowSpec,
    Verification,
    accepted_count,
    consume,
    grammar_masks,
    grammar_prefix,
)
from afmd.grammar.batch_masks import MASKING, MaskBuilder

_NEG_INF = float("-inf")


class DecodeBatch(GenerationRows):
    """The running batch of a ``BatchGenerator``, stepped by afmd's decode step."""

    _masks: MaskBuilder | None = None
    # The tokens last handed out have not been fed to the model yet (see ``afmd_step``).
    _deferred = False
    #: uid -> alternatives wanted, for the rows that report log-probabilities. Each
    #: response's ``logprobs`` is then what :func:`afmd.engine.batch.logprobs.resolve` reads.
    logprob_rows: dict[int, int]
    #: uid -> the row's speculation, for the rows that may speculate when alone.
    spec_rows: dict[int, RowSpec]
    # The verification pass in flight (a batch of one row only).
    _verify: Verification | None = None
    _trimmable: bool | None = None
    # uid -> tokens a settled pass accepted (and what resolves their log-probabilities),
    # handed out with the row's next step.
    _backlog: dict[int, tuple[list[int], list[Any]]]
    # uid -> prompt length (what the row's KV cache held when its first token went out).
    _prompt_len: dict[int, int]
    #: Seconds this thread spent waiting for the device's tokens (see
    #: :mod:`afmd.engine.batch.steptrace`).
    waited = 0.0

    @classmethod
    def install(cls, generator: Any) -> DecodeBatch:
        """Replace a fresh ``BatchGenerator``'s (empty) running batch with ours."""
        batch = cls.attach(generator)
        assert isinstance(batch, DecodeBatch)
        batch.logprob_rows = {}
        batch.spec_rows = {}
        batch._backlog = {}
        batch._prompt_len = {}
        return batch

    def next(self) -> list[Any]:
        """Every row's tokens of this step: one each, or several for a row whose
        proposal held (mlx-lm's ``next`` with lists, and a finish inside one)."""
        if not self.uids:
            return []
        if self._verify is not None or self._may_speculate():
            responses = self._speculate()
            if responses is not None:
                return responses
        tokens, logprobs = self.afmd_step()
        handed = [[t] for t in tokens]
        extra = [list(logprobs[i : i + 1]) for i in range(len(tokens))]
        for i, uid in enumerate(self.uids):
            backlog = self._backlog.pop(uid, None) if self._backlog else None
            if backlog:
                handed[i] = backlog[0] + handed[i]
                extra[i] = backlog[1] + extra[i]
        return self._account(handed, extra)

    def afmd_step(self) -> tuple[list[int], list[Any]]:
        self._launch_deferred()
        # The logprobs are what was kept for these tokens when they were sampled (see
        # ``_launch``).
        inputs, logprobs = self.take_next()
        if 0 in self.generated:
            # A row's first token: hand it out before building and starting the next
            # forward pass, which on MLX's CPU backend costs the calling thread a few ms.
            self._deferred = True
            return self._read(inputs), logprobs
        return self._launch(inputs), logprobs

    def extend(self, batch: Any) -> None:
        # Joining rows come with their next tokens already computed; ours must be too.
        self._launch_deferred()
        if self._verify is not None:
            accepted, pending, entries = self._resolve()
            self._backlog[self.uids[0]] = (accepted, entries[:-1])
            self.next_tokens = mx.array([pending], dtype=mx.uint32)
            self.next_logprobs = entries[-1:]
        super().extend(batch)

    def filter(self, keep: list[int]) -> None:
        if not keep:
            self._verify = None
        kept = {self.uids[i] for i in keep}
        for uid in self.uids:
            if uid not in kept:  # cancelled rows leave without _leaving
                self._prompt_len.pop(uid, None)
                self._backlog.pop(uid, None)
        super().filter(keep)
        if not keep:
            self._deferred = False

    def _launch_deferred(self) -> None:
        if self._deferred:
            self._deferred = False
            self._launch(self.next_tokens)

    def _launch(self, inputs: mx.array) -> list[int]:
        """Start the forward pass on ``inputs`` (this step's tokens, one per row).

        The tokens join ``self.tokens`` only here, so that it always lists what the KV
        cache holds, deferred or not; a row finishing on a deferred token leaves with a
        cache and token list that both stop before it.
        """
        n = len(self.uids)
        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]

        masked, others = split_processors(self.logits_processors)

        tokens: list[int] | None = None
        if masked:
            # The masks need this step's input tokens; the forward pass does not need the
            # masks. Start it, then let llguidance work (GIL released) while MLX computes.
            mx.async_eval(logits)
            tokens = self._read(inputs)
            if self._masks is None:
                self._masks = MaskBuilder()
            allowed = self._masks.build(masked, tokens, n, logits.shape[-1])
            logits = mx.where(allowed, logits, _NEG_INF)

        token_context: list[mx.array] = []
        if others:  # e.g. repetition penalty: mlx-lm's row-by-row way, for those rows only
            rows = [logits[e : e + 1] for e in range(n)]
            for row, procs in others:
                context = self.token_context(row).update_and_fetch(inputs[row : row + 1])
                token_context.append(context)
                for proc in procs:
                    rows[row] = proc(context, rows[row])
            logits = mx.concatenate(rows, axis=0)

        self.next_tokens = sampled = self._sample(logits, n)
        kept: list[Any] = [None] * n
        self.next_logprobs = kept
        wants = self._logprob_wants()
        if wants:
            step = step_logprobs(logits, sampled, wants)
            for i, (row, k) in enumerate(wants):
                kept[row] = RowLogprobs(step, i, k)
            mx.async_eval(sampled, token_context, step.arrays)
        else:
            mx.async_eval(sampled, token_context)

        if tokens is None:
            tokens = self._read(inputs)
        for sequence, token in zip(self.tokens, tokens, strict=True):
            sequence.append(token)
        return tokens

    def _read(self, tokens: mx.array) -> list[int]:
        """``tokens`` on the host: where the thread waits for the device."""
        started = time.perf_counter()
        out = cast("list[int]", tokens.tolist())
        self.waited += time.perf_counter() - started
        return out

    def _logprob_wants(self) -> list[tuple[int, int]]:
        """(row, alternatives) of the rows that report log-probabilities."""
        rows = getattr(self, "logprob_rows", None)
        if not rows:
            return []
        return [(i, rows[uid]) for i, uid in enumerate(self.uids) if uid in rows]

    def _sample(self, logits: mx.array, n: int) -> mx.array:
        return sample_rows(self.samplers, logits, n)

    # -- handing a step's tokens out: mlx-lm's responses, one per token, a row ending at
    # its first finish (length, a stop sequence) with a KV cache and token list that agree;
    # used by the plain step and by speculation, which hands out several tokens a step --
    def _account(self, handed: list[list[int]], logprobs: list[list[Any]]) -> list[Any]:
        """Responses for each row's tokens in order, ending a row at its first finish."""
        responses: list[Any] = []
        keep: list[int] = []
        for i, uid in enumerate(self.uids):
            if self.generated[i] == 0:  # its first token is never in its cache yet
                self._prompt_len[uid] = len(self.tokens[i])
            spec = self.spec_rows.get(uid) if self.spec_rows else None
            finish = None
            for token, lp in zip(handed[i], logprobs[i], strict=True):
                self.generated[i] += 1
                if spec is not None:
                    spec.history.append(token)
                if self.generated[i] >= self.max_tokens[i]:
                    finish = "length"
                if self.stop_matchers[i].advance(token):
                    finish = "stop"
                if finish is None:
                    responses.append(self.Response(uid, token, lp, None, None, None))
                    continue
                cache, tokens = self._leaving(i)
                responses.append(self.Response(uid, token, lp, finish, cache, tokens))
                break
            if finish is None:
                keep.append(i)
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses

    def _leaving(self, i: int) -> tuple[list[Any], list[int]]:
        """A finishing row's KV cache and tokens, cut back to the token it ended on (a
        verification may have fed tokens past it)."""
        if self._verify is not None:  # only a batch of one verifies: this row's pass
            verify, self._verify = self._verify, None
            trim_prompt_cache(self.prompt_cache, verify.k)
            self.tokens[i].append(int(verify.first))
        uid = self.uids[i]
        tokens = self.tokens[i]
        keep = self._prompt_len.pop(uid, 0) + self.generated[i]
        self._backlog.pop(uid, None)
        surplus = len(tokens) - keep
        cache = self.extract_cache(i)
        if surplus > 0:
            trim_prompt_cache(cache, surplus)
            for c in cache:
                if getattr(c, "keys", None) is not None and hasattr(c, "offset"):
                    c.keys = c.keys[..., : c.offset, :]
                    c.values = c.values[..., : c.offset, :]
            tokens = tokens[:keep]
        return cache, tokens

    # -- speculation: a row decoding alone verifies proposed tokens (the pass in flight
    # is ``_verify``, the tokens a settled pass accepted ``_backlog``) --
    def _may_speculate(self) -> bool:
        if len(self.uids) != 1 or not self.spec_rows:
            return False
        spec = self.spec_rows.get(self.uids[0])
        if spec is None or self.generated[0] == 0:
            return False
        if self.max_tokens[0] - self.generated[0] < 3:
            return False
        if self._trimmable is None:
            self._trimmable = all(c.is_trimmable() for c in self.prompt_cache)
        return self._trimmable

    def _speculate(self) -> list[Any] | None:
        """One step of the lone row: settle the pass in flight (hand out what held), then
        start the next; ``None``: nothing to propose, take the plain step."""
        spec = self.spec_rows[self.uids[0]]
        if self._verify is not None:
            accepted, pending, entries = self._resolve()
            responses = self._account([[*accepted, pending]], [entries])
            if self.uids:
                self._launch_after(spec, pending)
            return responses
        if spec.constrained:
            if not spec.would_propose(self.max_tokens[0] - self.generated[0] - 1):
                return None  # the plain step, its masks built while the model computes
            self._launch_deferred()
            # The proposal must go through the grammar first: wait for the token.
            pending = int(self.next_tokens)
            responses = self._account([[pending]], [self.next_logprobs[:1]])
            if self.uids:
                self._launch_after(spec, pending)
            return responses
        self._launch_deferred()
        # The token is still being computed: propose after the model's likely choice
        # (the source's guess), verified with it, so this step need not wait for it.
        budget = self.max_tokens[0] - self.generated[0] - 2
        got = spec.propose(budget, guess=True)
        if got is None:
            return None
        state, proposal = got
        first = self.next_tokens
        rest = proposal[1:]
        verify = Verification(spec, state, first, _as_array(rest), len(rest), self._wanted())
        verify.launch(self.model, self.prompt_cache, None, self._context(spec))
        self._verify = verify
        return self._account([[int(first)]], [self.next_logprobs[:1]])

    def _launch_after(self, spec: RowSpec, pending: int) -> None:
        """Feed ``pending`` (handed out, not yet in the cache) with a proposal, or alone."""
        budget = self.max_tokens[0] - self.generated[0] - 1
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
                                      self._wanted())
                verify.launch(self.model, self.prompt_cache, mask, self._context(spec))
                self._verify = verify
                return
        self._launch(mx.array([pending], dtype=mx.uint32))

    def _resolve(self) -> tuple[list[int], int, list[Any]]:
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
        fed = [int(verify.first), *proposal[:n]]
        self.tokens[0] += fed
        if verify.spec.replayed:  # the step's processors read what the cache holds
            self.token_context(0).update_and_fetch(mx.array(fed, dtype=mx.int32))
        verify.state.record(verify.k, n, len(verify.spec.history))
        return proposal[:n], targets[n], verify.entries(n + 1)

    def _context(self, spec: RowSpec) -> mx.array | None:
        """The lone row's tokens as its penalties see them, if it has any: what was fed
        to the model before this pass."""
        return self.token_context(0).tokens if spec.replayed else None

    def _wanted(self) -> int | None:
        """The alternatives the lone row reports, if it reports log-probabilities."""
        rows = getattr(self, "logprob_rows", None)
        return rows.get(self.uids[0]) if rows else None


def sample_rows(
    samplers: Sequence[Callable[[mx.array], mx.array] | None] | None, logits: mx.array, n: int
) -> mx.array:
    """Every row's next token: one argmax for a batch of greedy rows, one call for a
    batch sharing a sampler, else row by row."""
    picks = [
        None if s is None or s is greedy_sampler else s
        for s in (samplers or [None] * n)
    ]
    if all(s is None for s in picks):
        return mx.argmax(logits, axis=-1)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    first = picks[0]
    if first is not None and all(s is first for s in picks):
        return first(logprobs)
    return mx.concatenate(
        [
            mx.argmax(logprobs[e : e + 1], axis=-1) if s is None else s(logprobs[e : e + 1])
            for e, s in enumerate(picks)
        ],
        axis=0,
    )


def split_processors(
    processors: list[list[Any]] | None,
) -> tuple[list[tuple[int, list[Any]]], list[tuple[int, list[Any]]]]:
    """(row, processors) of the grammar masks, applied together, and of the others
    (repetition penalty), applied mlx-lm's row-by-row way."""
    masked: list[tuple[int, list[Any]]] = []
    others: list[tuple[int, list[Any]]] = []
    for row, procs in enumerate(processors or ()):
        if not procs:
            continue
        mine = [p for p in procs if isinstance(p, MASKING)]
        rest = [p for p in procs if not isinstance(p, MASKING)]
        if mine:
            masked.append((row, mine))
        if rest:
            others.append((row, rest))
    return masked, others


def _as_array(tokens: list[int] | mx.array) -> mx.array:
    return tokens if isinstance(tokens, mx.array) else mx.array(tokens, dtype=mx.uint32)


def _as_list(tokens: list[int] | mx.array) -> list[int]:
    return cast("list[int]", tokens.tolist()) if isinstance(tokens, mx.array) else list(tokens)
