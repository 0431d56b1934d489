"""Handing a prefilled request's KV blocks from a prefill engine to a decode engine (disaggregated serving).

The protocol is vLLM's P/D one (its KV connector API with the NIXL connector): the producer, once a request's
prefill is done, keeps the request's blocks until the transfer has completed and only then frees them; the
consumer allocates blocks in its own pool through its own scheduler, loads the KV into them, and notifies the
producer that it has read them. What travels beside the KV is a small descriptor (`KVHandle`: which blocks, how
many tokens), as NIXL describes a transfer by block descriptors, so a network transport (NIXL, Mooncake) can
implement the same three calls: `send` on the producer, `recv` on the consumer, `release` on the producer when the
consumer's notification arrives.

`SharedMemoryKVTransport` is the one-host implementation: a fixed staging pool of KV blocks in shared memory,
laid out as the engines' pools are ([layers, 2, kv_heads, blocks, block_size, head_dim]). Unlike NIXL's read from
the producer's own pool it stages a copy, so the prefill engine frees its blocks (keeping full ones in its prefix
cache) as soon as `send` returns, and the pool's size bounds what is in flight between the two: `send` returns
None when too few staging blocks are free, the prefill engine keeps the request's blocks and retries, its pool
fills and it stops admitting. That is how a full decode side applies backpressure, and nothing is dropped. The
free list lives on the producer only (one writer); the consumer's notification (`release`) reaches it through
the router (server/disagg_engine.py).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from inferlab.engine.outputs import RequestMetrics
from inferlab.engine.sampling_params import SamplingParams
from inferlab.engine.sequence import Sequence, SequenceStatus

BLOCK_DIM = 3  # the block axis of a KV pool (layers/attention.py, allocate_kv_cache)


@dataclass(frozen=True, slots=True)
class KVHandle:
    """Where a request's prompt KV waits: its staging blocks, in block-table order."""

    request_id: str
    blocks: tuple[int, ...]
    num_tokens: int
    num_bytes: int


@dataclass(slots=True)
class TransferCounters:
    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0  # copying: pool -> staging on the producer, staging -> pool on the consumer
    stalls: int = 0  # sends refused for want of staging room (the decode side was behind)


class KVTransport(Protocol):
    counters: TransferCounters

    def send(self, request_id: str, kv_cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> KVHandle | None:
        """Producer: copy the blocks out of `kv_cache`; None (nothing sent) when there is no room now."""

    def recv(self, handle: KVHandle, kv_cache: torch.Tensor, block_ids: list[int], skip: int = 0) -> None:
        """Consumer: copy the handle's blocks into `block_ids` of `kv_cache`, all but the first `skip` (blocks the
        consumer's prefix cache already holds)."""

    def release(self, handle: KVHandle) -> None:
        """Producer: the consumer has read the handle's blocks (or dropped them); their room is free again."""


class SharedMemoryKVTransport:
    """One host: `staging` is a [layers, 2, kv_heads, num_blocks, block_size, head_dim] tensor both processes map
    (see `from_buffer`)."""

    def __init__(self, staging: torch.Tensor):
        self.staging = staging
        self.num_blocks = staging.shape[BLOCK_DIM]
        self.block_bytes = staging[:, :, :, :1].numel() * staging.element_size()
        self.free: deque[int] = deque(range(self.num_blocks))  # used on the producer side only
        self.counters = TransferCounters()

    @classmethod
    def from_buffer(cls, buffer: Any, kv_cache: torch.Tensor) -> "SharedMemoryKVTransport":
        """The staging pool over a shared buffer (multiprocessing.shared_memory's .buf): as many blocks shaped like
        `kv_cache`'s as fit."""
        shape = list(kv_cache.shape)
        shape[BLOCK_DIM] = 1
        block_bytes = kv_cache.element_size() * int(torch.Size(shape).numel())
        shape[BLOCK_DIM] = len(buffer) // block_bytes
        if shape[BLOCK_DIM] == 0:
            raise ValueError(f"the KV transfer buffer ({len(buffer)} bytes) is smaller than one KV block "
                             f"({block_bytes} bytes); raise --kv-transfer-buffer")
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=shape[BLOCK_DIM] * block_bytes)
        return cls(raw.view(kv_cache.dtype).view(shape))

    def send(self, request_id: str, kv_cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> KVHandle | None:
        n = len(block_ids)
        if n > self.num_blocks:
            raise ValueError(f"request {request_id}: {n} KV blocks never fit the {self.num_blocks}-block transfer "
                             f"buffer; raise --kv-transfer-buffer")
        if n > len(self.free):
            self.counters.stalls += 1
            return None
        t0 = time.perf_counter()
        slots = [self.free.popleft() for _ in range(n)]
        src = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
        dst = torch.tensor(slots, dtype=torch.long)
        self.staging.index_copy_(BLOCK_DIM, dst, kv_cache.index_select(BLOCK_DIM, src).to(self.staging.device))
        handle = KVHandle(request_id, tuple(slots), num_tokens, n * self.block_bytes)
        self._count(handle, time.perf_counter() - t0)
        return handle

    def recv(self, handle: KVHandle, kv_cache: torch.Tensor, block_ids: list[int], skip: int = 0) -> None:
        assert len(block_ids) == len(handle.blocks), "one destination block per staged block"
        if skip >= len(block_ids):
            return
        t0 = time.perf_counter()
        src = torch.tensor(handle.blocks[skip:], dtype=torch.long)
        dst = torch.tensor(block_ids[skip:], dtype=torch.long, device=kv_cache.device)
        kv_cache.index_copy_(BLOCK_DIM, dst, self.staging.index_select(BLOCK_DIM, src).to(kv_cache.device))
        self._count(handle, time.perf_counter() - t0, len(block_ids) - skip)

    def release(self, handle: KVHandle) -> None:
        self.free.extend(handle.blocks)

    def _count(self, handle: KVHandle, seconds: float, num_blocks: int | None = None) -> None:
        c = self.counters
        c.transfers += 1
        c.bytes += handle.num_bytes if num_blocks is None else num_blocks * self.block_bytes
        c.seconds += seconds


@dataclass(slots=True)
class HandOff:
    """What a decode engine needs besides the KV to go on with a request where the prefill engine stopped: the
    tokens so far, the sampling state (a seeded request's generator), the detokenizer's offsets and the timings."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    handle: KVHandle
    cache_salt: str | None = None
    num_cached_tokens: int = 0
    generator_state: torch.Tensor | None = None
    detokenizer: tuple[str, int, int, int] = ("", 0, 0, 0)  # output_text, emitted_text_len, prefix/read offsets

    @classmethod
    def of(cls, seq: Sequence, handle: KVHandle, generator_state: torch.Tensor | None) -> "HandOff":
        return cls(seq.request_id, list(seq.prompt_token_ids), seq.output_token_ids, seq.params, seq.metrics, handle,
                   seq.cache_salt, seq.num_cached_tokens, generator_state,
                   (seq.output_text, seq.emitted_text_len, seq.prefix_offset, seq.read_offset))

    def to_sequence(self) -> Sequence:
        seq = Sequence(self.request_id, self.prompt_token_ids, self.params, self.metrics, cache_salt=self.cache_salt,
                       token_ids=self.prompt_token_ids + self.output_token_ids, status=SequenceStatus.WAITING,
                       num_cached_tokens=self.num_cached_tokens)
        seq.output_text, seq.emitted_text_len, seq.prefix_offset, seq.read_offset = self.detokenizer
        return seq
