"""What bounds a run from outside its loop: the client's cancel, the request's deadline,
retries of a transient model failure.

Chat and Completions runs differ in what they generate (one round at a time, or one
generation per prompt) but not in how they are stopped: a cancel or the deadline stops the
engine, the deadline also wakes the consumer with a 504, and a transient failure is retried
(with backoff) only while nothing has reached the client. :class:`RunControl` is that part,
owned by each run, which hands it how to stop and fail its own generations.
"""

from __future__ import annotations

import asyncio
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from afmd.config.sections import Config
from afmd.errors import APIError, request_timeout_error
from afmd.logs import get_logger

log = get_logger("afmd.service.pipeline")


@dataclass(frozen=True, slots=True)
class RunPolicy:
    """What bounds every run: retries of transient failures, tool budgets, time."""

    retries: int = 0
    retry_backoff: float = 0.0  # seconds before the first retry; doubles each time
    max_tool_rounds: int = 4
    max_tool_calls: int = 16
    request_timeout: float = 120.0

    @classmethod
    def of(cls, config: Config, request_timeout: float) -> RunPolicy:
        return cls(
            retries=config.engine.retries,
            retry_backoff=config.engine.retry_backoff,
            max_tool_rounds=config.tools.max_rounds,
            max_tool_calls=config.tools.max_calls,
            request_timeout=request_timeout,
        )


def _weakly(call: Callable[[], None]) -> Callable[[], None]:
    """``call``, not keeping its object alive if it is a bound method: once the object is
    gone there is nothing of it to stop or fail."""
    if not isinstance(call, types.MethodType):
        return call
    method = weakref.WeakMethod(call)

    def calling() -> None:
        bound = method()
        if bound is not None:
            bound()

    return calling


class RunControl:
    """One run's cancel, deadline and retries: the flags its loop checks between engine
    batches, and the calls into the run that stop (``stop``) and fail (``fail``, with a
    fresh 504 for each generation it wakes) what it generates."""

    __slots__ = ("_deadline", "_fail", "_request_id", "_stop", "_timer", "_waking", "attempt",
                 "cancelled", "emitted", "policy", "timed_out")

    def __init__(self, policy: RunPolicy, request_id: str, deadline: float, *,
                 stop: Callable[[], None], fail: Callable[[], None]) -> None:
        self.policy = policy
        self.attempt = 0  # retries made
        self.emitted = False  # something reached the client: no more retries
        self.cancelled = False
        self.timed_out = False
        self._request_id = request_id
        self._deadline = deadline  # time.monotonic()
        # Held weakly when they are the run's methods: the run owns this control, and a
        # cycle (run, control, the run's bound methods) kept a finished run, its request
        # and the request's messages (an agent's whole conversation) until a garbage
        # collection.
        self._stop = _weakly(stop)
        self._fail = _weakly(fail)
        # One timer per request for request_timeout, not one per awaited batch of tokens.
        self._timer: asyncio.TimerHandle | None = None
        # A retry's back-off being waited (None: none is), which a cancel cuts short.
        self._waking: asyncio.Future[None] | None = None

    def arm(self) -> None:
        """Start the deadline's timer (once: a later round or retry keeps it)."""
        if self._timer is None:
            loop = asyncio.get_running_loop()  # its clock is time.monotonic(), as deadline's
            self._timer = loop.call_at(self._deadline, self._on_deadline)

    def check(self) -> None:
        """The 504, once the deadline passed: the run ends at its next batch."""
        if self.timed_out:
            raise request_timeout_error()

    def cancel(self) -> None:
        """Stop for good (client cancel or disconnect; also when the response is over)."""
        self.cancelled = True
        if self._timer is not None:
            self._timer.cancel()
        if self._waking is not None and not self._waking.done():
            self._waking.set_result(None)
        self._stop()

    def _on_deadline(self) -> None:
        """request_timeout passed: stop the engine and wake the consumer with a 504."""
        self.timed_out = True
        self._stop()
        self._fail()

    def may_retry(self, exc: APIError, *, tools_ran: bool = False) -> bool:
        """Whether a failure is retried: a transient model failure, before anything reached
        the client or a tool ran (its effects may not be repeated), not cancelled, while
        retries are left."""
        return not (
            exc.code != "generation_failed"
            or self.emitted
            or tools_ran
            or self.cancelled
            or self.attempt >= self.policy.retries
        )

    async def back_off(self) -> None:
        """Wait before the next attempt, twice as long as before the last one, or until a
        cancel: the attempt then starts cancelled, and the run ends as any cancelled one."""
        delay = self.policy.retry_backoff * (2 ** self.attempt)
        self.attempt += 1
        log.warning("retrying generation", request_id=self._request_id,
                    attempt=self.attempt, delay_s=delay)
        if self.cancelled:
            return
        self._waking = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(delay):
                await self._waking
        except TimeoutError:
            pass
        finally:
            self._waking = None
