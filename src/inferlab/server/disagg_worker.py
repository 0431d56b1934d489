"""A prefill or decode worker of disaggregated serving: one engine process, pinned to its own core, driven over a
pipe by the router in the API process (server/disagg_engine.py).

Both roles run the ordinary LLMEngine, with chunked prefill and prefix caching as usual; only the edges differ:
- prefill: requests arrive from the router. Once a request has sampled its first token (streamed from here) the
  engine parks it with its blocks held (`hand_off_after_prefill`); the loop copies its prompt KV into the
  transport and tells the router, which forwards the HandOff to the decode worker. When the transport is full the
  request waits here with its blocks: backpressure.
- decode: HandOffs arrive from the router and wait, their KV in the transport, until the scheduler admits them
  (`LLMEngine.inject`: blocks allocated, the prefix cache's taken, the rest copied in); then the staging blocks
  are released back to the prefill worker through the router and the request decodes to its end here. A decode
  engine that must preempt recomputes the request's tokens itself, as any engine does.

The loop blocks on the pipe whenever the engine has nothing to step: an idle worker costs nothing, and a prefill
worker waiting for transfer-buffer room wakes on the router's Release. Anything escaping the engine ends the
process with its traceback on stderr; the router sees the pipe close and fails what was in flight.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from multiprocessing.connection import Connection

from inferlab.engine.config import EngineConfig
from inferlab.engine.kv_transfer import HandOff
from inferlab.engine.outputs import RequestOutput
from inferlab.server.disagg_messages import (Abort, Add, HandedOff, Inject, Outputs, Ready, Release, Released,
                                             Role)

log = logging.getLogger("inferlab.server.disagg")


def run_worker(role: Role, config: EngineConfig, conn: Connection, buffer_name: str, core: int | None) -> None:
    """The worker process's entry point (spawned by the router)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role.value} %(levelname)s %(message)s")
    if core is not None:
        try:  # one core per role: prefill's long GEMMs never share a core with decode's steps
            os.sched_setaffinity(0, {core})
        except (AttributeError, OSError) as e:  # not Linux, or a cgroup that forbids it: run unpinned
            log.warning("cannot pin the %s worker to core %d: %s", role.value, core, e)
    from multiprocessing.shared_memory import SharedMemory

    from inferlab.engine.kv_transfer import SharedMemoryKVTransport
    from inferlab.engine.llm_engine import LLMEngine

    buffer = SharedMemory(name=buffer_name)  # created, and unlinked at the end, by the router
    engine = LLMEngine(config)
    transport = SharedMemoryKVTransport.from_buffer(buffer.buf, engine.runner.kv_cache)
    engine.hand_off_after_prefill = role is Role.PREFILL
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    conn.send(Ready(role, os.getpid(), engine.model_name, engine.max_model_len, engine.vocab_size,
                    engine.max_token_chars, engine.block_manager.block_size, transport.num_blocks, cores))
    try:
        _Loop(role, engine, transport, conn).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the router is gone: so are we
        pass


class _Loop:
    def __init__(self, role: Role, engine, transport, conn: Connection):
        self.role, self.engine, self.transport, self.conn = role, engine, transport, conn
        self.pending: deque[HandOff] = deque()  # decode: hand-offs waiting for admission, in arrival order
        self.errors: list[RequestOutput] = []  # requests refused here, reported with the next outputs
        self.handled = 0

    def run(self) -> None:
        engine, conn = self.engine, self.conn
        while True:
            # decode: a request that just finished may have made room for a waiting hand-off
            changed = self.role is Role.DECODE and self._admit()
            if not engine.has_work() and not changed:
                conn.poll(None)  # idle, or waiting for transfer room: only the router's next message changes that
            while conn.poll():
                self._handle(conn.recv())
                self.handled += 1
                changed = True
            if self.role is Role.DECODE:
                changed |= self._admit()
            outputs = engine.step() if engine.has_work() else []
            if outputs or changed or self.errors:
                outputs, self.errors = self.errors + outputs, []
                conn.send(Outputs(self.role, outputs, self._stats(), self.handled))
            if self.role is Role.PREFILL:
                self._send_kv()

    def _handle(self, msg) -> None:
        engine = self.engine
        if isinstance(msg, Add):
            try:
                engine.add_request(msg.request_id, msg.token_ids, msg.params, arrival_time=msg.arrival_time,
                                   cache_salt=msg.cache_salt)
            except Exception as e:  # noqa: BLE001 - the router checked what it could; this request fails alone
                self.errors.append(_error(msg.request_id, "add", e))
        elif isinstance(msg, Inject):
            self.pending.append(msg.hand_off)
        elif isinstance(msg, Release):
            self.transport.release(msg.handle)
        elif isinstance(msg, Abort):
            if not engine.abort(msg.request_id):
                for h in [h for h in self.pending if h.request_id == msg.request_id]:
                    self.pending.remove(h)  # never admitted: its KV is dropped, its staging blocks go back
                    self.conn.send(Released(h.handle))
        else:
            raise TypeError(f"the {self.role.value} worker got an unknown message {msg!r}")

    def _admit(self) -> bool:
        """Decode: admit waiting hand-offs in order while the scheduler has room (no overtaking: a long prompt
        that does not fit yet is not starved by short ones behind it)."""
        admitted = False
        while self.pending:
            h = self.pending[0]
            try:
                if not self.engine.inject(h, self.transport):
                    break
            except Exception as e:  # noqa: BLE001 - this request fails alone
                self.errors.append(_error(h.request_id, "add", e))
            self.pending.popleft()
            self.conn.send(Released(h.handle))
            admitted = True
        return admitted

    def _send_kv(self) -> None:
        for seq in list(self.engine.handing_off):
            hand_off = self.engine.send_kv(seq, self.transport)
            if hand_off is None:
                return  # the transfer buffer is full: retry when the router brings a Release
            self.conn.send(HandedOff(hand_off))

    def _stats(self):
        s = self.engine.stats()
        c = self.transport.counters
        s.kv_transfers_total, s.kv_transfer_bytes_total = c.transfers, c.bytes
        s.kv_transfer_seconds_total, s.kv_transfer_stalls_total = c.seconds, c.stalls
        s.kv_transfer_pending = len(self.engine.handing_off) + len(self.pending)
        s.kv_transfer_free_blocks = len(self.transport.free) if self.role is Role.PREFILL else 0
        return s


def _error(request_id: str, stage: str, e: BaseException) -> RequestOutput:
    log.error("request %s failed in %s: %r", request_id, stage, e)
    return RequestOutput(request_id=request_id, new_token_ids=[], new_text="", finished=True, finish_reason="error",
                         error=f"{type(e).__name__}: {e}", error_stage=stage)
