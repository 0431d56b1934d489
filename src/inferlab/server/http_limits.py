"""What is checked of a request before its body is read: the API key and the body size (an ASGI middleware), and how
long a client may take to send its request (an h11 protocol with a read timeout).

FastAPI reads and parses the whole body before any dependency runs, so an API key checked as a dependency lets an
unauthenticated client make the server read and parse 20 MB. RequestLimits answers 401 and 413 from the headers
alone, and counts the bytes of a chunked body (no Content-Length) as they arrive.

uvicorn (0.54) has no timeout on reading a request: `timeout_keep_alive` runs only between requests, so a client
that sends half a header holds its connection (and a --max-connections slot) forever. ReadTimeoutH11Protocol gives
each request `read_timeout` seconds from its first byte (or from the connection's start) until its body is complete,
then answers 408 and closes; nginx's client_header_timeout and client_body_timeout do the same job.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import h11
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from inferlab.server.protocol import APIError

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # 4 MiB: a 128k-token prompt as text is ~0.5 MB; as JSON token ids ~0.9 MB
DEFAULT_READ_TIMEOUT = 30.0
DEFAULT_KEEP_ALIVE_TIMEOUT = 5
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_MAX_HEADER_BYTES = 16 * 1024  # h11's own default


class RequestLimits:
    """ASGI middleware: for /v1/* the API key (via `authenticate(raw Authorization header) -> tenant`, which raises
    a 401 APIError), then for every request the body size. The tenant goes to the request's state."""

    def __init__(self, app: Any, authenticate: Callable[[bytes | None], str | None], max_body_bytes: int,
                 rejected: Callable[[str], None]):
        self.app, self.authenticate, self.max_body_bytes, self.rejected = app, authenticate, max_body_bytes, rejected

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # lower-case names; a repeated header keeps its last value
        if scope["path"].startswith("/v1/"):
            try:
                tenant = self.authenticate(headers.get(b"authorization"))
            except APIError as e:
                self.rejected("unauthorized")
                return await _send_error(send, e, close=b"content-length" in headers or
                                         b"transfer-encoding" in headers)
            scope.setdefault("state", {})["tenant"] = tenant
        limit = self.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            self.rejected("body_too_large")
            return await _send_error(send, _too_large(int(length), limit), close=True)
        received = 0

        async def counted() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # a chunked body, or one longer than its Content-Length claimed
                    self.rejected("body_too_large")
                    e = _too_large(received, limit)
                    # Raised inside FastAPI's body read, which re-raises HTTPExceptions: the app's handler answers.
                    raise StarletteHTTPException(413, e.message, headers={"Connection": "close"})
            return message

        await self.app(scope, counted, send)


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server accepts ({size} > {limit} bytes, "
                         f"--max-request-bytes)", "invalid_request_error", None, "request_too_large")


async def _send_error(send: Callable, e: APIError, close: bool) -> None:
    """Answer without reading the body; with `close` the connection closes after it (the unread body would
    otherwise be taken for the next request)."""
    body = e.body().model_dump_json().encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (e.headers or {}).items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def h11_protocol(read_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a per-request read timeout (pass as uvicorn.Config(http=...))."""
    return type("ReadTimeoutH11Protocol", (ReadTimeoutH11Protocol,), {"read_timeout": read_timeout})


class ReadTimeoutH11Protocol(H11Protocol):
    read_timeout: float = DEFAULT_READ_TIMEOUT
    _read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # IDLE with bytes received: a request line or headers are partly in; SEND_BODY: the body is.
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._read_timer is None:
            self._read_timer = self.loop.call_later(self.read_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing() or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            return
        # IDLE: the request is not parsed yet (any earlier cycle on this connection is complete).
        if self.conn.their_state is h11.IDLE or (self.cycle is not None and not self.cycle.response_started):
            # Written raw: h11 will not send a response to a request it has not parsed yet.
            e = APIError(408, f"the request was not received within --http-read-timeout {self.read_timeout:g} s",
                         "invalid_request_error", None, "request_timeout")
            body = e.body().model_dump_json().encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()
