"""What a finished request or an unloaded model held is given back, on the real server.

Both leaks these tests guard against grew the server by the same amount with every
request, with no error anywhere: a finished request was held until its deadline by the
timers it had cancelled, and each load of a model left its tokenizer, and everything a
grammar built from it, behind for the process's life (docs/hardening.md).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Iterator

import httpx
import pytest

from helpers.servers import ServerProcess, start_server
from helpers.smoke import process_tree, vm_rss_kib

pytestmark = pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc")

MIB = 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A fresh interpreter: a server forked from the test's warm one grows as it touches
    the pages it shares with it."""
    server = start_server(tmp_path_factory.mktemp("memory"), fork=False)
    yield server
    server.stop()


def test_a_finished_request_is_not_held_until_its_deadline(server: ServerProcess) -> None:
    """A 4 MB ``user`` field, ten times: each request's body stayed resident for
    ``request_timeout`` after its response (its deadline timer, cancelled, kept the
    request's context), about 4 MB a request; now nothing stays."""
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


def test_an_unloaded_model_leaves_nothing_behind(server: ServerProcess) -> None:
    """``keep_alive: 0`` with a schema: each request loads demo-32k, compiles a grammar
    for it (in the server and in the compile worker) and unloads it. Each load's
    tokenizer and grammars stayed, in both processes, tens of MiB a request; now the
    server and the worker stay level."""
    def cycle(i: int) -> None:
        body = {"model": "demo-32k", "keep_alive": 0, "stream": False,
                "messages": [{"role": "user", "content": "hello there"}],
                "format": {"type": "object", "required": ["a"],
                           "properties": {"a": {"type": "integer"},
                                          f"k{i % 3}": {"type": "string"}}},
                "options": {"num_predict": 4}}
        r = httpx.post(server.url + "/api/chat", json=body, timeout=60)
        assert r.status_code == 200, r.text[:300]

    def sizes() -> tuple[int, int]:
        tree = process_tree(server.proc.pid)
        assert len(tree) == 2, f"the server and its compile worker, not {tree}"
        return vm_rss_kib(tree[0]), vm_rss_kib(tree[1])

    for i in range(3):  # each of the three grammars once: their first compiles
        cycle(i)
    first = sizes()
    for i in range(8):
        cycle(i)
    last = sizes()
    grown = [(b - a) // MIB for a, b in zip(first, last, strict=True)]
    assert grown[0] < 60, f"the server grew by {grown[0]} MiB over eight loads"
    assert grown[1] < 40, f"the compile worker grew by {grown[1]} MiB over eight loads"


def test_models_loaded_and_unloaded_again_and_again_leave_no_threads_behind(
    server: ServerProcess,
) -> None:
    """``keep_alive: 0``: each request loads its model and unloads it after. MLX gives
    every thread that computes its own streams (mlx-lm's and mlx-vlm's generation stream
    is thread-local too), each with a native thread behind it that outlives the Python
    thread: every load's worker thread left one or two behind, with their stacks, for
    good (a chat or vision model two, an embedding model one): five rounds of the three
    models left a dozen or more. The workers now run on reused threads, so the count
    levels off; a few threads may still start in the first rounds measured, as pools
    that start threads on demand up to their bound (asyncio's default executor, started
    by whichever work overlaps) reach it, and then it stays level however many rounds
    follow."""
    import base64
    import io
    import os

    from PIL import Image

    picture = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 30)).save(picture, "PNG")
    image = "data:image/png;base64," + base64.b64encode(picture.getvalue()).decode()
    requests = [
        ("/v1/chat/completions", {"model": "demo", "max_tokens": 4, "stream": True,
                                  "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/embeddings", {"model": "demo-embedding", "input": "hi"}),
        ("/v1/chat/completions", {"model": "demo-vision", "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                         {"type": "text", "text": "What is it?"}]}]}),
    ]

    def cycle() -> None:
        for path, body in requests:
            answer = httpx.post(server.url + path, json={**body, "keep_alive": 0}, timeout=60)
            assert answer.status_code == 200, answer.text[:300]
            model = body["model"]
            deadline = time.monotonic() + 10
            while httpx.get(server.url + "/health", timeout=10).json()[
                    "model_details"][model]["state"] != "available":
                assert time.monotonic() < deadline, f"{model} stayed loaded"
                time.sleep(0.02)

    def threads() -> int:
        return len(os.listdir(f"/proc/{server.proc.pid}/task"))

    def settled(at_most: int | None = None) -> int:
        """The count once the unloads' threads have ended: steady over 0.2 s (or down to
        ``at_most``), however busy the machine; a thread left for good never goes."""
        deadline = time.monotonic() + 10
        last = threads()
        while time.monotonic() < deadline:
            time.sleep(0.2)
            now = threads()
            if (now <= at_most) if at_most is not None else now == last:
                return now
            last = now
        return last

    cycle()
    cycle()
    before = settled()
    for _ in range(5):
        cycle()
    grown = settled(at_most=before + 4) - before
    assert grown <= 4, f"{grown} more threads after five loads and unloads of three models"
