"""The one endpoint in front of the replicas: forwards every request to a replica chosen by the deployment's
request router and streams the replica's response back byte for byte (SSE passes through unparsed).

A replica that dies mid-request surfaces here as a Ray error on the stream. If the client has not yet received a
byte, the request is retried once on another replica (nothing was sent, so nothing is duplicated); otherwise a
stream ends with an OpenAI error event and [DONE], and a plain response, whose head has gone, is cut short.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from inferlab.scaleout.messages import ForwardedRequest, ResponseHead, routing_text
from inferlab.scaleout.metrics_board import merge_expositions

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "upgrade", "content-length"}
RETRIES_BEFORE_FIRST_BYTE = 1


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Ingress:
    def __init__(self, replicas: DeploymentHandle, board: DeploymentHandle, max_body_bytes: int) -> None:
        self._replicas = replicas.options(stream=True)
        self._board = board
        self._max_body = max_body_bytes

    async def __call__(self, request: Request) -> Response:
        if request.url.path == "/metrics":
            texts = await self._board.snapshot.remote()
            return Response(merge_expositions(texts), media_type=CONTENT_TYPE)
        # Read at most one byte past the replicas' --max-request-bytes: a longer body reaches the replica cut there,
        # and its own limit answers 413 (and counts it), without this process holding a body of any size.
        body = b""
        async for part in request.stream():
            body += part
            if len(body) > self._max_body:
                body = body[:self._max_body + 1]
                break
        forwarded = ForwardedRequest(request.method, request.url.path, request.url.query,
                                     [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP],
                                     body, routing_text(body))
        error: Exception | None = None
        for _ in range(1 + RETRIES_BEFORE_FIRST_BYTE):
            stream: DeploymentResponseGenerator = self._replicas.forward.remote(forwarded)
            try:
                head = await stream.__anext__()
            except (RayError, BackPressureError) as e:  # the replica died or refused before answering: try another
                error = e
                continue
            assert isinstance(head, ResponseHead)
            headers = {k: v for k, v in head.headers if k.lower() not in _HOP_BY_HOP}
            is_sse = headers.get("content-type", "").startswith("text/event-stream")
            return StreamingResponse(_relay(stream, is_sse), status_code=head.status, headers=headers)
        return _error(503, f"no engine replica could take the request: {type(error).__name__}: {error}",
                      "replica_unavailable")


async def _relay(stream: DeploymentResponseGenerator, is_sse: bool) -> AsyncIterator[bytes]:
    finished = False
    try:
        async for chunk in stream:
            yield chunk
        finished = True
    except RayError as e:
        finished = True
        if not is_sse:
            raise  # a plain response whose head is sent: the client sees the body cut short
        event = {"error": {"message": f"the engine replica serving this request failed: {type(e).__name__}",
                           "type": "server_error", "param": None, "code": "replica_failed"}}
        yield f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
    finally:
        if not finished:  # the client went away: the replica's generator is cancelled, which aborts the request
            stream.cancel()


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": code}},
                        status_code=status)
