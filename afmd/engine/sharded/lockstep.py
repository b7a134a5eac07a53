"""Keeping the ranks of a distributed model in step: one plan and one set of tokens.

A sharded model's forward pass is itself a collective (tensor-parallel layers sum their
partial results across ranks; pipeline stages send activations on), so every rank must
run the same forward passes on the same batch in the same order, or the group deadlocks
or computes garbage. Rank 0 decides everything: before each step it broadcasts a plan
(the rows that join, with their prompts and the prefix each resumes from, the rows
cancelled, a stop), and every rank applies it to its own :class:`~afmd.engine.batch.stepper.
Stepper`. Only rank 0 samples: grammar masks, penalties, seeds and log-probabilities are
its alone, and the tokens it picks go to the other ranks inside the step's own graph (one
``all_sum`` where the others add zeros), so they never need the request's grammar or
sampler and can never pick a different token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
import orjson

from afmd.engine.batch.decode import DecodeBatch

# A plan up to this size travels in one collective; a longer one takes a second.
_HEADER_BYTES = 1024
_LENGTH_BYTES = 4


class Lockstep:
    """One rank's view of the group: who it is, and the broadcasts that keep it in step."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = int(group.rank())
        self.size = int(group.size())
        #: Wakes the other ranks before a plan that ends an idle spell (see share_plan).
        self.doorbell: Doorbell | None = None
        #: No row runs on any rank (every rank sets it alike after each step).
        self.idle = True

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def _all_sum(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(x, group=self.group, stream=mx.cpu)

    def share(self, payload: bytes | None = None) -> bytes:
        """Rank 0's ``payload`` on every rank (the others pass nothing); blocks until all
        ranks have called it."""
        header = bytearray(_HEADER_BYTES)
        if self.leads:
            assert payload is not None
            inline = payload[: _HEADER_BYTES - _LENGTH_BYTES]
            header[:_LENGTH_BYTES] = len(payload).to_bytes(_LENGTH_BYTES, "little")
            header[_LENGTH_BYTES : _LENGTH_BYTES + len(inline)] = inline
        got = self._all_sum(mx.array(memoryview(header), dtype=mx.uint8))  # type: ignore[arg-type]  # MLX's stub omits the buffer protocol
        mx.eval(got)
        data = bytes(memoryview(got))  # type: ignore[arg-type]  # MLX's stub omits the buffer protocol
        length = int.from_bytes(data[:_LENGTH_BYTES], "little")
        body = data[_LENGTH_BYTES : _LENGTH_BYTES + length]
        missing = length - len(body)
        if missing > 0:
            tail = bytearray(missing)
            if self.leads:
                assert payload is not None
                tail[:] = payload[len(body) :]
            more = self._all_sum(mx.array(memoryview(tail), dtype=mx.uint8))  # type: ignore[arg-type]  # MLX's stub omits the buffer protocol
            mx.eval(more)
            body += bytes(memoryview(more))  # type: ignore[arg-type]  # MLX's stub omits the buffer protocol
        return body

    def share_plan(self, plan: StepPlan | None = None) -> StepPlan:
        """Rank 0's next plan on every rank.

        MLX's ring backend polls while it waits in a collective, so a rank parked in one
        burns a core for as long as rank 0 has nothing to do. When the group is idle the
        others wait on the doorbell (a blocking read of the control connection) instead,
        and rank 0 rings it before the plan that ends the idle spell.
        """
        if self.idle and self.doorbell is not None:
            if self.leads:
                self.doorbell.ring()
            else:
                self.doorbell.wait()
        data = self.share(plan.encode() if plan is not None else None)
        return plan if plan is not None else StepPlan.decode(data)

    def tokens(self, local: mx.array | None, like: mx.array) -> mx.array:
        """Rank 0's sampled tokens (``local``) on every rank, lazily, in the step's graph.

        The other ranks add zeros that depend on their own ``like`` (the step's logits):
        their forward pass, with its collectives, must run before this sum does, in the
        same order as on rank 0.
        """
        if self.leads:
            assert local is not None
            mine = local.astype(mx.int32)
        else:
            zeros = mx.zeros((like.shape[0],), dtype=mx.int32)
            mine = mx.depends(zeros, like)
        out = self._all_sum(mine).astype(mx.uint32)
        # Evaluated now, not left to the step's asynchronous evaluation: a plan's
        # broadcast issued while this sum is still in flight was seen to receive the
        # next forward pass's bytes instead of its own (ring backend, CPU).
        mx.eval(out)
        return out

    def row_sampler(
        self, inner: Callable[[mx.array], mx.array] | None
    ) -> _BroadcastSampler:
        """A row's sampler for mlx-lm's own first-token step: rank 0's pick, shared."""
        return _BroadcastSampler(self, inner)


class Doorbell(Protocol):
    """How rank 0 wakes the others out of an idle spell (afmd.distributed.control)."""

    def ring(self) -> None: ...

    def wait(self) -> None: ...


class _BroadcastSampler:
    """Wraps a row's sampler (``None``: greedy) so its token reaches every rank."""

    __slots__ = ("inner", "lockstep")

    def __init__(
        self, lockstep: Lockstep, inner: Callable[[mx.array], mx.array] | None
    ) -> None:
        self.lockstep = lockstep
        self.inner = inner

    def __call__(self, logprobs: mx.array) -> mx.array:
        local = None
        if self.lockstep.leads:
            local = (
                self.inner(logprobs) if self.inner is not None
                else mx.argmax(logprobs, axis=-1)
            )
        return self.lockstep.tokens(local, logprobs)


def _unwrap(sampler: Any) -> Any:
    return sampler.inner if isinstance(sampler, _BroadcastSampler) else sampler


class ShardedDecodeBatch(DecodeBatch):
    """afmd's decode step on a sharded model: rank 0 samples, every rank gets its tokens.

    Speculation stays off (no row is ever given a ``spec_rows`` entry): a verification
    pass of several tokens would be one more shape of collective to keep in step.
    """

    lockstep: Lockstep

    @classmethod
    def install(cls, generator: Any, lockstep: Lockstep | None = None) -> DecodeBatch:
        batch = super().install(generator)
        assert isinstance(batch, ShardedDecodeBatch) and lockstep is not None
        batch.lockstep = lockstep
        return batch

    def _sample(self, logits: mx.array, n: int) -> mx.array:
        local = None
        if self.lockstep.leads:
            wrapped = self.samplers
            self.samplers = [_unwrap(s) for s in wrapped] if wrapped else wrapped
            try:
                local = super()._sample(logits, n)
            finally:
                self.samplers = wrapped
        return self.lockstep.tokens(local, logits)


@dataclass(slots=True)
class Admission:
    """A row that joins: everything a rank needs to run the same model work for it."""

    prompt: list[int]
    #: Prompt tokens resumed from the prefix cache (every rank's cache holds the same).
    cached: int
    max_tokens: int
    #: The request's own ending tokens besides the model's.
    stop_ids: list[int] = field(default_factory=list)
    #: Alternatives per prompt position when the prompt's log-probabilities are asked
    #: for: one more forward pass over the prompt, on every rank.
    prompt_logprobs: int | None = None


@dataclass(slots=True)
class StepPlan:
    """What rank 0 does before its next step, so every rank does the same."""

    admit: list[Admission] = field(default_factory=list)
    remove: list[int] = field(default_factory=list)
    #: Rows running once admissions and removals are applied: a check, not an input.
    active: int = 0
    stop: bool = False

    @classmethod
    def before_step(cls, admit: list[Admission], remove: list[int], running: int) -> StepPlan:
        """The plan of one iteration with ``running`` rows before it. A prompt-only pass
        (``max_tokens`` 0) ends within the step, so it never counts as running."""
        joining = sum(1 for a in admit if a.max_tokens > 0)
        return cls(admit=admit, remove=remove, active=running + joining - len(remove))

    def encode(self) -> bytes:
        return orjson.dumps({
            "a": [[a.prompt, a.cached, a.max_tokens, a.stop_ids, a.prompt_logprobs]
                  for a in self.admit],
            "r": self.remove, "n": self.active, "s": self.stop,
        })

    @classmethod
    def decode(cls, data: bytes) -> StepPlan:
        raw = orjson.loads(data)
        return cls(
            admit=[Admission(p, c, m, s, lp) for p, c, m, s, lp in raw["a"]],
            remove=list(raw["r"]), active=int(raw["n"]), stop=bool(raw["s"]),
        )


_CURRENT: Lockstep | None = None


def join(backend: str = "any") -> Lockstep | None:
    """Join the group this process was launched into (``mlx.launch`` set the
    environment) and remember it for the process: the model loader shards by it. A
    group of one is no group (``None``): the model loads whole."""
    global _CURRENT
    if _CURRENT is None:
        group = mx.distributed.init(strict=True, backend=backend)
        if group.size() == 1:
            return None
        _CURRENT = Lockstep(group)
    return _CURRENT


def current() -> Lockstep | None:
    """The process's group, if it was launched as one rank of several."""
    return _CURRENT
