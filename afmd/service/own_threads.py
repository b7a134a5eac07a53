"""Blocking work run on threads of its own kind, apart from asyncio's default executor.

The default executor (cores + 4 threads) renders every request's prompt and runs its
grammar and tokenizing. A kind of work that can take seconds a request and comes in
bursts (a request's images, a body near the size limit) filled those threads, and every
other request waited behind it for one. On threads of their own, such requests wait for
each other, and nothing else waits for them. The threads start on first use.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class OwnThreads:
    """A kind of work's threads: ``workers`` of them, named ``name``-N."""

    def __init__(self, workers: int, name: str) -> None:
        self.workers = workers
        self.name = name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    async def run(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """``fn(*args, **kwargs)`` on one of these threads, as :func:`asyncio.to_thread`
        runs it on the default executor (with the caller's context)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=self.name)
            pool = self._pool
        context = contextvars.copy_context()
        call: Callable[[], Any] = functools.partial(context.run, fn, *args, **kwargs)
        result: R = await asyncio.get_running_loop().run_in_executor(pool, call)
        return result
