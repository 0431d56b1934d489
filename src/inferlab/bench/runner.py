"""Load generation for one load point: closed loop (N users, each sending its next request when the last one
ends) or open loop (requests due on an arrival schedule, whatever the server's state), in one process or
spread over worker processes.

Open loop starts each request's latency clock at its scheduled time, so a client that falls behind (CPU-bound,
or held by --max-concurrency) cannot hide the wait: the lag is recorded as client delay and stays inside TTFT
and E2E (the coordinated-omission trap). Closed loop starts the clock at send.

A WorkerPlan holds everything one worker needs and pickles; `run_worker` runs it. Local workers are spawned
processes sharing the machine's monotonic clock. Multi-machine load would ship the same plans to Ray actors
(the distributed runtime to use; clocks then differ per host, so each host's records keep their own origin):
a seam, not built.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Callable

from inferlab.bench.client import Client, Target
from inferlab.bench.conversation import History, Session, ThinkTime, think_rng
from inferlab.bench.http import Pool
from inferlab.bench.records import RequestRecord
from inferlab.bench.tokenizer import load_tokenizer
from inferlab.bench.workload import RequestSpec


def request_id(tag: str, run: int, index: int) -> str:
    """X-Request-Id for request `index` of `run`: a well-formed UUID (version 4 layout) that still reads as
    tag-run-index, because some servers reject any other shape (llama-cpp-python's answers 400)."""
    return f"{tag[:8]:0>8}-{run % 0x10000:04x}-4000-8000-{index:012x}"


@dataclass(slots=True)
class Load:
    kind: str  # concurrency | rate | trace
    value: float  # users, or requests per second (inf: all at once), or the trace's time scale
    arrival: str = "poisson"  # rate: poisson | gamma | constant
    burstiness: float = 1.0
    max_concurrency: int | None = None  # open loop: a cap on requests in flight (waits count as client delay)

    @property
    def open_loop(self) -> bool:
        return self.kind != "concurrency"

    @property
    def label(self) -> str:
        if self.kind == "concurrency":
            return f"concurrency {int(self.value)}"
        if self.kind == "trace":
            return "trace replay" + (f" x{self.value:g}" if self.value != 1 else "")
        rate = "inf" if math.isinf(self.value) else f"{self.value:g}"
        return f"{self.arrival} {rate} req/s" + (f" (burstiness {self.burstiness:g})" if self.arrival == "gamma" else "")

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "value": None if math.isinf(self.value) else self.value, "label": self.label}
        if self.open_loop:
            d.update(arrival=self.arrival, burstiness=self.burstiness, max_concurrency=self.max_concurrency)
        return d


@dataclass(slots=True)
class WorkerPlan:
    target: Target
    load: Load
    pool: list[RequestSpec]  # the workload; request i uses pool[i % len(pool)]
    indices: list[int] | None  # open loop: this worker's request indices, aligned with `schedule`
    schedule: list[float] | None  # open loop: due offsets (s) from the clock origin
    users: int = 1  # closed loop: concurrent users in this worker
    num_requests: int | None = None  # closed loop: total over all workers (None: until `duration`)
    warmup: int = 0  # requests with index < warmup are sent but left out of the statistics
    duration: float | None = None
    run: int = 0
    worker: int = 0
    tag: str = ""  # 8 hex digits: the benchmark's part of X-Request-Id
    tokenizer: str | None = None  # spec for load_tokenizer ("none": count chunks)
    records_path: str = ""
    t0: float | None = None  # clock origin (absolute perf_counter); None = start now
    stats: dict = field(default_factory=dict)
    sessions: list[Session] | None = None  # conversations: each closed-loop user runs sessions turn by turn
    think_time: ThinkTime | None = None
    seed: int = 0


class _Counter:
    """Hands out request indices; a multiprocessing Value when workers are processes."""

    def __init__(self, shared=None):
        self.shared = shared
        self.n = 0

    def next(self) -> int:
        if self.shared is None:
            self.n += 1
            return self.n - 1
        with self.shared.get_lock():
            self.shared.value += 1
            return self.shared.value - 1


def warm_count(plan: WorkerPlan) -> int:
    """Connections to open before the clock starts: one per user in closed loop; in open loop as many as may
    be in flight at once, up to 64 (more are opened during the run if needed)."""
    if not plan.load.open_loop:
        return plan.users
    return min(len(plan.schedule or []), plan.load.max_concurrency or 64)


async def run_worker(plan: WorkerPlan, stop: asyncio.Event, on_done: Callable[[RequestRecord], None] | None = None,
                     counter: _Counter | None = None, pool: Pool | None = None) -> tuple[list[RequestRecord], bool]:
    """Run one worker's share of a load point. Returns its records and whether it was interrupted. Records are
    appended to plan.records_path as they complete. With plan.t0 unset, the clock starts once connections are
    open, and plan.t0 is set to it."""
    tok = load_tokenizer(plan.tokenizer)
    counter = counter or _Counter()
    records: list[RequestRecord] = []
    out = open(plan.records_path, "a", encoding="utf-8") if plan.records_path else None
    inflight: set[asyncio.Task] = set()
    perf = time.perf_counter
    if pool is None:
        pool = Pool(plan.target.base_url)
        await pool.warm(warm_count(plan))
    if plan.t0 is None:
        plan.t0 = perf()
    t0 = plan.t0
    if t0 > perf():
        await asyncio.sleep(t0 - perf())
    try:
        client = Client(pool, plan.target, tok, t0)
        cap = asyncio.Semaphore(plan.load.max_concurrency) if plan.load.max_concurrency else None

        def new(i: int, scheduled: float | None) -> RequestRecord:
            return RequestRecord(index=i, run=plan.run, worker=plan.worker,
                                 request_id=request_id(plan.tag, plan.run, i), warmup=i < plan.warmup,
                                 scheduled=scheduled)

        def finish(rec: RequestRecord) -> None:
            records.append(rec)
            if out is not None:
                out.write(rec.to_json() + "\n")
            if on_done is not None:
                on_done(rec)

        # A closed loop's users stop at the duration; an open loop's schedule already ends before it, and a
        # request sent late is the client delay its records show.
        send_before = None if plan.load.open_loop else plan.duration

        async def one(rec: RequestRecord, spec: RequestSpec | None = None) -> str | None:
            """The answer's text; None when the duration ended before the request could be sent (no record)."""
            spec = spec or plan.pool[rec.index % len(plan.pool)]
            try:
                if cap is not None:
                    async with cap:
                        answer = await client.send(rec, spec, send_before)
                else:
                    answer = await client.send(rec, spec, send_before)
            except asyncio.CancelledError:
                rec.error_kind, rec.error = "cancelled", "the run was interrupted before this request ended"
                finish(rec)
                raise
            if answer is not None:
                finish(rec)
            return answer

        async def user() -> None:
            while True:
                if plan.duration is not None and perf() - t0 >= plan.duration:
                    return
                i = counter.next()
                if plan.num_requests is not None and i >= plan.num_requests:
                    return
                if await one(new(i, None)) is None:
                    return

        async def session_user() -> None:
            """Take the next session and run its turns, each resending the history with the model's actual
            answers; then the next session, until the run's request budget or duration is spent. A failed
            turn ends its session (its history has no answer to resend)."""
            while True:
                sid = sessions.next()
                session = plan.sessions[sid % len(plan.sessions)]
                hist = History([{"role": "system", "content": session.system}] if session.system else [])
                for t, turn in enumerate(session.turns, 1):
                    if plan.duration is not None and perf() - t0 >= plan.duration:
                        return
                    i = counter.next()
                    if plan.num_requests is not None and i >= plan.num_requests:
                        return
                    msgs, in_len = hist.ask(turn)
                    rec = new(i, None)
                    rec.session, rec.turn = sid, t
                    answer = await one(rec, RequestSpec(messages=msgs, input_len=in_len, output_len=turn.output_len))
                    if answer is None:
                        return
                    if not rec.ok:
                        break
                    hist.answer(answer, rec.output_tokens)
                    if t < len(session.turns) and plan.think_time is not None:
                        await asyncio.sleep(plan.think_time.sample(think_rng(plan.seed, sid, t)))

        async def dispatch() -> None:
            for i, due in zip(plan.indices, plan.schedule):
                # The loop's timers are coarse (epoll waits in whole milliseconds): sleep to just before the due
                # time, then yield to other tasks until it comes. Never early; on an idle client, late by tens
                # of microseconds rather than up to a millisecond.
                while (delay := t0 + due - perf()) > 0:
                    await asyncio.sleep(delay - 0.0015 if delay > 0.002 else 0)
                task = asyncio.create_task(one(new(i, due)))
                inflight.add(task)
                task.add_done_callback(inflight.discard)
            while inflight:
                await asyncio.gather(*list(inflight))

        async def flusher() -> None:
            while out is not None:
                await asyncio.sleep(1.0)
                out.flush()

        if plan.load.open_loop:
            main = asyncio.create_task(dispatch())
        else:
            sessions = _Counter()  # conversations run in one process: the history lives in its user's task
            body = session_user if plan.sessions is not None else user
            users = [asyncio.create_task(body()) for _ in range(plan.users)]
            inflight.update(users)
            main = asyncio.create_task(asyncio.wait(users))
        flush = asyncio.create_task(flusher())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({main, stopper}, return_when=asyncio.FIRST_COMPLETED)
        interrupted = stop.is_set() and not main.done()
        if interrupted:
            main.cancel()
            for t in list(inflight):
                t.cancel()
            await asyncio.gather(main, *inflight, return_exceptions=True)
        stopper.cancel()
        flush.cancel()
    finally:
        pool.close()
    if out is not None:
        out.close()
    return records, interrupted


def install_stop(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """First Ctrl-C (or SIGTERM): stop sending, cancel what is in flight, keep every record and write the
    summary. A second one exits at once. SIGUSR1 is the parent's stop request to its workers: it never
    escalates, since a worker also receives the terminal's own Ctrl-C."""

    def on_sigint():
        if stop.is_set():
            os._exit(130)
        stop.set()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        loop.add_signal_handler(signal.SIGTERM, on_sigint)
        loop.add_signal_handler(signal.SIGUSR1, stop.set)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread (tests), or no signals here
        pass


def new_loop_runner():
    """The standard asyncio loop. Not uvloop: its add_reader never calls back when a socket fails (a reset is
    swallowed by the poll handle), so a dropped connection would hang its request; and with receive times
    taken by the kernel, a faster loop no longer changes the measurement, only the client's CPU budget."""
    return asyncio.new_event_loop, "asyncio"


# --- worker processes ---------------------------------------------------------------------------------------

def _process_main(plan: WorkerPlan, next_index, done, failed, stopped, barrier, t0_value) -> None:
    for sig in (signal.SIGINT, signal.SIGUSR1):  # until the loop's own handlers are in place
        signal.signal(sig, signal.SIG_IGN)
    # Everything slow happens before the barrier: the clock must not start while a worker is still loading.
    load_tokenizer(plan.tokenizer)
    make_loop, _ = new_loop_runner()
    loop = make_loop()
    asyncio.set_event_loop(loop)
    pool = Pool(plan.target.base_url)
    loop.run_until_complete(pool.warm(warm_count(plan)))
    barrier.wait()
    barrier.wait()  # the parent has written the clock origin in between
    plan.t0 = t0_value.value
    stop = asyncio.Event()
    install_stop(loop, stop)

    def on_done(rec: RequestRecord) -> None:
        with done.get_lock():
            done.value += 1
        if rec.error_kind and rec.error_kind != "cancelled":
            with failed.get_lock():
                failed.value += 1

    _, interrupted = loop.run_until_complete(run_worker(plan, stop, on_done, _Counter(next_index), pool))
    if interrupted:
        stopped.value = 1
    loop.close()


async def run_processes(plans: list[WorkerPlan], stop: asyncio.Event,
                        progress: Callable[[int, int], None] | None = None) -> bool:
    """Run worker plans in spawned processes on this machine; each writes its records_path. Sets every plan's
    t0 to the shared clock origin. Returns whether the run was interrupted."""
    ctx = mp.get_context("spawn")
    next_index, done, failed = ctx.Value("q", 0), ctx.Value("q", 0), ctx.Value("q", 0)
    # A terminal's Ctrl-C reaches the workers too, and they may all be gone before this loop sees its own stop:
    # each says whether it was cut short.
    stopped = ctx.Value("b", 0)
    t0_value = ctx.Value("d", 0.0)
    barrier = ctx.Barrier(len(plans) + 1)
    procs = [ctx.Process(target=_process_main, daemon=True,
                         args=(p, next_index, done, failed, stopped, barrier, t0_value)) for p in plans]
    for p in procs:
        p.start()
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, barrier.wait)
    t0_value.value = time.perf_counter() + 0.05
    for p in plans:
        p.t0 = t0_value.value
    await loop.run_in_executor(None, barrier.wait)
    interrupted = False
    while any(p.is_alive() for p in procs):
        if stop.is_set() and not interrupted:
            interrupted = True
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGUSR1)
        if progress:
            progress(done.value, failed.value)
        await asyncio.sleep(0.2)
    if progress:
        progress(done.value, failed.value)
    for p in procs:
        p.join()
    interrupted = interrupted or bool(stopped.value)
    bad = [p.exitcode for p in procs if p.exitcode not in (0, None)]
    if bad and not interrupted:
        raise RuntimeError(f"{len(bad)} bench worker process(es) failed (exit codes {bad}); see the messages above")
    return interrupted
