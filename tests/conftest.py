"""Shared fixtures: a real ``afmd serve`` process on a free port, on the real demo model."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))

# Re-exported: test files import these from here (``from conftest import start_server``).
from helpers.frozen import FIXTURE as FROZEN_FIXTURE  # noqa: E402
from helpers.frozen import BackgroundBuild, build_skipped  # noqa: E402
from helpers.servers import DIAGNOSE, ServerProcess, afmd_command, start_server  # noqa: E402

__all__ = ["DIAGNOSE", "ROOT", "ServerProcess", "afmd_command", "parse_sse", "start_server"]


#: The frozen build started by pytest_collection_modifyitems, for the ``frozen`` fixture.
FROZEN_BUILD = pytest.StashKey[BackgroundBuild]()


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected what they do
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests that need the frozen build run last, and the build starts now, so that its
    minutes overlap everything else (see tests/helpers/frozen.py)."""
    needing = [item for item in items if FROZEN_FIXTURE in getattr(item, "fixturenames", ())]
    if not needing:
        return
    items[:] = [item for item in items if item not in needing] + needing
    if (config.option.collectonly or os.environ.get("AFMD_FROZEN_BINARY")
            or build_skipped()):
        return
    config.stash[FROZEN_BUILD] = BackgroundBuild()


def pytest_unconfigure(config: pytest.Config) -> None:
    build = config.stash.get(FROZEN_BUILD, None)
    if build is not None:
        build.close()


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One demo-model cache per test session, never the user's own."""
    path = tmp_path_factory.mktemp("afmd-cache")
    old = os.environ.get("AFMD_CACHE_DIR")
    os.environ["AFMD_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("AFMD_CACHE_DIR", None)
    else:
        os.environ["AFMD_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, _cache_dir: Path) -> Iterator[ServerProcess]:
    """The shared server: default settings plus an alias, for tests that do not change them."""
    tmp = tmp_path_factory.mktemp("server")
    proc = start_server(
        tmp,
        config='[models.aliases]\n"gpt-4o-mini" = "demo"\n',
    )
    yield proc
    proc.stop()


@pytest.fixture()
def base_url(server: ServerProcess) -> str:
    return server.url


@pytest.fixture()
def client(server: ServerProcess) -> Any:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def parse_sse(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded except ``[DONE]``."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        if not block.strip() or block.startswith(":"):
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
