"""The prefill budget beside decodes (engine/step_budget.py), without a model: the online cost model recovers a known
step cost and follows it when it drifts, the budget is the slack its ratio leaves, and a scheduler fed the times a
known cost model gives keeps every step with decodes within the ratio while still admitting the prompts."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from inferlab.engine.block_manager import BlockManager
from inferlab.engine.config import EngineConfig
from inferlab.engine.outputs import RequestMetrics
from inferlab.engine.sampling_params import SamplingParams
from inferlab.engine.scheduler import ScheduledBatch, Scheduler
from inferlab.engine.sequence import Sequence
from inferlab.engine.step_budget import DRAIN_STEPS, MIN_SEEN, PrefillBudget

A, B, C, E = 0.008, 0.0011, 0.0017, 0.0005  # s: per step, per decode, per 1024 keys read, per prefill token


def cost(decodes: int, attended: int, prefill: int, speed: float = 1.0) -> float:
    return speed * (A + B * decodes + C * attended / 1024 + E * prefill)


def feed(budget: PrefillBudget, rng: np.random.Generator, steps: int, speed: float = 1.0, noise: float = 0.0):
    for _ in range(steps):
        d = int(rng.integers(1, 33))
        att = d * int(rng.integers(50, 600))
        p = int(rng.integers(0, 65)) if rng.random() < 0.4 else 0
        budget.observe(d, att, p, cost(d, att, p, speed) * (1 + noise * rng.standard_normal()))


def test_no_bound_until_both_kinds_of_step_were_seen():
    budget = PrefillBudget(2.0)
    for _ in range(20):
        budget.observe(16, 3000, 0, cost(16, 3000, 0))
    assert budget.coefficients() is None and budget.tokens(16, 3000) is None  # no step with prefill yet
    for _ in range(int(MIN_SEEN) + 1):  # the counts decay too
        budget.observe(0, 0, 300, cost(0, 0, 300))
    assert budget.tokens(16, 3000) is not None
    assert budget.tokens(0, 0) is None  # nothing decodes: nothing to stall


def test_recovers_the_cost_model_and_the_budget_is_the_ratio_slack():
    budget = PrefillBudget(1.5)
    feed(budget, np.random.default_rng(0), 400)
    np.testing.assert_allclose(budget.coefficients(), [A, B, C, E], rtol=1e-3)
    d, att = 16, 16 * 200
    decode_only = cost(d, att, 0)
    n = budget.tokens(d, att)
    # n tokens keep the step within 1.5x its decodes' time, n + 1 would not.
    assert cost(d, att, n) <= 1.5 * decode_only * (1 + 1e-3) and cost(d, att, n + 1) > 1.5 * decode_only
    # A larger batch's step is longer, so its slack holds more prefill; a bigger ratio more still.
    assert budget.tokens(64, 64 * 200) > n
    budget2 = PrefillBudget(2.0)
    feed(budget2, np.random.default_rng(0), 400)
    assert budget2.tokens(d, att) > n


def test_follows_a_host_that_slows_down_and_ignores_single_stalls():
    rng = np.random.default_rng(1)
    budget = PrefillBudget(2.0)
    feed(budget, rng, 400, noise=0.05)
    before = budget.predict(16, 3200, 0)
    assert before == pytest.approx(cost(16, 3200, 0), rel=0.05)
    budget.observe(16, 3200, 0, 50 * before)  # one step stalled 50x (a preempted thread)
    assert budget.predict(16, 3200, 0) == pytest.approx(before, rel=0.05)
    feed(budget, rng, 1000, speed=1.5, noise=0.05)  # the host now runs everything 1.5x slower
    assert budget.predict(16, 3200, 0) == pytest.approx(cost(16, 3200, 0, speed=1.5), rel=0.05)
    # The ratio is of times, so the budget in tokens stays where it was.
    fresh = PrefillBudget(2.0)
    feed(fresh, np.random.default_rng(2), 400)
    assert budget.tokens(16, 3200) == pytest.approx(fresh.tokens(16, 3200), rel=0.1)


def test_never_below_the_minimum_chunk_nor_slower_than_the_queue_drains():
    budget = PrefillBudget(1.01, min_tokens=16)
    feed(budget, np.random.default_rng(3), 300)
    assert budget.tokens(1, 100) == 16
    assert budget.tokens(1, 100, backlog=8000) == 8000 // DRAIN_STEPS  # eight 1,000-token prompts waiting


def test_scheduler_keeps_steps_with_decodes_within_the_ratio():
    """16 streams of 128-token prompts and 128 output tokens, new prompts arriving as streams finish (a closed
    loop), step times from the known cost model: once the fit has seen both kinds of step, no step with decodes
    exceeds 1.5x what its decodes alone take (unless carrying only the minimum chunk, or draining a long queue), and
    every prompt is still admitted and completed."""
    budget = PrefillBudget(1.5)
    sched = Scheduler(BlockManager(2000, 16, enable_prefix_caching=False), max_num_seqs=64,
                      max_num_batched_tokens=512, prefill_budget=budget)
    rng = np.random.default_rng(4)
    made = 0

    def new_seq() -> Sequence:
        nonlocal made
        made += 1
        ids = rng.integers(10, 30000, 128).tolist()
        return Sequence(f"r{made}", ids, SamplingParams(max_tokens=128), RequestMetrics(0.0))

    for _ in range(16):
        sched.add(new_seq())
    ratios, done = [], 0
    for _ in range(3000):
        backlog = sum(s.num_tokens - s.num_computed_tokens for s in [*sched.running, *sched.waiting]
                      if s.num_computed_tokens < s.num_tokens - 1)
        batch: ScheduledBatch = sched.schedule()
        prefill = batch.num_tokens - batch.num_decodes
        dt = cost(batch.num_decodes, batch.num_attended, prefill)
        if batch.num_decodes and budget.coefficients() is not None:
            ratios.append((dt / cost(batch.num_decodes, batch.num_attended, 0), prefill, backlog))
        sched.observe(batch, dt)
        sampled = {s: [7] for s, n in zip(batch.seqs, batch.num_new_tokens)
                   if s.num_computed_tokens + n == s.num_tokens}
        sched.update_from_output(batch, sampled)
        for s, tokens in sampled.items():
            s.token_ids.extend(tokens)
            if s.num_output_tokens >= 128:
                sched.finish(s)
                done += 1
                sched.add(new_seq())
    assert done > 300
    # Within the ratio, except beside the minimum chunk (16 tokens: 1.6x four decodes' step) or while the queue
    # is long enough to need DRAIN_STEPS steps at the budget
    assert all(r <= 1.5 + 1e-6 or p <= max(budget.min_tokens, -(-b // DRAIN_STEPS)) for r, p, b in ratios)
    assert sum(r <= 1.5 + 1e-6 for r, _, _ in ratios) > 0.9 * len(ratios)
    assert sum(r > 1.2 for r, _, _ in ratios) > 100  # the budget is used, not starved
    # A fresh budget, before any step is measured (a server's first steps), bounds nothing.
    assert PrefillBudget(1.5).tokens(16, 3200) is None


def test_engine_config_takes_the_ratio():
    assert EngineConfig().decode_stall_ratio == 1.5
    with pytest.raises(ValueError, match="decode_stall_ratio must be above 1"):
        EngineConfig(decode_stall_ratio=1.0)
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    for text, want in (("1.5", 1.5), ("none", None)):
        args = parser.parse_args(["--decode-stall-ratio", text])
        assert EngineConfig.from_cli_args(args).decode_stall_ratio == want
