"""What a turn yields, whatever dialect serves it: a typed stream of output events.

The output chain emits the fragments of the assistant's turn (:data:`Piece`: text,
reasoning, a tool call's start and its argument fragments) as the model writes them; the
run adds each call's end once the call is complete and, last, the finish reason, the
usage and (when the client asked for it) the profile. A dialect adapter encodes this one
sequence into its own JSON or SSE, so streamed and non-streamed answers, in every
dialect, are built from the very same events.
"""

from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str  # "stop" | "length" | "tool_calls" | "cancelled"


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Profile:
    """The ``X-AFM-Profile`` payload (``{"afm_profile": …}`` or the extended one)."""

    payload: dict[str, Any]


Piece = Content | Reasoning | ToolCallStart | ToolCallArguments
Event = Piece | ToolCallEnd | Finish | Usage | Profile
