"""The HTTP layer: OpenAI routes on FastAPI, with auth, admission control, timeouts and cancellation.

Every failure leaves as OpenAI's error object `{"error": {"message", "type", "param", "code"}}`; bad input is a 4xx
naming the problem, never a 500, and it never reaches the engine thread in a state that could disturb others.
The routes are small functions; what they share (the engine's event-loop side, the config, the API keys, the
metrics) is one OpenAIServer in `app.state.server`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferlab import __version__
from inferlab.common.errors import InvalidRequestError
from inferlab.engine.outputs import RequestOutput
from inferlab.server.async_engine import (TIMED_OUT, AsyncEngine, EngineDeadError, EngineFailed, QueueFullError,
                                          RequestFailed, RequestStream, ShuttingDown)
from inferlab.server.http_limits import DEFAULT_MAX_REQUEST_BYTES, RequestLimits
from inferlab.server.engine_client import EngineClient
from inferlab.server.logprobs import CompletionLogprobsFormatter, chat_logprobs
from inferlab.server.metrics import CONTENT_TYPE, ServerMetrics
from inferlab.server.protocol import (SSE_DONE, APIError, invalid, ChatCompletionChunk, ChatCompletionRequest,
                                      ChatCompletionResponse, ChatChoice, ChatStreamChoice, AssistantMessage,
                                      CompletionChoice, CompletionChunk, CompletionRequest, CompletionResponse,
                                      DeltaFunctionCall, DeltaMessage, DeltaToolCall, ErrorResponse, FunctionCall,
                                      ModelCard, ModelList, RoleDelta, ToolCall, ToolCallsDelta, UsageInfo, sse,
                                      sse_with_text)
from inferlab.server.tools import ToolPlan, new_call_id


@dataclass(slots=True)
class ServerConfig:
    max_queue: int = 256  # waiting requests beyond the running batch; more get 429
    request_timeout: float | None = None  # seconds from arrival to the last token; None = no limit
    api_keys: dict[str, str | None] = field(default_factory=dict)  # key -> tenant (None: no tenant); empty = open
    retry_after: int = 1  # seconds, sent with 429
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get 413 before they are read
    tokenizer_threads: int = 2  # the pool that tokenizes prompts off the engine thread


def build_app(engine: EngineClient, config: ServerConfig | None = None) -> FastAPI:
    """The OpenAI API on `engine`. Whoever runs the app steps the engine, on the thread it chooses, with
    `app.state.server.engine.run_engine()` (server/cli.py: the main thread, uvicorn on another)."""
    server = OpenAIServer(engine, config or ServerConfig())
    app = FastAPI(title="inferlab", version=__version__, lifespan=server.lifespan,
                  description="OpenAI-compatible streaming server on the inferlab engine.",
                  exception_handlers=_EXCEPTION_HANDLERS)  # type: ignore[arg-type]
    app.state.server = server
    app.include_router(router)
    # Outermost: the API key and the body size are checked before FastAPI reads and parses the body.
    app.add_middleware(RequestLimits, authenticate=server.authenticate_header, max_body_bytes=server.config.max_request_bytes,
                       rejected=server.metrics.rejected)
    return app


class OpenAIServer:
    """What the routes share, and the steps of a request they have in common: submit, then collect or events."""

    def __init__(self, engine: EngineClient, config: ServerConfig):
        self.config = config
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        # No token of the vocabulary decodes to more characters than this, so a prompt longer than max_model_len
        # times it cannot fit, and is refused before anyone spends time tokenizing it.
        self.max_prompt_chars = engine.max_model_len * engine.max_token_chars
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine.model_name)
        self.metrics.engine.extra_gauges["inferlab:max_queue"] = config.max_queue
        self.metrics.engine.block_size = engine.config.block_size
        self.engine = AsyncEngine(engine, config.max_queue, self.metrics, config.tokenizer_threads)
        # Keys are compared as SHA-256 digests: equal lengths, so hmac.compare_digest is constant-time, and every key
        # is compared on every request so the match position does not leak either.
        self._key_digests = [(hashlib.sha256(k.encode()).digest(), tenant) for k, tenant in config.api_keys.items()]

    @asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        self.engine.start()
        try:
            yield
        finally:
            await self.engine.shutdown()

    def authenticate_header(self, authorization: bytes | None) -> str | None:
        """The caller's tenant from its raw Authorization header (None when keys carry no tenant or auth is off);
        raises a 401 APIError. Called by RequestLimits, before the body is read."""
        if not self._key_digests:
            return None
        scheme, _, key = (authorization or b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(401, "missing API key: send the header `Authorization: Bearer YOUR_KEY`",
                           "invalid_request_error", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        given = hashlib.sha256(key.strip().encode("latin-1")).digest()
        found, tenant = False, None
        for digest, t in self._key_digests:
            if hmac.compare_digest(given, digest):
                found, tenant = True, t
        if not found:
            raise APIError(401, "incorrect API key provided", "invalid_request_error", None, "invalid_api_key",
                           {"WWW-Authenticate": "Bearer"})
        return tenant

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model `{name}` does not exist; this server serves `{self.model_name}`",
                           "invalid_request_error", "model", "model_not_found")

    async def submit(self, rid: str, body: CompletionRequest | ChatCompletionRequest,
                     tenant: str | None) -> RequestStream:
        """Checks the request and hands it to the engine thread; every refusal is an APIError."""
        arrival = time.perf_counter()
        self.check_model(body.model)
        prompt = body.check()
        self._check_fits(prompt, body)
        max_tokens = body.max_output_tokens  # None: until the context is full
        # None: sized from the prompt length once tokenized; 0: scoring the prompt (echo + logprobs)
        params = body.sampling_params(1 if max_tokens is None else max_tokens)
        try:
            return await self.engine.add_request(rid, prompt, params, _cache_salt(tenant, body.cache_salt),
                                                 max_tokens is None, arrival)
        except RequestFailed as e:
            self.metrics.request_failed(e.stage)
            raise APIError(500, str(e), "server_error", None, "engine_error") from None
        except QueueFullError as e:
            raise APIError(429, str(e), "rate_limit_error", None, "rate_limit_exceeded",
                           {"Retry-After": str(self.config.retry_after)}) from None
        except InvalidRequestError as e:
            param = body.prompt_field if e.param in (None, "prompt") else e.param
            raise APIError(400, str(e), "invalid_request_error", param, "invalid_value") from None
        except EngineDeadError as e:
            raise APIError(503, str(e), "server_error", None, "engine_dead") from None

    def _check_fits(self, prompt: str | list, body: CompletionRequest | ChatCompletionRequest) -> None:
        """What can be refused before tokenizing: a prompt too long in characters, token ids and top_k beyond the
        vocabulary (the sampler's tensors are sized by it)."""
        field = body.prompt_field
        if (max_tokens := body.max_output_tokens) is not None and max_tokens >= self.max_model_len:
            raise invalid(f"max_tokens is {max_tokens}, but this model's maximum context length is "
                          f"{self.max_model_len} tokens, prompt included", "max_tokens")
        if isinstance(prompt, dict):  # messages with tools (ChatCompletionRequest.check)
            prompt = prompt["messages"]
        if isinstance(prompt, str):
            chars = len(prompt)
        elif prompt and isinstance(prompt[0], dict):
            chars = sum(len(m.get("content") or "") for m in prompt)
        else:
            chars = 0
            if len(prompt) > self.max_model_len:
                raise invalid(f"the prompt is {len(prompt)} tokens; this model's maximum context length is "
                              f"{self.max_model_len} tokens", field)
            if (bad := next((t for t in prompt if t >= self.vocab_size), None)) is not None:
                raise invalid(f"token id {bad} is out of the vocabulary range [0, {self.vocab_size})", field)
        if chars > self.max_prompt_chars:
            raise invalid(f"the prompt is {chars} characters, more than can fit in this model's maximum context "
                          f"length of {self.max_model_len} tokens (at most {self.max_prompt_chars} characters)", field)
        if body.top_k is not None and body.top_k > self.vocab_size:
            raise invalid(f"top_k must be at most the vocabulary size {self.vocab_size} (or -1/0 for no cut), got "
                          f"{body.top_k}", "top_k")
        if body.stop_token_ids and (bad := max(body.stop_token_ids)) >= self.vocab_size:
            raise invalid(f"stop_token_ids: token id {bad} is out of the vocabulary range [0, {self.vocab_size})",
                          "stop_token_ids")

    async def collect(self, request: Request, stream: RequestStream) -> list[tuple[str, RequestOutput]] | None:
        """Non-streaming: each choice's whole text and finishing delta, in choice order, or None when the client
        left first (the request is then aborted)."""
        timer = self._start_timer(stream)
        result = asyncio.ensure_future(self._whole_text(stream))
        gone = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
            return result.result() if result.done() else None
        finally:
            for t in (result, gone):
                t.cancel()
            if timer:
                timer.cancel()
            self.engine.abort(stream.request_id)  # no-op when it finished

    async def events(self, stream: RequestStream, chunk: Callable[..., CompletionChunk | ChatCompletionChunk],
                     first: str | None, include_usage: bool,
                     detailed: Callable[[RequestOutput], CompletionChunk | ChatCompletionChunk | None] | None = None,
                     ) -> AsyncIterator[str]:
        """SSE lines: `first`, one chunk per engine delta that has text, the last with its finish_reason, the usage
        chunk when asked for, then [DONE]. `chunk(text, finish_reason=None, stop_reason=None)` builds one chunk.
        A request that asked for more than text per token (logprobs, echo) passes `detailed(delta)`, which builds
        each delta's whole chunk; the others keep the spliced-text fast path."""
        token_line = sse_with_text(chunk)
        timer = self._start_timer(stream)
        try:
            if first is not None:
                yield first
            finished: list[RequestOutput] = []  # with n > 1, each choice's last delta (`detailed` is then set)
            while not (out := await self._next_output(stream)).finished or len(finished) + 1 < stream.num_choices:
                if out.finished:
                    finished.append(out)
                if detailed is not None:
                    if (c := detailed(out)) is not None:  # None: held back (a tool call known only when whole)
                        yield sse(c)
                elif out.new_text:
                    yield token_line(out.new_text)
            last = detailed(out) if detailed is not None else chunk(out.new_text, out.finish_reason, out.stop_reason)
            yield sse(last)
            if include_usage:
                yield sse(last.model_copy(update={"choices": [], "usage": UsageInfo.of(out, *finished)}))
            yield SSE_DONE
        except APIError as e:  # the status line is long gone: the error travels as an event
            yield sse(e.body()) + SSE_DONE
        finally:
            if timer:
                timer.cancel()
            self.engine.abort(stream.request_id)  # no-op when finished; otherwise the client left or timed out

    async def _whole_text(self, stream: RequestStream) -> list[tuple[str, RequestOutput]]:
        """Per choice: the whole text, and the finishing delta carrying the choice's logprobs and first-delta
        fields."""
        parts: dict[int, list[str]] = {}
        logprobs: dict[int, list] = {}
        first: dict[int, RequestOutput] = {}
        done: dict[int, tuple[str, RequestOutput]] = {}
        while len(done) < stream.num_choices:
            out = await self._next_output(stream)
            i = out.index
            first.setdefault(i, out)
            parts.setdefault(i, []).append(out.new_text)
            logprobs.setdefault(i, []).extend(out.logprobs or ())
            if out.finished:
                if out.logprobs is not None:
                    out.logprobs = logprobs[i]
                out.prompt_logprobs, out.prompt_text = first[i].prompt_logprobs, first[i].prompt_text
                done[i] = "".join(parts[i]), out
        return [done[i] for i in sorted(done)]

    async def _next_output(self, stream: RequestStream) -> RequestOutput:
        """The stream's next delta; a timeout, a dead engine or a failed request raise their APIError."""
        item = await stream.queue.get()
        if item is TIMED_OUT:
            self.engine.abort(stream.request_id)
            self.metrics.timeouts.inc()
            raise APIError(504, f"the request did not finish within --request-timeout {self.config.request_timeout:g} "
                                f"s and was aborted", "timeout_error", None, "request_timeout")
        if isinstance(item, EngineFailed):
            raise _engine_dead(item.error)
        if isinstance(item, ShuttingDown):
            raise APIError(503, f"the server is shutting down: {item.reason}", "server_error", None, "server_shutdown")
        if item.finish_reason == "error":
            raise APIError(500, f"request {stream.request_id} failed in {item.error_stage or 'the engine'}: "
                                f"{item.error}", "server_error", None, "engine_error")
        return item

    def _start_timer(self, stream: RequestStream) -> asyncio.TimerHandle | None:
        if self.config.request_timeout is None:
            return None
        loop = asyncio.get_running_loop()
        left = self.config.request_timeout - (time.perf_counter() - stream.arrival_time)
        return loop.call_at(loop.time() + left, stream.expire)


def _cache_salt(tenant: str | None, salt: str | None) -> str | None:
    if salt == "":
        raise APIError(400, "cache_salt must be a non-empty string", param="cache_salt", code="invalid_value")
    if tenant is None and salt is None:
        return None
    # A JSON pair cannot collide across tenants: a tenant's requests share cache only with that tenant.
    return json.dumps([tenant, salt])


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """Server-sent events whose generator is closed as soon as the response ends, however it ends, so that a
    disconnected client's request is aborted now rather than whenever the generator is garbage-collected."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


# ---------------------------------------------------------------- routes

router = APIRouter()
_bearer = HTTPBearer(auto_error=False, description="Required when the server runs with --api-key/--api-keys-file")

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    429: {"model": ErrorResponse, "description": "Waiting queue full; retry after Retry-After seconds"},
    500: {"model": ErrorResponse, "description": "The engine failed on this request"},
    413: {"model": ErrorResponse, "description": "Request body larger than --max-request-bytes"},
    503: {"model": ErrorResponse, "description": "The engine has stopped, or the server is shutting down"},
    504: {"model": ErrorResponse, "description": "--request-timeout expired"},
}
# With "stream": true the 200 is server-sent events; the schema describes one event.
_SSE_DOC = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk (`chat.completion.chunk` or "
                                                             "`text_completion`), an error object, or `[DONE]`"}}}}}


def _server(request: Request) -> OpenAIServer:
    return request.app.state.server


def _tenant(request: Request, _: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> str | None:
    """RequestLimits checked the key before the body was read and left the tenant in the request's state; the
    HTTPBearer dependency only documents the scheme in the OpenAPI schema."""
    return request.scope.get("state", {}).get("tenant")


@router.get("/health", summary="Liveness: 200 (empty body) while the engine thread runs", response_class=Response,
            responses={200: {"description": "alive"}, 503: _ERROR_RESPONSES[503]})
async def health(request: Request) -> Response:
    if (error := _server(request).engine.error) is not None:
        raise _engine_dead(error)
    return Response(status_code=200)


@router.get("/metrics", summary="Prometheus metrics (vLLM names)", response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
async def prometheus(request: Request) -> Response:
    s = _server(request)
    s.metrics.engine.extra_gauges["inferlab:num_requests_in_flight"] = s.engine.num_in_flight
    return Response(s.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models", response_model=ModelList, responses={401: _ERROR_RESPONSES[401]})
async def models(request: Request, _: str | None = Depends(_tenant)) -> ModelList:
    s = _server(request)
    return ModelList(data=[ModelCard(id=s.model_name, created=s.created, max_model_len=s.max_model_len)])


@router.post("/v1/completions", response_model=CompletionResponse,
             responses={200: {"content": _SSE_DOC}, **_ERROR_RESPONSES})
async def completions(body: CompletionRequest, request: Request, tenant: str | None = Depends(_tenant)):
    s = _server(request)
    rid = f"cmpl-{uuid.uuid4().hex}"
    stream = await s.submit(rid, body, tenant)
    if body.stream:
        created = int(time.time())

        def chunk(text: str, finish_reason: str | None = None, stop_reason: int | str | None = None) -> CompletionChunk:
            return CompletionChunk(id=rid, created=created, model=s.model_name, choices=[CompletionChoice(
                text=text, finish_reason=finish_reason, stop_reason=stop_reason)])

        detailed = None
        if body.logprobs is not None or body.echo or stream.num_choices > 1:
            choices: dict[int, Callable[[str, RequestOutput], CompletionChoice]] = {}

            def detailed(out: RequestOutput) -> CompletionChunk:
                choice = choices.setdefault(out.index, _completion_choice(body))
                return CompletionChunk(id=rid, created=created, model=s.model_name,
                                       choices=[choice(out.new_text, out)])

        return _EventStream(s.events(stream, chunk, None, body.include_usage, detailed))
    if (done := await s.collect(request, stream)) is None:
        return Response(status_code=499)  # nobody reads it: the client closed the connection
    return CompletionResponse(id=rid, model=s.model_name, usage=UsageInfo.of(*(last for _, last in done)),
                              choices=[_completion_choice(body)(text, last) for text, last in done])


def _completion_choice(body: CompletionRequest) -> Callable[[str, RequestOutput], CompletionChoice]:
    """`(text, delta) -> choice` for one completion choice: with echo, the prompt's text (and logprobs) come
    first, on the first delta."""
    fmt = CompletionLogprobsFormatter() if body.logprobs is not None else None

    def choice(text: str, out: RequestOutput) -> CompletionChoice:
        entries = list(out.logprobs or [])
        if body.echo and out.prompt_text is not None:
            text = out.prompt_text + text
            entries = list(out.prompt_logprobs or []) + entries
        return CompletionChoice(index=out.index, text=text, logprobs=fmt(entries) if fmt is not None else None,
                                finish_reason=out.finish_reason if out.finished else None,
                                stop_reason=out.stop_reason if out.finished else None)

    return choice


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses={200: {"content": _SSE_DOC}, **_ERROR_RESPONSES})
async def chat_completions(body: ChatCompletionRequest, request: Request, tenant: str | None = Depends(_tenant)):
    s = _server(request)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    stream = await s.submit(rid, body, tenant)
    if body.stream:
        created = int(time.time())

        def chunk(text: str, finish_reason: str | None = None, stop_reason: int | str | None = None,
                  role: str | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=created, model=s.model_name, choices=[ChatStreamChoice(
                delta=DeltaMessage(content=text) if role is None else RoleDelta(role=role, content=text),
                finish_reason=finish_reason, stop_reason=stop_reason)])

        detailed = None
        first = sse(chunk("", role="assistant"))
        plan = body.tool_plan()
        if body.logprobs or stream.num_choices > 1 or plan is not None:
            tool_deltas = _ToolCallDeltas(plan) if plan is not None else None

            def detailed(out: RequestOutput) -> ChatCompletionChunk | None:
                delta = DeltaMessage(content=out.new_text)
                finish = out.finish_reason if out.finished else None
                if tool_deltas is not None:
                    if (d := tool_deltas(out)) is None:
                        return None
                    delta, finish = d
                return ChatCompletionChunk(id=rid, created=created, model=s.model_name, choices=[ChatStreamChoice(
                    index=out.index, delta=delta, finish_reason=finish,
                    logprobs=chat_logprobs(out.logprobs or []) if body.logprobs else None,
                    stop_reason=out.stop_reason if out.finished else None)])

            first = "".join(sse(ChatCompletionChunk(id=rid, created=created, model=s.model_name, choices=[
                ChatStreamChoice(index=i, delta=RoleDelta(role="assistant"), finish_reason=None)]))
                for i in range(stream.num_choices))

        return _EventStream(s.events(stream, chunk, first, body.include_usage, detailed))
    if (done := await s.collect(request, stream)) is None:
        return Response(status_code=499)
    plan = body.tool_plan()
    choices = []
    for text, last in done:
        message, finish = AssistantMessage(content=text), last.finish_reason
        calls = plan.calls(text) if plan is not None and last.finish_reason != "length" else None
        if calls:
            message = AssistantMessage(content=None, tool_calls=[
                ToolCall(id=new_call_id(), function=FunctionCall(name=n, arguments=a)) for n, a in calls])
            finish = "stop" if plan.mode == "named" else "tool_calls"  # type: ignore[union-attr]
        choices.append(ChatChoice(index=last.index, message=message, finish_reason=finish,
                                  stop_reason=last.stop_reason,
                                  logprobs=chat_logprobs(last.logprobs or []) if body.logprobs else None))
    return ChatCompletionResponse(id=rid, model=s.model_name, usage=UsageInfo.of(*(last for _, last in done)),
                                  choices=choices)


class _ToolCallDeltas:
    """A chat stream's deltas under tools (server/tools.py): a named function's arguments stream as they are
    generated; a required or auto output is held and sent whole at its end, as tool calls or as content."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text: dict[int, str] = {}
        self.call_ids: dict[int, str] = {}

    def __call__(self, out: RequestOutput) -> tuple[DeltaMessage | ToolCallsDelta, str | None] | None:
        plan, i = self.plan, out.index
        finish = out.finish_reason if out.finished else None
        if plan.streams_arguments:
            fn = DeltaFunctionCall(arguments=out.new_text)
            call = DeltaToolCall(function=fn)
            if i not in self.call_ids:
                self.call_ids[i] = call.id = new_call_id()
                call.type, fn.name = "function", plan.name
            return ToolCallsDelta(tool_calls=[call]), finish
        self.text[i] = self.text.get(i, "") + out.new_text
        if not out.finished:
            return None
        text = self.text.pop(i)
        calls = plan.calls(text) if out.finish_reason != "length" else None
        if not calls:
            return DeltaMessage(content=text), finish
        return ToolCallsDelta(tool_calls=[
            DeltaToolCall(index=k, id=new_call_id(), type="function", function=DeltaFunctionCall(name=n, arguments=a))
            for k, (n, a) in enumerate(calls)]), "tool_calls"


# ---------------------------------------------------------------- errors


async def _error_response(request: Request, e: Exception) -> JSONResponse:
    """Every failure as OpenAI's error object: ours (APIError), pydantic's, Starlette's (404, 405) and the rest."""
    if isinstance(e, RequestValidationError):
        message, param = _validation_message(e)
        e = APIError(400, message, "invalid_request_error", param, "invalid_value" if param else None)
    elif isinstance(e, StarletteHTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status_code)
        detail = str(e.detail)
        if e.status_code == 400 and e.__cause__ is not None:  # FastAPI could not parse the body: say why
            cause = e.__cause__
            detail = ("the JSON body is nested too deeply" if isinstance(cause, RecursionError)
                      else f"cannot parse the request body: {type(cause).__name__}: {cause}")
        e = APIError(e.status_code, detail, kind, None, code, dict(e.headers or {}))
    elif not isinstance(e, APIError):
        e = APIError(500, f"internal server error: {type(e).__name__}: {e}", "server_error")
    if 400 <= e.status < 500 and e.status not in (401, 413, 429):  # those three count where they are raised
        request.app.state.server.metrics.rejected("invalid")
    return JSONResponse(e.body().model_dump(), status_code=e.status, headers=e.headers)


_EXCEPTION_HANDLERS = dict.fromkeys([APIError, RequestValidationError, StarletteHTTPException, Exception],
                                    _error_response)


def _engine_dead(error: BaseException) -> APIError:
    return APIError(503, f"the engine stopped: {error!r}", "server_error", None, "engine_dead")


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
