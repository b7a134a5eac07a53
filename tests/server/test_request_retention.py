"""A finished request is let go as it ends, without Python's cyclic garbage collector.

Agents send bodies of hundreds of KB to MB every turn (up to max_request_body_bytes); a
Sanic request caught in a reference cycle keeps its body resident until a collection,
which may come several requests later. With the collector off, each request's Sanic
``Request`` must die with its last reference, whether it was answered whole or streamed,
refused, or its client went away mid-answer. Two cycles held it: a keep-alive stream's
pinger task (Anthropic's ``ping`` events: the task kept the CancelledError that ended it,
whose frame held the stream that held the task) and Sanic's own connection state after a
client went away (the request, its response and the connection's writer referring to
each other; ``ExactHttp.http1`` in ``afmd/http/compat.py`` unlinks them). A third kept
every run, with its parsed request (the conversation's text): the run, its
``RunControl`` and the control's calls into the run (now held weakly).
"""

from __future__ import annotations

import gc
import json
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import sanic.request

from afmd.service.chat_run import ChatRun
from afmd.service.completion_run import CompletionRun

from helpers.inprocess import InProcessServer
from helpers.raw_http import RawConn

#: An ignored field that makes the body an agent's size.
PADDING = "x" * 300_000


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    inproc = InProcessServer()
    yield inproc
    inproc.stop()


def _made_while(monkeypatch: pytest.MonkeyPatch,
                classes: tuple[type, ...]) -> Iterator[list[weakref.ref[Any]]]:
    """Weak references to every instance of ``classes`` made while the test runs, with
    the cyclic garbage collector off (what a cycle holds then stays)."""
    made: list[weakref.ref[Any]] = []
    for cls in classes:
        def recording(self: Any, *args: Any, _init: Any = cls.__init__, **kwargs: Any) -> None:
            _init(self, *args, **kwargs)
            made.append(weakref.ref(self))

        monkeypatch.setattr(cls, "__init__", recording)
    gc.collect()
    gc.disable()
    try:
        yield made
    finally:
        gc.enable()


@pytest.fixture()
def requests(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[weakref.ref[Any]]]:
    """Every Sanic request made while the test runs (see :func:`_made_while`)."""
    yield from _made_while(monkeypatch, (sanic.request.Request,))


def raw_request(path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def assert_let_go(made: list[weakref.ref[Any]], name: str, timeout: float = 10.0) -> None:
    """The one request made is gone (the server thread may still be finishing it)."""
    assert len(made) == 1, f"{name}: {len(made)} requests were made"
    deadline = time.monotonic() + timeout
    while made[0]() is not None:
        assert time.monotonic() < deadline, (
            f"{name}: the request outlived its answer; it is held by "
            f"{[type(r).__name__ for r in gc.get_referrers(made[0]())]}")
        time.sleep(0.02)


CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
ANSWERED = {
    "chat": (CHAT, {"model": "demo", "messages": HI, "max_tokens": 4, "user": PADDING}, 200),
    "chat-stream": (CHAT, {"model": "demo", "messages": HI, "max_tokens": 4, "stream": True,
                           "user": PADDING}, 200),
    "chat-refused": (CHAT, {"model": "demo", "messages": "hi", "user": PADDING}, 400),
    "chat-unknown-model": (CHAT, {"model": "nope", "messages": HI, "user": PADDING}, 404),
    "anthropic": ("/v1/messages", {"model": "demo", "max_tokens": 4, "messages": HI,
                                   "padding": PADDING}, 200),
    "anthropic-stream": ("/v1/messages", {"model": "demo", "max_tokens": 4, "stream": True,
                                          "messages": HI, "padding": PADDING}, 200),
    "anthropic-refused": ("/v1/messages", {"model": "demo", "messages": HI,
                                           "padding": PADDING}, 400),
    "responses-stream": ("/v1/responses", {"model": "demo", "input": "hi", "stream": True,
                                           "max_output_tokens": 16, "user": PADDING}, 200),
    "ollama": ("/api/chat", {"model": "demo", "stream": False, "messages": HI,
                             "options": {"num_predict": 4}, "padding": PADDING}, 200),
    "ollama-stream": ("/api/chat", {"model": "demo", "messages": HI,
                                    "options": {"num_predict": 4}, "padding": PADDING}, 200),
    "ollama-refused": ("/api/chat", {"model": "nope", "messages": HI,
                                     "padding": PADDING}, 404),
}


@pytest.mark.parametrize("name", list(ANSWERED))
def test_an_answered_request_is_let_go(server: InProcessServer,
                                       requests: list[weakref.ref[Any]], name: str) -> None:
    path, body, status = ANSWERED[name]
    with RawConn(server.port) as conn:
        conn.send(raw_request(path, body))
        response = conn.read_response("POST")
        assert response.status == status, response.body[:300]
        assert_let_go(requests, name)  # the connection still open, kept alive


GONE = {
    "chat-stream": (CHAT, {"model": "demo", "messages": HI, "max_tokens": 100_000,
                           "stream": True, "user": PADDING}),
    "anthropic-stream": ("/v1/messages", {"model": "demo", "max_tokens": 100_000,
                                          "stream": True, "messages": HI,
                                          "padding": PADDING}),
    "ollama-stream": ("/api/chat", {"model": "demo", "messages": HI,
                                    "options": {"num_predict": 100_000}, "padding": PADDING}),
}


@pytest.mark.parametrize("name", list(GONE))
def test_a_request_whose_client_went_away_is_let_go(
        server: InProcessServer, requests: list[weakref.ref[Any]], name: str) -> None:
    path, body = GONE[name]
    with RawConn(server.port) as conn:
        conn.send(raw_request(path, body))
        assert conn.sock.recv(64).startswith(b"HTTP/1.1 200 ")  # the stream began
    assert_let_go(requests, name)


@pytest.fixture()
def runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[weakref.ref[Any]]]:
    """Every chat and completion run made while the test runs (see :func:`_made_while`)."""
    yield from _made_while(monkeypatch, (ChatRun, CompletionRun))


RUNS = {
    "chat": (CHAT, {"model": "demo", "messages": HI, "max_tokens": 4}, 1),
    "chat-stream": (CHAT, {"model": "demo", "messages": HI, "max_tokens": 4,
                           "stream": True}, 1),
    "chat-n2": (CHAT, {"model": "demo", "messages": HI, "max_tokens": 4, "n": 2}, 2),
    "completions": ("/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 4}, 1),
    "anthropic": ("/v1/messages", {"model": "demo", "max_tokens": 4, "messages": HI}, 1),
    "ollama-stream": ("/api/chat", {"model": "demo", "messages": HI,
                                    "options": {"num_predict": 4}}, 1),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_a_finished_run_is_let_go(server: InProcessServer, runs: list[weakref.ref[Any]],
                                  name: str) -> None:
    """A run (its request, its messages: an agent's whole conversation, its rounds) dies
    with its response: it and its control's calls into it referred to each other."""
    path, body, count = RUNS[name]
    with RawConn(server.port) as conn:
        conn.send(raw_request(path, body))
        response = conn.read_response("POST")
        assert response.status == 200, response.body[:300]
    assert len(runs) == count, f"{name}: {len(runs)} runs were made"
    deadline = time.monotonic() + 10
    while any(ref() is not None for ref in runs):
        assert time.monotonic() < deadline, f"{name}: a run outlived its response"
        time.sleep(0.02)
