"""One engine replica: a Ray Serve deployment whose actor process holds an LLMEngine and inferlab's own FastAPI
app, and answers requests the ingress forwards by calling that app in-process (ASGI), streaming its bytes back.

The engine is loaded on a thread of its own, which then steps it: the thread that loaded the model is the one
that runs it fastest (server/async_engine.py: OpenMP teams), as on `inferlab serve`'s main thread. The app's
event-loop side (AsyncEngine's futures and streams) lives on the replica's event loop, where `forward` runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from inferlab.engine.config import EngineConfig
from inferlab.scaleout.messages import ForwardedRequest, ResponseHead
from inferlab.server.api import ServerConfig

REPLICA_HEADER = "x-inferlab-replica"
METRICS_POST_INTERVAL = 1.0  # seconds between posts of this replica's /metrics to the board


@serve.deployment
class EngineReplica:
    async def __init__(self, engine_config: EngineConfig, server_config: ServerConfig,
                       board: DeploymentHandle) -> None:
        from inferlab.engine.llm_engine import LLMEngine
        from inferlab.server.api import build_app

        loaded: concurrent.futures.Future = concurrent.futures.Future()
        self._stop = threading.Event()

        def engine_thread() -> None:
            try:
                engine = LLMEngine(engine_config)
                app = build_app(engine, server_config)
            except BaseException as e:  # the constructor re-raises it: Ray reports the replica as failed to start
                loaded.set_exception(e)
                return
            loaded.set_result(app)
            app.state.server.engine.run_engine(should_stop=self._stop.is_set)

        self._thread = threading.Thread(target=engine_thread, name="inferlab-engine", daemon=True)
        self._thread.start()
        self.app = await asyncio.wrap_future(loaded)
        self.server = self.app.state.server
        self.server.engine.start()  # what the app's lifespan does: the engine thread starts stepping
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._board = board
        self._poster = asyncio.create_task(self._post_metrics())

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
        """The response to `request` from this replica's app: a ResponseHead, then body chunks as the app sends them.
        When the caller goes away (the client disconnected), Ray cancels this generator and the app sees an
        http.disconnect, which aborts the request in the engine."""
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
                 "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
                 "query_string": request.query.encode(), "root_path": "", "client": None, "server": None,
                 "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers]}
        sent: asyncio.Queue[dict | None] = asyncio.Queue()
        gone = asyncio.Event()
        body_given = False

        async def receive() -> dict:
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def run_app() -> None:
            try:
                await self.app(scope, receive, sent.put)
            finally:
                sent.put_nowait(None)

        task = asyncio.create_task(run_app())
        try:
            while (message := await sent.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                    # which replica answered: for debugging routing, as gateways name the endpoint they picked
                    yield ResponseHead(message["status"], headers + [(REPLICA_HEADER, self.replica_id)])
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        break
        finally:
            gone.set()
            await asyncio.gather(task, return_exceptions=True)
        # Reached only when the response ended, not when the caller went away. An app that raised after its head
        # must not look like a complete response: the ingress turns this into an error event (or a cut body).
        if (error := task.exception()) is not None:
            raise RuntimeError(f"the replica's app failed mid-response: {error!r}") from error

    async def _post_metrics(self) -> None:
        while True:
            try:
                await self._board.post.remote(self.replica_id, self.server.metrics.render().decode())
            except Exception:  # a board restarting must not end the loop; the next post catches up
                pass
            await asyncio.sleep(METRICS_POST_INTERVAL)

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising marks the replica unhealthy and Ray replaces it. A replica
        whose engine thread stopped (an exception in a step) serves nothing, so it must go."""
        if not self._thread.is_alive() or self.server.engine.error is not None:
            raise RuntimeError(f"the engine stopped: {self.server.engine.error!r}")

    async def __del__(self) -> None:
        self._poster.cancel()
        self._stop.set()
        await self.server.engine.shutdown()
