"""Header values, absolute-form targets and Host ports, screened by the gate.

In process (bytes fed to :meth:`Gate.feed`) for the verdicts, then against the real server
for the wiring: what reaches the handlers must be exactly what the client sent, minus
optional whitespace (SP and HTAB) and nothing else, so a value with a leading U+00A0 can
never pass for another client's request id or match the Origin allow-list.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import pytest

from afmd.config.sections import ServerConfig
from afmd.http.sansio.gate import Direct, Forward, Gate, Output, Reply
from afmd.http.sansio.screen import Cors, GatePolicy, normalize_origin

from conftest import ServerProcess, start_server
from helpers.fuzz import POLICY
from helpers.raw_http import RawConn, check_error, exchange

GOOD = "http://ok.example"


def feed(raw: bytes) -> list[Output]:
    return Gate(POLICY).feed(raw)


def forwarded(raw: bytes) -> bytes:
    """The request as Sanic is handed it."""
    out = feed(raw)
    assert len(out) == 1 and isinstance(out[0], Forward), out
    return out[0].render()


def refused(raw: bytes) -> int:
    out = feed(raw)
    assert len(out) == 1 and isinstance(out[0], Reply), out
    rejection = out[0].rejection
    assert rejection is not None and out[0].close, out
    return rejection.status


def get(target: bytes = b"/health", *, host: bytes | None = b"localhost",
        extra: bytes = b"") -> bytes:
    head = b"GET " + target + b" HTTP/1.1\r\n"
    if host is not None:
        head += b"Host: " + host + b"\r\n"
    return head + extra + b"\r\n"


# --------------------------------------------------------------------------- field values

# Whitespace to Python's str.strip() or str.isspace(), and other control characters.
CONTROLS = [b"\x01", b"\x08", b"\x0b", b"\x0c", b"\x1b", b"\x1c", b"\x1f", b"\x7f"]


@pytest.mark.parametrize("ctl", CONTROLS, ids=[c.hex() for c in CONTROLS])
@pytest.mark.parametrize("where", ["lead", "inside", "trail"])
def test_control_characters_in_a_value_are_refused(ctl: bytes, where: str) -> None:
    value = {"lead": ctl + b"abc", "inside": b"a" + ctl + b"bc", "trail": b"abc" + ctl}[where]
    assert refused(get(extra=b"X-Request-ID: " + value + b"\r\n")) == 400
    assert refused(get(extra=b"Origin: " + value + b"\r\n")) == 400
    # In a chunked trailer too (validated, then dropped).
    post = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
            b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n"
            b"X-T: " + value + b"\r\n\r\n")
    assert refused(post) == 400


def test_control_character_message_is_precise() -> None:
    out = feed(get(extra=b"X-Request-ID: \x1fabc\r\n"))
    assert isinstance(out[0], Reply) and out[0].rejection is not None
    assert "control character" in out[0].rejection.message
    assert out[0].rejection.code == "malformed_request"


@pytest.mark.parametrize("value", [b"\xc2\xa0abc", b"\xe2\x80\xa9abc", b"\xc2\x85abc",
                                   b"\xe3\x80\x80abc", b"\xa0abc", b"\x85abc", b"abc\xc2\xa0",
                                   b"a\tb", b"\xff\xfe"])
def test_only_sp_and_htab_are_trimmed(value: bytes) -> None:
    request = forwarded(get(extra=b"X-Request-ID: \t " + value + b" \t\r\n"))
    assert b"\r\nX-Request-ID: " + value + b"\r\n" in request


@pytest.mark.parametrize("origin", [b"\xc2\xa0" + GOOD.encode(), b"\xa0" + GOOD.encode(),
                                    b"\x85" + GOOD.encode(), b"\xe2\x80\xa9" + GOOD.encode(),
                                    b"\xe3\x80\x80" + GOOD.encode(),
                                    GOOD.encode() + b"\xc2\xa0", GOOD.encode() + b"\xa0"])
def test_origin_with_other_whitespace_does_not_match(origin: bytes) -> None:
    assert refused(get(extra=b"Origin: " + origin + b"\r\n")) == 403


def test_allowed_origin_still_matches() -> None:
    for origin in (GOOD, GOOD.upper().replace("HTTP", "http"), GOOD + "/"):
        assert isinstance(feed(get(extra=f"Origin: \t{origin} \r\n".encode()))[0], Forward)


@pytest.mark.parametrize(("origin", "passes"), [
    (b"app://obsidian.md", True),  # Obsidian's pages, Electron apps
    (b"file://", True),  # an Electron page loaded from a file
    (b"tauri://localhost", True),
    (b"vscode-webview://1abc2def", True),
    (b"vscode-file://vscode-app", True),
    (b"APP://Obsidian.md", True),
    (b"null", False),  # a browser's local file or sandboxed page: any web page can be one
    (b"http://app.example", False),
    (b"https://obsidian.md", False),
    (b"app:/obsidian.md", False),
    (b"xapp://obsidian.md", False),
])
def test_origins_only_local_apps_send_are_allowed_as_ollama_allows_them(
        origin: bytes, passes: bool) -> None:
    """Desktop apps and editor plugins call the API from pages of their own schemes, which
    no web page can send: they are let in with no ``allowed_origins``, as Ollama's default
    ``OLLAMA_ORIGINS`` lets them, and get CORS headers; web origins still need listing."""
    out = Gate(GatePolicy(route=POLICY.route)).feed(
        get(b"/health", extra=b"Origin: " + origin + b"\r\n"))
    if passes:
        assert isinstance(out[0], Direct | Forward), origin
        assert Cors.from_origins(()).headers(origin.decode())[0] == (
            "Access-Control-Allow-Origin", origin.decode())
    else:
        assert isinstance(out[0], Reply) and out[0].rejection is not None
        assert out[0].rejection.status == 403


@pytest.mark.parametrize(("entry", "origin", "passes"), [
    ("chrome-extension://*", "chrome-extension://jfgfiigpkhlkbnfnbobbkinehhfdhndo", True),
    ("chrome-extension://*", "moz-extension://abc", False),
    ("http://localhost:*", "http://localhost:3000", True),
    ("http://127.0.0.1:*", "http://127.0.0.1", False),
    ("http://localhost:*", "https://localhost:3000", False),
    ("http://localhost:*", "http://localhost:3000/evil", False),  # never past the port
    ("https://*.example.com", "https://chat.example.com", True),
    ("https://*.example.com", "https://example.com.evil.net", False),
    ("HTTP://LOCALHOST:*", "http://localhost:5173", True),
])
def test_an_allowed_origin_may_hold_a_wildcard(entry: str, origin: str, passes: bool) -> None:
    """``allowed_origins`` takes ``*`` as Ollama's ``OLLAMA_ORIGINS`` does (browser
    extensions' guides say ``chrome-extension://*``): any run of characters but ``/``."""
    config = ServerConfig(allowed_origins=(entry,))
    policy = GatePolicy.from_config(config, POLICY.route, check_host=True)
    out = Gate(policy).feed(get(b"/v1/models", extra=f"Origin: {origin}\r\n".encode()))
    assert isinstance(out[0], Forward | Direct) is passes, (entry, origin)


@pytest.mark.parametrize(("host", "origin", "passes"), [
    (b"127.0.0.1:9999", b"http://127.0.0.1:9999", True),  # the page afmd served, calling back
    (b"LOCALHOST:9999", b"http://localhost:9999/", True),
    (b"localhost", b"http://localhost", True),
    (b"127.0.0.1:9999", b"http://127.0.0.1:9998", False),  # another port: another origin
    (b"127.0.0.1:9999", b"http://localhost:9999", False),  # another name: another origin
    (b"127.0.0.1:9999", b"https://127.0.0.1:9999", False),  # afmd speaks plain HTTP
    (b"127.0.0.1:9999", b"null", False),
])
def test_an_origin_naming_the_host_is_the_servers_own(host: bytes, origin: bytes,
                                                      passes: bool) -> None:
    raw = get(b"/v1/models", host=host, extra=b"Origin: " + origin + b"\r\n")
    if passes:
        assert isinstance(feed(raw)[0], Forward)
    else:
        assert refused(raw) == 403


def test_a_rebinding_page_is_not_its_own_origin() -> None:
    """With every Host allowed ("*"), a DNS-rebinding page's Host is its own name: that it
    names itself in Origin does not make it afmd's page."""
    policy = dataclasses.replace(POLICY, check_host=False)
    raw = get(b"/v1/models", host=b"evil.example:9999",
              extra=b"Origin: http://evil.example:9999\r\n")
    out = Gate(policy).feed(raw)
    assert isinstance(out[0], Reply) and out[0].rejection is not None
    assert out[0].rejection.status == 403


def test_the_dashboards_page_is_read_without_the_key_its_data_is_not() -> None:
    routes = {"/", "/ui/", "/ui/dashboard.js", "/ui/api/status", "/health", "/v1/models"}
    policy = dataclasses.replace(POLICY, api_key=b"k",
                                 route=lambda m, p: (200, ()) if p in routes else (404, ()))
    for path, open_ in (("/", True), ("/ui/", True), ("/ui/dashboard.js", True),
                        ("/health", True), ("/ui/api/status", False), ("/v1/models", False)):
        out = Gate(policy).feed(get(path.encode()))
        assert isinstance(out[0], Forward) is open_, path
        if not open_:
            assert out[0].rejection.status == 401
        keyed = Gate(policy).feed(get(path.encode(), extra=b"Authorization: Bearer k\r\n"))
        assert isinstance(keyed[0], Forward), path


def test_normalize_origin_folds_ascii_only() -> None:
    assert normalize_origin(" HTTP://Ok.Example/ ") == "http://ok.example"
    assert normalize_origin("\u00a0http://ok.example") != "http://ok.example"
    assert normalize_origin("\x1fhttp://ok.example") != "http://ok.example"
    # KELVIN SIGN lowers to an ASCII 'k' under str.lower(): it must not match.
    assert normalize_origin("http://\u212ait.example") != "http://kit.example"


# --------------------------------------------------------------------------- Host ports


@pytest.mark.parametrize("host", [b"localhost:99999", b"localhost:65536", b"[::1]:70000",
                                  b"127.0.0.1:" + b"9" * 30, b"localhost:+80",
                                  b"localhost:8o"])
def test_host_port_out_of_range_is_refused(host: bytes) -> None:
    assert refused(get(host=host)) == 400


@pytest.mark.parametrize("host", [b"localhost:", b"localhost:0", b"localhost:65535",
                                  b"localhost:065535", b"[::1]:1", b"127.0.0.1:" + b"0" * 40
                                  + b"80"])
def test_host_port_in_range_is_accepted(host: bytes) -> None:
    forwarded(get(host=host))


# --------------------------------------------------------------------------- absolute-form


@pytest.mark.parametrize(("target", "origin_form"), [
    (b"http://localhost/health", b"/health"),
    (b"HTTP://LOCALHOST/health", b"/health"),
    (b"hTtP://localhost:9999/health?x=1", b"/health?x=1"),
    (b"http://127.0.0.1:1/health", b"/health"),
    (b"http://[::1]/health", b"/health"),
    (b"http://localhost:/health", b"/health"),
])
def test_absolute_form_is_forwarded_in_origin_form(target: bytes, origin_form: bytes) -> None:
    request = forwarded(get(target, extra=b"X-A: 1\r\n"))
    assert request.startswith(b"GET " + origin_form + b" HTTP/1.1\r\n"), request


def test_absolute_form_without_path_is_the_root() -> None:
    """``http://localhost`` and ``http://localhost?q`` name ``/`` (404 here: no such route)."""
    for target in (b"http://localhost", b"http://localhost?q=1"):
        out = feed(get(target))
        assert isinstance(out[0], Reply) and out[0].rejection is not None
        assert out[0].rejection.status == 404
        assert "URL: GET /." in out[0].rejection.message


def test_absolute_form_authority_replaces_the_host_header() -> None:
    """RFC 9112 3.2.2: the target's authority wins; the Host header is ignored (but must
    be there and well formed)."""
    request = forwarded(get(b"http://localhost:8080/health", host=b"evil.example"))
    lines = request.split(b"\r\n")
    assert lines[0] == b"GET /health HTTP/1.1"
    assert [line for line in lines if line.lower().startswith(b"host:")] == [
        b"Host: localhost:8080"]
    assert refused(get(b"http://evil.example/health")) == 421
    assert refused(get(b"http://evil.example:80/health", host=b"localhost")) == 421


@pytest.mark.parametrize(("target", "host"), [
    (b"http://localhost/health", None),  # HTTP/1.1 still needs a Host header
    (b"http://localhost/health", b"local host"),  # ... a valid one
    (b"http://localhost/health", b"localhost:99999"),
    (b"https://localhost/health", b"localhost"),  # plain HTTP is served here
    (b"ftp://localhost/health", b"localhost"),
    (b"http:///health", b"localhost"),  # an http URI needs a host
    (b"http://user@localhost/health", b"localhost"),  # no userinfo
    (b"http://localhost:99999/health", b"localhost"),
    (b"http://loc\x7fhost/health", b"localhost"),
    (b"http://localhost/health#frag", b"localhost"),
    (b"http:/localhost/health", b"localhost"),
    (b"http://localhost\\@evil/health", b"localhost"),
])
def test_bad_absolute_form_is_refused(target: bytes, host: bytes | None) -> None:
    assert refused(get(target, host=host)) == 400


def test_absolute_form_http10_needs_no_host() -> None:
    out = Gate(POLICY).feed(b"GET http://localhost/health HTTP/1.0\r\n\r\n")
    assert isinstance(out[0], Forward)
    assert out[0].render().startswith(b"GET /health HTTP/1.0\r\n")


# --------------------------------------------------------------------------- real server

KEY = "sk-headers"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("headers"), config=f"""
[server]
api_key = "{KEY}"
allowed_origins = ["{GOOD}"]
""")
    yield proc
    proc.stop()


def _chat(rid: bytes, *, max_tokens: int = 2, stream: bool = False,
          target: bytes = b"/v1/chat/completions") -> bytes:
    body = json.dumps({"messages": [{"role": "user", "content": "Hi."}],
                       "max_tokens": max_tokens, "stream": stream}).encode()
    return (b"POST " + target + b" HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer "
            + KEY.encode() + b"\r\nContent-Type: application/json\r\nX-Request-ID: " + rid
            + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


@pytest.mark.parametrize("lead", [b"\xc2\xa0", b"\xe2\x80\xa9", b"\xc2\x85", b"\xe3\x80\x80"])
def test_request_id_keeps_a_leading_unicode_space(srv: ServerProcess, lead: bytes) -> None:
    """Sanic's own parser lstrips every Unicode space: the id would have become 'abc'."""
    response, _ = exchange(srv.port, _chat(lead + b"abc"), "POST", wait=0.01)
    error = check_error(response, 400, "invalid_value")
    assert error["param"] == "X-Request-ID"
    assert response.headers.get("x-request-id") != "abc"
    response, _ = exchange(srv.port, _chat(b"abc"), "POST", wait=0.01)
    assert response.status == 200 and response.headers["x-request-id"] == "abc"


def test_cancel_of_a_plain_id_does_not_hit_the_spaced_one(srv: ServerProcess) -> None:
    cancel = (b"POST /v1/chat/completions/victim/cancel HTTP/1.1\r\nHost: localhost\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nConnection: close\r\n\r\n")
    with RawConn(srv.port, timeout=30) as conn:
        conn.send(_chat(b"\xc2\xa0victim", max_tokens=3000, stream=True))
        head = conn.read_interim(timeout=30)  # the response head only: it may be streaming
        # While it would still be streaming, a cancel for 'victim' must find nothing.
        response, _ = exchange(srv.port, cancel, "POST")
        assert response.status == 404 and response.json()["cancelled"] is False
        assert b"x-request-id: victim\r\n" not in head.lower() + b"\r\n"
        assert head.startswith(b"HTTP/1.1 400"), head


@pytest.mark.parametrize("lead", [b"\xc2\xa0", b"\xa0", b"\x85", b"\xe2\x80\xa9"])
def test_spaced_origin_is_refused(srv: ServerProcess, lead: bytes) -> None:
    raw = (b"GET /health HTTP/1.1\r\nHost: localhost\r\nOrigin: " + lead + GOOD.encode()
           + b"\r\nConnection: close\r\n\r\n")
    response, _ = exchange(srv.port, raw)
    check_error(response, 403, "origin_not_allowed")
    assert "access-control-allow-origin" not in response.headers
    ok, _ = exchange(srv.port, raw.replace(lead, b" \t"))
    assert ok.status == 200 and ok.headers["access-control-allow-origin"] == GOOD


def test_absolute_form_end_to_end(srv: ServerProcess) -> None:
    with RawConn(srv.port) as conn:
        conn.send(b"GET http://localhost/health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert conn.read_response().status == 200
        conn.send(_chat(b"abs-1", target=b"HTTP://127.0.0.1:1/v1/chat/completions"))
        response = conn.read_response("POST")
        assert response.status == 200, response.body
        assert response.json()["object"] == "chat.completion"
        conn.send(b"GET http://localhost:99999/health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        check_error(conn.read_response(), 400, "malformed_request")
        assert conn.closed()


def test_host_port_out_of_range_end_to_end(srv: ServerProcess) -> None:
    response, closed = exchange(srv.port, b"GET /health HTTP/1.1\r\nHost: localhost:99999"
                                          b"\r\n\r\n")
    check_error(response, 400, "malformed_request")
    assert closed


def test_an_apps_own_origin_reaches_the_api_and_may_read_it(srv: ServerProcess) -> None:
    """An Obsidian plugin's request (``app://obsidian.md``) is preflighted, answered by a
    handler (Sanic's CORS middleware) and by a direct answer, each with its CORS headers,
    though ``allowed_origins`` names only a web origin; a ``null`` origin still is not."""
    app = b"app://obsidian.md"
    preflight, _ = exchange(srv.port, b"OPTIONS /api/chat HTTP/1.1\r\nHost: localhost\r\n"
                            b"Origin: " + app + b"\r\nAccess-Control-Request-Method: POST\r\n"
                            b"Connection: close\r\n\r\n")
    assert preflight.status == 204
    assert preflight.headers["access-control-allow-origin"] == app.decode()
    body = json.dumps({"model": "demo", "prompt": "Hi", "stream": False,
                       "options": {"num_predict": 1}}).encode()
    for raw in (b"POST /api/generate HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer "
                + KEY.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode() + b"\r\nOrigin: " + app
                + b"\r\nConnection: close\r\n\r\n" + body,
                b"GET /health HTTP/1.1\r\nHost: localhost\r\nOrigin: " + app
                + b"\r\nConnection: close\r\n\r\n"):
        answer, _ = exchange(srv.port, raw)
        assert answer.status == 200, raw
        assert answer.headers["access-control-allow-origin"] == app.decode()
    null, _ = exchange(srv.port, b"GET /health HTTP/1.1\r\nHost: localhost\r\nOrigin: null"
                       b"\r\nConnection: close\r\n\r\n")
    check_error(null, 403, "origin_not_allowed")
