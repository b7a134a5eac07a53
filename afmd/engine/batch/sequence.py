"""A request's row in the running batch: from the engine's tokens to its events.

The worker (:mod:`afmd.engine.batch.generation_thread`) owns the thread and the hand-off to the
event
loop; this is what one row does with each token it gets (text through its detokenizer,
reasoning counted, log-probabilities kept with the text they belong to) and how it ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from afmd.engine.batch.logprobs import resolve
from afmd.engine.generation import Event, Finished, Generation, Text
from afmd.engine.reasoning_count import ReasoningCount
from afmd.engine.speculative.verification import RowSpec


@dataclass(slots=True)
class Row:
    """One request in the running batch: its counts and the events not yet handed out."""

    generation: Generation
    uid: int
    detokenizer: Any
    prompt_tokens: int
    cached_tokens: int = 0
    cached_disk_tokens: int = 0  # of cached_tokens, read from the disk tier
    completion_tokens: int = 0
    started_at: float = 0.0
    first_token_at: float = 0.0
    pending: list[Event] = field(default_factory=list)
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    reasoning: ReasoningCount | None = None
    # Some text a client would see has been produced (see :meth:`take`).
    shown: bool = False
    # Alternatives per token when the request reports log-probabilities (else None).
    logprobs: int | None = None
    # Tokens that end this sequence unseen: the model's end-of-sequence ones and the
    # request's own (fill-in-the-middle end markers).
    stop_ids: frozenset[int] = frozenset()
    # Tokens generated and counted that add no text (GenerationRequest.hidden_ids).
    hidden_ids: frozenset[int] = frozenset()
    # Speculation's numbers, read when the sequence leaves (see DecodeBatch.spec_rows).
    spec: RowSpec | None = None
    # Every token the engine produced for this row, its end-of-sequence token included:
    # the ids a client may send back as the start of its next prompt (Finished.output_ids).
    ids: list[int] = field(default_factory=list)

    def take(self, token: int, reason: str | None, logprobs: Any, now: float) -> bool:
        """One token the engine produced for this row (``reason``: it ends here); whether
        the client was still waiting for visible text when it came."""
        waiting = not self.shown
        self.ids.append(token)
        if not self.first_token_at:
            self.first_token_at = now
        every = self.generation.request.sample_every
        sample = every and (self.completion_tokens % every == 0 or reason is not None)
        if reason == "stop" and token in self.stop_ids:
            # The end-of-sequence token is a signal, not text.
            pass
        else:
            self.completion_tokens += 1
            if token in self.hidden_ids:
                # Never detokenized: the text around it is what it would be without it.
                segment = ""
            else:
                self.detokenizer.add_token(token)
                segment = self.detokenizer.last_segment
            reasoning = self.reasoning
            if reasoning is not None:
                reasoning.take(segment)
            if (
                not self.shown
                and segment.strip()
                and (reasoning is None or not reasoning.markers.within(segment.strip()))
            ):
                self.shown = True
            if self.logprobs is not None:
                # One event per token, so its numbers stay with the text it released.
                entry = resolve(logprobs, token, self.logprobs)
                self.pending.append(Text(segment, 1, (entry,)))
            elif segment:
                self.pending.append(Text(segment, 1))
            elif self.pending and isinstance(self.pending[-1], Text):
                last = self.pending[-1]
                self.pending[-1] = Text(last.text, last.tokens + 1)
            else:
                self.pending.append(Text("", 1))
        if sample:  # counted after this step's token, so it is included
            self.samples.append(
                (now - self.started_at, self.completion_tokens, mx.get_active_memory())
            )
        return waiting

    def finish(self, reason: str) -> None:
        """The sequence's last events: the detokenizer's tail, then its numbers."""
        self.detokenizer.finalize()
        tail = self.detokenizer.last_segment
        if tail:
            self.pending.append(Text(tail, 0))
        now = time.perf_counter()
        self.pending.append(
            Finished(
                finish_reason=reason,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens,
                cached_tokens=self.cached_tokens,
                cached_disk_tokens=self.cached_disk_tokens,
                reasoning_tokens=self.reasoning.tokens if self.reasoning is not None else 0,
                timings={
                    "queued_at": self.generation.created_at,
                    "started_at": self.started_at,
                    "first_token_at": self.first_token_at or now,
                    "finished_at": now,
                },
                peak_memory_bytes=mx.get_peak_memory(),
                samples=tuple(self.samples),
                output_ids=tuple(self.ids),
                **speculation(self.spec),
            )
        )


def speculation(spec: RowSpec | None) -> dict[str, Any]:
    if spec is None:
        return {}
    accepted, rejected = spec.usage()
    return {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": rejected,
            "speculation": spec.stats()}
