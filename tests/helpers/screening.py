"""The screening and framing cases shared by the socket tests (tests/server/test_transport.py)
and the in-process gate tests (tests/unit/http/test_gate_tables.py): one table, so both see the same
requests and expect the same status and code.

Screening cases send a head announcing a body they never send; the answer must come
before it. The framing cases are requests that could smuggle or confuse, refused whole.
"""

from __future__ import annotations

KEY = "sk-transport-test"
GOOD_ORIGIN = "http://good.example"
AUTH = f"Authorization: Bearer {KEY}\r\n"
JSON_CT = "Content-Type: application/json\r\n"
CHAT = "/v1/chat/completions"
BODY_LIMIT = 4096
HEAD_LIMIT = 2048

SCREEN_CONFIG = f"""
[server]
api_key = "{KEY}"
allowed_origins = ["{GOOD_ORIGIN}"]
allowed_hosts = ["api.example"]
max_request_body_bytes = {BODY_LIMIT}
max_header_bytes = {HEAD_LIMIT}
"""


def _head(method: str = "POST", path: str = CHAT, *, host: str = "localhost",
          extra: str = AUTH + JSON_CT, length: int = 20, expect: bool = True) -> str:
    """A request head that announces a body (by default with Expect: 100-continue)."""
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{extra}"
    if length:
        head += f"Content-Length: {length}\r\n"
    if expect:
        head += "Expect: 100-continue\r\n"
    return head + "\r\n"


SCREENING = [
    # (id, head, status, code)
    ("host-foreign", _head(host="evil.example"), 421, "invalid_host"),
    ("host-foreign-port", _head(host="evil.example:80"), 421, "invalid_host"),
    ("host-lookalike", _head(host="localhost.evil.example"), 421, "invalid_host"),
    ("host-before-origin", _head(host="evil.example", extra=AUTH + JSON_CT
                                 + "Origin: http://evil.example\r\n"), 421, "invalid_host"),
    ("origin-foreign", _head(extra=AUTH + JSON_CT + "Origin: http://evil.example\r\n"),
     403, "origin_not_allowed"),
    ("origin-null", _head(extra=AUTH + JSON_CT + "Origin: null\r\n"), 403,
     "origin_not_allowed"),
    ("origin-before-route", _head(path="/v1/nope", extra="Origin: http://evil.example\r\n"),
     403, "origin_not_allowed"),
    ("route-unknown", _head(path="/v1/nope"), 404, "unknown_url"),
    # (an unknown route: /v1/completions is served now)
    ("route-before-auth", _head(path="/v1/engines/davinci/completions", extra=JSON_CT), 404,
     "unknown_url"),
    ("method-wrong", _head(method="PUT"), 405, "method_not_allowed"),
    ("method-before-auth", _head(method="DELETE", extra=""), 405, "method_not_allowed"),
    ("auth-missing", _head(extra=JSON_CT), 401, "invalid_api_key"),
    ("auth-wrong", _head(extra="Authorization: Bearer sk-wrong\r\n" + JSON_CT), 401,
     "invalid_api_key"),
    ("auth-prefix", _head(extra=f"Authorization: Bearer {KEY[:-1]}\r\n" + JSON_CT), 401,
     "invalid_api_key"),
    ("auth-not-bearer", _head(extra=f"Authorization: Basic {KEY}\r\n" + JSON_CT), 401,
     "invalid_api_key"),
    ("auth-models", _head(method="GET", path="/v1/models", extra="", length=0,
                          expect=False), 401, "invalid_api_key"),
    ("auth-root-chat", _head(path="/chat/completions", extra=JSON_CT), 401,
     "invalid_api_key"),
    ("auth-before-media", _head(extra="Content-Type: text/plain\r\n"), 401,
     "invalid_api_key"),
    ("media-text", _head(extra=AUTH + "Content-Type: text/plain\r\n"), 415,
     "unsupported_media_type"),
    ("media-missing", _head(extra=AUTH), 415, "unsupported_media_type"),
    ("media-form", _head(extra=AUTH + "Content-Type: application/x-www-form-urlencoded\r\n"),
     415, "unsupported_media_type"),
    ("media-before-size", _head(extra=AUTH + "Content-Type: text/plain\r\n",
                                length=BODY_LIMIT + 1), 415, "unsupported_media_type"),
    # A compressed body would reach the JSON parser as bytes it cannot read (RFC 7694: 415,
    # and Accept-Encoding says what is read).
    ("encoding-gzip", _head(extra=AUTH + JSON_CT + "Content-Encoding: gzip\r\n"), 415,
     "unsupported_media_type"),
    ("encoding-listed", _head(extra=AUTH + JSON_CT + "Content-Encoding: identity, br\r\n"),
     415, "unsupported_media_type"),
    ("encoding-before-media", _head(extra=AUTH + "Content-Encoding: zstd\r\n"), 415,
     "unsupported_media_type"),
    ("body-too-large", _head(length=BODY_LIMIT + 1), 413, "malformed_request"),
    ("body-huge", _head(length=10**30), 413, "malformed_request"),
    ("cancel-too-large", _head(path=f"{CHAT}/abc/cancel", length=BODY_LIMIT + 1), 413,
     "malformed_request"),
]


H = "Host: localhost\r\n"
GET = "GET /health HTTP/1.1\r\n"
POST_HEAD = f"POST {CHAT} HTTP/1.1\r\n{H}{AUTH}{JSON_CT}"
CHUNKED = POST_HEAD + "Transfer-Encoding: chunked\r\n\r\n"

MALFORMED = [
    # (id, raw request, status)
    ("cl-and-te", POST_HEAD + "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
     "0\r\n\r\n", 400),
    ("te-and-cl", POST_HEAD + "Transfer-Encoding: chunked\r\nContent-Length: 0\r\n\r\n", 400),
    ("cl-repeated-same", POST_HEAD + "Content-Length: 2\r\nContent-Length: 2\r\n\r\n{}", 400),
    ("cl-conflicting", POST_HEAD + "Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400),
    ("cl-list", POST_HEAD + "Content-Length: 2, 2\r\n\r\n{}", 400),
    ("cl-plus", POST_HEAD + "Content-Length: +2\r\n\r\n{}", 400),
    ("cl-minus", POST_HEAD + "Content-Length: -2\r\n\r\n{}", 400),
    ("cl-hex", POST_HEAD + "Content-Length: 0x2\r\n\r\n{}", 400),
    ("cl-underscore", POST_HEAD + "Content-Length: 1_0\r\n\r\n{}", 400),
    ("cl-fullwidth", (POST_HEAD + "Content-Length: ").encode() + "２".encode()
     + b"\r\n\r\n{}", 400),
    ("cl-empty", POST_HEAD + "Content-Length:\r\n\r\n", 400),
    ("space-before-colon", GET + "Host : localhost\r\n\r\n", 400),
    ("tab-before-colon", GET + H + "X-A\t: 1\r\n\r\n", 400),
    ("obs-fold", GET + H + "X-A: 1\r\n 2\r\n\r\n", 400),
    ("obs-fold-tab", GET + H + "X-A: 1\r\n\t2\r\n\r\n", 400),
    ("obs-fold-colon", GET + H + "X-A: 1\r\n X-B: 2\r\n\r\n", 400),
    ("nul-in-value", GET + H + "X-A: a\x00b\r\n\r\n", 400),
    ("cr-in-value", GET + H + "X-A: a\rb\r\n\r\n", 400),
    ("lf-in-value", GET + H + "X-A: a\nb\r\n\r\n", 400),
    ("nul-in-name", GET + H + "X-\x00A: 1\r\n\r\n", 400),
    ("cr-in-name", GET + H + "X\r-A: 1\r\n\r\n", 400),
    ("no-colon", GET + H + "X-A\r\n\r\n", 400),
    ("empty-name", GET + H + ": 1\r\n\r\n", 400),
    ("bare-lf-lines", "GET /health HTTP/1.1\nHost: localhost\n\n", 400),
    ("host-missing", GET + "\r\n", 400),
    ("host-duplicate", GET + H + H + "\r\n", 400),
    ("host-duplicate-foreign", GET + H + "Host: evil.example\r\n\r\n", 400),
    ("host-invalid", GET + "Host: local host\r\n\r\n", 400),
    ("host-userinfo", GET + "Host: user@localhost\r\n\r\n", 400),
    ("host-port-out-of-range", GET + "Host: localhost:99999\r\n\r\n", 400),
    ("host-port-sign", GET + "Host: localhost:-1\r\n\r\n", 400),
    ("ctl-in-value", GET + H + "X-A: \x1fa\r\n\r\n", 400),
    ("vt-in-value", GET + H + "X-A: \x0ba\r\n\r\n", 400),
    ("chunk-plus", CHUNKED + "+2\r\n{}\r\n0\r\n\r\n", 400),
    ("chunk-minus-zero", CHUNKED + "-0\r\n\r\n", 400),
    ("chunk-0x", CHUNKED + "0x2\r\n{}\r\n0\r\n\r\n", 400),
    ("chunk-fullwidth", CHUNKED.encode() + "２".encode() + b"\r\n{}\r\n0\r\n\r\n", 400),
    ("chunk-leading-space", CHUNKED + " 2\r\n{}\r\n0\r\n\r\n", 400),
    ("chunk-trailing-space", CHUNKED + "2 \r\n{}\r\n0\r\n\r\n", 400),
    ("chunk-empty-size", CHUNKED + "\r\n{}\r\n0\r\n\r\n", 400),
    ("chunk-underscore", CHUNKED + "1_0\r\n", 400),
    ("chunk-no-crlf-after-data", CHUNKED + "2\r\n{}XX0\r\n\r\n", 400),
    ("chunk-lf-after-data", CHUNKED + "2\r\n{}\n0\r\n\r\n", 400),
    ("chunk-bare-lf-size", CHUNKED + "2\n{}\r\n0\r\n\r\n", 400),
    ("chunk-trailer-fold", CHUNKED + "2\r\n{}\r\n0\r\nX-T: 1\r\n 2\r\n\r\n", 400),
    ("chunk-trailer-nul", CHUNKED + "2\r\n{}\r\n0\r\nX-T: \x00\r\n\r\n", 400),
    ("te-http10", f"POST {CHAT} HTTP/1.0\r\n{H}{AUTH}{JSON_CT}"
     "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    ("te-empty", POST_HEAD + "Transfer-Encoding:\r\n\r\n", 400),
    ("te-gzip", POST_HEAD + "Transfer-Encoding: gzip\r\n\r\n", 501),
    ("te-gzip-chunked", POST_HEAD + "Transfer-Encoding: gzip, chunked\r\n\r\n", 501),
    ("te-chunked-twice", POST_HEAD + "Transfer-Encoding: chunked\r\n"
     "Transfer-Encoding: chunked\r\n\r\n", 501),
    ("te-identity", POST_HEAD + "Transfer-Encoding: identity\r\n\r\n", 501),
    ("te-chunked-suffix", POST_HEAD + "Transfer-Encoding: chunkedx\r\n\r\n", 501),
    ("version-lower", "GET /health http/1.1\r\n" + H + "\r\n", 400),
    ("version-letters", "GET /health HTTP/1.x\r\n" + H + "\r\n", 400),
    ("version-fullwidth", b"GET /health HTTP/" + "１".encode() + b".1\r\n"
     + H.encode() + b"\r\n", 400),
    ("version-no-minor", "GET /health HTTP/1\r\n" + H + "\r\n", 400),
    ("version-long", "GET /health HTTP/1.10\r\n" + H + "\r\n", 400),
    ("version-https", "GET /health HTTPS/1.1\r\n" + H + "\r\n", 400),
    ("request-line-extra-space", "GET  /health HTTP/1.1\r\n" + H + "\r\n", 400),
    ("request-line-tab", "GET\t/health HTTP/1.1\r\n" + H + "\r\n", 400),
    ("request-line-short", "GET /health\r\n" + H + "\r\n", 400),
    ("target-absolute-https", "GET https://localhost/health HTTP/1.1\r\n" + H + "\r\n", 400),
    ("target-absolute-userinfo", "GET http://u@localhost/health HTTP/1.1\r\n" + H + "\r\n",
     400),
    ("target-absolute-port", "GET http://localhost:65536/health HTTP/1.1\r\n" + H + "\r\n",
     400),
    ("target-absolute-no-host-header", "GET http://localhost/health HTTP/1.1\r\n\r\n", 400),
    ("target-non-ascii", b"GET /health" + "é".encode() + b" HTTP/1.1\r\n"
     + H.encode() + b"\r\n", 400),
    ("method-not-token", "G(T /health HTTP/1.1\r\n" + H + "\r\n", 400),
    ("head-too-large", GET + H + "X-Big: " + "a" * HEAD_LIMIT + "\r\n\r\n", 431),
    ("head-too-large-unterminated", GET + H + "X-Big: " + "a" * (HEAD_LIMIT + 10), 431),
    ("trailer-too-large", CHUNKED + "2\r\n{}\r\n0\r\nX-Big: " + "a" * HEAD_LIMIT
     + "\r\n\r\n", 431),
    ("chunked-too-large", CHUNKED + f"{BODY_LIMIT:x}\r\n" + "a" * BODY_LIMIT + "\r\n"
     "1\r\na\r\n0\r\n\r\n", 413),
    ("chunk-size-huge", CHUNKED + "f" * 40 + "\r\n", 413),
    ("expect-unknown", POST_HEAD + "Content-Length: 2\r\nExpect: 200-ok\r\n\r\n", 417),
    ("version-2", "GET /health HTTP/2.0\r\n" + H + "\r\n", 505),
]

CODES = {400: "malformed_request", 413: "malformed_request", 417: "malformed_request",
         431: "malformed_request", 501: "malformed_request", 505: "malformed_request"}
