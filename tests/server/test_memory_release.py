"""What a finished request held is given back, on the real server.

The leak guarded against grew the server by the same amount with every request, with no
error anywhere: a finished request was held until its deadline by the timers it had
cancelled (docs/hardening.md).
"""

from __future__ import annotations

import platform
from pathlib import Path

import httpx
import pytest

from helpers.servers import start_server
from helpers.smoke import vm_rss_kib

pytestmark = pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc")

MIB = 1024


def test_a_finished_request_is_not_held_until_its_deadline(tmp_path: Path) -> None:
    """A 4 MB ``user`` field, ten times: each request's body stayed resident for
    ``request_timeout`` after its response (its deadline timer, cancelled, kept the
    request's context), about 4 MB a request; now nothing stays."""
    server = start_server(tmp_path)
    try:
        def ask(i: int) -> None:
            body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4, "user": chr(ord("a") + i) * 4_000_000}
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text[:300]

        ask(0)
        ask(1)  # the allocator's high-water marks are reached
        before = vm_rss_kib(server.proc.pid)
        for i in range(10):
            ask(i)
        grown = vm_rss_kib(server.proc.pid) - before
        assert grown < 15 * MIB, f"the server grew by {grown // MIB} MiB over ten requests"
    finally:
        server.stop()
