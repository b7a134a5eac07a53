"""One TLS client context per test process, built once.

Every ``httpx`` client, and every ``openai`` and ``anthropic`` SDK client (their own
httpx), builds a TLS context when it is made, loading the whole CA bundle: tens of
milliseconds of CPU, for plain ``http://127.0.0.1``, which is all the tests speak. The tests
make thousands of clients (``httpx.get`` in a polling loop makes one per call), so that
was a good share of the suite's CPU time on two cores. A context from
``ssl.create_default_context`` is only read by the clients that use it (they wrap sockets
with it), so one per set of arguments serves them all.
"""

from __future__ import annotations

import functools
import ssl
from typing import Any

_CREATE = ssl.create_default_context


@functools.cache
def _shared(purpose: ssl.Purpose, cafile: str | None, capath: str | None,
            cadata: Any) -> ssl.SSLContext:
    return _CREATE(purpose, cafile=cafile, capath=capath, cadata=cadata)


def _create_default_context(purpose: ssl.Purpose = ssl.Purpose.SERVER_AUTH, *,
                            cafile: str | None = None, capath: str | None = None,
                            cadata: Any = None) -> ssl.SSLContext:
    return _shared(purpose, cafile, capath, cadata)


def share_default_context() -> None:
    """Make ``ssl.create_default_context`` return one context per set of arguments."""
    ssl.create_default_context = _create_default_context  # type: ignore[assignment]
