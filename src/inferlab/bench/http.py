"""A minimal HTTP/1.1 client for the measuring path: keep-alive connections whose every block of received bytes
carries its arrival time: the kernel's receive timestamp on Linux over plain HTTP (read with recvmsg), else the
moment data_received runs.

Why not aiohttp here: its stream reader wakes a coroutine for every chunk, which at hundreds of streams costs
more CPU than the rest of the client and delays every stamp behind a queue of task switches. Here a chunk costs
one callback: stamp, de-chunk, split SSE events, hand them on. aiohttp still does the once-per-run calls
(GET /v1/models, /metrics). Plain HTTP/1.1 and HTTPS only; no proxies, no redirects, no compression.
"""

from __future__ import annotations

import asyncio
import socket
import ssl as ssl_mod
import struct
import sys
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

    @property
    def in_body(self) -> bool:
        return self._in_body

    def want(self) -> int:
        """How many bytes to ask the socket for next, so that one read does not run past the end of the
        current HTTP chunk: the server wrote each chunk apart, and the kernel stamps a read with the last
        segment it touched, so a client that fell behind still gets each chunk's own arrival time."""
        if not self._in_body:
            return 1024
        if self._chunked:
            if self._left is None or self._left < 0:
                return 32  # a size line (or the trailer), well inside the segment that begins with it
            return self._left  # the rest of this chunk and its CRLF
        if self._left is not None:
            return max(self._left, 1)
        return 1 << 16

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


# Kernel receive timestamps (Linux): the time the bytes reached the socket, whatever the event loop was doing
# then. A read that returns several TCP segments carries the last one's stamp.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35 if sys.platform.startswith("linux") else None)
_CMSG_SPACE = socket.CMSG_SPACE(16) if hasattr(socket, "CMSG_SPACE") else 0


def kernel_receive_time(ancdata: list) -> float:
    """perf_counter time of the kernel's stamp on the bytes just read (CLOCK_REALTIME, converted with the
    offset between the two clocks read now), or now when there is no stamp."""
    now = time.perf_counter_ns()
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
            sec, nsec = struct.unpack("qq", data[:16])
            ago = time.time_ns() - (sec * 1_000_000_000 + nsec)
            return (now - max(ago, 0)) / 1e9
    return now / 1e9


def enable_receive_stamps(sock: socket.socket) -> bool:
    if SO_TIMESTAMPNS is None or not _CMSG_SPACE:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        return True
    except OSError:
        return False


class StampedSocket:
    """A non-blocking TCP socket, read by the subclass with recvmsg (each read carries the kernel's receive
    stamp) and written in order: what the kernel does not take at once waits in `out` until the socket is
    writable. Both ends of a measurement use it: bench's connections and the fake server's."""

    __slots__ = ("sock", "fd", "loop", "out", "closed")

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop):
        self.sock, self.loop, self.fd = sock, loop, sock.fileno()
        self.out = bytearray()
        self.closed = False
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small writes must not wait for Nagle
        enable_receive_stamps(sock)
        loop.add_reader(self.fd, self._readable)

    def _readable(self) -> None:
        raise NotImplementedError

    def _lost(self) -> None:
        """The connection failed (a send or receive raised, or the peer closed it)."""
        raise NotImplementedError

    def receive(self, n: int) -> tuple[bytes, float]:
        """Up to n bytes and the time they reached the socket (raises BlockingIOError when none wait)."""
        data, anc, _, _ = self.sock.recvmsg(n, _CMSG_SPACE)
        return data, kernel_receive_time(anc)

    def write(self, data: bytes) -> None:
        if self.closed:
            return self._lost()
        if self.out:  # earlier bytes still wait for the socket: keep the order
            self.out += data
            return
        try:
            n = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            return self._lost()
        if n < len(data):
            self.out += data[n:]
            self.loop.add_writer(self.fd, self._writable)

    def _writable(self) -> None:
        try:
            n = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return self._lost()
        del self.out[:n]
        if not self.out:
            self.loop.remove_writer(self.fd)

    def _close_socket(self) -> bool:
        """Stop watching and close the socket; False when it was closed already."""
        if self.closed:
            return False
        self.closed = True
        self.loop.remove_reader(self.fd)
        if self.out:
            self.loop.remove_writer(self.fd)
        self.sock.close()
        return True


class _RawConn(StampedSocket):
    """A plain-HTTP connection read with recvmsg, so every block of bytes carries the kernel's receive time: a
    client busy with other streams does not delay its own stamps."""

    __slots__ = ("pool", "exchange", "reused")

    def __init__(self, pool: "Pool", sock: socket.socket, loop: asyncio.AbstractEventLoop):
        self.pool = pool
        self.exchange: Exchange | None = None
        self.reused = False  # carried an earlier response: the server may have closed it as we wrote
        super().__init__(sock, loop)

    def _readable(self) -> None:
        ex = self.exchange
        while True:  # read what is waiting, chunk by chunk, each read with its own receive stamp
            n = ex.want() if ex is not None else 1 << 16
            try:
                if ex is not None and not ex.in_body:  # the head: read up to its blank line, not into the body
                    peek = self.sock.recv(4096, socket.MSG_PEEK)
                    end = peek.find(b"\r\n\r\n")
                    n = end + 4 if end >= 0 else max(len(peek), 1)
                data, t = self.receive(n)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return self._lost()
            if not data:
                return self._lost()
            if ex is None:  # bytes nobody asked for: the connection cannot be trusted
                return self._lost()
            ex.feed(t, data)
            if len(data) < n or ex.done.done() or self.exchange is not ex:
                return

    def usable(self) -> bool:
        return not self.closed

    def _lost(self) -> None:
        ex = self.exchange
        self.abort()
        if ex is not None:
            ex.closed()

    def abort(self) -> None:
        self._close_socket()


class _Conn(asyncio.Protocol):
    """An HTTPS connection (or any platform without receive stamps): stamped when data_received runs."""

    __slots__ = ("pool", "transport", "exchange", "alive", "reused")

    def __init__(self, pool: "Pool"):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.alive = True
        self.reused = False

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

    def write(self, data: bytes) -> None:
        self.transport.write(data)

    def usable(self) -> bool:
        return self.alive and not self.transport.is_closing()

    def abort(self) -> None:
        self.alive = False
        if self.transport is not None:
            self.transport.abort()


class Pool:
    """Keep-alive connections to one origin; a connection carries one request at a time."""

    def __init__(self, base_url: str):
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https"):
            raise ValueError(f"{base_url}: only http:// and https:// URLs are supported")
        self.host = u.hostname or "localhost"
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl = ssl_mod.create_default_context() if u.scheme == "https" else None
        self.raw = self.ssl is None and SO_TIMESTAMPNS is not None and bool(_CMSG_SPACE)
        self.host_header = u.netloc
        self.prefix = u.path.rstrip("/")
        self.idle: deque = deque()
        self.all: set = set()
        self._addr: tuple | None = None

    @property
    def receive_clock(self) -> str:
        return "kernel receive timestamps (SO_TIMESTAMPNS)" if self.raw else "time the event loop read the bytes"

    async def _connect(self):
        loop = asyncio.get_running_loop()
        if not self.raw:
            _, conn = await loop.create_connection(lambda: _Conn(self), self.host, self.port, ssl=self.ssl)
            return conn
        if self._addr is None:
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            self._addr = infos[0]
        family, type_, proto, _, addr = self._addr
        sock = socket.socket(family, type_, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, addr)
        except BaseException:
            sock.close()
            raise
        return _RawConn(self, sock, loop)

    async def _get(self):
        while self.idle:
            c = self.idle.pop()
            if c.usable():
                c.reused = True
                return c
        try:
            conn = await self._connect()
        except OSError as e:
            raise HTTPError("connection_refused", f"cannot connect to {self.host}:{self.port}: {e.strerror or e}") from None
        self.all.add(conn)
        return conn

    async def warm(self, n: int) -> None:
        """Open up to n idle connections now, so that connecting is not counted in the first requests' TTFT
        (a server benchmark measures the server, not TCP handshakes). Failures are left to the requests."""
        results = await asyncio.gather(*(self._connect() for _ in range(max(0, n - len(self.idle)))),
                                       return_exceptions=True)
        for conn in results:
            if not isinstance(conn, BaseException):
                self.all.add(conn)
                self.idle.append(conn)

    def request_bytes(self, method: str, path: str, headers: dict[str, str], body: bytes) -> bytes:
        lines = [f"{method} {self.prefix}{path} HTTP/1.1", f"Host: {self.host_header}",
                 f"Content-Length: {len(body)}", "Accept: text/event-stream, application/json"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    async def start(self, request: bytes, on_event: Callable[[float, bytes], HTTPError | None] | None):
        conn = await self._get()
        ex = Exchange(asyncio.get_running_loop(), on_event)
        conn.exchange = ex
        conn.write(request)
        return conn, ex

    def release(self, conn, reusable: bool) -> None:
        ex, conn.exchange = conn.exchange, None
        if reusable and ex is not None and ex.keep_alive and ex.done.done() and not ex.done.exception() \
                and conn.usable():
            self.idle.append(conn)
        else:
            self.all.discard(conn)
            conn.abort()

    def close(self) -> None:
        for c in list(self.all):
            c.abort()
        self.all.clear()
        self.idle.clear()
