"""A deterministic OpenAI-compatible streaming server with known timings: the oracle for bench's accuracy, and
a feature for anyone testing a pipeline or dashboard without a model.

Each request gets an absolute schedule when it is admitted: the first chunk at admit + ttft, chunk j at
admit + ttft + j * tokens_per_chunk * itl (plus optional seeded jitter), so lateness never accumulates; "admit" is
the kernel's receive time of the request's first byte (SO_TIMESTAMPNS), or a later moment when a full
--max-concurrency queue held it. One timer over a heap of deadlines writes every stream (no coroutine or sleep per
token) with non-blocking sends; the time of every actual write is recorded and served on GET /stats, so a client
is judged against what the server really did. Raw sockets on the event loop rather than a web framework keep
the write path a few microseconds and give recvmsg's receive timestamps.

Endpoints: GET /health, /v1/models, /metrics (a few vllm: series), /stats; DELETE /stats; POST /v1/completions
and /v1/chat/completions, streamed (SSE) or not, with stream_options.include_usage / continuous_usage_stats.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import json
import random
import socket
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable

from inferlab.bench.http import StampedSocket

# Common words that are single tokens in GPT-2-style and Llama-style vocabularies, so a tokenizer counts one
# token per word of the fake output.
WORDS = (" the", " of", " and", " to", " in", " is", " that", " for", " it", " as", " was", " with", " be",
         " by", " on", " not", " he", " this", " are", " or", " his", " from", " at", " which", " but", " have")
_WORD_BYTES = tuple(w.encode() for w in WORDS)  # plain words: their JSON form needs no escaping
FAULTS = ("http500", "drop", "malformed", "stall")
PREFIX_BLOCK = 16  # words per block of the fake prefix cache


@dataclass(slots=True)
class FakeConfig:
    ttft: float = 0.05  # seconds from admission to the first chunk
    itl: float = 0.01  # seconds per output token
    tokens_per_chunk: int = 1
    jitter: float = 0.0  # each deadline moves later by a seeded uniform draw in [0, jitter) seconds
    ttft_per_input_token: float = 0.0  # prefill cost added to ttft per prompt token
    output_len: int | None = None  # force every answer to this many tokens (else max_tokens, else 16)
    max_concurrency: int | None = None  # more requests than this wait in a FIFO queue (a saturated server)
    reasoning_tokens: int = 0  # chat: the first N tokens are streamed as reasoning, in `reasoning_field`
    reasoning_field: str = "reasoning_content"  # vLLM's name; "reasoning" as OpenRouter, Ollama and others
    model: str = "fake-model"
    api_key: str | None = None
    seed: int = 0
    faults: dict[str, float] = field(default_factory=dict)  # kind -> share of requests, kinds in FAULTS
    count_tokens: Callable[[str], int] | None = None  # prompt token counter; default: whitespace words

    def __post_init__(self):
        if self.ttft < 0 or self.itl < 0 or self.jitter < 0 or self.tokens_per_chunk < 1:
            raise ValueError("ttft, itl and jitter must be >= 0 and tokens_per_chunk >= 1")
        if self.reasoning_field not in ("reasoning_content", "reasoning"):
            raise ValueError(f"reasoning_field {self.reasoning_field!r}: choose reasoning_content or reasoning")
        unknown = set(self.faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown fault kind(s) {sorted(unknown)}; choose from {', '.join(FAULTS)}")
        if sum(self.faults.values()) > 1 or any(v < 0 for v in self.faults.values()):
            raise ValueError("fault shares must be >= 0 and add up to at most 1")


@dataclass(slots=True)
class _Stream:
    proto: "_Conn"
    rid: str
    chat: bool
    stream: bool
    n_tokens: int
    prompt_tokens: int
    cached_tokens: int
    usage_each: bool
    usage_last: bool
    fault: str | None
    arrival: float
    admitted: float = 0.0
    chunk: int = 0  # next chunk to write
    sizes: list[int] = field(default_factory=list)  # tokens per chunk
    deadlines: list[float] = field(default_factory=list)
    writes: list[float] = field(default_factory=list)
    status: str = "queued"
    head: bytes | None = None  # the start of every SSE event of this stream


class FakeServer:
    def __init__(self, config: FakeConfig):
        self.cfg = config
        self._heap: list[tuple[float, int, _Stream]] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._waiting: collections.deque[_Stream] = collections.deque()
        self.running = 0
        # With max_concurrency: when each slot freed that no waiting request took (a heap), so that a request whose
        # first byte came before its slot was free is admitted when the slot was, not at its arrival.
        self._freed: list[float] = []
        self.log: list[_Stream] = []
        self._seen_prompts: set[int] = set()
        self._seen_blocks: set[int] = set()
        self.counters = collections.Counter()
        self.queue_time_sum = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lsock: socket.socket | None = None
        self._conns: set[_Conn] = set()
        self._thread: threading.Thread | None = None
        self.port = 0

    # --- lifecycle ----------------------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._loop = asyncio.get_running_loop()
        lsock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind((host, port))
        lsock.listen(4096)
        lsock.setblocking(False)
        self._lsock = lsock
        self._conns: set[_Conn] = set()
        self._loop.add_reader(lsock.fileno(), self._accept)
        self.port = lsock.getsockname()[1]
        return self.port

    def _accept(self) -> None:
        for _ in range(256):
            try:
                sock, _ = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            self._conns.add(_Conn(self, sock))

    async def serve_forever(self) -> None:
        try:
            await asyncio.get_running_loop().create_future()  # until cancelled
        finally:
            self.close()

    def close(self) -> None:
        if self._lsock is not None:
            self._loop.remove_reader(self._lsock.fileno())
            self._lsock.close()
            self._lsock = None
        for c in list(self._conns):
            c.close()

    def start_in_thread(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Run on a background thread with its own event loop (tests); returns the base URL."""
        ready = threading.Event()

        def main():
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self.start(host, port))
            ready.set()
            loop.run_forever()
            self.close()
            loop.close()

        self._thread = threading.Thread(target=main, name="fake-server", daemon=True)
        self._thread.start()
        ready.wait(30)
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        if self._thread and self._loop:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    # --- scheduling ---------------------------------------------------------------------------------------

    def _fault_for(self, seq: int) -> str | None:
        if not self.cfg.faults:
            return None
        x = random.Random(self.cfg.seed * 1_000_003 + seq).random()
        for kind in FAULTS:
            x -= self.cfg.faults.get(kind, 0.0)
            if x < 0:
                return kind
        return None

    def submit(self, s: _Stream) -> None:
        self.log.append(s)
        cap = self.cfg.max_concurrency
        if cap and self.running >= cap:
            self._waiting.append(s)
        elif cap and self.running + len(self._freed) >= cap:
            # Every free slot was freed by a finish; take the earliest. On a loaded host a request's first byte can
            # come in before the finish that freed its slot is handled: it starts when the slot was free.
            self._admit(s, max(s.arrival, heapq.heappop(self._freed)))
        else:
            self._admit(s, s.arrival)  # the schedule counts from the request's first byte, not from parsing

    def _admit(self, s: _Stream, now: float) -> None:
        cfg = self.cfg
        self.running += 1
        s.admitted, s.status = now, "running"
        self.queue_time_sum += now - s.arrival
        rng = random.Random(zlib.crc32(f"{cfg.seed}|{s.rid}".encode()))  # same id, same jitter
        n, k = s.n_tokens, cfg.tokens_per_chunk
        s.sizes = [min(k, n - i) for i in range(0, n, k)]
        t = now + cfg.ttft + s.prompt_tokens * cfg.ttft_per_input_token
        done = 0
        for size in s.sizes:
            d = t + done * cfg.itl + (rng.random() * cfg.jitter if cfg.jitter else 0.0)
            s.deadlines.append(max(d, s.deadlines[-1]) if s.deadlines else d)
            done += size
        if not s.stream:  # one write when the last token would have been produced
            s.deadlines = [s.deadlines[-1]]
        self._push(s.deadlines[0], s)

    def _push(self, deadline: float, s: _Stream) -> None:
        heapq.heappush(self._heap, (deadline, next(self._seq), s))
        if deadline < self._timer_at:
            self._arm(deadline)

    def _arm(self, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        loop = self._loop
        self._timer_at = deadline
        self._timer = loop.call_at(loop.time() + (deadline - time.perf_counter()), self._fire)

    def _fire(self) -> None:
        """The one timer: write every chunk that is due, then sleep until the next deadline."""
        self._timer, self._timer_at = None, float("inf")
        heap = self._heap
        # Only what was due when the timer fired: if writing falls behind, the loop still gets back to reading
        # sockets between batches, so new requests are not starved by a queue that never empties.
        now = time.perf_counter()
        while heap and heap[0][0] <= now:
            _, _, s = heapq.heappop(heap)
            if s.status != "running":
                continue
            self._write_next(s)
            if s.status == "running":
                heapq.heappush(heap, (s.deadlines[s.chunk], next(self._seq), s))
        if heap:
            self._arm(heap[0][0])

    def _finish(self, s: _Stream, status: str) -> None:
        if s.status != "running":
            return
        s.status = status
        self.running -= 1
        self.counters[f"requests_{status}"] += 1
        now = time.perf_counter()
        while self._waiting and (not self.cfg.max_concurrency or self.running < self.cfg.max_concurrency):
            w = self._waiting.popleft()
            if w.status == "queued":
                self._admit(w, now)
        if self.cfg.max_concurrency and self.running < self.cfg.max_concurrency:
            heapq.heappush(self._freed, now)

    # --- response bodies ----------------------------------------------------------------------------------

    def _text(self, start: int, size: int) -> str:
        return "".join(WORDS[i % len(WORDS)] for i in range(start, start + size))

    def _usage(self, s: _Stream, completion: int) -> dict:
        u = {"prompt_tokens": s.prompt_tokens, "completion_tokens": completion,
             "total_tokens": s.prompt_tokens + completion}
        if s.cached_tokens:
            u["prompt_tokens_details"] = {"cached_tokens": s.cached_tokens}
        return u

    def _event(self, s: _Stream, start: int, size: int, last: bool) -> bytes:
        """One SSE event, assembled from bytes prepared per stream: a json.dumps per chunk would make the
        server, not the client under test, the bottleneck at hundreds of streams."""
        if s.head is None:
            obj = "chat.completion.chunk" if s.chat else "text_completion"
            s.head = (b'data: {"id":' + json.dumps(s.rid).encode() + b',"object":"' + obj.encode()
                      + b'","created":0,"model":' + json.dumps(self.cfg.model).encode() + b',"choices":[{"index":0,')
        text = b'"' + b"".join(_WORD_BYTES[i % len(WORDS)] for i in range(start, start + size)) + b'"'
        if s.chat:
            key = self.cfg.reasoning_field.encode() if start < self.cfg.reasoning_tokens else b"content"
            choice = b'"delta":{"' + key + b'":' + text + b"}"
        else:
            choice = b'"text":' + text
        out = s.head + choice + (b',"logprobs":null,"finish_reason":"length"}]' if last
                                 else b',"logprobs":null,"finish_reason":null}]')
        if s.usage_each:
            done = start + size
            out += (b',"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d'
                    % (s.prompt_tokens, done, s.prompt_tokens + done))
            out += (b',"prompt_tokens_details":{"cached_tokens":%d}}' % s.cached_tokens) if s.cached_tokens else b"}"
        out += b"}\n\n"
        if s.chat and start == 0:  # like vLLM: a role-only chunk before the first token
            out = s.head + b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n' + out
        return out

    def _write_next(self, s: _Stream) -> None:
        conn = s.proto
        if conn.closed:
            self._finish(s, "cancelled")
            return
        if not s.stream:
            n = s.n_tokens
            if s.chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": self._text(0, n)},
                          "finish_reason": "length"}
            else:
                choice = {"index": 0, "text": self._text(0, n), "finish_reason": "length"}
            body = {"id": s.rid, "object": "chat.completion" if s.chat else "text_completion", "created": 0,
                    "model": self.cfg.model, "choices": [choice], "usage": self._usage(s, n)}
            s.writes.append(time.perf_counter())
            conn.send_json(200, body)
            self._finish(s, "done")
            return
        j = s.chunk
        start = sum(s.sizes[:j]) if j else 0
        last = j == len(s.sizes) - 1
        if s.fault == "malformed" and j == len(s.sizes) // 2:
            data = b"data: {this is not json\n\n"
        else:
            data = self._event(s, start, s.sizes[j], last)
        if last:
            if s.usage_last and not s.usage_each:
                fin = {"id": s.rid, "object": "chat.completion.chunk" if s.chat else "text_completion",
                       "created": 0, "model": self.cfg.model, "choices": [], "usage": self._usage(s, s.n_tokens)}
                data += b"data: " + json.dumps(fin, separators=(",", ":")).encode() + b"\n\n"
            data += b"data: [DONE]\n\n"
        s.writes.append(time.perf_counter())
        conn.send_chunk(data)
        s.chunk += 1
        if s.fault == "drop" and s.chunk >= max(1, len(s.sizes) // 2):
            conn.abort()
            self._finish(s, "dropped")
        elif s.fault == "stall" and s.chunk >= 1:
            self._finish(s, "stalled")  # never written again and never closed: the client must time out
        elif last:
            conn.end_chunks()
            self._finish(s, "done")

    # --- request handling ---------------------------------------------------------------------------------

    def handle(self, conn: "_Conn", method: str, path: str, headers: dict[str, str], body: bytes,
               arrival: float) -> None:
        path = path.split("?", 1)[0]
        if method == "GET" and path in ("/health", "/ping"):
            return conn.send_json(200, {"status": "ok"})
        if method == "GET" and path == "/metrics":
            return conn.send_raw(200, self.metrics_text().encode(), "text/plain; version=0.0.4")
        if path == "/stats":
            if method == "DELETE":
                self.log.clear()
                return conn.send_json(200, {"cleared": True})
            return conn.send_json(200, self.stats())
        if path.startswith("/v1/") and self.cfg.api_key is not None:
            if headers.get("authorization", "") != f"Bearer {self.cfg.api_key}":
                return conn.send_json(401, _err("invalid API key", "authentication_error"))
        if method == "GET" and path == "/v1/models":
            return conn.send_json(200, {"object": "list", "data": [
                {"id": self.cfg.model, "object": "model", "created": 0, "owned_by": "inferlab-fake-server"}]})
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return conn.send_json(404, _err(f"no route {method} {path}", "not_found"))
        if method != "POST":
            return conn.send_json(405, _err(f"{path} takes POST", "invalid_request_error"))
        try:
            req = json.loads(body or b"{}")
        except json.JSONDecodeError as e:
            return conn.send_json(400, _err(f"request body is not JSON: {e.msg}", "invalid_request_error"))
        chat = path.endswith("chat/completions")
        if chat:
            msgs = req.get("messages")
            if not isinstance(msgs, list) or not msgs:
                return conn.send_json(400, _err("'messages' must be a non-empty list", "invalid_request_error"))
            prompt = "\n".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))
        else:
            prompt = req.get("prompt")
            if isinstance(prompt, list):
                prompt = " ".join(map(str, prompt))
            if not isinstance(prompt, str):
                return conn.send_json(400, _err("'prompt' must be a string", "invalid_request_error"))
        n = self.cfg.output_len or req.get("max_tokens") or req.get("max_completion_tokens") or 16
        if not isinstance(n, int) or n < 1:
            return conn.send_json(400, _err("'max_tokens' must be a positive integer", "invalid_request_error"))
        seq = len(self.log)
        fault = self._fault_for(seq)
        rid = headers.get("x-request-id") or f"fake-{seq}"
        if fault == "http500":
            self.log.append(_Stream(conn, rid, chat, False, 0, 0, 0, False, False, fault, arrival, status="http500"))
            return conn.send_json(500, _err("fake server: injected internal error", "server_error"))
        count = self.cfg.count_tokens or (lambda t: len(t.split()))
        ptoks = count(prompt)
        cached = self._cache_lookup(prompt, ptoks)
        self.counters["prefix_queries"] += ptoks
        self.counters["prefix_hits"] += cached
        self.counters["prompt_tokens"] += ptoks
        self.counters["generation_tokens"] += n
        opts = req.get("stream_options") or {}
        stream = bool(req.get("stream"))
        s = _Stream(conn, rid, chat, stream, n, ptoks, cached,
                    usage_each=stream and bool(opts.get("continuous_usage_stats")),
                    usage_last=stream and bool(opts.get("include_usage")), fault=fault, arrival=arrival)
        if stream:
            conn.start_chunks()
        self.submit(s)

    def _cache_lookup(self, prompt: str, ptoks: int) -> int:
        """The fake's prefix cache, in prompt tokens served from it: a prompt seen before is all cached;
        otherwise the longest run of whole PREFIX_BLOCK-word blocks that an earlier prompt began with (chained
        block hashes, as vLLM's block manager keys them). A conversation's next turn starts with its history,
        so its history's blocks hit. Counted in words, so exact with the default token counter."""
        key = hash(prompt)
        if key in self._seen_prompts:
            return ptoks
        self._seen_prompts.add(key)
        words = prompt.split()
        h, hit, missed = 0, 0, False
        for k in range(len(words) // PREFIX_BLOCK):
            h = hash((h, tuple(words[k * PREFIX_BLOCK:(k + 1) * PREFIX_BLOCK])))
            if not missed and h in self._seen_blocks:
                hit += PREFIX_BLOCK
            else:
                missed = True
            self._seen_blocks.add(h)
        return min(hit, ptoks)

    def stats(self) -> dict:
        return {"clock": "time.perf_counter (CLOCK_MONOTONIC)", "requests": [
            {"id": s.rid, "arrival": s.arrival, "admitted": s.admitted, "prompt_tokens": s.prompt_tokens,
             "output_tokens": s.n_tokens, "tokens_per_write": s.sizes[:len(s.writes)] if s.stream else [s.n_tokens],
             "deadlines": s.deadlines[:len(s.writes)], "writes": s.writes, "status": s.status, "fault": s.fault}
            for s in self.log]}

    def metrics_text(self) -> str:
        c = self.counters
        cap = self.cfg.max_concurrency or 0
        lines = [
            "# TYPE vllm:num_requests_running gauge", f'vllm:num_requests_running{{model_name="{self.cfg.model}"}} {self.running}',
            "# TYPE vllm:num_requests_waiting gauge", f'vllm:num_requests_waiting{{model_name="{self.cfg.model}"}} {len(self._waiting)}',
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f'vllm:kv_cache_usage_perc{{model_name="{self.cfg.model}"}} {self.running / cap if cap else 0.0}',
            "# TYPE vllm:num_preemptions counter", f'vllm:num_preemptions_total{{model_name="{self.cfg.model}"}} 0',
            "# TYPE vllm:prefix_cache_queries counter",
            f'vllm:prefix_cache_queries_total{{model_name="{self.cfg.model}"}} {c["prefix_queries"]}',
            "# TYPE vllm:prefix_cache_hits counter",
            f'vllm:prefix_cache_hits_total{{model_name="{self.cfg.model}"}} {c["prefix_hits"]}',
            "# TYPE vllm:prompt_tokens counter", f'vllm:prompt_tokens_total{{model_name="{self.cfg.model}"}} {c["prompt_tokens"]}',
            "# TYPE vllm:generation_tokens counter",
            f'vllm:generation_tokens_total{{model_name="{self.cfg.model}"}} {c["generation_tokens"]}',
            "# TYPE vllm:request_queue_time_seconds histogram",
            f'vllm:request_queue_time_seconds_sum{{model_name="{self.cfg.model}"}} {self.queue_time_sum}',
            f'vllm:request_queue_time_seconds_count{{model_name="{self.cfg.model}"}} {sum(1 for s in self.log if s.admitted)}',
        ]
        return "\n".join(lines) + "\n"


def _err(message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind}}


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            500: "Internal Server Error"}


# A request's arrival is the kernel's receive time of its first bytes, not when this process got round to
# reading them, so the server's own backlog is never counted against the client being measured.
class _Conn(StampedSocket):
    """One HTTP/1.1 connection: keep-alive, Content-Length bodies, chunked SSE responses. A raw socket rather
    than an asyncio transport, for recvmsg's receive timestamps."""

    def __init__(self, server: FakeServer, sock: socket.socket):
        self.server = server
        self.buf = b""
        self.first_byte = 0.0
        super().__init__(sock, server._loop)

    def _readable(self) -> None:
        try:
            data, t = self.receive(1 << 18)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return self.close()
        if not data:
            return self.close()
        if not self.buf:
            self.first_byte = t  # a request's arrival: its first byte, before any parsing
        self.buf += data
        while not self.closed:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            lines = self.buf[:head_end].decode("latin-1").split("\r\n")
            try:
                method, target, _ = lines[0].split(" ", 2)
            except ValueError:
                self.send_json(400, _err("malformed request line", "invalid_request_error"))
                return self.abort()
            headers = {}
            for line in lines[1:]:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            length = int(headers.get("content-length", "0") or 0)
            if len(self.buf) < head_end + 4 + length:
                return
            body = self.buf[head_end + 4: head_end + 4 + length]
            self.buf = self.buf[head_end + 4 + length:]
            self.server.handle(self, method, target, headers, body, self.first_byte)

    def _lost(self) -> None:
        self.close()

    def send_raw(self, status: int, body: bytes, ctype: str) -> None:
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n")
        self.write(head.encode() + body)

    def send_json(self, status: int, obj: dict) -> None:
        self.send_raw(status, json.dumps(obj).encode(), "application/json")

    def start_chunks(self) -> None:
        self.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                    b"Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n")

    def send_chunk(self, data: bytes) -> None:
        self.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end_chunks(self) -> None:
        self.write(b"0\r\n\r\n")

    def abort(self) -> None:
        """Drop the connection as a crashed server would: a reset, unsent bytes discarded."""
        if not self.closed:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.close()

    def close(self) -> None:
        if self._close_socket():
            self.server._conns.discard(self)
