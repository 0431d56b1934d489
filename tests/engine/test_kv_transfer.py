"""The engine side of disaggregated serving without a model: the prefill scheduler holding a handed-off request's
blocks, the decode scheduler admitting a request with injected KV (exact block accounting, prefix-cache hits,
refusals that change nothing), and the shared-memory transport (exact bytes across two mappings, backpressure)."""

from __future__ import annotations

from multiprocessing.shared_memory import SharedMemory

import pytest
import torch

from inferlab.engine.block_manager import BlockManager
from inferlab.engine.kv_transfer import HandOff, KVHandle, SharedMemoryKVTransport
from inferlab.engine.outputs import RequestMetrics
from inferlab.engine.sampling_params import SamplingParams
from inferlab.engine.scheduler import Scheduler
from inferlab.engine.sequence import Sequence, SequenceStatus

from test_scheduler import run_step, seq


def test_prefill_hand_off_keeps_blocks_until_finished_then_caches_them():
    bm = BlockManager(10, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = seq("a", 10)
    sched.add(a)
    run_step(sched)  # the whole prompt, and the first token sampled
    assert a.num_output_tokens == 1 and bm.table("a") == [0, 1, 2]
    sched.hand_off(a)
    assert a.status is SequenceStatus.HANDING_OFF and not sched.running and not sched.has_work()
    assert bm.num_free_blocks == 7  # still held: the KV has not been copied out yet
    assert not run_step(sched)  # nothing scheduled for it
    sched.finish(a)
    assert bm.num_free_blocks == 10 and a.status is SequenceStatus.FINISHED
    # its two full prompt blocks stay in the prefix cache for the next request with this prefix
    b = seq("b", 10)
    assert bm.find_cached_prefix(b) == [0, 1]


def injected(rid: str, prompt: int, first_token: int = 99, start: int = 0) -> Sequence:
    s = seq(rid, prompt, start)
    s.token_ids.append(first_token)
    return s


def test_admit_injected_allocates_all_tokens_and_runs_it_as_a_decode():
    bm = BlockManager(10, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    d = injected("d", 8)  # 8 prompt tokens (2 full blocks) + its first token -> 3 blocks
    assert sched.admit_injected(d, [])
    assert bm.table("d") == [0, 1, 2] and bm.num_free_blocks == 7
    assert d.num_computed_tokens == 8 and d.status is SequenceStatus.RUNNING
    batch = run_step(sched)
    assert batch.seqs == [d] and batch.num_new_tokens == [1] and batch.num_decodes == 1  # the first token's K/V
    assert d.num_computed_tokens == 9 and d.num_output_tokens == 2 and bm.table("d") == [0, 1, 2]
    assert bm.prefix_queries == 8 and bm.prefix_hits == 0


def test_admit_injected_takes_cached_prefix_blocks():
    bm = BlockManager(10, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = injected("a", 9)
    assert sched.admit_injected(a, [])
    bm.cache_computed_blocks(a)  # as LLMEngine.inject does after copying the KV in
    b = injected("b", 9)  # the same prompt
    cached = bm.find_cached_prefix(b)
    assert cached == [0, 1]
    assert sched.admit_injected(b, cached)
    assert bm.table("b")[:2] == [0, 1] and bm.blocks[0].ref_cnt == 2
    assert len(set(bm.table("b")[2:]) & set(bm.table("a"))) == 0
    assert bm.prefix_hits == 8


def test_admit_injected_refuses_without_changing_anything():
    bm = BlockManager(5, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    assert sched.admit_injected(injected("a", 11), [])  # 3 blocks
    big = injected("big", 12)  # 4 blocks: only 2 free
    assert not sched.admit_injected(big, [])
    assert bm.num_free_blocks == 2 and bm.table("big") == [] and big.status is SequenceStatus.WAITING
    assert sched.admit_injected(injected("b", 4), [])  # 2 blocks
    assert not sched.admit_injected(injected("c", 1), [])  # max_num_seqs
    sched.running[0].num_computed_tokens = 0
    sched.waiting.append(sched.running.pop())  # a preempted sequence waits: it goes first
    assert not sched.admit_injected(injected("c", 1), [])


def test_hand_off_round_trip_restores_the_sequence():
    s = injected("r", 5, first_token=42)
    s.output_text, s.emitted_text_len, s.prefix_offset, s.read_offset = "hi", 2, 3, 5
    s.num_cached_tokens = 4
    h = HandOff.of(s, KVHandle("r", (3, 4), 5, 100), None)
    t = h.to_sequence()
    assert t.token_ids == s.token_ids and t.prompt_token_ids == s.prompt_token_ids and t.num_output_tokens == 1
    assert (t.output_text, t.emitted_text_len, t.prefix_offset, t.read_offset) == ("hi", 2, 3, 5)
    assert t.num_cached_tokens == 4 and t.num_computed_tokens == 0 and t.status is SequenceStatus.WAITING


def _pool(num_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, 2, num_blocks, 4, 8, generator=g)  # [layers, K/V, heads, blocks, block_size, dim]


def test_shared_memory_transport_moves_exact_blocks_and_applies_backpressure():
    src, dst = _pool(8, 0), torch.zeros(3, 2, 2, 8, 4, 8)
    block_bytes = src[:, :, :, :1].numel() * 4
    shm = SharedMemory(create=True, size=5 * block_bytes + 7)
    try:
        producer = SharedMemoryKVTransport.from_buffer(shm.buf, src)
        peer = SharedMemory(name=shm.name)  # the consumer's own mapping, as in the decode process
        consumer = SharedMemoryKVTransport.from_buffer(peer.buf, dst)
        assert producer.num_blocks == consumer.num_blocks == 5
        h1 = producer.send("a", src, [6, 2, 5], num_tokens=10)
        assert h1 is not None and len(h1.blocks) == 3 and h1.num_bytes == 3 * block_bytes
        assert producer.send("b", src, [0, 1, 3], num_tokens=12) is None  # 2 free: backpressure, nothing sent
        assert producer.counters.stalls == 1 and len(producer.free) == 2
        consumer.recv(h1, dst, [1, 7, 4], skip=1)  # block 0 "cached" on the consumer: not copied
        assert torch.equal(dst[:, :, :, 7], src[:, :, :, 2]) and torch.equal(dst[:, :, :, 4], src[:, :, :, 5])
        assert torch.count_nonzero(dst[:, :, :, 1]) == 0
        assert consumer.counters.bytes == 2 * block_bytes and producer.counters.bytes == 3 * block_bytes
        producer.release(h1)
        assert producer.send("b", src, [0, 1, 3], num_tokens=12) is not None
        with pytest.raises(ValueError, match="never fit the 5-block transfer buffer"):
            producer.send("huge", src, list(range(6)), num_tokens=24)
        del consumer, producer
    finally:
        shm.unlink()


def test_transport_moves_an_int8_pool_with_its_scales():
    """An int8 pool (layers/kv_int8.py: [layers, K/V, heads, blocks, block bytes]) moves block by block too."""
    g = torch.Generator().manual_seed(3)
    src = torch.randint(-128, 128, (3, 2, 2, 6, 4 * (8 + 4)), generator=g, dtype=torch.int8)
    dst = torch.zeros_like(src)
    shm = SharedMemory(create=True, size=src[:, :, :, :3].numel())
    try:
        producer = SharedMemoryKVTransport.from_buffer(shm.buf, src)
        peer = SharedMemory(name=shm.name)
        consumer = SharedMemoryKVTransport.from_buffer(peer.buf, dst)
        assert producer.num_blocks == 3
        consumer.recv(producer.send("a", src, [4, 0], num_tokens=7), dst, [1, 5])
        assert torch.equal(dst[:, :, :, 1], src[:, :, :, 4]) and torch.equal(dst[:, :, :, 5], src[:, :, :, 0])
        assert torch.count_nonzero(dst[:, :, :, [0, 2, 3, 4]]) == 0
        del consumer, producer
    finally:
        shm.unlink()


def test_transport_refuses_a_buffer_smaller_than_a_block():
    with pytest.raises(ValueError, match="smaller than one KV block"):
        SharedMemoryKVTransport.from_buffer(bytearray(100), _pool(2, 0))


def test_sequence_params_travel_unchanged():
    p = SamplingParams(max_tokens=7, temperature=0.5, seed=3)
    s = Sequence("x", [1, 2], p, RequestMetrics(1.0), token_ids=[1, 2, 9])
    assert HandOff.of(s, KVHandle("x", (0,), 2, 1), None).to_sequence().params == p
