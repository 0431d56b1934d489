"""Hostile input at the HTTP boundary, on the fake engine: every numeric field at its type's extremes, invalid
Unicode, huge, deeply nested and truncated bodies, stalled and surplus connections. For each, a 4xx OpenAI error
naming the problem (or a correct 200 where the input is valid), and then a normal request still answered
correctly. The real engine's side (the same extremes reaching a real sampler) is in test_server_engine.py."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from inferlab.server.http_limits import h11_protocol
from server_testkit import FakeEngine, LiveServer, metric

MAX_BODY = 256 * 1024
READ_TIMEOUT = 1.0
MAX_CONNECTIONS = 8
KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    from inferlab.server.api import ServerConfig, build_app

    app = build_app(FakeEngine(max_num_seqs=4), ServerConfig(max_request_bytes=MAX_BODY, api_keys={KEY: None}))
    with LiveServer(app, http=h11_protocol(READ_TIMEOUT), limit_concurrency=MAX_CONNECTIONS) as s:
        yield s


def _still_serves(s: LiveServer) -> None:
    r = httpx.post(s.base + "/v1/completions", json={"prompt": "a b", "max_tokens": 2}, headers=AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " w0 w1", r.text


def _post(s: LiveServer, body: str | bytes, path: str = "/v1/completions", **headers) -> httpx.Response:
    return httpx.post(s.base + path, content=body, headers={"content-type": "application/json", **AUTH, **headers},
                      timeout=30)


# (field, value) pairs at the extremes of JSON numbers and of int64/uint64; the status each must get.
I64, U64 = 2**63, 2**64
NUMERIC = [
    ("max_tokens", I64 - 1, 400), ("max_tokens", I64, 400), ("max_tokens", -I64, 400), ("max_tokens", 10**30, 400),
    ("max_tokens", 0, 400), ("max_tokens", 1.5, 400), ("max_tokens", 256, 400), ("max_tokens", 253, 200),
    ("top_k", I64, 400), ("top_k", I64 - 1, 400), ("top_k", 1001, 400), ("top_k", -2, 400), ("top_k", -I64, 400),
    ("top_k", 1000, 200), ("top_k", -1, 200),
    ("seed", U64 - 1, 200), ("seed", -I64, 200), ("seed", U64, 400), ("seed", -I64 - 1, 400), ("seed", 0, 200),
    ("temperature", 1e-300, 200), ("temperature", 5e-324, 200), ("temperature", -0.0, 200), ("temperature", 2.0, 200),
    ("temperature", 1e308, 400), ("temperature", -1e-300, 400),
    ("top_p", 1e-300, 200), ("top_p", 0.0, 400), ("top_p", 1.0000001, 400),
    ("n", I64, 400), ("n", -I64, 400),
    ("presence_penalty", 1e308, 400), ("frequency_penalty", -1e308, 400), ("presence_penalty", 0, 200),
    ("logprobs", I64, 400),
    ("stop_token_ids", [I64 - 1], 400), ("stop_token_ids", [I64], 400), ("stop_token_ids", [-1], 400),
    ("stop_token_ids", [999], 200), ("stop_token_ids", [1000], 400),
    ("prompt", [I64], 400), ("prompt", [U64], 400), ("prompt", [-1], 400), ("prompt", [999], 200),
]


@pytest.mark.parametrize("field,value,status", NUMERIC, ids=[f"{f}={v!r}"[:40] for f, v, _ in NUMERIC])
def test_numeric_extremes_get_a_4xx_naming_the_field_or_a_correct_200(server, field, value, status):
    body = {"prompt": "a b c", "max_tokens": 3, field: value}
    r = _post(server, json.dumps(body))
    assert r.status_code == status, r.text
    if status == 200:
        assert r.json()["choices"][0]["text"] == "".join(f" w{i}" for i in range(body["max_tokens"]))
    else:
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"] or field in err["param"], err
    _still_serves(server)


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "max_tokens", "top_k", "seed"])
def test_non_finite_numbers_are_refused_naming_the_field(server, field, raw):
    r = _post(server, '{"prompt": "a", "%s": %s}' % (field, raw))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    _still_serves(server)


def test_an_integer_too_long_to_parse_is_a_400(server):
    r = _post(server, '{"prompt": "a", "max_tokens": %s}' % ("9" * 5000))
    assert r.status_code == 400 and "parse" in r.json()["error"]["message"], r.text
    _still_serves(server)


LONE = "\\ud800"
UNICODE = [
    ("/v1/completions", '{"prompt": "x%sy"}' % LONE, "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"]}', "prompt"),
    ("/v1/completions", '{"prompt": "a", "stop": ["%s"]}' % LONE, "stop"),
    ("/v1/completions", '{"prompt": "a", "model": "%s"}' % LONE, "model"),
    ("/v1/completions", '{"prompt": "a", "cache_salt": "%s"}' % LONE, "cache_salt"),
    ("/v1/completions", '{"prompt": "a", "user": "%s"}' % LONE, "user"),
    ("/v1/completions", '{"prompt": "a", "some_extra": {"deep": ["%s"]}}' % LONE, "some_extra"),
    ("/v1/completions", '{"prompt": "a", "%s": 1}' % LONE, "\\ud800"),  # a key: named escaped
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "%s"}]}' % LONE, "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a", "name": "%s"}]}' % LONE, "messages"),
]


@pytest.mark.parametrize("path,body,param", UNICODE, ids=[str(i) for i in range(len(UNICODE))])
def test_lone_surrogates_anywhere_are_a_400_naming_the_field(server, path, body, param):
    r = _post(server, body, path)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "invalid Unicode" in err["message"] and err["param"] == param, err
    _still_serves(server)


def test_a_valid_surrogate_pair_is_text():
    """The check refuses lone halves only: an escaped pair is one astral character, served like any other."""
    from inferlab.server.protocol import CompletionRequest

    assert CompletionRequest.model_validate(json.loads('{"prompt": "\\ud83d\\ude00"}')).prompt == "\U0001F600"


def test_huge_bodies_get_413_before_they_are_read(server):
    big = json.dumps({"prompt": "w " * MAX_BODY})
    r = _post(server, big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert "--max-request-bytes" in r.json()["error"]["message"]
    _still_serves(server)

    def chunks():  # no Content-Length: counted as it streams
        for _ in range(2 * MAX_BODY // 1024):
            yield b" " * 1024

    r = httpx.post(server.base + "/v1/completions", content=chunks(), headers=AUTH, timeout=30)
    assert r.status_code == 413, r.text
    _still_serves(server)
    m = httpx.get(server.base + "/metrics").text
    assert metric(m, "inferlab:requests_rejected_total", reason="body_too_large") >= 2


def test_a_body_just_under_the_limit_is_parsed():
    """The 413 is about size, not content: a body of MAX_BODY - 1 bytes reaches the prompt check."""
    from inferlab.server.api import ServerConfig, build_app

    engine = FakeEngine(max_token_chars=MAX_BODY)  # the fake's tokens are words: one word of MAX_BODY characters
    with LiveServer(build_app(engine, ServerConfig(max_request_bytes=MAX_BODY))) as s:
        head, tail = '{"max_tokens": 1, "prompt": "', '"}'
        body = head + "w" * (MAX_BODY - 1 - len(head) - len(tail)) + tail
        assert len(body) < MAX_BODY
        r = httpx.post(s.base + "/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 200, r.text[:300]


def test_the_api_key_is_checked_before_the_body_is_read(server):
    """Headers announcing a 1 MB body and no body at all: a wrong key gets 401 at once (were the body awaited, the
    answer would be the read timeout's 408), and the 413 for the size comes only to a caller with the key."""
    for headers, status in [(b"Authorization: Bearer wrong\r\n", 401), (b"", 401),
                            (f"Authorization: Bearer {KEY}\r\n".encode(), 413)]:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + headers
                         + b"Content-Length: 1000000\r\n\r\n")
            head = sock.recv(65536).decode()
        assert head.startswith(f"HTTP/1.1 {status}"), head
    _still_serves(server)


def test_deeply_nested_bodies_are_a_400(server):
    for depth in (100, 10_000, 30_000):
        r = _post(server, '{"prompt": ' + "[" * depth + "]" * depth + "}")
        assert r.status_code == 400, (depth, r.text[:300])
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        _still_serves(server)
    r = _post(server, '{"prompt": "a", "x": ' + '{"a":' * 30_000 + "1" + "}" * 30_000 + "}")
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text[:300]
    _still_serves(server)


@pytest.mark.parametrize("body", ['{"prompt": "abc', '{"prompt": "a", "max_tokens": ', '{"prompt"', '{', '"', "\x00"])
def test_truncated_bodies_are_a_400(server, body):
    r = _post(server, body)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"], r.text
    _still_serves(server)


def test_limits_on_stop_lists_messages_and_prompt_length(server):
    from inferlab.server.protocol import MAX_MESSAGES, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

    cases = [
        ({"prompt": "a", "stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"prompt": "a", "stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
        ({"prompt": "a", "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
        ({"messages": [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)}, "messages"),
        ({"prompt": "x" * (256 * 32 + 1)}, "prompt"),  # the fake: 256 tokens of at most 32 characters
        ({"prompt": list(range(257))}, "prompt"),
    ]
    for body, param in cases:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = _post(server, json.dumps(body), path)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (param, r.text[:300])
        _still_serves(server)
    ok = {"prompt": "a", "stop": ["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS, "max_tokens": 2}
    assert _post(server, json.dumps(ok)).status_code == 200


def _closed_by_server(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the socket's own timeout bounds the wait)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                  b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-test\r\n"
                                  b"Content-Length: 100\r\n\r\n{\"prompt\": "])
def test_a_stalled_request_is_answered_408_and_closed(server, sent):
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(sent)
        answer = _closed_by_server(sock)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer
    if answer:
        assert b"--http-read-timeout" in answer
    _still_serves(server)


def test_connections_beyond_the_cap_get_503_and_stalled_ones_are_reclaimed(server):
    stalled = [socket.create_connection(("127.0.0.1", server.port), timeout=60) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in stalled:
            sock.sendall(b"GET /health HTTP/1.1\r\n")  # half a request line's headers, then nothing
        # Every slot is held: a new connection is refused with uvicorn's 503 (the stalled ones keep theirs).
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert extra.recv(65536).startswith(b"HTTP/1.1 503")
        for sock in stalled:
            assert _closed_by_server(sock).startswith(b"HTTP/1.1 408")
    finally:
        for sock in stalled:
            sock.close()
    _still_serves(server)
