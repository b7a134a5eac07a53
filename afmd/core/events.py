"""What a turn yields, whatever dialect serves it: a typed stream of output events.

The output chain emits the fragments of the assistant's turn (:data:`Piece`: text,
reasoning, a tool call's start and its argument fragments) as the model writes them; the
run adds each call's end once the call is complete and, last, the finish reason, the
usage and (when the client asked for it) the profile. A dialect adapter encodes this one
sequence into its own JSON or SSE, so streamed and non-streamed answers, in every
dialect, are built from the very same events.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from afmd.core.request import ToolCall


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class Reasoning:
    text: str


@dataclass(frozen=True, slots=True)
class Refusal:
    """The model declined to answer, and says why: OpenAI's ``refusal``, not content (a
    model that reports refusals as such: Apple's on-device model)."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int  # the client's numbering: 0, 1, … in the order calls start
    id: str
    name: str
    arguments: str = ""  # the first argument fragment, when it is already known


@dataclass(frozen=True, slots=True)
class ToolCallArguments:
    index: int
    fragment: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    """The call is complete: its arguments are the concatenation of its fragments."""

    index: int
    call: ToolCall
    #: The output ended inside it (the token limit, a cancel): the call is as far as
    #: it was written, unfinished.
    cut: bool = False


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str  # "stop" | "length" | "tool_calls" | "cancelled"
    #: The client's stop sequence that ended the turn (reason "stop"), for dialects
    #: that report which one matched (Anthropic's ``stop_sequence``).
    stop_sequence: str | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    #: The request's prediction tokens that appeared in the output, and the others.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Timings:
    """How long the turn's phases took, in seconds, for dialects that report durations
    (Ollama's ``*_duration``); it comes in the run's last batch, before its end."""

    total: float  # from the request's arrival to its end
    load: float  # waiting for the model (its load, when it was not loaded)
    prompt: float  # prefill, until each generation's first token
    generation: float  # decoding, from the first token to the last


@dataclass(frozen=True, slots=True)
class Profile:
    """The ``X-AFM-Profile`` payload (``{"afm_profile": …}`` or the extended one)."""

    payload: dict[str, Any]


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token: str  # the token's text, or ``bytes:\xNN…`` when it holds part of a character
    bytes: bytes
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token of the output (or of an echoed prompt) with its log-probability."""

    token: str
    bytes: bytes
    logprob: float | None  # None: an echoed prompt's first token, which nothing predicts
    top: tuple[TopLogprob, ...] = ()  # the most likely tokens at its position, best first
    offset: int = 0  # where its text starts in the choice's text (completions' text_offset)


@dataclass(frozen=True, slots=True)
class Logprobs:
    """The tokens whose text the events before it (in the same batch) carried; a token
    whose text a stop sequence swallowed never gets one."""

    tokens: tuple[TokenLogprob, ...]


@dataclass(frozen=True, slots=True)
class Choice:
    """Events of one of the completions a request asked for several of at once (one per
    prompt of a Completions request), ``index`` being its prompt's position."""

    index: int
    events: tuple[Event, ...]


Piece = Content | Reasoning | ToolCallStart | ToolCallArguments
Event = Piece | Refusal | ToolCallEnd | Finish | Usage | Timings | Profile | Logprobs | Choice


def profile_payload(events: Sequence[Event]) -> dict[str, Any]:
    """The profile's keys for an answer that is one object (none when not asked): a
    stream sends the profile as an event of its own, a whole answer carries it at its top
    level, so every dialect answers the header streamed or not."""
    for event in events:
        if isinstance(event, Profile):
            return event.payload
    return {}
