"""A client that speaks HTTP/1.1 by hand over a raw socket, for tests that need to see
exactly what the server puts on the wire (interim responses, framing, closes), which an
HTTP library would hide or normalise."""

from __future__ import annotations

import contextlib
import json
import socket
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Response:
    status: int
    reason: str
    headers: dict[str, str]
    header_list: list[tuple[str, str]]
    body: bytes
    interim: list[int] = field(default_factory=list)

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def code(self) -> str:
        return self.json()["error"]["code"]


class RawConn:
    """A socket speaking HTTP/1.1 by hand, reading exactly one response at a time."""

    def __init__(self, port: int | None = None, unix: str | None = None,
                 timeout: float = 10.0) -> None:
        if unix is not None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(unix)
        else:
            assert port is not None
            self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.settimeout(timeout)
        self.buf = b""
        self.eof = False

    def __enter__(self) -> RawConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def send(self, data: bytes | str) -> None:
        self.sock.sendall(data.encode("latin-1") if isinstance(data, str) else data)

    def _fill(self) -> bool:
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            data = b""
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    def _until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            if not self._fill():
                raise AssertionError(f"connection closed before {marker!r}; got {self.buf!r}")
        part, _, self.buf = self.buf.partition(marker)
        return part

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise AssertionError(f"connection closed after {len(self.buf)}/{n} bytes")
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def read_interim(self, timeout: float = 3.0) -> bytes:
        """Wait for a 1xx head (e.g. ``100 Continue``) and return it."""
        old = self.sock.gettimeout()
        self.sock.settimeout(timeout)
        try:
            head = self._until(b"\r\n\r\n")
        finally:
            self.sock.settimeout(old)
        return head

    def read_response(self, method: str = "GET") -> Response:
        interim: list[int] = []
        while True:
            head = self._until(b"\r\n\r\n").decode("latin-1")
            status_line, *lines = head.split("\r\n")
            version, status_text, *reason = status_line.split(" ", 2)
            assert version == "HTTP/1.1", status_line
            status = int(status_text)
            header_list = []
            for line in lines:
                name, _, value = line.partition(":")
                header_list.append((name.strip().lower(), value.strip()))
            headers: dict[str, str] = {}
            for name, value in header_list:
                headers[name] = f"{headers[name]}, {value}" if name in headers else value
            if 100 <= status < 200:
                assert not lines or lines == [""], f"1xx with headers: {head!r}"
                interim.append(status)
                continue
            if status in (204, 304) or method == "HEAD":
                body = b""
            elif "content-length" in headers:
                body = self._exactly(int(headers["content-length"]))
            elif headers.get("transfer-encoding") == "chunked":
                parts = []
                while True:
                    size = int(self._until(b"\r\n"), 16)
                    if size == 0:
                        self._until(b"\r\n")
                        break
                    parts.append(self._exactly(size))
                    assert self._exactly(2) == b"\r\n"
                body = b"".join(parts)
            else:
                while self._fill():
                    pass
                body, self.buf = self.buf, b""
            return Response(status, reason[0] if reason else "", headers, header_list, body,
                            interim)

    def closed(self, timeout: float = 5.0) -> bool:
        """True when the server closes the connection (EOF) with nothing more to read."""
        if self.buf:
            return False
        if self.eof:
            return True
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
        if data:
            self.buf += data
            return False
        self.eof = True
        return True


def exchange(port: int, raw: bytes | str, method: str = "GET",
             wait: float = 5.0) -> tuple[Response, bool]:
    """One request on a fresh connection: the response, and whether the server closed."""
    with RawConn(port) as conn:
        conn.send(raw)
        response = conn.read_response(method)
        return response, conn.closed(timeout=wait)


def check_error(response: Response, status: int, code: str) -> dict[str, Any]:
    assert response.status == status, (response.status, response.body)
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code, error
    message = error["message"]
    assert message[:1].isupper() and " " in message and "\n" not in message, message
    return error


def chat_body(**fields: Any) -> bytes:
    payload = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2, **fields}
    return json.dumps(payload).encode()
