"""The HTTP client: one aiohttp session carrying hundreds of streams, timestamping every SSE event on arrival.

Work on the event loop per received block is kept to a timestamp, a split and one json.loads per event, so that
with hundreds of streams a chunk is stamped close to when its bytes arrived; token counting by tokenizer runs
once per request, after its stream has ended.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from inferlab.bench.records import RequestRecord
from inferlab.bench.tokenizer import BenchTokenizer
from inferlab.bench.workload import RequestSpec, messages_to_prompt


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

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ("/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions")

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
            raise BenchError(f"the server lists no models on /v1/models; name one with --model")
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


class _Malformed(Exception):
    pass


class Client:
    def __init__(self, session: aiohttp.ClientSession, target: Target, tokenizer: BenchTokenizer | None, t0: float):
        self.session = session
        self.target = target
        self.tokenizer = tokenizer
        self.t0 = t0  # the run's clock origin (absolute perf_counter)
        self._headers = target.headers()

    async def send(self, rec: RequestRecord, spec: RequestSpec) -> None:
        """Send one request and fill `rec` in place with what arrived; never raises for server faults, which
        become rec.error_kind. Cancellation propagates (the runner marks the record)."""
        body = build_body(self.target, spec)
        headers = dict(self._headers)
        headers["X-Request-Id"] = rec.request_id
        rec.input_len, rec.output_len = spec.input_len, spec.output_len
        texts: list[str] = []
        usage: list[int | None] = []
        kinds: list[bool] = []  # True = reasoning
        try:
            await self._send(rec, body, headers, texts, usage, kinds)
        finally:
            if len(rec.chunk_tokens) != len(rec.chunk_times):  # a failed or cut stream: count what did arrive
                self._count_tokens(rec, texts, usage, kinds)

    async def _send(self, rec: RequestRecord, body: bytes, headers: dict, texts: list[str],
                    usage: list[int | None], kinds: list[bool]) -> None:
        perf = time.perf_counter
        t0 = self.t0
        try:
            async with asyncio.timeout(self.target.timeout):
                rec.sent = perf() - t0
                async with self.session.post(self.target.url, data=body, headers=headers) as resp:
                    rec.http_status = resp.status
                    if resp.status != 200:
                        text = await resp.text(errors="replace")
                        rec.end = perf() - t0
                        rec.error_kind, rec.error = f"http_{resp.status}", _short(text)
                        return
                    if not self.target.stream:
                        raw = await resp.read()
                        rec.end = perf() - t0
                        self._whole(rec, raw)
                        return
                    done = await self._read_stream(resp, rec, texts, usage, kinds)
                    rec.end = perf() - t0
        except TimeoutError:
            rec.error_kind, rec.error = "timeout", f"no complete response within {self.target.timeout:g} s"
            return
        except _Malformed as e:
            rec.end = perf() - t0
            rec.error_kind, rec.error = "malformed_sse", str(e)
            return
        except aiohttp.ClientConnectorError as e:
            rec.error_kind, rec.error = "connection_refused", _short(str(e))
            return
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError,
                ConnectionError) as e:
            rec.error_kind, rec.error = "connection_dropped", _short(f"{type(e).__name__}: {e}")
            return
        except aiohttp.ClientError as e:
            rec.error_kind, rec.error = "client_error", _short(f"{type(e).__name__}: {e}")
            return
        if rec.error_kind:
            return
        if not done and rec.finish_reason is None:
            rec.error_kind, rec.error = "incomplete_stream", "the stream ended without [DONE] or a finish_reason"
            return
        self._count_tokens(rec, texts, usage, kinds)
        if not rec.output_tokens:
            rec.error_kind, rec.error = "empty_response", "the stream carried no output tokens"

    async def _read_stream(self, resp, rec, texts, usage, kinds) -> bool:
        perf, t0, loads = time.perf_counter, self.t0, json.loads
        chat = self.target.endpoint == "chat"
        times = rec.chunk_times
        buf = b""
        done = False
        async for data in resp.content.iter_any():
            t = perf() - t0  # every event completed by this block arrived now
            buf += data
            if b"\r" in buf:
                buf = buf.replace(b"\r\n", b"\n")
            while True:
                cut = buf.find(b"\n\n")
                if cut < 0:
                    break
                event, buf = buf[:cut], buf[cut + 2:]
                payload = _data(event)
                if payload is None:
                    continue
                if payload == b"[DONE]":
                    done = True
                    continue
                try:
                    obj = loads(payload)
                except ValueError:
                    raise _Malformed(f"not JSON: {_short(payload.decode('utf-8', 'replace'))}") from None
                if not isinstance(obj, dict):
                    raise _Malformed(f"not a JSON object: {_short(payload.decode('utf-8', 'replace'))}")
                if "error" in obj and not obj.get("choices"):
                    err = obj["error"]
                    rec.error_kind = "stream_error"
                    rec.error = _short(err.get("message", str(err)) if isinstance(err, dict) else str(err))
                    return done
                text, reasoning = "", False
                choices = obj.get("choices")
                if choices:
                    c = choices[0]
                    if chat:
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
                    usage.append(u.get("completion_tokens"))
                    rec.prompt_tokens = u.get("prompt_tokens", rec.prompt_tokens)
                    details = u.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        rec.cached_tokens = details["cached_tokens"]
                else:
                    usage.append(None)
                times.append(t)
                texts.append(text)
                kinds.append(reasoning)
        return done

    def _count_tokens(self, rec: RequestRecord, texts: list[str], usage: list[int | None], kinds: list[bool]) -> None:
        """Tokens per chunk from continuous usage stats when every text-carrying chunk has them, else from the
        tokenizer over the whole text, else one per non-empty chunk. The total is the server's final usage when
        it gave one."""
        if any(kinds):
            rec.reasoning = True
            rec.first_content = next((t for t, x, k in zip(rec.chunk_times, texts, kinds) if x and not k), None)
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

    def _whole(self, rec: RequestRecord, raw: bytes) -> None:
        """A non-streamed answer: only E2E and token counts are defined."""
        try:
            obj = json.loads(raw)
            c = obj["choices"][0]
            text = (c.get("message") or {}).get("content") or "" if "message" in c else c.get("text") or ""
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            rec.error_kind, rec.error = "malformed_response", _short(raw.decode("utf-8", "replace"))
            return
        rec.finish_reason = c.get("finish_reason")
        u = obj.get("usage") or {}
        rec.prompt_tokens = u.get("prompt_tokens")
        if u.get("completion_tokens") is not None:
            rec.output_tokens, rec.token_source = u["completion_tokens"], "usage"
        elif self.tokenizer is not None:
            rec.output_tokens, rec.token_source = self.tokenizer.count(text), "tokenizer"
        else:
            rec.output_tokens, rec.token_source = 1 if text else 0, "chunks"


def _data(event: bytes) -> bytes | None:
    """The data of one SSE event (several data lines join with a newline); None for comments and empties."""
    if event.startswith(b"data:") and b"\n" not in event:
        return event[5:].strip()
    parts = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(parts) if parts else None


def _short(text: str, n: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n] + "..."
