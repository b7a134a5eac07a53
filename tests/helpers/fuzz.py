"""A gate policy over a small fixed route table, with no server behind it: the property
tests over request heads (tests/server/test_fuzz_heads.py) and the header tests
(tests/server/test_gate_headers.py) feed it bytes directly."""

from __future__ import annotations

import dataclasses
import re

from afmd.http.sansio.screen import GatePolicy

ROUTES = {
    "/v1/chat/completions": ("POST",),
    "/chat/completions": ("POST",),
    "/v1/models": ("GET",),
    "/health": ("GET",),
}


def _route(method: str, path: str) -> tuple[int, tuple[str, ...]]:
    if path.startswith("/v1/models/"):
        allowed: tuple[str, ...] = ("GET",)
    elif re.fullmatch(r"/v1/chat/completions/[^/]+/cancel", path):
        allowed = ("POST",)
    elif path in ROUTES:
        allowed = ROUTES[path]
    else:
        return 404, ()
    return (200, ()) if method in allowed else (405, allowed)


POLICY = GatePolicy(route=_route, api_key=b"", max_header_bytes=1024, max_body_bytes=512,
                    allowed_origins=frozenset({"http://ok.example"}))
DIRECT_POLICY = dataclasses.replace(POLICY, direct_paths=frozenset({"/health", "/v1/models"}))
