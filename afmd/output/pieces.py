"""What the output processors emit: typed pieces of the assistant's turn.

The pipeline turns these into OpenAI deltas; keeping them independent of the wire format
lets streamed and non-streamed responses be built from the very same sequence.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class Reasoning:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int
    id: str
    name: str
    arguments: str = ""  # the first argument fragment, when it is already known


@dataclass(frozen=True, slots=True)
class ToolCallArguments:
    index: int
    fragment: str


Piece = Content | Reasoning | ToolCallStart | ToolCallArguments
