"""Server tools within one request: hidden from the client, run between rounds, budgeted.

When a round's only calls are to server tools, afmd runs them and generates again with
their results in the conversation; the client sees every round's text but never a server
tool's call or result, and its own calls are numbered 0, 1, … as if server calls had never
been written. Budgets bound the loop: past ``max_rounds`` rounds or ``max_calls`` calls,
the model is told to answer without tools and is given none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from afmd.core.events import Event, ToolCallArguments, ToolCallEnd, ToolCallStart
from afmd.core.request import ChatRequest, Message, ToolCall, ToolChoice
from afmd.service.servertools import ServerTools

ANSWER_WITHOUT_TOOLS = (
    "The tool budget for this request is used up. Answer the user now with what you have, "
    "without calling any tool."
)
BUDGET_EXHAUSTED = '{"error": "tool call budget exhausted"}'


class ClientView:
    """One round's events as the client sees them: server calls dropped, its own renumbered.

    Indexes in the events are the output parser's (every call of the round, in order);
    the client's are positions among its own calls.
    """

    __slots__ = ("_hidden", "_names", "_visible")

    def __init__(self, names: ServerTools) -> None:
        self._names = names
        self._hidden: set[int] = set()
        self._visible: dict[int, int] = {}

    def __call__(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if isinstance(event, ToolCallStart):
                if event.name in self._names:
                    self._hidden.add(event.index)
                    continue
                self._visible[event.index] = len(self._visible)
                out.append(dataclasses.replace(event, index=self._visible[event.index]))
            elif isinstance(event, ToolCallArguments | ToolCallEnd):
                if event.index in self._hidden:
                    continue
                out.append(dataclasses.replace(event, index=self._visible[event.index]))
            else:
                out.append(event)
        return out


class ToolLoop:
    """The server-tool side of one request: what it may run, what it ran."""

    def __init__(self, tools: ServerTools, *, max_rounds: int, max_calls: int) -> None:
        self._tools = tools
        self._max_rounds = max_rounds
        self._max_calls = max_calls
        self.rounds = 0  # rounds whose calls afmd ran
        self.calls = 0  # server tool calls run
        self.inside = 0  # server calls a model made mid-generation (run_one)

    @property
    def ran(self) -> bool:
        """A tool ran (or is running): its effects may not be repeated by a retry."""
        return self.rounds > 0 or self.inside > 0

    async def run_one(self, name: str, arguments: str) -> str:
        """One server call a model made itself mid-generation (Apple's on-device model
        calls tools and goes on): run within the call budget; its output for the model."""
        self.inside += 1
        if self.calls >= self._max_calls:
            return BUDGET_EXHAUSTED
        self.calls += 1
        return (await self._tools.run(name, arguments)).content

    def view(self) -> ClientView | None:
        """A fresh round's filter of events (None: no server tools, nothing to hide)."""
        return ClientView(self._tools) if self._tools else None

    def split(self, calls: Sequence[ToolCall]) -> tuple[list[ToolCall], list[ToolCall]]:
        """The client's calls and the server's, each in order."""
        if not self._tools:
            return list(calls), []
        return ([c for c in calls if c.name not in self._tools],
                [c for c in calls if c.name in self._tools])

    async def run(
        self, request: ChatRequest, calls: Sequence[ToolCall], tokens_left: int | None
    ) -> ChatRequest:
        """Run ``calls`` (within budget); the next round's conversation, results appended.

        ``tokens_left``: what the client's ``max_tokens`` leaves for the rounds to come.
        """
        self.rounds += 1
        said = request.messages
        prefill = None
        if request.continue_final:  # the calls end the prefilled message: one turn
            said, prefill = said[:-1], said[-1].content
        history = [*said,
                   Message(role="assistant", content=prefill, tool_calls=tuple(calls))]
        for call in calls:
            if self.calls >= self._max_calls:
                content = BUDGET_EXHAUSTED
            else:
                self.calls += 1
                content = (await self._tools.run(call.name, call.arguments)).content
            history.append(Message(role="tool", content=content, tool_call_id=call.id))
        request = dataclasses.replace(request, messages=tuple(history), max_tokens=tokens_left,
                                      continue_final=False)
        if self.rounds >= self._max_rounds or self.calls >= self._max_calls:
            request = dataclasses.replace(
                request,
                tool_choice=ToolChoice("none"),
                messages=(*request.messages,
                          Message(role="system", content=ANSWER_WITHOUT_TOOLS)),
            )
        return request
