"""The simulator against the real engine: LLMEngine on the bundled model (float32), a handful of requests added at
fixed steps; every step's (requests, tokens each) must equal the simulator's, fed the same requests with a cost of
one second a step. Loads the model (a few seconds); the model-free check of the same property with many more steps
is test_simulator.py::test_reproduces_the_real_schedulers_step_sequence_exactly."""

from __future__ import annotations

import numpy as np

from inferlab.engine.config import EngineConfig
from inferlab.engine.sampling_params import SamplingParams
from inferlab.engine.step_trace import read_step_trace, read_trace_requests
from inferlab.lab.simulator import EngineShape, SimRequest, Simulation
from inferlab.lab.step_cost import StepCost


def test_engine_and_simulator_take_the_same_steps(tmp_path):
    from inferlab.engine.llm_engine import LLMEngine

    per_block = 2 * 30 * 3 * 64 * 4 * 16  # SmolLM2-135M: 30 layers, 3 KV heads of 64, float32, 16-token blocks
    cfg = EngineConfig(dtype="float32", max_num_seqs=3, max_num_batched_tokens=48, block_size=16,
                       kv_cache_memory=11 * per_block, max_prefill_tokens_with_decodes=24, num_threads=1,
                       step_trace=str(tmp_path / "steps.jsonl"))
    engine = LLMEngine(cfg)
    assert engine.block_manager.num_blocks == 11
    rng = np.random.default_rng(0)
    shared = rng.integers(1000, 20000, 32).tolist()
    # (step index it is added before, prompt, output tokens)
    plan = [(0, shared + rng.integers(1000, 20000, 20).tolist(), 30),
            (0, rng.integers(1000, 20000, 70).tolist(), 12),
            (2, shared + rng.integers(1000, 20000, 9).tolist(), 25),
            (3, rng.integers(1000, 20000, 5).tolist(), 40),
            (9, rng.integers(1000, 20000, 60).tolist(), 20),
            (10, shared + rng.integers(1000, 20000, 40).tolist(), 8)]
    steps = []
    original = engine.scheduler.schedule

    def schedule():
        batch = original()
        steps.append(([s.request_id for s in batch.seqs], list(batch.num_new_tokens)))
        return batch

    engine.scheduler.schedule = schedule
    k = 0
    while k < 200 and (engine.has_work() or any(at >= k for at, _, _ in plan)):
        for i, (at, prompt, out) in enumerate(plan):
            if at == k:
                engine.add_request(f"q{i}", prompt, SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0))
        engine.step()
        k += 1
    assert engine.scheduler.num_preemptions > 0 and engine.block_manager.prefix_hits > 0  # exercised

    reqs = [SimRequest(f"q{i}", at - 0.5 if at else 0.0, prompt, out) for i, (at, prompt, out) in enumerate(plan)]
    shape = EngineShape(max_num_seqs=3, max_num_batched_tokens=48, max_prefill_tokens_with_decodes=24, block_size=16,
                        num_blocks=11, max_queue=None)
    run = Simulation(StepCost(intercept=1.0), shape, record_steps=True).run(reqs)
    assert [(s.request_ids, s.num_new_tokens) for s in run.steps] == [s for s in steps if s[0]]
    assert [s.start for s in run.steps] == list(range(len(run.steps)))  # never idle: step k is the engine's k-th

    # The step trace (what `simulate calibrate served` fits) has a row for every step that ran a batch, carrying
    # that batch: its sequences' new tokens split into decodes and multi-token chunks, in order, each after the last.
    engine.step_trace.close()
    header, rows = read_step_trace(tmp_path / "steps.jsonl")
    assert header["num_blocks"] == 11 and header["max_prefill_tokens_with_decodes"] == 24
    ran = [s for s in steps if s[0]]
    assert len(rows) == len(ran)
    for row, (ids, new) in zip(rows, ran):
        assert row["d"] + len(row["p"]) == len(ids)
        assert row["d"] + sum(n for _, n, _ in row["p"]) == sum(new)
        assert sorted(n for _, n, _ in row["p"]) == sorted(n for n in new if n > 1)
    assert all(a["t"] + a["dt"] <= b["t"] for a, b in zip(rows, rows[1:])) and all(r["dt"] > 0 for r in rows)
    assert all(r["busy"] for r in rows[:-1]) and not rows[-1]["busy"]  # stepped back to back until it ran dry
    # and the bound each step's prefill was scheduled under (the fixed cap, wherever something decoded), as the
    # simulator's steps record it
    assert [r.get("cap") for r in rows] == [s.prefill_cap for s in run.steps]
    assert {r.get("cap") for r in rows} == {None, 24}

    # Each finished request's times: in order, on the steps' clock, its first token sampled in the step where the
    # simulator's came (step k ends at k + 1 there), with the prompt and output lengths it was given.
    done = {r["req"]: r for r in read_trace_requests(tmp_path / "steps.jsonl")}
    assert sorted(done) == sorted(r.request_id for r in reqs)
    for o in run.outcomes:
        r = done[o.request_id]
        assert r["a"] <= r["q"] <= r["s"] <= r["f"] <= r["e"]
        assert (r["n"], r["o"]) == (o.prompt_len, o.output_len)
        step = rows[round(o.first_token) - 1]
        assert step["t"] <= r["f"] <= step["t"] + step["dt"]
