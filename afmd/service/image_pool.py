"""The threads a vision request's images are read, decoded and processed on, apart from
asyncio's default executor.

Everything else blocking that a request does (a text prompt's rendering and grammar,
tokenizing, server tools) runs on the default executor, which has a few threads (cores +
4). Image work can take seconds a request (a header walked in Python, a large picture
decoded and resized), and requests that each brought such images filled that executor:
a text request then waited for a free thread, 14 s behind eight of them on two cores.
On threads of their own, image requests wait for each other, and nothing else waits for
them.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

#: Threads for image work: decoding runs in C without the GIL, so up to a few cores help.
WORKERS = max(2, min(4, os.cpu_count() or 1))

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="afmd-images")
        return _pool


async def run(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """``fn(*args, **kwargs)`` on an image thread, as :func:`asyncio.to_thread` runs it on
    the default executor (with the caller's context)."""
    context = contextvars.copy_context()
    call: Callable[[], Any] = functools.partial(context.run, fn, *args, **kwargs)
    result: R = await asyncio.get_running_loop().run_in_executor(_executor(), call)
    return result
