"""Fuzzed bodies of every dialect, grammar fields included, against a server of its own:
no 5xx, and the server answers throughout (``bench/fuzz_bodies.py`` runs the large count).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.fuzz_bodies import BASES, run

from conftest import ServerProcess, start_server

pytestmark = pytest.mark.slow  # a server of its own and a few hundred requests


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(Path(tmp_path_factory.mktemp("fuzz-bodies")))
    yield proc
    proc.stop()


def test_fuzzed_bodies_get_no_5xx_and_the_server_lives(fuzzed: ServerProcess) -> None:
    result = asyncio.run(run(fuzzed.url, 400, seed=26, concurrency=4, timeout=120,
                             log=lambda _line: None))
    assert result["failures"] == [], result["failures"][:3]
    assert result["alive"] and fuzzed.proc.poll() is None
    counts = result["counts"]
    assert set(counts) == {dialect for dialect, _, _ in BASES}
    assert sum(counts[d].get("400", 0) for d in counts) > 100  # the fuzz reached the checks
    assert sum(counts[d].get("200", 0) for d in counts) > 20  # and past them
    # The embedding routes' bases name an embedding model: with a chat model's, every
    # body there stopped at the model's kind and none reached the embedder.
    assert counts["embeddings"].get("200", 0) and counts["ollama_embed"].get("200", 0)
