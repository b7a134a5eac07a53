"""A rank other than 0: the same model work as rank 0, in the same order, and nothing else.

It has no requests, only rank 0's plans (:class:`~afmd.engine.sharded.lockstep.StepPlan`): each
names the rows that join (prompt, cached prefix, limits) and leave, and the follower then
takes the same step through its own :class:`~afmd.engine.batch.stepper.Stepper`. Rows end where
rank 0's end, because the tokens are rank 0's (broadcast inside the step) and the stop
rules are the same. Its prefix cache sees the same inserts in the same order, so it holds
what rank 0's holds; a plan that says otherwise means the ranks drifted apart, which is
fatal (:class:`OutOfStep`), never silently wrong.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from afmd.engine.batch.logprobs import prompt_pass
from afmd.engine.batch.stepper import Stepper
from afmd.engine.sharded.lockstep import Admission, Lockstep, StepPlan

log = logging.getLogger("afmd.engine")


class OutOfStep(RuntimeError):
    """This rank's state no longer matches rank 0's plan."""


class Follower:
    """Applies rank 0's plans to this rank's shard until a plan says stop."""

    def __init__(
        self, stepper: Stepper, lockstep: Lockstep,
        after_plan: Callable[[], None] | None = None,
    ) -> None:
        assert not lockstep.leads
        #: Called on this thread after each plan is applied (the heartbeat's numbers are
        #: read here, between steps, never from another thread during one).
        self._after_plan = after_plan
        self._stepper = stepper
        self._lockstep = lockstep
        self._active: set[int] = set()
        #: When the current step began (0.0: waiting for rank 0's next plan).
        self.busy_since = 0.0
        self.steps = 0

    def run(self) -> None:
        """Blocks until rank 0 says stop (returns) or the group breaks (raises)."""
        self._stepper.reset()
        try:
            while True:
                plan = self._lockstep.share_plan()
                if plan.stop:
                    return
                self.busy_since = time.monotonic()
                self._apply(plan)
                self.busy_since = 0.0
                if self._after_plan is not None:
                    self._after_plan()
        finally:
            self._stepper.close()

    def _apply(self, plan: StepPlan) -> None:
        for admission in plan.admit:
            self._admit(admission)
        if plan.remove:
            self._stepper.remove(plan.remove)
            self._active.difference_update(plan.remove)
        if len(self._active) != plan.active:
            raise OutOfStep(f"{len(self._active)} rows running here, {plan.active} on rank 0")
        if self._active:
            self.steps += 1
            for response in self._stepper.next():
                if response.finish_reason is not None:
                    self._active.discard(response.uid)
                    self._stepper.remember(response.all_tokens, response.prompt_cache)
        self._lockstep.idle = not self._active

    def _admit(self, admission: Admission) -> None:
        prompt = admission.prompt
        if admission.prompt_logprobs is not None:
            prompt_pass(self._stepper.model, prompt)
        cache, rest = (None, prompt)
        if admission.max_tokens > 0 or admission.prompt_logprobs is None:
            cache, rest = self._resume(prompt, admission.cached)
        if admission.max_tokens <= 0:
            if admission.prompt_logprobs is None:  # as rank 0 warms its prefix cache
                self._stepper.warm(prompt, rest, cache)
            return
        uid = self._stepper.insert(
            prompt, rest, cache, max_tokens=admission.max_tokens, sampler=None,
            processors=[], stop_ids=admission.stop_ids,
        )
        self._active.add(uid)

    def _resume(self, prompt: list[int], cached: int) -> tuple[Any, list[int]]:
        """The cached prefix rank 0 resumed ``prompt`` from: ``cached`` tokens of it."""
        if cached == 0:
            return None, prompt
        cache, rest = self._stepper.cached_prefix(prompt)
        got = len(prompt) - len(rest)
        if got > cached and cache is not None and can_trim_prompt_cache(cache):
            trim_prompt_cache(cache, got - cached)  # this rank kept a longer entry
            got, rest = cached, prompt[cached:]
        if got != cached:
            raise OutOfStep(f"rank 0 resumed from {cached} cached tokens, this rank has {got}")
        return cache, rest
