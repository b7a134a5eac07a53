"""The threads a request that may compile a grammar has its rounds built on.

A request with tools, a response format or a thinking budget may bring a grammar the
server has not compiled, and the compile worker (:mod:`afmd.grammar.sandbox`) takes one
at a time, seconds each for a large schema. Built on asyncio's default executor, eight
requests with new large schemas held every one of its threads waiting for the worker, and
a plain request, whose prompt is rendered there, waited seconds behind them. On threads
of their own (:mod:`afmd.service.own_threads`), such requests wait for each other, and
nothing else waits for them.
"""

from __future__ import annotations

import os

from afmd.core.request import ChatRequest
from afmd.service.own_threads import OwnThreads

#: Threads for those rounds: an agent's render tokenizes a long prompt (in Rust, without
#: the GIL), so a few cores help, and one thread waiting for the compile worker leaves
#: the others to renders.
WORKERS = max(4, min(16, (os.cpu_count() or 1) + 2))

GRAMMAR_THREADS = OwnThreads(WORKERS, "afmd-grammars")


def may_compile(request: ChatRequest) -> bool:
    """Whether building ``request``'s rounds may compile a grammar: tools (their calls),
    a response format (its schema) or a thinking budget (the block closed at it)."""
    return (bool(request.tools) or request.response_format is not None
            or request.thinking_budget is not None)
