"""The transport's screening and framing tables, fed to the gate in process.

``tests/server/test_transport.py`` sends each case to the real server over a socket; here the
same tables go to a :class:`~afmd.http.sansio.gate.Gate` built from the same configuration and
the app's own router, whole, split at random boundaries and byte by byte: the same status
and code every way, no ``100 Continue`` before a refusal, and a close after it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from afmd.config.load import load_config
from afmd.http.sansio.gate import Gate, Output, Reply
from afmd.http.sansio.screen import GatePolicy
from afmd.server import Server

from helpers.screening import CODES, MALFORMED, SCREEN_CONFIG, SCREENING


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> GatePolicy:
    path: Path = tmp_path_factory.mktemp("tables") / "afmd.toml"
    path.write_text(SCREEN_CONFIG)
    server = Server(load_config(path, env={}))
    server.app.finalize()  # its routes, as once it serves
    # As for the loopback TCP listener that the socket tests talk to.
    return server.gate.policy(check_host=True, extra_hosts=("127.0.0.1",))


def _ways(raw: bytes) -> Iterator[list[bytes]]:
    """``raw`` whole, in random pieces (a few seeds), and one byte at a time."""
    yield [raw]
    for seed in range(4):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(raw)), min(len(raw) - 1, rng.randint(1, 6))))
        yield [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    yield [raw[i:i + 1] for i in range(len(raw))]


def _refusal(policy: GatePolicy, pieces: list[bytes]) -> Reply:
    gate = Gate(policy)
    out: list[Output] = []
    for piece in pieces:
        out.extend(gate.feed(piece))
    assert len(out) == 1 and isinstance(out[0], Reply), out  # no 100 Continue, nothing else
    assert out[0].rejection is not None and out[0].close
    assert gate.dead and gate.buffered == 0
    return out[0]


@pytest.mark.parametrize(("head", "status", "code"), [c[1:] for c in SCREENING],
                         ids=[c[0] for c in SCREENING])
def test_screening(policy: GatePolicy, head: str, status: int, code: str) -> None:
    for pieces in _ways(head.encode()):
        reply = _refusal(policy, pieces)
        rejection = reply.rejection
        assert rejection is not None
        assert (rejection.status, rejection.code) == (status, code)
        headers = dict(rejection.headers)
        if status == 405:
            assert headers["Allow"] == "POST"
        if status == 401:
            assert headers["WWW-Authenticate"] == "Bearer"
        assert reply.data.startswith(b"HTTP/1.1 %d " % status)
        assert b"\r\nconnection: close\r\n" in reply.data


@pytest.mark.parametrize(("raw", "status"), [c[1:] for c in MALFORMED],
                         ids=[c[0] for c in MALFORMED])
def test_framing(policy: GatePolicy, raw: str | bytes, status: int) -> None:
    data = raw.encode() if isinstance(raw, str) else raw
    for pieces in _ways(data):
        rejection = _refusal(policy, pieces).rejection
        assert rejection is not None
        assert (rejection.status, rejection.code) == (status, CODES[status])
