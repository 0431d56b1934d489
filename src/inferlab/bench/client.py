"""The client: builds each request, sends it over http.Pool's keep-alive connections and records what arrives.

Per received block the work is a timestamp (taken first, in data_received), de-chunking, an SSE split and one
json.loads per event, so that with hundreds of streams a chunk is stamped close to when its bytes arrived;
token counting by tokenizer runs once per request, after its stream has ended. aiohttp serves the once-per-run
calls (preflight).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from inferlab.bench.http import HTTPError, Pool
from inferlab.bench.records import RequestRecord
from inferlab.bench.tokenizer import BenchTokenizer
from inferlab.bench.workload import RequestSpec, messages_to_prompt


try:  # optional: a faster parser when installed; the standard one otherwise
    from orjson import loads as _loads
except ImportError:
    _std_decode = json.JSONDecoder().decode

    def _loads(payload: bytes):
        return _std_decode(payload.decode("utf-8"))  # skips json.loads' encoding sniffing on bytes


class BenchError(RuntimeError):
    """A fault that stops the run before load starts (unreachable server, refused key, no model)."""


@dataclass(slots=True)
class Target:
    base_url: str
    endpoint: str = "completions"  # completions | chat
    model: str = ""
    api_key: str | None = None
    stream: bool = True
    usage_stats: bool = True  # send stream_options {include_usage, continuous_usage_stats}
    ignore_eos: bool = True  # vLLM's extension, so output lengths are honoured
    temperature: float | None = None
    extra_body: dict = field(default_factory=dict)
    timeout: float = 600.0  # per request, seconds

    def headers(self) -> dict[str, str]:
        # identity: a compressing proxy would otherwise buffer the stream
        h = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


def make_session(limit: int = 0) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=limit, ttl_dns_cache=300, keepalive_timeout=60)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                 auto_decompress=False)


def api_root(base_url: str) -> str:
    """Accept both http://host:port and http://host:port/v1."""
    b = base_url.rstrip("/")
    return b[:-3] if b.endswith("/v1") else b


async def preflight(session: aiohttp.ClientSession, target: Target) -> dict:
    """GET /v1/models before any load: fail fast on an unreachable server or a refused key. Returns the
    server's answer ({} when it has no such endpoint but a model was named)."""
    url = target.base_url.rstrip("/") + "/v1/models"
    try:
        async with asyncio.timeout(30):
            async with session.get(url, headers=target.headers()) as resp:
                body = await resp.text()
                status = resp.status
    except (aiohttp.ClientConnectorError, OSError) as e:
        raise BenchError(f"cannot reach the server at {target.base_url}: {e}") from None
    except TimeoutError:
        raise BenchError(f"the server at {target.base_url} did not answer GET /v1/models within 30 s") from None
    except aiohttp.ClientError as e:
        raise BenchError(f"GET {url} failed: {e}") from None
    if status in (401, 403):
        raise BenchError(f"the server refused the API key (HTTP {status} on GET /v1/models): {body[:200].strip()}"
                         f" -- pass --api-key")
    if status != 200:
        if target.model:
            return {}
        raise BenchError(f"GET {url} answered HTTP {status}; name the model with --model")
    try:
        models = json.loads(body)
        ids = [m["id"] for m in models.get("data", [])]
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError):
        raise BenchError(f"GET {url} did not return an OpenAI model list: {body[:200]!r}") from None
    if not target.model:
        if not ids:
            raise BenchError("the server lists no models on /v1/models; name one with --model")
        target.model = ids[0]
    return models


def build_body(target: Target, spec: RequestSpec) -> bytes:
    body: dict = {"model": target.model}
    if target.endpoint == "chat":
        body["messages"] = spec.messages if spec.messages is not None else [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt if spec.prompt is not None else messages_to_prompt(spec.messages or [])
    if spec.output_len is not None:
        body["max_tokens"] = spec.output_len
        if target.ignore_eos:
            body["ignore_eos"] = True
    if target.temperature is not None:
        body["temperature"] = target.temperature
    body["stream"] = target.stream
    if target.stream and target.usage_stats:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    body.update(target.extra_body)
    return json.dumps(body).encode()


class Client:
    """Sends requests over a Pool and turns what arrives into RequestRecords."""

    def __init__(self, pool: Pool, target: Target, tokenizer: BenchTokenizer | None, t0: float):
        self.pool = pool
        self.target = target
        self.tokenizer = tokenizer
        self.t0 = t0  # the run's clock origin (absolute perf_counter)
        self._headers = target.headers()
        self._path = "/v1/chat/completions" if target.endpoint == "chat" else "/v1/completions"

    async def send(self, rec: RequestRecord, spec: RequestSpec, send_before: float | None = None) -> str | None:
        """Send one request and fill `rec` in place with what arrived; never raises for server faults, which
        become rec.error_kind. Cancellation propagates (the runner marks the record). Returns the answer's
        text (reasoning left out; "" when the request failed): a conversation's next turn resends it.
        With `send_before` (a time on the run's clock), a request that would be sent at or after it is not
        sent and None is returned. The check and `rec.sent` are one clock reading: a client descheduled
        between the runner's decision and the send still never stamps a send past a --duration."""
        headers = dict(self._headers)
        headers["X-Request-Id"] = rec.request_id
        request = self.pool.request_bytes("POST", self._path, headers, build_body(self.target, spec))
        rec.input_len, rec.output_len = spec.input_len, spec.output_len
        sent = time.perf_counter() - self.t0
        if send_before is not None and sent >= send_before:
            return None
        rec.sent = sent
        state = _StreamState(rec, self.t0, self.target.endpoint == "chat")
        await self._send(rec, request, state)
        if not rec.ok:
            return ""
        if not self.target.stream:
            return state.whole_text
        return "".join(x for x, k in zip(state.texts, state.kinds) if not k)

    async def _send(self, rec: RequestRecord, request: bytes, state: "_StreamState") -> None:
        t0 = self.t0
        conn = ex = None
        try:
            async with asyncio.timeout(self.target.timeout):
                conn, ex = await self.pool.start(request, state.on_event if self.target.stream else None)
                try:
                    rec.http_status = await ex.head
                except HTTPError:
                    if not (conn.reused and ex.status == 0):
                        raise
                    # A kept-alive connection the server closed as we wrote: try once on a fresh one, with the
                    # latency clock still running from the first attempt.
                    self.pool.release(conn, reusable=False)
                    conn, ex = await self.pool.start(request, state.on_event if self.target.stream else None)
                    rec.http_status = await ex.head
                await ex.done
            rec.end = ex.last_t - t0
        except HTTPError as e:
            rec.error_kind, rec.error = e.kind, _short(str(e))
            if ex is not None and ex.last_t:
                rec.end = ex.last_t - t0
        except TimeoutError:
            rec.error_kind, rec.error = "timeout", f"no complete response within {self.target.timeout:g} s"
        finally:
            if conn is not None:
                self.pool.release(conn, reusable=rec.error_kind is None)
            if len(rec.chunk_tokens) != len(rec.chunk_times):  # a failed or cut stream: count what did arrive
                self._count_tokens(rec, state)
        if rec.error_kind:
            return
        if rec.http_status != 200:
            rec.error_kind, rec.error = f"http_{rec.http_status}", _short(ex.body.decode("utf-8", "replace"))
            return
        if not self.target.stream:
            state.whole_text = self._whole(rec, bytes(ex.body))
            return
        if not ex.sse:
            rec.error_kind = "malformed_sse"
            rec.error = f"expected text/event-stream, got {ex.headers.get('content-type', 'no content type')!r}"
            return
        if state.error is not None:
            rec.error_kind, rec.error = state.error
            return
        if not state.done and rec.finish_reason is None:
            rec.error_kind, rec.error = "incomplete_stream", "the stream ended without [DONE] or a finish_reason"
            return
        self._count_tokens(rec, state)
        if not rec.output_tokens:
            rec.error_kind, rec.error = "empty_response", "the stream carried no output tokens"

    def _count_tokens(self, rec: RequestRecord, st: "_StreamState") -> None:
        """Tokens per chunk from continuous usage stats when every text-carrying chunk has them, else from the
        tokenizer over the whole text, else one per non-empty chunk. The total is the server's final usage when
        it gave one."""
        texts, usage, kinds = st.texts, st.usage, st.kinds
        reasoning = any(kinds)
        final = next((u for u in reversed(usage) if u is not None), None)
        if usage and all(u is not None for u, x in zip(usage, texts) if x):
            prev, toks = 0, []
            for u in usage:
                cur = prev if u is None else u
                toks.append(max(cur - prev, 0))
                prev = max(prev, cur)
            rec.token_source = "usage"
        elif self.tokenizer is not None:
            toks = self.tokenizer.tokens_per_chunk(texts)
            rec.token_source = "tokenizer"
        else:
            toks = [1 if x else 0 for x in texts]
            rec.token_source = "chunks"
        rec.chunk_tokens = toks
        rec.output_tokens = final if final is not None else sum(toks)
        if reasoning:
            rec.reasoning = True
            rec.first_reasoning = next((t for t, n, k in zip(rec.chunk_times, toks, kinds) if n and k), None)
            rec.first_content = next((t for t, n, k in zip(rec.chunk_times, toks, kinds) if n and not k), None)
            rec.reasoning_tokens = sum(n for n, k in zip(toks, kinds) if k)

    def _whole(self, rec: RequestRecord, raw: bytes) -> str:
        """A non-streamed answer: only E2E and token counts are defined. Returns the answer's text."""
        try:
            obj = json.loads(raw)
            c = obj["choices"][0]
            text = (c.get("message") or {}).get("content") or "" if "message" in c else c.get("text") or ""
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            rec.error_kind, rec.error = "malformed_response", _short(raw.decode("utf-8", "replace"))
            return ""
        rec.finish_reason = c.get("finish_reason")
        u = obj.get("usage") or {}
        rec.prompt_tokens = u.get("prompt_tokens")
        if u.get("completion_tokens") is not None:
            rec.output_tokens, rec.token_source = u["completion_tokens"], "usage"
        elif self.tokenizer is not None:
            rec.output_tokens, rec.token_source = self.tokenizer.count(text), "tokenizer"
        else:
            rec.output_tokens, rec.token_source = 1 if text else 0, "chunks"
        return text


class _StreamState:
    """Per-request SSE handling, called from the connection's data_received: keep it to a parse and appends."""

    __slots__ = ("rec", "t0", "chat", "texts", "usage", "kinds", "done", "error", "whole_text")

    def __init__(self, rec: RequestRecord, t0: float, chat: bool):
        self.rec, self.t0, self.chat = rec, t0, chat
        self.texts: list[str] = []
        self.usage: list[int | None] = []
        self.kinds: list[bool] = []  # True = reasoning
        self.done = False
        self.error: tuple[str, str] | None = None
        self.whole_text = ""  # a non-streamed answer's text

    def on_event(self, t: float, payload: bytes) -> HTTPError | None:
        if payload == b"[DONE]":
            self.done = True
            return None
        try:
            obj = _loads(payload)
        except ValueError:
            return HTTPError("malformed_sse", f"not JSON: {_short(payload.decode('utf-8', 'replace'))}")
        if not isinstance(obj, dict):
            return HTTPError("malformed_sse", f"not a JSON object: {_short(payload.decode('utf-8', 'replace'))}")
        rec = self.rec
        if "error" in obj and not obj.get("choices"):
            err = obj["error"]
            msg = _short(err.get("message", str(err)) if isinstance(err, dict) else str(err))
            self.error = ("stream_error", msg)
            return HTTPError("stream_error", msg)
        text, reasoning = "", False
        choices = obj.get("choices")
        if choices:
            c = choices[0]
            if self.chat:
                d = c.get("delta") or {}
                text = d.get("content") or ""
                r = d.get("reasoning_content") or d.get("reasoning") or ""
                if r and not text:
                    text, reasoning = r, True
            else:
                text = c.get("text") or ""
            if c.get("finish_reason"):
                rec.finish_reason = c["finish_reason"]
        u = obj.get("usage")
        if u:
            self.usage.append(u.get("completion_tokens"))
            rec.prompt_tokens = u.get("prompt_tokens", rec.prompt_tokens)
            details = u.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                rec.cached_tokens = details["cached_tokens"]
        else:
            self.usage.append(None)
        rec.chunk_times.append(t - self.t0)
        self.texts.append(text)
        self.kinds.append(reasoning)
        return None


def _short(text: str, n: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n] + "..."
