"""Scheduler without a model: token budgets, chunked prefill, decode-first batches, preemption order."""

from __future__ import annotations

import argparse

import pytest

from inferlab.engine.block_manager import BlockManager
from inferlab.engine.config import EngineConfig
from inferlab.engine.outputs import RequestMetrics
from inferlab.engine.sampling_params import SamplingParams
from inferlab.engine.scheduler import Scheduler
from inferlab.engine.sequence import Sequence, SequenceStatus


def seq(rid: str, n: int, start: int = 0) -> Sequence:
    return Sequence(rid, list(range(start, start + n)), SamplingParams(), RequestMetrics(0.0))


def run_step(sched: Scheduler, sample_token: int = 7):
    """A step as the engine runs it, without a model: schedule, let the scheduler account for the computed tokens,
    then append a token to every sequence that reached its end."""
    batch = sched.schedule()
    sampled = {s: [sample_token] for s, n in zip(batch.seqs, batch.num_new_tokens)
               if s.num_computed_tokens + n == s.num_tokens}
    sched.update_from_output(batch, sampled)
    for s, tokens in sampled.items():
        s.token_ids.extend(tokens)
    return batch


def test_long_prompt_is_chunked_and_mixed_with_decodes():
    sched = Scheduler(BlockManager(100, 16, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=64)
    a = seq("a", 10)
    sched.add(a)
    b1 = run_step(sched)
    assert b1.num_new_tokens == [10]
    big = seq("big", 150, start=1000)
    sched.add(big)
    b2 = run_step(sched)
    # a decodes (1 token) first, big gets the remaining 63 of the 64-token budget.
    assert [s.request_id for s in b2.seqs] == ["a", "big"] and b2.num_new_tokens == [1, 63] and b2.num_decodes == 1
    b3 = run_step(sched)
    assert b3.num_new_tokens == [1, 63]
    b4 = run_step(sched)
    assert b4.num_new_tokens == [1, 24]
    assert big.num_computed_tokens == 150 and big.num_output_tokens == 1


def test_prefill_beside_decodes_is_capped_but_not_when_alone():
    """max_prefill_tokens_with_decodes bounds the prefill a step carries while anyone decodes (their inter-token
    latency); with nothing decoding a prefill may use the whole step budget."""
    sched = Scheduler(BlockManager(100, 16, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=64,
                      max_prefill_tokens_with_decodes=20)
    a, b = seq("a", 50), seq("b", 40, start=500)
    sched.add(a)
    sched.add(b)
    assert run_step(sched).num_new_tokens == [50, 14]  # nobody decodes yet: the full 64
    step = run_step(sched)  # a decodes; b's remaining 26 prompt tokens are cut to 20
    assert [s.request_id for s in step.seqs] == ["a", "b"] and step.num_new_tokens == [1, 20]
    c = seq("c", 30, start=900)
    sched.add(c)
    step = run_step(sched)  # the cap is shared: b's last 6, then c gets 14
    assert [s.request_id for s in step.seqs] == ["a", "b", "c"] and step.num_new_tokens == [1, 6, 14]
    step = run_step(sched)  # a and b decode, c's remaining 16 fit under the cap
    assert step.num_new_tokens == [1, 1, 16] and step.num_decodes == 2


def test_admission_respects_max_num_seqs_and_budget():
    sched = Scheduler(BlockManager(100, 16), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        sched.add(seq(f"r{i}", 30, start=100 * i))
    b = run_step(sched)
    assert [s.request_id for s in b.seqs] == ["r0", "r1"] and len(sched.waiting) == 2
    assert all(s.status is SequenceStatus.RUNNING for s in b.seqs)


def test_preempts_most_recent_and_does_not_admit_in_that_step():
    # 6 blocks of 4 tokens. Three sequences of 7 tokens take 2 blocks each; when they grow past 8, someone must go.
    sched = Scheduler(BlockManager(6, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [seq(f"s{i}", 7, start=10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    run_step(sched)  # prefill all: 7 computed of 8 tokens, 2 blocks each, pool full
    run_step(sched)  # decode: 8 computed of 9, still 2 blocks each
    sched.add(seq("late", 2, start=500))
    b = run_step(sched)  # s0 needs a third block: s2 (most recent) is preempted, which also covers s1
    assert [s.request_id for s in b.preempted] == ["s2"]
    assert [s.request_id for s in b.seqs] == ["s0", "s1"]  # and "late" is not admitted in a preempting step
    assert [s.request_id for s in sched.waiting] == ["s2", "late"]  # the victim goes back to the front
    assert seqs[2].status is SequenceStatus.WAITING and seqs[2].num_computed_tokens == 0
    assert sched.num_preemptions == 1 and seqs[2].num_preemptions == 1
    # Eventually everything runs to completion with a bounded number of steps and no leaks.
    for _ in range(50):
        for s in list(sched.running):
            if s.num_output_tokens >= 3:
                sched.finish(s)
        if not sched.has_work():
            break
        run_step(sched)
    assert not sched.has_work()
    assert sched.bm.num_free_blocks == 6


def test_finish_from_waiting_and_running():
    sched = Scheduler(BlockManager(10, 4), max_num_seqs=1, max_num_batched_tokens=64)
    a, b = seq("a", 5), seq("b", 5, start=50)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.finish(b)  # still waiting
    sched.finish(a)  # running
    assert not sched.has_work() and sched.bm.num_free_blocks == 10


def test_engine_config_names_a_bad_budget():
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes must be at least 1"):
        EngineConfig(max_prefill_tokens_with_decodes=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be at least 1"):
        EngineConfig(max_num_batched_tokens=0)
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    for text, want in (("64", 64), ("none", None)):
        args = parser.parse_args(["--max-prefill-tokens-with-decodes", text])
        assert EngineConfig.from_cli_args(args).max_prefill_tokens_with_decodes == want


def test_update_from_output_keeps_accepted_proposals_and_returns_the_rest():
    """A verifying step schedules the last token and the proposals; what the target rejects is not computed, and
    blocks past the kept tokens go back to the pool, tail first."""
    bm = BlockManager(10, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = seq("a", 7)
    sched.add(a)
    run_step(sched)  # 7 computed, 8 tokens, 2 blocks
    sched.set_proposals({a: [1, 2, 3, 4, 5]})
    batch = sched.schedule()
    assert batch.num_new_tokens == [6] and bm.table("a") == [0, 1, 2, 3]  # room for 8 + 5 tokens
    sched.update_from_output(batch, {a: [1, 2, 99]})  # two proposals accepted, then the target's own token
    assert a.num_computed_tokens == 10 and a.spec_token_ids == []
    assert (a.spec_proposed, a.spec_accepted) == (5, 2)
    assert bm.table("a") == [0, 1, 2] and bm.num_free_blocks == 7  # 10 computed + 1 to come: 3 blocks
    assert list(bm.free_queue)[0] == 3  # the trimmed block holds nothing reusable: first in line
