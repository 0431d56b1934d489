"""The HTTP layer: OpenAI routes on FastAPI, with auth, admission control, timeouts and cancellation.

Every failure leaves as OpenAI's error object `{"error": {"message", "type", "param", "code"}}`; bad input is a 4xx
naming the problem, never a 500, and it never reaches the engine thread in a state that could disturb others.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferlab import __version__
from inferlab.common.errors import InvalidRequestError
from inferlab.engine.sampling_params import SamplingParams
from inferlab.server.async_engine import (TIMED_OUT, AsyncEngine, EngineDeadError, EngineFailed, QueueFullError,
                                          RequestStream)
from inferlab.server.metrics import CONTENT_TYPE, ServerMetrics
from inferlab.server.protocol import (APIError, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                      CompletionResponse, ErrorResponse, ModelCard, ModelList, usage)


@dataclass(slots=True)
class ServerConfig:
    max_queue: int = 256  # waiting requests beyond the running batch; more get 429
    request_timeout: float | None = None  # seconds from arrival to the last token; None = no limit
    api_keys: dict[str, str | None] = field(default_factory=dict)  # key -> tenant (None: no tenant); empty = open
    retry_after: int = 1  # seconds, sent with 429


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


# What a field accepts, for fields whose type is a union (pydantic reports one error per branch, with internal names).
_FIELD_HINTS = {
    "prompt": "must be a string or a list of token ids (integers >= 0)",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of {\"type\": \"text\", \"text\": ...} parts",
}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """pydantic's errors -> one message naming each offending field, and OpenAI's `param` (the first field)."""
    by_field: dict[str, list[dict]] = {}
    for e in exc.errors():
        if e.get("type") == "json_invalid":
            return f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None
        # Union branches appear in loc as type names ('str', 'list[constrained-int]'): keep the field path only.
        loc = [str(x) for x in e.get("loc", ()) if x != "body" and not _is_type_tag(x)]
        # A union-typed top-level field gets one message, whichever branch pydantic tried last.
        key = loc[0] if loc and loc[0] in ("prompt", "stop") else ".".join(loc)
        by_field.setdefault(key, []).append(e)
    parts: list[str] = []
    for where, errs in by_field.items():
        e = errs[0]
        if not where:
            parts.append("a JSON request body is required" if e.get("type") == "missing"
                         else "the request body must be a JSON object")
            continue
        leaf = where.rsplit(".", 1)[-1]
        if len(errs) > 1 and leaf in _FIELD_HINTS:
            parts.append(f"{where}: {_FIELD_HINTS[leaf]}")
        else:
            parts.append(f"{where}: {e.get('msg')}")
    first = next(iter(by_field), "")
    return "; ".join(parts[:3]) + (f" (and {len(parts) - 3} more)" if len(parts) > 3 else ""), (first.split(".")[0] or None)


def _is_type_tag(x: object) -> bool:
    return isinstance(x, str) and (x in ("str", "int", "float", "bool", "list", "dict") or "[" in x)


_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    429: {"model": ErrorResponse, "description": "Waiting queue full; retry after Retry-After seconds"},
    500: {"model": ErrorResponse, "description": "The engine failed on this request"},
    503: {"model": ErrorResponse, "description": "The engine has stopped"},
    504: {"model": ErrorResponse, "description": "--request-timeout expired"},
}
# With "stream": true the 200 is server-sent events; the schema describes one event.
_SSE_DOC = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk (`chat.completion.chunk` or "
                                                             "`text_completion`), an error object, or `[DONE]`"}}}}}


class _EventStream(StreamingResponse):
    """Server-sent events whose generator is closed as soon as the response ends, however it ends, so that a
    disconnected client's request is aborted now rather than whenever the generator is garbage-collected."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def build_app(engine: Any, max_num_seqs: int, config: ServerConfig | None = None,
              engine_thread: bool = True) -> FastAPI:
    """`engine` follows LLMEngine's contract (add_request/step/abort/has_work/stats/tokenize_prompt, model_name,
    max_model_len); the app owns the thread that steps it from startup to shutdown, unless engine_thread=False:
    then the caller steps it with `app.state.async_engine.run_engine()` (see server/async_engine.py).
    `max_num_seqs` must be the engine's: admission control counts free running slots with it."""
    cfg = config or ServerConfig()
    model_name: str = engine.model_name
    metrics = ServerMetrics(model_name)
    aengine = AsyncEngine(engine, max_num_seqs=max_num_seqs, max_queue=cfg.max_queue, metrics=metrics,
                          own_thread=engine_thread)
    metrics.engine.extra_gauges["inferlab:max_queue"] = cfg.max_queue
    created = int(time.time())
    json_model = json.dumps(model_name)
    # Keys are compared as SHA-256 digests: equal lengths, so hmac.compare_digest is constant-time, and every key is
    # compared on every request so the match position does not leak either.
    key_digests = [(hashlib.sha256(k.encode()).digest(), tenant) for k, tenant in cfg.api_keys.items()]

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start()
        try:
            yield
        finally:
            await aengine.shutdown()

    app = FastAPI(title="inferlab", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible streaming server on the inferlab engine.")
    app.state.async_engine = aengine
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(e)
        return _error_response(APIError(400, message, "invalid_request_error", param, "invalid_value" if param else None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return _error_response(APIError(e.status_code, str(e.detail), kind, None, code, dict(e.headers or {})))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        return _error_response(APIError(500, f"internal server error: {type(e).__name__}: {e}", "server_error"))

    bearer = HTTPBearer(auto_error=False, description="Required when the server runs with --api-key/--api-keys-file")

    def authenticate(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> str | None:
        """Returns the caller's tenant (None when keys carry no tenant or auth is off)."""
        if not key_digests:
            return None
        if creds is None:
            raise APIError(401, "missing API key: send the header `Authorization: Bearer YOUR_KEY`",
                           "invalid_request_error", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        given = hashlib.sha256(creds.credentials.encode()).digest()
        found, tenant = False, None
        for digest, t in key_digests:
            if hmac.compare_digest(given, digest):
                found, tenant = True, t
        if not found:
            raise APIError(401, "incorrect API key provided", "invalid_request_error", None, "invalid_api_key",
                           {"WWW-Authenticate": "Bearer"})
        return tenant

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model `{name}` does not exist; this server serves `{model_name}`",
                           "invalid_request_error", "model", "model_not_found")

    def cache_salt(tenant: str | None, salt: str | None) -> str | None:
        if salt == "":
            raise APIError(400, "cache_salt must be a non-empty string", param="cache_salt", code="invalid_value")
        if tenant is None and salt is None:
            return None
        # A JSON pair cannot collide across tenants: a tenant's requests share cache only with that tenant.
        return json.dumps([tenant, salt])

    async def submit(rid: str, prompt: Any, params: SamplingParams, salt: str | None, fill_context: bool,
                     arrival: float, prompt_param: str) -> RequestStream:
        try:
            return await aengine.add_request(rid, prompt, params, salt, fill_context, arrival)
        except QueueFullError as e:
            raise APIError(429, str(e), "rate_limit_error", None, "rate_limit_exceeded",
                           {"Retry-After": str(cfg.retry_after)}) from None
        except InvalidRequestError as e:
            param = prompt_param if e.param in (None, "prompt") else e.param
            raise APIError(400, str(e), "invalid_request_error", param, "invalid_value") from None
        except EngineDeadError as e:
            raise APIError(503, str(e), "server_error", None, "engine_dead") from None

    def start_timer(stream: RequestStream) -> asyncio.TimerHandle | None:
        if cfg.request_timeout is None:
            return None
        loop = asyncio.get_running_loop()
        left = cfg.request_timeout - (time.perf_counter() - stream.arrival_time)
        return loop.call_at(loop.time() + left, stream.expire)

    def timeout_error(rid: str) -> APIError:
        aengine.abort(rid)
        metrics.timeouts.inc()
        return APIError(504, f"the request did not finish within --request-timeout {cfg.request_timeout:g} s "
                             f"and was aborted", "timeout_error", None, "request_timeout")

    async def collect(stream: RequestStream) -> tuple[str, Any]:
        parts: list[str] = []
        while True:
            item = await stream.queue.get()
            if item is TIMED_OUT:
                raise timeout_error(stream.request_id)
            if isinstance(item, EngineFailed):
                raise APIError(503, f"the engine stopped: {item.error!r}", "server_error", None, "engine_dead")
            parts.append(item.new_text)
            if item.finished:
                if item.finish_reason == "error":
                    raise APIError(500, f"the engine failed on this request: {item.error}", "server_error", None,
                                   "engine_error")
                return "".join(parts), item

    async def until_disconnected(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def complete(request: Request, stream: RequestStream) -> tuple[str, Any] | None:
        """Non-streaming: the whole answer, or None when the client left first (the request is then aborted)."""
        timer = start_timer(stream)
        result = asyncio.ensure_future(collect(stream))
        gone = asyncio.ensure_future(until_disconnected(request))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
            if result.done():
                return result.result()
            return None
        finally:
            for t in (result, gone):
                t.cancel()
            if timer:
                timer.cancel()
            aengine.abort(stream.request_id)  # no-op when it finished

    async def events(stream: RequestStream, head: str, tail: str, first: str | None, obj: str,
                     include_usage: bool) -> AsyncIterator[str]:
        """SSE lines: `head + json(text) + tail(finish_reason)`; one chunk per engine delta that has text."""
        rid = stream.request_id
        timer = start_timer(stream)
        try:
            if first is not None:
                yield first
            while True:
                item = await stream.queue.get()
                if item is TIMED_OUT:
                    yield "data: " + json.dumps(timeout_error(rid).body()) + "\n\ndata: [DONE]\n\n"
                    return
                if isinstance(item, EngineFailed):
                    err = APIError(503, f"the engine stopped: {item.error!r}", "server_error", None, "engine_dead")
                    yield "data: " + json.dumps(err.body()) + "\n\ndata: [DONE]\n\n"
                    return
                if not item.finished:
                    if item.new_text:
                        yield head + json.dumps(item.new_text) + tail + "null}]}\n\n"
                    continue
                if item.finish_reason == "error":
                    err = APIError(500, f"the engine failed on this request: {item.error}", "server_error", None,
                                   "engine_error")
                    yield "data: " + json.dumps(err.body()) + "\n\ndata: [DONE]\n\n"
                    return
                stop = "" if item.stop_reason is None else f',"stop_reason":{json.dumps(item.stop_reason)}'
                yield head + json.dumps(item.new_text) + tail + json.dumps(item.finish_reason) + stop + "}]}\n\n"
                if include_usage:
                    yield "data: " + json.dumps({
                        "id": rid, "object": obj, "created": int(time.time()), "model": model_name, "choices": [],
                        "usage": usage(item.num_prompt_tokens, item.num_output_tokens, item.num_cached_tokens)}) + "\n\n"
                yield "data: [DONE]\n\n"
                return
        finally:
            if timer:
                timer.cancel()
            aengine.abort(rid)  # no-op when finished; otherwise the client left or timed out

    # ------------------------------------------------------------ routes

    @app.get("/health", summary="Liveness: 200 (empty body) while the engine thread runs", response_class=Response,
             responses={200: {"description": "alive"}, 503: _ERROR_RESPONSES[503]})
    async def health() -> Response:
        if aengine.error is not None:
            return _error_response(APIError(503, f"the engine stopped: {aengine.error!r}", "server_error", None,
                                            "engine_dead"))
        return Response(status_code=200)

    @app.get("/metrics", summary="Prometheus metrics (vLLM names)", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus() -> Response:
        metrics.engine.extra_gauges["inferlab:num_requests_in_flight"] = aengine.num_in_flight
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, responses={401: _ERROR_RESPONSES[401]})
    async def models(_: str | None = Depends(authenticate)) -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, created=created, max_model_len=engine.max_model_len)])

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={200: {"content": _SSE_DOC}, **_ERROR_RESPONSES})
    async def completions(body: CompletionRequest, request: Request, tenant: str | None = Depends(authenticate)):
        arrival = time.perf_counter()
        check_model(body.model)
        prompt = body.check()
        params = body.sampling_params(body.max_tokens)
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = await submit(rid, prompt, params, cache_salt(tenant, body.cache_salt), False, arrival, "prompt")
        if body.stream:
            head = (f'data: {{"id":"{rid}","object":"text_completion","created":{int(time.time())},'
                    f'"model":{json_model},"choices":[{{"index":0,"text":')
            return _EventStream(events(stream, head, ',"logprobs":null,"finish_reason":', None, "text_completion",
                                       body.include_usage))
        done = await complete(request, stream)
        if done is None:
            return Response(status_code=499)  # nobody reads it: the client closed the connection
        text, last = done
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason,
                             "stop_reason": last.stop_reason}],
                "usage": usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)}

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={200: {"content": _SSE_DOC}, **_ERROR_RESPONSES})
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               tenant: str | None = Depends(authenticate)):
        arrival = time.perf_counter()
        check_model(body.model)
        messages = body.check()
        max_tokens = body.max_output_tokens
        params = body.sampling_params(max_tokens or 1)  # unset: set from the prompt length on the engine thread
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await submit(rid, messages, params, cache_salt(tenant, body.cache_salt), max_tokens is None,
                              arrival, "messages")
        if body.stream:
            start = (f'data: {{"id":"{rid}","object":"chat.completion.chunk","created":{int(time.time())},'
                     f'"model":{json_model},"choices":[{{"index":0,"delta":')
            first = start + '{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
            return _EventStream(events(stream, start + '{"content":', '},"logprobs":null,"finish_reason":', first,
                                       "chat.completion.chunk", body.include_usage))
        done = await complete(request, stream)
        if done is None:
            return Response(status_code=499)
        text, last = done
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": last.finish_reason, "stop_reason": last.stop_reason}],
                "usage": usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)}

    return app
