"""The end-to-end smoke checks, written once and run against any afmd: the source tree's
server (tests/server/test_smoke.py) and the frozen binary (tests/server/test_frozen_binary.py).

``run_smoke_checks(base_url)`` is what a release must pass: /health ok, a non-streamed and a
streamed chat completion through the official ``openai`` client, both schema-valid, an
invalid request answered with a schema-valid OpenAI error envelope, and the dashboard's
page with its files.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx

from helpers.openai_schemas import validate_chunk, validate_error, validate_response
from helpers.servers import ServerProcess

T = TypeVar("T")

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something."},
]


def check_health(base_url: str) -> dict[str, Any]:
    response = httpx.get(base_url + "/health", timeout=10)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "ok", body
    assert body["models"].get("demo") == "available", body
    return body


def check_completion(client: Any) -> Any:
    """One non-streamed completion, checked against OpenAI's schema; returned for more."""
    completion = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=12, temperature=0
    )
    validate_response(completion.model_dump(exclude_unset=True))
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("length", "stop")
    assert 0 < completion.usage.completion_tokens <= 12
    assert completion.model == "demo"
    return completion


def check_streamed_completion(client: Any) -> None:
    stream = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    for chunk in chunks:
        validate_chunk(chunk.model_dump(exclude_unset=True))
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason]
    assert finishes == ["length"], finishes
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


def check_error_envelope(base_url: str) -> None:
    response = httpx.post(
        base_url + "/v1/chat/completions",
        json={"model": "demo", "messages": "not a list"},
        timeout=10,
    )
    assert response.status_code == 400, response.text
    body = response.json()
    validate_error(body)
    assert body["error"]["param"] == "messages", body
    assert body["error"]["type"] == "invalid_request_error", body

    missing = httpx.post(
        base_url + "/v1/chat/completions",
        json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert missing.status_code == 404, missing.text
    validate_error(missing.json())
    assert missing.json()["error"]["code"] == "model_not_found"


def check_dashboard(base_url: str) -> None:
    """The dashboard's page and every file it names are served (package data, which a
    frozen build must carry), and a browser's ``GET /`` is sent there."""
    import re

    root = httpx.get(base_url + "/", headers={"Accept": "text/html"}, timeout=10)
    assert root.status_code == 302 and root.headers["location"] == "/ui/", root
    page = httpx.get(base_url + "/ui/", timeout=10)
    assert page.status_code == 200
    assert 'data-testid="prompt"' in page.text, page.text[:200]
    for url in sorted(set(re.findall(r'(?:src|href)="(/ui/[^"]+)"', page.text))):
        asset = httpx.get(base_url + url, timeout=10)
        assert asset.status_code == 200 and asset.content, url


def run_smoke_checks(base_url: str) -> None:
    """Every end-to-end check, against the server at ``base_url`` (``http://host:port``)."""
    import openai

    check_health(base_url)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    check_completion(client)
    check_streamed_completion(client)
    check_error_envelope(base_url)
    check_dashboard(base_url)


# ---------------------------------------------------------------------------- processes


def start_command(
    cmd: Sequence[str], *, cwd: Path, env: Mapping[str, str] | None = None,
    listening_timeout: float = 120.0,
) -> ServerProcess:
    """Start any afmd command line that serves (``... serve --port 0 --log-format json``)
    and wait for its ``listening`` event; the caller waits for readiness."""
    proc = subprocess.Popen(
        list(cmd), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, env=dict(os.environ if env is None else env), cwd=str(cwd),
    )
    server = ServerProcess(proc)
    threading.Thread(target=server._reader, daemon=True).start()
    server.wait_event("listening", timeout=listening_timeout)
    return server


def wait_healthy(url: str, proc: subprocess.Popen[str], timeout: float = 120.0) -> float:
    """Poll /health until 200; return the monotonic time it first answered 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise AssertionError("server never became healthy")


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux /proc); a onefile binary is a bootloader parent
    plus the Python child, so memory is reported for every process."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def vm_rss_kib(pid: int) -> int:
    """VmRSS of one process in KiB, from /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def grown_mib_while(pid: int, call: Callable[[], T]) -> tuple[T, float]:
    """What ``call`` returns and how far above where it was the RSS of process ``pid``
    rose while it ran, in MiB (sampled every few milliseconds: a peak the process gives
    back before the call returns still counts)."""
    before = vm_rss_kib(pid)
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak.append(vm_rss_kib(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = call()
    finally:
        done.set()
        sampler.join(5)
    return result, (max(peak) - before) / 1024


class Running:
    """A request sent on a thread of its own: :meth:`under_way` returns once the server
    counts it as running, :meth:`answer` waits for its answer."""

    def __init__(self, base_url: str, call: Callable[[], httpx.Response]) -> None:
        self._base_url = base_url
        self._answers: list[httpx.Response] = []
        self._thread = threading.Thread(target=lambda: self._answers.append(call()))
        self._thread.start()

    def under_way(self, settle: float = 0.3) -> Running:
        """Once ``/health`` counts a running request (or this one was answered), and
        ``settle`` seconds more: a long prompt is then into its first chunks."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not self._answers:
            if httpx.get(self._base_url + "/health", timeout=10).json()["active_requests"]:
                break
            time.sleep(0.05)
        time.sleep(settle)
        return self

    def answer(self, timeout: float = 300) -> httpx.Response:
        self._thread.join(timeout)
        assert self._answers, f"no answer within {timeout} s"
        return self._answers[0]
