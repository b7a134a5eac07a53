"""The one HTTP client every server is driven with: raw asyncio streams, no dependencies.

A small hand-written HTTP/1.1 client keeps the client's own cost per token low and the
same for every server (the client shares the CPU with the server under test). It speaks
what both servers answer: ``Transfer-Encoding: chunked`` (afmd/Sanic), ``Content-Length``,
and body-until-close (``mlx_lm.server`` is an HTTP/1.0 ``BaseHTTPRequestHandler``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

perf = time.perf_counter


class HTTPError(Exception):
    pass


@dataclass(slots=True)
class StreamResult:
    """What one streamed chat completion looked like from the client's side."""

    status: int = 0
    error: str | None = None
    t_send: float = 0.0  # just before the request bytes were written
    t_first: float = 0.0  # first delta carrying content, reasoning or a tool call
    t_last: float = 0.0  # last such delta
    t_end: float = 0.0  # the stream ended ([DONE] or EOF)
    chunks: int = 0  # SSE events with a non-empty delta
    reads: int = 0  # socket reads that carried body bytes
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    text_parts: list[str] = field(default_factory=list)
    tool_args: list[str] = field(default_factory=list)
    profile: dict[str, Any] | None = None  # afmd's X-AFM-Profile event, when asked for

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and self.t_first > 0

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def tokens(self) -> int:
        """completion_tokens from the usage chunk; else one per content chunk."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return self.chunks

    @property
    def ttft(self) -> float:
        return self.t_first - self.t_send

    @property
    def decode_tps(self) -> float | None:
        """Tokens after the first over the time between first and last delta."""
        span = self.t_last - self.t_first
        if self.tokens < 2 or span <= 0:
            return None
        return (self.tokens - 1) / span

    @property
    def stream_tps(self) -> float | None:
        """Tokens over the time from sending the request to the last delta."""
        span = self.t_last - self.t_send
        return self.tokens / span if span > 0 and self.tokens else None

    @property
    def e2e_tps(self) -> float | None:
        span = self.t_end - self.t_send
        return self.tokens / span if span > 0 and self.tokens else None


def _parse_head(head: bytes) -> tuple[int, dict[str, str], bytes]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        raise HTTPError(f"bad status line {lines[0]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return int(parts[1]), headers, parts[0].encode()


async def _body_pieces(reader: asyncio.StreamReader, headers: dict[str, str]):
    """Yield the response body as it arrives, whatever its framing."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            line = await reader.readuntil(b"\r\n")
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                # Trailers (none expected) end with an empty line.
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    elif "content-length" in headers:
        remaining = int(headers["content-length"])
        while remaining > 0:
            data = await reader.read(min(remaining, 1 << 16))
            if not data:
                raise HTTPError("connection closed inside the body")
            remaining -= len(data)
            yield data
    else:
        while True:
            data = await reader.read(1 << 16)
            if not data:
                return
            yield data


def _request_bytes(method: str, host: str, port: int, path: str, body: bytes | None,
                   extra: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    for k, v in (extra or {}).items():
        lines.append(f"{k}: {v}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


async def request(host: str, port: int, method: str, path: str, body: Any = None,
                  timeout: float = 30.0) -> tuple[int, Any]:
    """One plain request; the JSON body (or raw bytes when it is not JSON)."""
    payload = orjson.dumps(body) if body is not None else None
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(_request_bytes(method, host, port, path, payload))
            status, headers, _ = _parse_head(await reader.readuntil(b"\r\n\r\n"))
            data = b"".join([p async for p in _body_pieces(reader, headers)])
        finally:
            writer.close()
    try:
        return status, orjson.loads(data)
    except orjson.JSONDecodeError:
        return status, data


def _handle_event(res: StreamResult, obj: dict[str, Any], now: float) -> None:
    if obj.get("error"):
        err = obj["error"]
        res.error = str(err.get("message", err) if isinstance(err, dict) else err)
        return
    for choice in obj.get("choices") or ():
        delta = choice.get("delta") or {}
        content = delta.get("content")
        calls = delta.get("tool_calls")
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if content or calls or reasoning:
            if not res.t_first:
                res.t_first = now
            res.t_last = now
            res.chunks += 1
            if content:
                res.text_parts.append(content)
            for call in calls or ():
                args = (call.get("function") or {}).get("arguments")
                if args:
                    res.tool_args.append(args)
        if choice.get("finish_reason"):
            res.finish_reason = choice["finish_reason"]
    if "afm_profile" in obj:
        res.profile = obj["afm_profile"]
    usage = obj.get("usage")
    if usage:
        res.completion_tokens = usage.get("completion_tokens")
        res.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        res.cached_tokens = details.get("cached_tokens")


async def stream_chat(host: str, port: int, body: dict[str, Any], *,
                      path: str = "/v1/chat/completions", timeout: float = 300.0,
                      headers: dict[str, str] | None = None) -> StreamResult:
    """One streamed chat completion on a fresh connection, timed from the client."""
    res = StreamResult()
    payload = orjson.dumps(body)
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                data = _request_bytes("POST", host, port, path, payload,
                                      {"Accept": "text/event-stream", **(headers or {})})
                res.t_send = perf()
                writer.write(data)
                status, headers, _ = _parse_head(await reader.readuntil(b"\r\n\r\n"))
                res.status = status
                buf = b""
                done = False
                async for piece in _body_pieces(reader, headers):
                    now = perf()
                    res.reads += 1
                    buf += piece
                    if status != 200:
                        continue
                    while not done:
                        i = buf.find(b"\n\n")
                        if i < 0:
                            break
                        event, buf = buf[:i], buf[i + 2:]
                        for line in event.split(b"\n"):
                            if not line.startswith(b"data:"):
                                continue  # comments (": keepalive") and other fields
                            data = line[5:].strip()
                            if data == b"[DONE]":
                                done = True
                                break
                            _handle_event(res, orjson.loads(data), now)
                    if done:
                        break
                res.t_end = perf()
                if status != 200:
                    res.error = f"HTTP {status}: {buf[:300].decode('utf-8', 'replace')}"
                elif not done and res.error is None:
                    res.error = "stream ended without [DONE]"
            finally:
                writer.close()
    except TimeoutError:
        res.error = f"timed out after {timeout:.0f} s"
    except (OSError, HTTPError, asyncio.IncompleteReadError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    if not res.t_end:
        res.t_end = perf()
    return res


# -- requests per second ---------------------------------------------------------------


class _Counter:
    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.ok = 0
        self.errors = 0
        self.connects = 0
        self.open = 0
        self.transports: set[asyncio.BaseTransport] = set()
        self.closed = asyncio.get_running_loop().create_future()


class _Hammer(asyncio.Protocol):
    """One connection sending a request as soon as the previous answer is complete."""

    def __init__(self, request_bytes: bytes, counter: _Counter, restart: Any) -> None:
        self._req = request_bytes
        self._c = counter
        self._restart = restart
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self._until_close = False
        self._status = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._c.connects += 1
        self._c.transports.add(transport)
        self._send()

    def _send(self) -> None:
        assert self._transport is not None
        if perf() >= self._c.deadline:
            self._transport.close()
            return
        self._transport.write(self._req)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if self._until_close:
            return
        while True:
            i = self._buf.find(b"\r\n\r\n")
            if i < 0:
                return
            head = bytes(self._buf[:i]).lower()
            status = int(head[9:12]) if head[:5] == b"http/" else 0
            pos = head.find(b"\ncontent-length:")
            if pos < 0:
                # No length: the body ends when the server closes the connection.
                self._until_close = True
                self._status = status
                return
            end = head.find(b"\r", pos + 1)
            length = int(head[pos + 16:end if end > 0 else len(head)])
            total = i + 4 + length
            if len(self._buf) < total:
                return
            del self._buf[:total]
            if perf() <= self._c.deadline:
                if status == 200:
                    self._c.ok += 1
                else:
                    self._c.errors += 1
            closes = b"connection: close" in head or (
                head.startswith(b"http/1.0") and b"connection: keep-alive" not in head
            )
            if closes:
                assert self._transport is not None
                self._transport.close()
                return
            self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        self._c.transports.discard(self._transport)  # type: ignore[arg-type]
        if self._until_close and perf() <= self._c.deadline:
            if self._status == 200:
                self._c.ok += 1
            else:
                self._c.errors += 1
        self._restart()


async def hammer(host: str, port: int, path: str, *, connections: int = 32,
                 duration: float = 3.0) -> dict[str, Any]:
    """``connections`` keep-alive connections sending GET ``path`` back to back.

    A server that closes after each response (HTTP/1.0) is reconnected to, as any client
    would have to. Only responses completed within ``duration`` count.
    """
    loop = asyncio.get_running_loop()
    req = (f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: keep-alive\r\n"
           "Accept: application/json\r\n\r\n").encode()
    start = perf()
    counter = _Counter(start + duration)

    def restart() -> None:
        counter.open -= 1
        if perf() < counter.deadline:
            counter.open += 1
            task = loop.create_task(open_one())
            task.add_done_callback(_swallow)
        elif counter.open == 0 and not counter.closed.done():
            counter.closed.set_result(None)

    async def open_one() -> None:
        try:
            await loop.create_connection(lambda: _Hammer(req, counter, restart), host, port)
        except OSError:
            counter.errors += 1
            await asyncio.sleep(0.01)
            restart()

    for _ in range(connections):
        counter.open += 1
        task = loop.create_task(open_one())
        task.add_done_callback(_swallow)
    await asyncio.sleep(duration)
    elapsed = perf() - start
    # Connections still waiting for an answer are abandoned after a grace period.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(5.0):
            await counter.closed
    for transport in list(counter.transports):
        transport.close()
    return {
        "requests": counter.ok,
        "errors": counter.errors,
        "connects": counter.connects,
        "seconds": round(elapsed, 3),
        "rps": counter.ok / elapsed if elapsed > 0 else None,
    }


def _swallow(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()

