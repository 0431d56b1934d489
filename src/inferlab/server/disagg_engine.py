"""Disaggregated serving (`inferlab serve --disaggregate`): the router, an EngineClient over two worker processes.

    API process: HTTP, tokenizing, this router          (the engine thread of server/async_engine.py steps it)
      | pipe                               | pipe
    prefill worker (core 0, 1 thread)    decode worker (core 1, 1 thread)      (server/disagg_worker.py)
      '--- KV blocks: shared-memory transfer buffer (engine/kv_transfer.py) ---'

A request goes to the prefill worker, which computes its prompt (chunked, with prefix caching), samples and
streams the first token, copies the prompt's KV into the transfer buffer and reports a HandOff; the router
forwards it to the decode worker, which admits it when it has room, copies the KV in, tells the router to release
the buffer blocks back to prefill, and streams the rest. This is the flow of vLLM's P/D proxy (a request with
max_tokens 1 to a prefill instance, then to a decode instance with the KV transfer parameters), with the router
inside the API process instead of in front of two servers, so one OpenAI endpoint, one /metrics and the usual
admission control and request lifecycle (server/async_engine.py) serve both roles unchanged.

The router's `step()` is not an engine step: it waits (up to POLL_SECONDS) for messages from the workers and
returns the deltas they carry. Adds and aborts therefore reach a busy worker at most POLL_SECONDS late.

Aborts: the router knows where each request is (prefill, or decode once handed off) and aborts it there; a
HandOff that arrives for a request aborted meanwhile has its buffer blocks released at once; a decode worker
aborting a request it has not admitted yet releases them too. So an abort or a client disconnect frees the blocks
on both sides and in the buffer.

A worker that dies ends what was in flight: `step()` raises WorkerDiedError naming the worker and its exit code,
the server fails every request in flight with that error and `inferlab serve` exits 1, as it does when a
colocated engine dies, so that its supervisor restarts the whole set. (Restarting only the dead worker would keep
the others' requests alive only when the prefill worker died; with one worker per role every request in flight
depends on both, so we chose the simple, predictable rule.)
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, fields
from multiprocessing.connection import Connection, wait
from multiprocessing.shared_memory import SharedMemory

from inferlab.common.errors import InvalidRequestError
from inferlab.engine.config import EngineConfig
from inferlab.engine.outputs import EngineStats, RequestOutput
from inferlab.engine.prompt import Prompt, PromptTokenizer, check_prompt_fits
from inferlab.engine.sampling_params import SamplingParams
from inferlab.server.disagg_messages import (Abort, Add, HandedOff, Inject, Outputs, Ready, Release, Released,
                                             Role)
from inferlab.server.disagg_worker import run_worker

log = logging.getLogger("inferlab.server.disagg")

POLL_SECONDS = 0.005
DEFAULT_TRANSFER_BUFFER = 256 * 2**20


class WorkerDiedError(RuntimeError):
    """A prefill or decode worker process ended; the requests in flight cannot finish."""


@dataclass
class _Worker:
    role: Role
    process: mp.process.BaseProcess
    conn: Connection
    ready: Ready | None = None
    sent: int = 0  # messages sent to the worker
    answered: int = 0  # of those, handled by the worker as of its last Outputs

    def describe(self) -> str:
        code = self.process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return f"the {self.role.value} worker (pid {self.process.pid}) {how}"


class DisaggEngine:
    """EngineClient (server/engine_client.py) over one prefill and one decode worker."""

    def __init__(self, config: EngineConfig, transfer_buffer: int = DEFAULT_TRANSFER_BUFFER,
                 cores: tuple[int | None, int | None] | None = None, start_timeout: float = 1800.0):
        if config.speculative is not None:
            raise ValueError("--speculative is not supported with --disaggregate yet")
        self.config = config
        if cores is None:
            available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
            cores = (available[0], available[-1]) if len(available) >= 2 else (None, None)
        # One intra-op thread per worker unless told otherwise: each has its core (the 1 + 1 on 2 cores).
        worker_config = EngineConfig(**{**config.to_dict(), "num_threads": config.num_threads or 1})
        self._buffer = SharedMemory(create=True, size=transfer_buffer)
        ctx = mp.get_context("spawn")  # never fork a process that may already run OpenMP or hold threads
        self.workers: dict[Role, _Worker] = {}
        try:
            for role, core in zip(Role, cores):
                here, there = ctx.Pipe()
                cfg = worker_config if config.step_trace is None else \
                    EngineConfig(**{**worker_config.to_dict(), "step_trace": f"{config.step_trace}.{role.value}0"})
                p = ctx.Process(target=run_worker, args=(role, cfg, there, self._buffer.name, core),
                                name=f"inferlab-{role.value}", daemon=True)
                p.start()
                there.close()
                self.workers[role] = _Worker(role, p, here)
            for w in self.workers.values():
                w.ready = self._wait_ready(w, start_timeout)
        except BaseException:
            self.close()
            raise
        info = self.workers[Role.PREFILL].ready
        self.model_name = info.model_name
        self.max_model_len = min(w.ready.max_model_len for w in self.workers.values())
        self.vocab_size = info.vocab_size
        self.max_token_chars = info.max_token_chars
        self.block_size = info.block_size
        self.transfer_blocks = info.transfer_blocks
        from inferlab.models.loader import load_tokenizer

        self.prompts = PromptTokenizer(load_tokenizer(config.model), self.vocab_size)
        self._where: dict[str, Role] = {}  # requests in flight -> the worker that has them now
        self._outputs: list[RequestOutput] = []
        self._stats = {role.value: EngineStats() for role in Role}

    def _wait_ready(self, w: _Worker, timeout: float) -> Ready:
        deadline = time.monotonic() + timeout
        while not w.conn.poll(1.0):
            if not w.process.is_alive():
                raise WorkerDiedError(f"{w.describe()} while loading the model (see its error above)")
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"the {w.role.value} worker did not load the model within {timeout:g} s")
        msg = w.conn.recv()
        assert isinstance(msg, Ready), msg
        return msg

    @property
    def worker_pids(self) -> dict[str, int]:
        return {role.value: w.process.pid for role, w in self.workers.items()}

    # -- EngineClient -----------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Prompt) -> tuple[list[int], str | None]:
        return self.prompts.tokenize(prompt)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> int:
        params.validate(self.vocab_size)
        if params.n > 1:
            raise InvalidRequestError("n > 1 is not supported with --disaggregate yet", "n")
        if params.guide is not None:
            raise InvalidRequestError("structured output is not supported with --disaggregate yet", "response_format")
        if request_id in self._where:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        token_ids, _ = self.tokenize_prompt(prompt)
        n = len(token_ids)
        check_prompt_fits(n, params.max_tokens, self.max_model_len, "the maximum context length")
        if -(-n // self.block_size) > self.transfer_blocks:
            raise InvalidRequestError(
                f"a {n}-token prompt's KV does not fit the KV transfer buffer ({self.transfer_blocks} blocks of "
                f"{self.block_size} tokens); shorten the prompt or raise --kv-transfer-buffer", "prompt")
        self._send(Role.PREFILL, Add(request_id, token_ids, params, arrival_time or time.perf_counter(), cache_salt))
        self._where[request_id] = Role.PREFILL
        return n

    def abort(self, request_id: str) -> bool:
        role = self._where.pop(request_id, None)
        if role is None:
            return False
        self._send(role, Abort(request_id))
        return True

    def has_work(self) -> bool:
        """Requests in flight, or messages a worker has not answered yet (an abort's freed blocks, a release of
        transfer-buffer blocks: the stats and the forwarding that follow must not wait for the next request), or
        a dead worker (the next step() reports it, which stops the server even when it is idle)."""
        return (bool(self._where or self._outputs) or any(w.sent > w.answered for w in self.workers.values())
                or not all(w.process.is_alive() for w in self.workers.values()))

    def step(self) -> list[RequestOutput]:
        conns = {w.conn: w for w in self.workers.values()}
        sentinels = {w.process.sentinel: w for w in self.workers.values()}
        ready = wait([*conns, *sentinels], timeout=POLL_SECONDS)
        for w in self.workers.values():
            try:
                while w.conn.poll():
                    self._receive(w.conn.recv())
            except (EOFError, OSError):
                pass  # a dead worker's pipe: its sentinel says so below
        for s in ready:
            if s in sentinels:
                w = sentinels[s]
                w.process.join(1.0)
                raise WorkerDiedError(f"{w.describe()}; {len(self._where)} request(s) in flight failed")
        outputs, self._outputs = self._outputs, []
        return outputs

    def stats(self) -> EngineStats:
        return _combine(self._stats)

    # -- routing ----------------------------------------------------------------------------------------------
    def _receive(self, msg) -> None:
        if isinstance(msg, Outputs):
            self._stats[msg.role.value] = msg.stats
            self.workers[msg.role].answered = msg.handled
            for out in msg.outputs:
                if out.finished:
                    self._where.pop(out.request_id, None)
            self._outputs += msg.outputs
        elif isinstance(msg, HandedOff):
            rid = msg.hand_off.request_id
            if self._where.get(rid) is Role.PREFILL:
                self._where[rid] = Role.DECODE
                self._send(Role.DECODE, Inject(msg.hand_off))
            else:  # aborted while its KV was being copied out: nobody will read it
                self._send(Role.PREFILL, Release(msg.hand_off.handle))
        elif isinstance(msg, Released):
            self._send(Role.PREFILL, Release(msg.handle))
        else:
            raise TypeError(f"unknown message from a worker: {msg!r}")

    def _send(self, role: Role, msg) -> None:
        w = self.workers[role]
        try:
            w.conn.send(msg)
            w.sent += 1
        except (BrokenPipeError, OSError) as e:
            w.process.join(1.0)
            raise WorkerDiedError(f"{w.describe()}; {len(self._where)} request(s) in flight failed") from e

    def close(self) -> None:
        """Stop the workers (closing their pipes ends them; stragglers are killed) and free the transfer buffer."""
        for w in self.workers.values():
            w.conn.close()
        for w in self.workers.values():
            w.process.join(10.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(10.0)
        try:
            self._buffer.close()
            self._buffer.unlink()
        except FileNotFoundError:
            pass


def _combine(by_role: dict[str, EngineStats]) -> EngineStats:
    """The server's totals (admission control reads running and waiting) with each role's stats beside them."""
    total = EngineStats(by_role=dict(by_role))
    for f in fields(EngineStats):
        values = [getattr(s, f.name) for s in by_role.values()]
        if values and isinstance(values[0], (int, float)) and not isinstance(values[0], bool):
            setattr(total, f.name, sum(values))
    total.kv_cache_usage = (1 - total.num_free_kv_blocks / total.num_kv_blocks) if total.num_kv_blocks else 0.0
    return total
