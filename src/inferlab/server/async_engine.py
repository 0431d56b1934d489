"""The engine behind the event loop: one thread owns LLMEngine and steps it; each request gets an asyncio queue.

Whoever owns the engine steps it with `run_engine()` on a thread of its choosing: `inferlab serve` uses the process's
main thread, the one that loaded the model, and runs the event loop on another. The reason is OpenMP: libgomp gives
every thread that starts parallel regions its own team, and once a process holds more OpenMP threads than CPUs (the
loading thread's team plus a second thread's) their workers stop spinning between regions and sleep, so every kernel
call pays a futex wake-up. Measured on the 2-core machine with benchmarks/peers.py: batch-1 ITL over HTTP 17.7 ms
with the engine on its own thread, 12.6 ms on the main one (offline batch 1: ~11 ms).

The engine is not thread-safe, so everything that touches it (add, abort, step, stats) runs on its thread. The event
loop only appends commands to two deques and sets an event; the engine thread drains them between steps, so an abort
takes effect before the next forward pass. Each step's deltas cross back in one call_soon_threadsafe callback, and a
token reaches its HTTP handler as soon as the step that produced it returns.

Prompts are tokenized (and chat templates applied) here, on a small thread pool of the event-loop side, and the engine
thread receives token ids: a huge prompt costs its own request time, never a pause in everyone else's tokens (the
tokenizer's Rust encode releases the GIL). A failure confined to one request (its tokenization, its admission, or,
inside the engine, its sampling or detokenization) finishes that request with an error and is counted in
inferlab:request_errors_total{stage}; anything else that escapes step() stops the engine thread, fails every request
in flight, and `inferlab serve` then exits non-zero so that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from inferlab.common.errors import InvalidRequestError
from inferlab.engine.outputs import EngineStats, RequestOutput
from inferlab.engine.sampling_params import SamplingParams
from inferlab.server.engine_client import EngineClient
from inferlab.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from inferlab.engine.llm_engine import Prompt

log = logging.getLogger("inferlab.server")


class QueueFullError(Exception):
    """Admission control: the waiting queue is at --max-queue."""

    def __init__(self, num_waiting: int, max_queue: int):
        super().__init__(f"the server is at capacity: {num_waiting} requests are already waiting "
                         f"(limit --max-queue {max_queue}); retry shortly")


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an unexpected exception; the server can no longer generate."""


class RequestFailed(RuntimeError):
    """One request failed on the server before reaching the engine's batch (stage "tokenize" or "add")."""

    def __init__(self, request_id: str, stage: str, error: BaseException):
        super().__init__(f"request {request_id} failed in {stage}: {type(error).__name__}: {error}")
        self.stage = stage


class TimedOut:
    """Queued into a stream when its --request-timeout expires."""


class ShuttingDown:
    """Queued into every stream when a second signal cuts the graceful drain short."""

    def __init__(self, reason: str):
        self.reason = reason


class EngineFailed:
    def __init__(self, error: BaseException):
        self.error = error


TIMED_OUT = TimedOut()
StreamItem = RequestOutput | TimedOut | EngineFailed | ShuttingDown


@dataclass(slots=True)
class RequestStream:
    """One request's deltas, handed from the engine thread to its HTTP handler."""

    request_id: str
    max_tokens: int
    queue: asyncio.Queue[StreamItem] = field(default_factory=asyncio.Queue)
    num_prompt_tokens: int = 0
    arrival_time: float = 0.0
    num_choices: int = 1  # n: the stream ends when each choice has sent its finishing delta
    num_open: int = 1  # choices whose finishing delta has not been published yet

    def expire(self) -> None:
        self.queue.put_nowait(TIMED_OUT)


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: list[int]  # tokenized on the event-loop side
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None
    future: asyncio.Future[int]


class AsyncEngine:
    """start() and shutdown() run on the event loop (the app's lifespan); run_engine() on the engine's thread."""

    def __init__(self, engine: EngineClient, max_queue: int, metrics: ServerMetrics, tokenizer_threads: int = 2):
        self._loop_ready = threading.Event()
        self._engine_done = threading.Event()
        self.engine = engine
        self.max_num_seqs = engine.config.max_num_seqs
        self.max_queue = max_queue
        self.metrics = metrics
        self.stats = EngineStats()  # as of the end of the engine's last step (event-loop side)
        self.error: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}
        self._adds: deque[_Add] = deque()
        self._aborts: deque[str] = deque()
        self._wake = threading.Event()
        self._stopping = False
        # Adds submitted that the last published stats do not yet reflect (they may be waiting).
        self._unseen_adds = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tokenizer_pool = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="inferlab-tokenize")

    # ------------------------------------------------------------ event-loop side

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_ready.set()

    async def shutdown(self) -> None:
        """Stops the engine loop and waits until run_engine() has returned."""
        self._stopping = True
        self._wake.set()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self._engine_done.wait)

    def cut_short(self, reason: str) -> None:
        """The drain is over (a second signal): every request in flight ends now with an error (its stream gets an
        error event and [DONE]), and the engine loop stops after its current step. Callable from any thread."""
        self._stopping = True
        self._wake.set()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._end_streams, reason)

    def _end_streams(self, reason: str) -> None:
        streams = list(self._streams.values())
        self._streams.clear()
        for stream in streams:
            stream.queue.put_nowait(ShuttingDown(reason))
        self.metrics.request_failed("shutdown", len(streams))

    def run_engine(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Step the engine on the calling thread until shutdown(). Waits for start() first; `should_stop()` is
        polled while waiting, so a server that fails to start does not block this forever."""
        while not self._loop_ready.wait(0.1):
            if should_stop():
                return
        try:
            self._run()
        finally:
            self._engine_done.set()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def num_waiting(self) -> int:
        """Requests that would wait if scheduled now: the engine's waiting count at its last step, plus
        submissions since then that do not fit in the running slots left free (none are free while some wait)."""
        s = self.stats
        free = self.max_num_seqs - s.num_running if s.num_waiting == 0 else 0
        return s.num_waiting + max(0, self._unseen_adds - free)

    async def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, cache_salt: str | None,
                          fill_context: bool, arrival_time: float) -> RequestStream:
        """fill_context: max_tokens was unset, so generate until the context is full (see _fill_context).
        Raises QueueFullError at once when the queue is full, InvalidRequestError when the prompt or the engine
        refuses it, RequestFailed when tokenizing or admitting it raised anything else."""
        self._admit()
        assert self._loop is not None, "AsyncEngine.start() was not called"
        try:  # off the engine thread: see the module docstring
            ids, _ = await self._loop.run_in_executor(self._tokenizer_pool, self.engine.tokenize_prompt, prompt)
        except InvalidRequestError:
            raise
        except Exception as e:  # noqa: BLE001 - this request's failure, not the server's
            log.exception("tokenizing request %s failed", request_id)
            raise RequestFailed(request_id, "tokenize", e) from e
        if fill_context:
            self._fill_context(ids, params)
        self._admit()  # again: the queue may have filled while we tokenized
        stream = RequestStream(request_id, params.max_tokens, arrival_time=arrival_time,
                               num_choices=params.n, num_open=params.n)
        future: asyncio.Future[int] = self._loop.create_future()
        self._streams[request_id] = stream
        self._unseen_adds += 1
        self._adds.append(_Add(request_id, ids, params, arrival_time, cache_salt, future))
        self._wake.set()
        try:
            stream.num_prompt_tokens = await future
        except asyncio.CancelledError:
            self.abort(request_id)  # the client left while we waited for the engine thread
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    def _admit(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        if self._stopping:
            raise EngineDeadError("the server is shutting down")
        waiting = self.num_waiting()
        if waiting >= self.max_queue:
            self.metrics.rejected("queue_full")
            raise QueueFullError(waiting, self.max_queue)

    def _fill_context(self, ids: list[int], params: SamplingParams) -> None:
        """A request without max_tokens generates until the context is full (OpenAI's default for chat): size
        max_tokens from the prompt."""
        room = self.engine.max_model_len - len(ids)
        if room < 1:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.engine.max_model_len} tokens and the prompt alone "
                f"is {len(ids)} tokens, leaving no room to generate; shorten the prompt", "prompt")
        params.max_tokens = room

    def abort(self, request_id: str) -> None:
        """Stop a request that has not finished; its further deltas are dropped. Idempotent."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self._aborts.append(request_id)
        self._wake.set()
        self.metrics.request_finished("abort", None, stream.num_prompt_tokens, 0, stream.max_tokens)

    def _resolve_adds(self, results: list[tuple[asyncio.Future[int], int | BaseException]]) -> None:
        for future, result in results:
            if future.cancelled():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    def _publish(self, outputs: list[RequestOutput], stats: EngineStats, num_added: int) -> None:
        self.stats = stats
        self._unseen_adds -= num_added
        self.metrics.engine.stats = stats
        streams = self._streams
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue  # aborted: its handler is gone
            if out.finished:
                stream.num_open -= 1
            if out.finished and stream.num_open == 0:
                del streams[out.request_id]
                if out.finish_reason == "error":
                    self.metrics.request_failed(out.error_stage)
                self.metrics.request_finished(out.finish_reason or "error", out.metrics, out.num_prompt_tokens,
                                              out.num_output_tokens, stream.max_tokens)
            stream.queue.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        while self._adds:  # the engine thread is gone, so nothing else pops these
            future = self._adds.popleft().future
            if not future.done():
                future.set_exception(EngineDeadError(f"the engine stopped: {error!r}"))
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineFailed(error))
        self.metrics.request_failed("engine", len(self._streams))
        self._streams.clear()

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        loop, engine = self._loop, self.engine
        assert loop is not None
        try:
            while not self._stopping:
                self._wake.clear()
                num_added, num_aborted = self._drain()
                if engine.has_work():
                    outputs = engine.step()
                    loop.call_soon_threadsafe(self._publish, outputs, engine.stats(), num_added)
                    continue
                if num_added or num_aborted:
                    loop.call_soon_threadsafe(self._publish, [], engine.stats(), num_added)
                self._wake.wait()
        except BaseException as e:  # noqa: BLE001 - a dead engine thread must fail every request, not hang them
            log.exception("engine thread stopped")
            self.error = e
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._fail_all, e)

    def _drain(self) -> tuple[int, int]:
        engine, adds, aborts = self.engine, self._adds, self._aborts
        results: list[tuple[asyncio.Future[int], int | BaseException]] = []
        num_added = 0
        while adds:
            a = adds.popleft()
            num_added += 1
            try:
                results.append((a.future, engine.add_request(a.request_id, a.prompt, a.params,
                                                             arrival_time=a.arrival_time, cache_salt=a.cache_salt)))
            except InvalidRequestError as e:
                results.append((a.future, e))
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the engine for the others
                log.exception("add_request(%s) failed", a.request_id)
                results.append((a.future, RequestFailed(a.request_id, "add", e)))
        if results:
            self._loop.call_soon_threadsafe(self._resolve_adds, results)  # type: ignore[union-attr]
        num_aborted = 0
        while aborts:
            engine.abort(aborts.popleft())
            num_aborted += 1
        return num_added, num_aborted
