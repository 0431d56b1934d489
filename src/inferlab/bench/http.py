"""A minimal HTTP/1.1 client for the measuring path: keep-alive connections as asyncio Protocols that stamp each
block of bytes in data_received, before anything else runs.

Why not aiohttp here: its stream reader wakes a coroutine for every chunk, which at hundreds of streams costs
more CPU than the rest of the client and delays every stamp behind a queue of task switches. Here a chunk costs
one callback: stamp, de-chunk, split SSE events, hand them on. aiohttp still does the once-per-run calls
(GET /v1/models, /metrics). Plain HTTP/1.1 and HTTPS only; no proxies, no redirects, no compression.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_mod
import time
from collections import deque
from typing import Callable
from urllib.parse import urlsplit


class HTTPError(Exception):
    """The connection failed or the response could not be read; `kind` names the fault."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class Exchange:
    """One request's response, parsed as bytes arrive. `on_event(t, data)` gets each SSE event's data of a
    200 text/event-stream response as soon as its terminating blank line arrives, and returns an HTTPError to
    reject it (the response then fails with that error); any other body is kept whole in `body`."""

    __slots__ = ("on_event", "head", "done", "status", "headers", "body", "sse", "_buf", "_chunked", "_left",
                 "_in_body", "_sse_buf", "keep_alive", "last_t")

    def __init__(self, loop: asyncio.AbstractEventLoop, on_event: Callable[[float, bytes], HTTPError | None] | None):
        self.on_event = on_event
        self.head: asyncio.Future = loop.create_future()
        self.done: asyncio.Future = loop.create_future()
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.sse = False
        self._buf = b""
        self._chunked = False
        self._left: int | None = None  # bytes left in the current chunk, or of a Content-Length body
        self._in_body = False
        self._sse_buf = b""
        self.keep_alive = True
        self.last_t = 0.0

    def feed(self, t: float, data: bytes) -> None:
        self.last_t = t
        buf = self._buf + data if self._buf else data
        self._buf = b""
        if not self._in_body:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self._buf = buf
                return
            self._head(buf[:end])
            buf = buf[end + 4:]
            if self.done.done():
                return
        if self._chunked:
            self._dechunk(t, buf)
        elif self._left is not None:
            take = buf[: self._left]
            self._left -= len(take)
            self._payload(t, take)
            if self._left == 0:
                self._finish()
        else:  # body until the connection closes
            self._payload(t, buf)

    def _head(self, raw: bytes) -> None:
        lines = raw.decode("latin-1").split("\r\n")
        try:
            self.status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            return self.fail(HTTPError("malformed_response", f"not an HTTP status line: {lines[0][:80]!r}"))
        for line in lines[1:]:
            k, _, v = line.partition(":")
            self.headers[k.strip().lower()] = v.strip()
        self._in_body = True
        self.keep_alive = self.headers.get("connection", "").lower() != "close"
        self.sse = self.status == 200 and "text/event-stream" in self.headers.get("content-type", "")
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            self._chunked, self._left = True, None
        elif "content-length" in self.headers:
            self._left = int(self.headers["content-length"])
        else:
            self.keep_alive = False
        if not self.head.done():
            self.head.set_result(self.status)
        if self._left == 0 and not self._chunked:
            self._finish()

    def _dechunk(self, t: float, buf: bytes) -> None:
        pos, n = 0, len(buf)
        while pos < n:
            if self._left == -1:  # trailers: read lines until the empty one, so no byte is left on the socket
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    self._buf = buf[pos:]
                    return
                if eol == pos:
                    return self._finish()
                pos = eol + 2
                continue
            if self._left is None:  # expecting a chunk-size line
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    self._buf = buf[pos:]
                    return
                try:
                    size = int(buf[pos:eol].split(b";", 1)[0], 16)
                except ValueError:
                    return self.fail(HTTPError("malformed_response", f"bad chunk size {buf[pos:eol][:20]!r}"))
                pos = eol + 2
                if size == 0:
                    self._left = -1  # the last chunk: trailer lines follow, up to an empty line
                    continue
                self._left = size + 2  # the chunk and its CRLF
            take = min(self._left, n - pos)
            part = buf[pos: pos + min(take, max(self._left - 2, 0))]  # the chunk's bytes, not its CRLF
            self._left -= take
            pos += take
            self._payload(t, part)
            if self.done.done():
                return
            if self._left == 0:
                self._left = None

    def _payload(self, t: float, data: bytes) -> None:
        if not data:
            return
        if not self.sse:
            self.body += data
            return
        buf = self._sse_buf + data if self._sse_buf else data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        start = 0
        while True:
            cut = buf.find(b"\n\n", start)
            if cut < 0:
                break
            event = buf[start:cut]
            start = cut + 2
            if event.startswith(b"data:") and b"\n" not in event:
                err = self.on_event(t, event[5:].strip())
            else:
                parts = [ln[5:].strip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
                err = self.on_event(t, b"\n".join(parts)) if parts else None
            if err is not None:  # the handler rejected the event: stop reading this response
                return self.fail(err)
        self._sse_buf = buf[start:]

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(True)

    def fail(self, exc: Exception) -> None:
        self.keep_alive = False
        # Marked as retrieved: a caller may stop at either future; awaiting one still raises.
        if not self.head.done():
            self.head.set_exception(exc)
            self.head.exception()
        if not self.done.done():
            self.done.set_exception(exc)
            self.done.exception()

    def closed(self) -> None:
        """The connection closed: the end of a body read until close, else a dropped connection."""
        if self._in_body and not self._chunked and self._left is None:
            self._finish()
        else:
            self.fail(HTTPError("connection_dropped", "the server closed the connection before the response ended"))


class _Conn(asyncio.Protocol):
    __slots__ = ("pool", "transport", "exchange", "alive", "reused")

    def __init__(self, pool: "Pool"):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.alive = True
        self.reused = False  # carried an earlier response: the server may have closed it as we wrote

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        t = time.perf_counter()  # first: this is the arrival time of every event completed by `data`
        ex = self.exchange
        if ex is None:
            self.transport.close()  # bytes nobody asked for: the connection cannot be trusted
            return
        ex.feed(t, data)

    def connection_lost(self, exc) -> None:
        self.alive = False
        if self.exchange is not None:
            self.exchange.closed()


class Pool:
    """Keep-alive connections to one origin; a connection carries one request at a time."""

    def __init__(self, base_url: str):
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https"):
            raise ValueError(f"{base_url}: only http:// and https:// URLs are supported")
        self.host = u.hostname or "localhost"
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl = ssl_mod.create_default_context() if u.scheme == "https" else None
        self.host_header = u.netloc
        self.prefix = u.path.rstrip("/")
        self.idle: deque[_Conn] = deque()
        self.all: set[_Conn] = set()

    async def _get(self) -> _Conn:
        while self.idle:
            c = self.idle.pop()
            if c.alive and not c.transport.is_closing():
                c.reused = True
                return c
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Conn(self), self.host, self.port, ssl=self.ssl)
        except OSError as e:
            raise HTTPError("connection_refused", f"cannot connect to {self.host}:{self.port}: {e.strerror or e}") from None
        self.all.add(conn)
        return conn

    def request_bytes(self, method: str, path: str, headers: dict[str, str], body: bytes) -> bytes:
        lines = [f"{method} {self.prefix}{path} HTTP/1.1", f"Host: {self.host_header}",
                 f"Content-Length: {len(body)}", "Accept: text/event-stream, application/json"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    async def start(self, request: bytes, on_event: Callable[[float, bytes], HTTPError | None] | None) -> tuple[_Conn, Exchange]:
        conn = await self._get()
        ex = Exchange(asyncio.get_running_loop(), on_event)
        conn.exchange = ex
        conn.transport.write(request)
        return conn, ex

    def release(self, conn: _Conn, reusable: bool) -> None:
        ex, conn.exchange = conn.exchange, None
        if reusable and ex is not None and ex.keep_alive and ex.done.done() and not ex.done.exception() \
                and conn.alive and not conn.transport.is_closing():
            self.idle.append(conn)
        else:
            self.all.discard(conn)
            conn.alive = False
            if conn.transport is not None:
                conn.transport.abort()

    def close(self) -> None:
        for c in list(self.all):
            c.alive = False
            if c.transport is not None:
                c.transport.abort()
        self.all.clear()
        self.idle.clear()
