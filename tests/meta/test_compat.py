"""afmd.http.compat: the one module that reaches into Sanic's and asyncio's privates.

First the upgrade alarm: what compat relies on must still read as it did in the versions
it names (an upgrade of Sanic or Python fails here, naming what to re-read, before it
fails anywhere else). Then each private is exercised on its own, against the real
libraries, and no other module of the HTTP edge may reach into either.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import contextvars
import socket
from pathlib import Path
from typing import Any

import pytest
from sanic import headers as sanic_headers
from sanic.http import Http
from sanic.server.protocols.http_protocol import HttpProtocol

from afmd.http import compat

from helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
#: The modules that serve HTTP; all but compat keep to Sanic's and asyncio's public API.
EDGE = sorted([*(ROOT / "afmd" / "http").rglob("*.py"), ROOT / "afmd" / "server.py"])
#: Sanic modules anyone may import from: its application API.
SANIC_PUBLIC = {"sanic", "sanic.exceptions", "sanic.handlers", "sanic.request",
                "sanic.response"}
SANIC_PUBLIC_NAMES = {"Request", "Sanic"}  # from ``from sanic import ...``


def test_upstream_is_what_compat_was_written_against() -> None:
    problems = compat.upstream_problems()
    assert not problems, (
        f"Sanic or asyncio changed under afmd/http/compat.py (written against sanic "
        f"{compat.SANIC_VERSION} and Python 3.11): re-read each of these upstream, adapt "
        "compat, then update its fingerprints:\n  " + "\n  ".join(problems))


def test_reason_phrases_are_patched() -> None:
    assert sanic_headers.format_http1_response(421, []).startswith(
        b"HTTP/1.1 421 Misdirected Request\r\n")
    assert sanic_headers.format_http1_response(431, []).startswith(
        b"HTTP/1.1 431 Request Header Fields Too Large\r\n")


def test_exact_fields_keep_values_as_the_gate_rendered_them() -> None:
    head = "GET / HTTP/1.1\r\nHost: x\r\nX-Id: \u00a0abc\r\nX-Empty: \r\nX-Raw: \udcff".encode(
        errors="surrogateescape")
    assert compat.exact_fields(head) == [("host", "x"), ("x-id", "\u00a0abc"),
                                         ("x-empty", ""), ("x-raw", "\udcff")]


def test_connection_hooks_are_sanic_slots() -> None:
    """What SanicConnection reads and writes exists on Sanic's protocol, and its Http
    subclass is the one each connection runs."""
    assert compat.SanicConnection.HTTP_CLASS is compat.ExactHttp
    assert issubclass(compat.ExactHttp, Http)
    assert issubclass(compat.SanicConnection, HttpProtocol)
    assert compat.ExactHttp.HEADER_MAX_SIZE > 1 << 40


def test_a_connection_lets_go_of_its_last_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """However Sanic's request loop ends (a client gone mid-answer returns from it before
    it unlinks the request), the request, its response and the connection's writer no
    longer refer to each other: that cycle held the request's body until a collection."""

    class Linked:
        stream: object = None

    http = compat.ExactHttp.__new__(compat.ExactHttp)
    request, response = Linked(), Linked()

    async def gone_mid_answer(self: Http) -> None:
        self.request, self.response = request, response  # type: ignore[assignment]
        request.stream = response.stream = self
        self.response_func = self.http1_response_header

    monkeypatch.setattr(Http, "http1", gone_mid_answer)
    asyncio.run(http.http1())
    assert (http.request, http.response, http.response_func) == (None, None, None)
    assert request.stream is None and response.stream is None


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    return sock


def test_a_broken_listener_is_named_and_its_reader_forgotten() -> None:
    """A listening socket shut down underneath: asyncio reports its accept() failure
    through the loop's exception handler, compat finds the socket in that report, and
    forgetting the accept reader stops the reports."""
    loop = asyncio.new_event_loop()
    sock = _listening()
    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    try:
        server = loop.run_until_complete(loop.create_server(asyncio.Protocol, sock=sock))
        sock.shutdown(socket.SHUT_RDWR)
        loop.run_until_complete(asyncio.sleep(0.05))
        assert seen, "asyncio no longer reports a failing accept() to the loop"
        assert compat.accept_failure(seen[-1]) is sock
        assert compat.accept_failure({"exception": OSError(), "handle": None}) is None
        compat.forget_accept_reader(loop, sock.fileno())
        assert not loop.remove_reader(sock.fileno())  # it was gone already
        count = len(seen)
        loop.run_until_complete(asyncio.sleep(0.05))
        assert len(seen) == count  # the storm stopped
        server.close()
    finally:
        with contextlib.suppress(OSError):
            sock.close()
        loop.close()


def test_only_an_accept_reader_is_forgotten() -> None:
    loop = asyncio.new_event_loop()
    a, b = socket.socketpair()
    try:
        loop.add_reader(a.fileno(), lambda: None)
        compat.forget_accept_reader(loop, a.fileno())
        assert loop.remove_reader(a.fileno())  # someone else's reader: left in place
        compat.forget_accept_reader(loop, -1)
    finally:
        a.close()
        b.close()
        loop.close()


def test_the_current_request_is_forgotten_in_this_context_only() -> None:
    """What a timer made after the head is parsed copies holds no request."""
    from sanic import Request
    from sanic.exceptions import ServerError

    def in_a_request() -> contextvars.Context:
        Request._current.set(object())  # type: ignore[arg-type]  # any object will do
        compat.forget_current_request()
        return contextvars.copy_context()  # what call_at would keep

    copied = contextvars.Context().run(in_a_request)
    assert copied.get(Request._current) is None
    with pytest.raises(ServerError):
        copied.run(Request.get_current)


# --------------------------------------------------------------------------- no one else


def _sanic_internals() -> set[str]:
    """Names of Sanic's protocol and HTTP internals: its private attributes and methods,
    and the undocumented ones compat overrides or reads."""
    names = {"recv_buffer", "check_timeouts", "http1_request_header", "init_for_request",
             "HEADER_MAX_SIZE", "STATUS_CODES", "_HTTP1_STATUSLINES", "_current"}
    for base in (HttpProtocol, Http):
        for cls in base.__mro__:
            if not cls.__module__.startswith("sanic"):
                continue
            for name in (*vars(cls), *getattr(cls, "__slots__", ())):
                if name.startswith("_") and not name.startswith("__"):
                    names.add(name)
    return names


def _problems(path: Path, internals: set[str]) -> list[str]:
    problems = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sanic"):
            if node.module not in SANIC_PUBLIC or (
                    node.module == "sanic"
                    and any(a.name not in SANIC_PUBLIC_NAMES for a in node.names)):
                problems.append(f"{where}: from {node.module} import "
                                + ", ".join(a.name for a in node.names))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("sanic.") and alias.name not in SANIC_PUBLIC:
                    problems.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.Attribute):
            receiver = node.value.id if isinstance(node.value, ast.Name) else None
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            if (node.attr in internals and receiver != "self") or (
                    private and receiver not in ("self", "cls")):
                problems.append(f"{where}: .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant)
              and str(node.args[1].value).startswith("_")
              and not str(node.args[1].value).startswith("__")):
            problems.append(f"{where}: {node.func.id}(..., {node.args[1].value!r})")
    return problems


def _sanic_subclass_problems(path: Path, internals: set[str]) -> list[str]:
    """``self.<Sanic internal>`` inside afmd's subclasses of Sanic's classes."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    namespace = __import__(module, fromlist=["_"])
    problems = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        cls = getattr(namespace, node.name, None) if isinstance(node, ast.ClassDef) else None
        if not (isinstance(cls, type) and issubclass(cls, (HttpProtocol, Http))):
            continue
        for inner in ast.walk(node):
            if (isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name)
                    and inner.value.id == "self" and inner.attr in internals):
                problems.append(f"{path.relative_to(ROOT)}:{inner.lineno}: self.{inner.attr}")
    return problems


@pytest.mark.parametrize("path", [p for p in EDGE if p.name != "compat.py"],
                         ids=lambda p: str(p.relative_to(ROOT / "afmd")))
def test_no_private_outside_compat(path: Path) -> None:
    internals = _sanic_internals()
    problems = _problems(path, internals) + _sanic_subclass_problems(path, internals)
    assert not problems, ("Sanic's or asyncio's internals belong in afmd/http/compat.py:\n  "
                          + "\n  ".join(problems))


def test_the_check_sees_privates() -> None:
    compat_path = ROOT / "afmd" / "http" / "compat.py"
    internals = _sanic_internals()
    assert {"_time", "_can_write", "_task", "recv_buffer"} <= internals
    found = "\n".join(_problems(compat_path, internals)
                      + _sanic_subclass_problems(compat_path, internals))
    for needle in ("from sanic.http import", "._HTTP1_STATUSLINES", "self.recv_buffer",
                   "self._can_write", "'_callback'", "'_selector'"):
        assert needle in found, (needle, found)
