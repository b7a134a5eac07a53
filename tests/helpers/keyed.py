"""A stand-in for afmd with ``[server] api_key`` on a non-loopback listener, on loopback.

A real afmd shows /health's details to a loopback client without the key, so the answers a
client command gets from a keyed LAN listener cannot be had from a test server on 127.0.0.1.
This answers as afmd does there: ``GET /health`` without the right ``Authorization: Bearer``
key is the status alone (200 ``{"status": "ok"}``), with it the whole body; any other
request without it is afmd's 401 in OpenAI's envelope.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

KEY = "the-servers-key"

FULL_HEALTH = {"status": "ok", "models": {"demo": "available"}, "active_requests": 0,
               "queued_requests": 0, "model_details": {}}


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _keyed(self) -> bool:
        return self.headers.get("Authorization") == f"Bearer {KEY}"

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _refuse(self) -> None:
        sent = self.headers.get("Authorization")
        message = ("Incorrect API key provided." if sent else
                   "You didn't provide an API key.")
        self._answer(401, {"error": {"message": message, "type": "invalid_request_error",
                                     "param": None, "code": "invalid_api_key"}})

    def do_GET(self) -> None:
        if self.path == "/health":
            self._answer(200, FULL_HEALTH if self._keyed() else {"status": "ok"})
        elif self._keyed():
            self._answer(404, {"error": {"message": "not found"}})
        else:
            self._refuse()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self._keyed():
            self._answer(200, {"cleared": [], "disk_bytes": 0})
        else:
            self._refuse()

    do_DELETE = do_POST


@contextmanager
def keyed_afmd() -> Iterator[str]:
    """The stand-in's URL while the block runs."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
