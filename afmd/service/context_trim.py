"""Which messages a conversation can lose when it outgrows the context window.

With ``[context] policy = "trim"`` the oldest turns go first, under three invariants: the
system/developer instructions stay, the last user message and the current turn's last
round (the latest answer or call with its outputs) stay, and an assistant tool call never
loses its outputs (or the outputs their call): a call and its results are dropped together
as one unit. When every older turn is gone, the current turn's older rounds go too, oldest
first: an agent's loop is one user message and then only calls, and would never fit
otherwise.
"""

from __future__ import annotations

from afmd.core.request import Message


def droppable_units(messages: tuple[Message, ...]) -> list[list[int]]:
    """Indexes of messages that may be dropped, grouped into turns, oldest first, then the
    current turn's rounds but its last.

    A turn is a user message and everything up to the next one (the assistant's reply, its
    tool calls and their outputs), so dropping a unit never leaves an answer without its
    question, a call without its outputs, or roles out of alternation. A round of the
    current turn is an assistant message and the outputs of its calls: the user message
    stays, still followed by an assistant message. System and developer messages stay.
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
    if last_user < 0:
        return units
    rounds: list[list[int]] = []
    for i in range(last_user + 1, len(messages)):
        role = messages[i].role
        if role == "assistant" or (role not in ("system", "developer") and not rounds):
            rounds.append([i])
        elif role not in ("system", "developer"):
            rounds[-1].append(i)
    return units + rounds[:-1]


def without_units(
    messages: tuple[Message, ...], units: list[list[int]], count: int
) -> tuple[tuple[Message, ...], int]:
    """The conversation minus its ``count`` oldest units, and how many messages went."""
    dropped = {i for unit in units[:count] for i in unit}
    kept = tuple(m for i, m in enumerate(messages) if i not in dropped)
    return kept, len(dropped)
