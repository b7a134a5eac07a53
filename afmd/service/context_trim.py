"""Which messages a conversation can lose when it outgrows the context window.

With ``[context] policy = "trim"`` the oldest turns go first, under three invariants: the
system/developer instructions stay, the last user message (and everything after it, the
current turn) stays, and an assistant tool call never loses its outputs (or the outputs
their call): a call and its results are dropped together as one unit.
"""

from __future__ import annotations

from afmd.core.request import Message


def droppable_units(messages: tuple[Message, ...]) -> list[list[int]]:
    """Indexes of messages that may be dropped, grouped into turns, oldest first.

    A turn is a user message and everything up to the next one (the assistant's reply, its
    tool calls and their outputs), so dropping a unit never leaves an answer without its
    question, a call without its outputs, or roles out of alternation. System and developer
    messages inside a turn stay.
    """
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    units: list[list[int]] = []
    for i in range(last_user):
        role = messages[i].role
        if role in ("system", "developer"):
            continue
        if role == "user" or not units:
            units.append([i])
        else:
            units[-1].append(i)
    return units


def without_units(
    messages: tuple[Message, ...], units: list[list[int]], count: int
) -> tuple[tuple[Message, ...], int]:
    """The conversation minus its ``count`` oldest units, and how many messages went."""
    dropped = {i for unit in units[:count] for i in unit}
    kept = tuple(m for i, m in enumerate(messages) if i not in dropped)
    return kept, len(dropped)
