"""The measuring HTTP client's response parser, fed every way the bytes can be split across reads."""

import asyncio

import pytest

from inferlab.bench.http import Exchange, HTTPError

EVENTS = [b'{"a":1}', b'{"b":"x\\ny"}', b"[DONE]"]


def sse_body(crlf: bool = False) -> bytes:
    nl = b"\r\n" if crlf else b"\n"
    return b"".join(b"data: " + e + nl + nl for e in EVENTS) + b": a comment" + nl + nl


def chunked(body: bytes, size: int) -> bytes:
    parts = [body[i:i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\nX-Trailer: 1\r\n\r\n"


HEAD_SSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def feed_all(raw: bytes, cuts: list[int]) -> tuple[Exchange, list]:
    loop = asyncio.new_event_loop()
    got = []
    ex = Exchange(loop, lambda t, d: got.append((t, d)))
    prev = 0
    for i, c in enumerate(cuts + [len(raw)]):
        ex.feed(float(i), raw[prev:c])
        prev = c
    loop.close()
    return ex, got


@pytest.mark.parametrize("crlf", [False, True])
@pytest.mark.parametrize("chunk", [3, 7, 1000])
def test_sse_over_chunked_transfer_at_every_split_point(crlf, chunk):
    raw = HEAD_SSE + chunked(sse_body(crlf), chunk)
    for cut in range(1, len(raw)):
        ex, got = feed_all(raw, [cut])
        assert [d for _, d in got] == EVENTS, cut
        assert ex.done.done() and ex.done.result() is True and ex.status == 200 and ex.sse


def test_each_event_is_stamped_with_the_read_that_completed_it():
    raw = HEAD_SSE + chunked(sse_body(), 1000)
    first_end = raw.index(b"\n\n") + 2
    ex, got = feed_all(raw, [first_end - 1, first_end])  # event 1 completes in read 1, the rest in read 2
    assert [t for t, _ in got] == [1.0, 2.0, 2.0]


def test_content_length_body_and_error_status():
    raw = b'HTTP/1.1 500 Internal Server Error\r\nContent-Length: 13\r\n\r\n{"error":"x"}'
    for cut in range(1, len(raw)):
        ex, got = feed_all(raw, [cut])
        assert ex.status == 500 and bytes(ex.body) == b'{"error":"x"}' and ex.done.done() and not got


def test_a_rejected_event_fails_the_exchange():
    loop = asyncio.new_event_loop()
    ex = Exchange(loop, lambda t, d: HTTPError("malformed_sse", "bad") if d == b"oops" else None)
    ex.feed(0.0, HEAD_SSE + chunked(b"data: oops\n\ndata: [DONE]\n\n", 100))
    assert ex.done.done() and isinstance(ex.done.exception(), HTTPError) and not ex.keep_alive
    loop.close()


def test_connection_closed_mid_body_is_a_dropped_connection():
    loop = asyncio.new_event_loop()
    ex = Exchange(loop, lambda t, d: None)
    ex.feed(0.0, HEAD_SSE + b"20\r\ndata: {}\n\n")
    ex.closed()
    assert ex.done.exception().kind == "connection_dropped"
    loop.close()


def test_reads_sized_by_want_never_cross_a_chunk_written_apart():
    # Each server write (one HTTP chunk) is a "segment"; reading want() bytes at a time from the concatenated
    # stream must never return bytes of two segments in one read, so every read keeps its own receive stamp.
    loop = asyncio.new_event_loop()
    ex = Exchange(loop, lambda t, d: None)
    events = [b"data: {\"i\":%d,\"pad\":\"%s\"}\n\n" % (i, b"x" * (i * 7 % 50)) for i in range(12)]
    segments = [HEAD_SSE] + [b"%x\r\n%s\r\n" % (len(e), e) for e in events] + [b"0\r\n\r\n"]
    owner = [i for i, seg in enumerate(segments) for _ in seg]  # segment index of every byte
    stream = b"".join(segments)
    pos = 0
    while pos < len(stream) and not ex.done.done():
        n = ex.want()
        data = stream[pos:pos + n]
        assert len(set(owner[pos:pos + len(data)])) == 1 or owner[pos] == 0, (pos, data)
        ex.feed(float(owner[pos]), data)
        pos += len(data)
    assert ex.done.done() and pos == len(stream)
    loop.close()


def test_request_ids_are_uuids_that_name_run_and_index():
    import uuid

    from inferlab.bench.runner import request_id

    ids = {request_id("044eb51c", run, i) for run in (0, 1, 70000) for i in (0, 1, 2**40)}
    assert len(ids) == 9
    for rid in ids:
        assert str(uuid.UUID(rid)) == rid  # servers that validate X-Request-Id (llama-cpp-python) accept it
    assert request_id("044eb51c", 3, 17) == "044eb51c-0003-4000-8000-000000000011"
