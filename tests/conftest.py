"""Shared fixtures: a real ``afmd serve`` process on a free port, on the real demo model."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent

# Bytecode is written for this run and the processes it starts, whatever the environment
# says (some machines set PYTHONDONTWRITEBYTECODE): without it every worker rewrites every
# test module's asserts again and every CLI or server process started plainly compiles
# afmd's sources again, a large share of a suite that starts hundreds of processes. Set
# before any test module is imported and before pytest-xdist starts its workers.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
sys.path.insert(0, str(Path(__file__).parent))  # helpers, from any depth

# Re-exported: test files import these from here (``from conftest import start_server``).
from helpers.frozen import FIXTURE as FROZEN_FIXTURE  # noqa: E402
from helpers.frozen import BackgroundBuild, build_skipped  # noqa: E402
from helpers.servers import DIAGNOSE, ServerProcess, afmd_command, start_server  # noqa: E402
from helpers.session import ENV as RUN_DIR_ENV  # noqa: E402
from helpers.session import run_dir  # noqa: E402
from helpers.tls import share_default_context  # noqa: E402

share_default_context()

# MLX's CUDA backend multiplies float32 matrices in TF32 unless told otherwise: the tests
# compare afmd's numbers with mlx-lm's in float32 (tests/helpers/numerics.py). Set before
# anything computes, so test servers inherit it too; other backends ignore it.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

__all__ = ["DIAGNOSE", "ROOT", "ServerProcess", "afmd_command", "parse_sse", "start_server"]

#: Workers for a run over the whole suite (or a folder): one more than the cores, as the
#: tests wait on sockets, child servers and timeouts much of the time. Two more was slower
#: on 2 cores: each worker collects the whole suite and starts its own shared server.
WORKERS = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
           else os.cpu_count() or 2) + 1


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """What ``-n auto`` (pyproject.toml's addopts) means: WORKERS for a run over the
    suite or a folder, and none (in process, as without xdist) for a run that names test
    files or tests, where starting workers costs more than it saves.
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides it."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    named = any(arg.split("::")[0].endswith(".py") for arg in config.args)
    return 0 if named else WORKERS


#: Slow files marked from here rather than by a ``pytestmark`` line of their own.
SLOW_FILES = {
    "test_tool_formats_e2e.py": "a model per call format, built and served in process",
    "test_model_budget.py": "servers loading and unloading several models",
    "test_speculative.py": "draft and target models decoding side by side",
}


def pytest_itemcollected(item: pytest.Item) -> None:
    if item.path.name in SLOW_FILES:
        item.add_marker(pytest.mark.slow)


#: The run's shared folder, when this process made it, and the variable's value before.
_MADE_RUN_DIR = pytest.StashKey[tuple[Path, str | None]]()


def pytest_configure(config: pytest.Config) -> None:
    """The run's shared folder (tests/helpers/session.py), made once, before any worker."""
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller made it
        return
    path = Path(tempfile.mkdtemp(prefix="afmd-tests-"))
    config.stash[_MADE_RUN_DIR] = (path, os.environ.get(RUN_DIR_ENV))
    os.environ[RUN_DIR_ENV] = str(path)


def pytest_unconfigure(config: pytest.Config) -> None:
    made = config.stash.get(_MADE_RUN_DIR, None)
    if made is None:
        return
    path, old = made
    BackgroundBuild(path / "frozen").kill()
    shutil.rmtree(path, ignore_errors=True)
    if old is None:
        os.environ.pop(RUN_DIR_ENV, None)
    else:
        os.environ[RUN_DIR_ENV] = old


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which would answer for loadfile
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` as tests/helpers/schedule.py hands it out."""
    if config.getvalue("dist") != "loadfile":
        return None
    from helpers.schedule import FileSchedule

    return FileSchedule(config, log)


#: The files that take a worker longest, handed out first under xdist (in collection
#: order: tests/helpers/schedule.py), longest first: one started last would leave the
#: others idle at the end, while short files (and the call-format file's per-family units)
#: fill the gaps late. Ranked by a whole run's worker time per file (``--durations=0``
#: summed by file), which the list must follow as files grow: the engine's speculative
#: tests, collected last of all (tests/unit), once started with the others done.
LONGEST_FILES = ("test_bench_quick.py", "test_distributed.py", "test_pull.py",
                 "test_kvcache.py", "test_ollama_api.py", "test_speculative.py",
                 "test_listeners.py", "test_slow_readers.py", "test_dashboard_browser.py",
                 "test_fuzz_heads.py", "test_completions.py", "test_anthropic_wire.py",
                 "test_cli.py", "test_model_budget.py", "test_server_tools.py",
                 "test_models_cli.py")


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected what they do
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist the longest files go first. The files with tests that need the frozen
    build run last, and the build starts now, so that its minutes overlap everything else
    (see tests/helpers/frozen.py)."""
    if hasattr(config, "workerinput"):
        rank = {name: i for i, name in enumerate(LONGEST_FILES)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable
    files = {item.path for item in items
             if FROZEN_FIXTURE in getattr(item, "fixturenames", ())}
    if not files:
        return
    items[:] = ([item for item in items if item.path not in files]
                + [item for item in items if item.path in files])
    if (config.option.collectonly or os.environ.get("AFMD_FROZEN_BINARY")
            or build_skipped()):
        return
    BackgroundBuild(run_dir() / "frozen").start()


@pytest.fixture(scope="session", autouse=True)
def _cache_dir() -> Iterator[Path]:
    """One demo-model cache per test run, never the user's own: shared by pytest-xdist's
    workers (a model is built privately and renamed into place, so concurrent builders are
    safe), so each demo model is built once per run."""
    path = run_dir() / "afmd-cache"
    path.mkdir(exist_ok=True)
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
