"""The simulator against queueing theory (M/D/1), Little's law, and the real scheduler driven as the engine drives
it. Model-free and fast."""

from __future__ import annotations

from dataclasses import replace

import math

import numpy as np
import pytest

from inferlab.engine.block_manager import BlockManager
from inferlab.engine.outputs import RequestMetrics
from inferlab.engine.sampling_params import SamplingParams
from inferlab.engine.scheduler import Scheduler
from inferlab.engine.sequence import Sequence
from inferlab.lab.simulator import EngineShape, SimRequest, Simulation, Topology
from inferlab.lab.step_cost import StepCost


def poisson_requests(n: int, rate: float, seed: int, prompt=(4, 40), output=(1, 1), groups: int = 0,
                     prefix: int = 0) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    shared = [rng.integers(1000, 30000, prefix).tolist() for _ in range(groups)]
    out = []
    for i in range(n):
        g = int(rng.integers(0, groups)) if groups else None
        body = rng.integers(1000, 30000, int(rng.integers(prompt[0], prompt[1] + 1))).tolist()
        out.append(SimRequest(f"r{i}", float(t[i]), (shared[g] if groups else []) + body,
                              int(rng.integers(output[0], output[1] + 1)), g))
    return out


def test_constant_cost_and_batch_one_is_md1():
    """One sequence at a time, each request one step of S seconds: an M/D/1 queue, whose mean wait is
    rho S / (2 (1 - rho)) (Pollaczek-Khinchine). 40,000 requests at rho = 0.5, fixed seed."""
    s, lam = 0.1, 5.0
    reqs = poisson_requests(40_000, lam, seed=3, prompt=(4, 40), output=(1, 1))
    run = Simulation(StepCost(intercept=s), EngineShape(max_num_seqs=1, max_queue=None)).run(reqs)
    waits = np.array([o.first_token - o.arrival - s for o in run.outcomes])
    rho = lam * s
    assert waits.min() >= -1e-12
    assert waits.mean() == pytest.approx(rho * s / (2 * (1 - rho)), rel=0.05)
    # And the fraction that did not wait at all is 1 - rho (PASTA: arrivals see the time-average state).
    assert np.mean(waits < 1e-12) == pytest.approx(1 - rho, abs=0.01)


def test_step_noise_draws_each_step_from_the_profiles_quantiles():
    """A profile's step noise multiplies each step's cost by one of its ratios, drawn uniformly: with M/D/1's
    S = 0.1 and ratios {0.5, 1.5}, every step lasts 0.05 or 0.15 s, about half each, and the queue becomes M/G/1,
    whose mean wait is lambda E[S^2] / (2 (1 - rho)) (Pollaczek-Khinchine): 62.5 ms here against M/D/1's 50 ms."""
    s, lam = 0.1, 5.0
    reqs = poisson_requests(40_000, lam, seed=3, prompt=(4, 40), output=(1, 1))
    cost = StepCost(intercept=s, step_noise=[0.5, 1.5])
    run = Simulation(cost, EngineShape(max_num_seqs=1, max_queue=None), record_steps=True).run(reqs)
    lengths = np.array([st.end - st.start for st in run.steps])
    assert np.allclose(np.sort(np.unique(lengths.round(9))), [0.05, 0.15])
    assert np.mean(lengths > 0.1) == pytest.approx(0.5, abs=0.01)
    waits = np.array([o.first_token - o.arrival for o in run.outcomes]) - lengths
    rho = lam * s
    assert waits.mean() == pytest.approx(lam * np.mean(lengths ** 2) / (2 * (1 - rho)), rel=0.05)
    again = Simulation(cost, EngineShape(max_num_seqs=1, max_queue=None), record_steps=True).run(reqs)
    assert [st.end for st in again.steps] == [st.end for st in run.steps]  # repeatable


def _little(run) -> tuple[float, float]:
    sojourn = [o.departure - o.arrival for o in run.outcomes]
    return run.mean_in_system, len(run.outcomes) / run.end_time * float(np.mean(sojourn))


COST = StepCost(intercept=0.01, per_prefill_token=2e-4, per_decode_seq=1e-3, per_attended=1e-7,
                per_sampled_row=2e-4, request_overhead=0.003)


@pytest.mark.parametrize("shape,topology,users", [
    (EngineShape(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=30, block_size=8), Topology(), None),
    (EngineShape(max_num_seqs=2, max_queue=3), Topology(), None),  # overloaded: many 429s
    (EngineShape(max_num_seqs=4), Topology(replicas=3, router="least-loaded"), None),
    (EngineShape(max_num_seqs=4), Topology(replicas=2, router="prefix-affinity"), None),
    (EngineShape(max_num_seqs=4, block_size=8), Topology(prefill=1, decode=2, kv_bytes_per_token=1e5,
                                                          link_bandwidth=1e8, link_latency=1e-3), None),
    (EngineShape(max_num_seqs=4), Topology(), 6),  # closed loop
])
@pytest.mark.parametrize("delivery", [[], [0.0, 0.004, 0.03]])
def test_littles_law_holds_on_every_run(shape, topology, users, delivery):
    """L (time-averaged requests in the system, read from the instances' queues at every event) = lambda W
    (arrivals per second x mean time in system, from each request's own timestamps), with tokens read when sampled
    and with a delivery delay after it."""
    reqs = poisson_requests(300, 20.0, seed=1, prompt=(4, 120), output=(1, 30), groups=3, prefix=24)
    run = Simulation(replace(COST, delivery=delivery), shape, topology).run(reqs, users=users)
    assert len(run.outcomes) == 300 and all(o.departure is not None for o in run.outcomes)
    lhs, rhs = _little(run)
    assert lhs == pytest.approx(rhs, rel=1e-9)
    assert lhs > 0.5  # a loaded system, not a trivial one


def test_each_token_is_read_a_delivery_draw_after_its_step_in_stream_order():
    """With a profile's delivery quantiles, a token is read max(its step's end + a draw, the previous token's
    read): a constant delay moves every token, TTFT and E2E by exactly that and leaves the inter-token gaps as they
    were; delays that vary spread the gaps while their sum, first token to last, moves by the last token's delay
    less the first's."""
    reqs = poisson_requests(200, 8.0, seed=5, prompt=(4, 60), output=(2, 20))
    shape = EngineShape(max_num_seqs=4)
    base = Simulation(COST, shape, record_steps=True).run(reqs)
    fixed = Simulation(replace(COST, delivery=[0.007]), shape, record_steps=True).run(reqs)
    assert [(s.start, s.end) for s in fixed.steps] == [(s.start, s.end) for s in base.steps]  # steps unmoved
    for a, b in zip(base.outcomes, fixed.outcomes):
        assert np.allclose(np.array(b.token_times) - a.token_times, 0.007)
        assert (b.first_token - a.first_token, b.finish - a.finish) == pytest.approx((0.007, 0.007))
    varied = Simulation(replace(COST, delivery=[0.0, 0.03]), shape).run(reqs)
    gaps_b = np.concatenate([np.diff(o.token_times) for o in base.outcomes])
    gaps_v = np.concatenate([np.diff(o.token_times) for o in varied.outcomes])
    assert (gaps_v >= 0).all() and np.percentile(gaps_v, 99) > np.percentile(gaps_b, 99) + 0.01
    ends = {o.request_id: o.token_times for o in base.outcomes}
    for o in varied.outcomes:  # read no sooner than sampled, and no later than the longest delay after it
        d = np.array(o.token_times) - ends[o.request_id]
        assert (d >= -1e-12).all() and (d <= 0.03 + 1e-12).all()


def test_overload_shows_in_rejections_and_preemptions():
    reqs = poisson_requests(300, 20.0, seed=1, prompt=(4, 120), output=(1, 30))
    run = Simulation(COST, EngineShape(max_num_seqs=2, max_queue=3)).run(reqs)
    assert sum(o.rejected == "queue full" for o in run.outcomes) > 50
    run = Simulation(COST, EngineShape(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=30, block_size=8)).run(reqs)
    assert run.num_preemptions > 0


# --- the real scheduler's step sequence ---------------------------------------------------------------------------

def reference_engine(requests: list[SimRequest], shape: EngineShape) -> list[tuple[float, list[str], list[int]]]:
    """The engine loop written out over the real Scheduler and BlockManager, as LLMEngine.step and the server's
    engine thread run it: requests that have arrived are added before each step; a step is schedule(), the model
    (here a fixed cost formula: 10 ms + 0.5 ms per token), update_from_output(), append the sampled tokens, finish
    what reached max_tokens; with no work the engine sleeps until the next arrival."""
    bm = BlockManager(shape.num_blocks, shape.block_size, shape.enable_prefix_caching)
    sched = Scheduler(bm, shape.max_num_seqs, shape.max_num_batched_tokens, shape.max_prefill_tokens_with_decodes)
    pending = sorted(requests, key=lambda r: r.arrival)
    now, i, log = 0.0, 0, []
    while i < len(pending) or sched.has_work():
        while i < len(pending) and pending[i].arrival <= now:
            r = pending[i]
            sched.add(Sequence(r.request_id, list(r.prompt_token_ids),
                               SamplingParams(max_tokens=r.output_len, ignore_eos=True), RequestMetrics(r.arrival)))
            i += 1
        if not sched.has_work():
            now = pending[i].arrival
            continue
        batch = sched.schedule()
        log.append((now, [s.request_id for s in batch.seqs], list(batch.num_new_tokens)))
        now += 0.010 + 0.0005 * batch.num_tokens
        sampled = {s: [99] for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_computed_tokens + n == s.num_tokens}
        sched.update_from_output(batch, sampled)
        for s, toks in sampled.items():
            s.token_ids.extend(toks)
            if s.num_output_tokens >= s.params.max_tokens:
                sched.finish(s)
    return log


def test_reproduces_the_real_schedulers_step_sequence_exactly():
    """Chunked prefill, a prefill cap beside decodes, a pool small enough to preempt, shared prefixes (cache hits),
    the sequence limit: the simulator's steps (start time, requests, tokens each) equal the reference loop's."""
    shape = EngineShape(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_tokens_with_decodes=32,
                        block_size=8, num_blocks=40, max_queue=None)
    reqs = poisson_requests(60, 15.0, seed=5, prompt=(10, 150), output=(1, 25), groups=2, prefix=40)
    expected = reference_engine(reqs, shape)
    cost = StepCost(intercept=0.010, per_prefill_token=0.0005, per_decode_seq=0.0005)
    run = Simulation(cost, shape, record_steps=True).run(reqs)
    got = [(s.start, s.request_ids, s.num_new_tokens) for s in run.steps]
    assert len(got) == len(expected) > 100
    for (t1, ids1, n1), (t2, ids2, n2) in zip(got, expected):
        assert (ids1, n1) == (ids2, n2)
        assert t1 == pytest.approx(t2, abs=1e-9)
    assert run.num_preemptions > 0 and run.prefix_hit_share > 0  # the features under test were exercised


def test_a_simulated_engine_starts_with_its_prefill_budget_fitted(monkeypatch):
    """A simulated engine runs as a server in service, its prefill budget already fitted: a prompt that arrives
    while a stream decodes is prefilled in chunks that keep each step within the stall ratio. A fresh budget (a
    server's first steps) would bound nothing and take the prompt whole beside the decode."""
    import inferlab.lab.simulator as simulator

    # Linear in what the budget sees, so its fit is exact: a step beside one decode takes 11 ms, so the ratio 1.5
    # leaves 5.5 ms, 11 tokens; the floor is 16 tokens (the budget's min_tokens; 400 waiting / DRAIN_STEPS is 13).
    cost = StepCost(intercept=0.010, per_prefill_token=0.0005, per_decode_seq=0.001)
    shape = EngineShape(max_num_seqs=4, max_num_batched_tokens=512, decode_stall_ratio=1.5, max_queue=None)
    reqs = [SimRequest("a", 0.0, list(range(1000, 1020)), 60), SimRequest("b", 0.1, list(range(2000, 2400)), 2)]

    def chunks_beside_decodes():
        run = Simulation(cost, shape, record_steps=True).run(reqs)
        return [n for s in run.steps for n in s.num_new_tokens if n > 1 and 1 in s.num_new_tokens]

    assert chunks_beside_decodes() == [16] * 25
    monkeypatch.setattr(simulator, "prime_budget", lambda *a: None)
    assert chunks_beside_decodes() == [400]


def test_admission_limit_is_the_servers():
    """A burst of 10 at once to max_num_seqs 2, max_queue 3: the running slots and 3 waiting are taken, the rest
    refused at once (the server's 429), as AsyncEngine.num_waiting counts."""
    reqs = [SimRequest(f"r{i}", 0.0, [1000 + i] * 10, 5) for i in range(10)]
    run = Simulation(StepCost(intercept=0.01), EngineShape(max_num_seqs=2, max_queue=3)).run(reqs)
    assert [o.rejected for o in run.outcomes] == [None] * 5 + ["queue full"] * 5


def test_closed_loop_keeps_the_users_busy():
    reqs = [SimRequest(f"r{i}", 123.0, [1000 + i] * 10, 3) for i in range(12)]
    run = Simulation(StepCost(intercept=0.01), EngineShape(max_num_seqs=8)).run(reqs, users=3)
    events = sorted([(o.arrival, 1) for o in run.outcomes] + [(o.finish, -1) for o in run.outcomes])
    in_flight = np.cumsum([d for _, d in events])
    assert in_flight.max() == 3 and run.outcomes[0].arrival == 0.0
    assert run.end_time == pytest.approx(4 * 3 * 0.01)  # 4 rounds of 3 steps, each step decoding all 3 users


def test_disaggregated_kv_arrives_as_cached_blocks():
    """Prefill instance: the prompt and the first token; then the link (latency + bytes/bandwidth); then the
    decode instance recomputes only what is past the last full cached block."""
    prompt = list(range(1000, 1040))  # 40 tokens, block 16: 2 full blocks travel
    topo = Topology(prefill=1, decode=1, kv_bytes_per_token=1000.0, link_bandwidth=40_000.0, link_latency=0.5)
    run = Simulation(StepCost(intercept=0.1, per_prefill_token=0.01), EngineShape(block_size=16), topo,
                     record_steps=True).run([SimRequest("a", 0.0, prompt, 4)])
    o = run.outcomes[0]
    first = 0.1 + 0.01 * 40
    assert o.first_token == pytest.approx(first) and o.prefill_instance == "prefill0" and o.instance == "decode0"
    assert o.kv_transfer == pytest.approx(0.5 + 1.0)
    decode_steps = [s for s in run.steps if s.instance == "decode0"]
    assert decode_steps[0].start == pytest.approx(first + 1.5)
    assert decode_steps[0].num_new_tokens == [41 - 32]  # prompt + first token, less the 32 cached
    assert len(o.token_times) == 4 and len(decode_steps) == 3


def test_routers():
    reqs = [SimRequest(f"r{i}", i * 10.0, [1000 + i] * 10, 2, group=i % 2) for i in range(6)]
    rr = Simulation(StepCost(intercept=0.01), topology=Topology(replicas=3)).run(reqs)
    assert [o.instance for o in rr.outcomes] == ["replica0", "replica1", "replica2"] * 2
    aff = Simulation(StepCost(intercept=0.01), topology=Topology(replicas=3, router="prefix-affinity")).run(reqs)
    assert {o.instance for o in aff.outcomes if o.request_id in ("r0", "r2", "r4")} == {"replica0"}
    assert {o.instance for o in aff.outcomes if o.request_id in ("r1", "r3", "r5")} == {"replica1"}
    # Least-loaded: two long requests at once go to different replicas.
    two = [SimRequest("x", 0.0, [1] * 10, 50), SimRequest("y", 0.0, [2] * 10, 50)]
    ll = Simulation(StepCost(intercept=0.01), topology=Topology(replicas=2, router="least-loaded")).run(two)
    assert {o.instance for o in ll.outcomes} == {"replica0", "replica1"}


def test_bad_topology_is_named():
    with pytest.raises(ValueError, match="unknown router 'random'"):
        Simulation(COST, topology=Topology(replicas=2, router="random"))
    with pytest.raises(ValueError, match="link bandwidth"):
        Simulation(COST, topology=Topology(prefill=1, decode=1))
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        Simulation(COST, EngineShape(max_num_seqs=0))


def test_a_request_larger_than_the_pool_is_refused_not_hung():
    run = Simulation(COST, EngineShape(num_blocks=4, block_size=8)).run([SimRequest("big", 0.0, [5] * 40, 4)])
    assert run.outcomes[0].rejected == "too long" and math.isclose(run.end_time, 0.003)
