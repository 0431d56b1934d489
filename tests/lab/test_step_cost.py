"""The step-cost model and its calibration: both fits recover known coefficients from synthetic measurements made
by a known cost model with noise. Model-free."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import numpy as np
import pytest

from inferlab.bench.records import RequestRecord
from inferlab.bench.runner import Load
from inferlab.bench.summary import summarize
from inferlab.engine.block_manager import BlockManager
from inferlab.engine.config import EngineConfig
from inferlab.engine.outputs import RequestMetrics
from inferlab.engine.scheduler import Scheduler
from inferlab.engine.sequence import Sequence
from inferlab.engine.step_trace import BatchShape
from inferlab.lab.calibrate import calibrate_blackbox, calibrate_served, profile_engine
from inferlab.lab.simulator import EngineShape, SimRequest, Simulation
from inferlab.lab.step_cost import (COEFFICIENTS, StepCost, StepFeatures, batch_features, fit_step_cost,
                                    nonnegative_lstsq, shape_features, with_coefficients)

TRUE = StepCost(intercept=0.020, per_prefill_token=4e-4, per_decode_seq=1.5e-3, per_attended=1e-6,
                per_sampled_row=5e-4, per_prefill_step=0.005)


def test_nonnegative_lstsq_matches_brute_force():
    """Oracle: the best of the unconstrained fits over every subset of free variables that comes out
    non-negative (the NNLS optimum is one of them)."""
    rng = np.random.default_rng(0)
    for _ in range(30):
        a = rng.normal(size=(12, 4))
        b = rng.normal(size=12)
        best = (np.inf, None)
        for k in range(5):
            for free in itertools.combinations(range(4), k):
                x = np.zeros(4)
                if free:
                    x[list(free)] = np.linalg.lstsq(a[:, list(free)], b, rcond=None)[0]
                if (x >= -1e-12).all():
                    best = min(best, (float(np.linalg.norm(a @ x - b)), tuple(x)), key=lambda t: t[0])
        got = nonnegative_lstsq(a, b)
        assert (got >= 0).all()
        assert np.linalg.norm(a @ got - b) == pytest.approx(best[0], rel=1e-7, abs=1e-9)


class FakeEngine:
    """LLMEngine's step over the real Scheduler, with the model replaced by the known cost model times
    multiplicative noise: what `profile_engine` sees of a real engine (scheduler, config, last_step_time)."""

    def __init__(self, cost: StepCost, noise: float, seed: int = 0, stalls: float = 0.0):
        self.config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256)
        self.scheduler = Scheduler(BlockManager(2000, 16), 16, 256)
        self.cost, self.noise, self.stalls = cost, noise, stalls
        self.rng = np.random.default_rng(seed)
        self.last_step_time = 0.0

    def add_request(self, rid, prompt, params):
        self.scheduler.add(Sequence(rid, prompt, params, RequestMetrics(0.0)))

    def has_work(self):
        return self.scheduler.has_work()

    def step(self):
        batch = self.scheduler.schedule()
        self.last_step_time = self.cost.time(batch_features(batch)) * self.rng.lognormal(0, self.noise)
        if self.rng.random() < self.stalls:  # another process took the cores: a step several times slower
            self.last_step_time *= self.rng.uniform(3, 20)
        sampled = {s: [7] for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_computed_tokens + n == s.num_tokens}
        self.scheduler.update_from_output(batch, sampled)
        for s, t in sampled.items():
            s.token_ids.extend(t)
            if s.num_output_tokens >= s.params.max_tokens:
                self.scheduler.finish(s)


def test_engine_profile_recovers_known_coefficients():
    feats, times, labels = profile_engine(FakeEngine(TRUE, noise=0.03), repeats=2, log=lambda m: None)
    assert len(times) > 100 and {"mixed", "prefill 16", "16 prompts of 2"} <= set(labels)
    coef, q = fit_step_cost(feats, times, fixed_zero=("request_overhead",))
    got = with_coefficients(coef)
    for name in ("intercept", "per_prefill_token", "per_decode_seq", "per_attended", "per_prefill_step"):
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=0.15), name
    # A sampled row is ~2% of a step here, less than the noise on one step: known to within a third.
    assert got.per_sampled_row == pytest.approx(TRUE.per_sampled_row, rel=0.3)
    assert q.rel_abs_p50 < 0.05 and q.r2 > 0.95  # residuals are the noise's size
    # A shared machine: 10% of steps stalled 3-20x. Best-of-3 passes and the robust refit still recover them.
    feats, times, _ = profile_engine(FakeEngine(TRUE, noise=0.03, seed=4, stalls=0.10), repeats=3, log=lambda m: None)
    coef, q = fit_step_cost(feats, times, robust=True)
    for name, v in zip(COEFFICIENTS, coef):
        if name not in ("request_overhead", "per_prefill_pair"):  # none offline; pairs ~0.1% of a prefill here
            assert v == pytest.approx(getattr(TRUE, name), rel=0.3 if name == "per_sampled_row" else 0.15), name
    # Noise-free, the fit is exact.
    feats, times, _ = profile_engine(FakeEngine(TRUE, noise=0.0), repeats=1, log=lambda m: None)
    coef, q = fit_step_cost(feats, times)
    assert np.allclose(coef, TRUE.coefficients(), rtol=1e-6) and q.rel_abs_max < 1e-9


def test_robust_fit_sets_stalled_steps_aside():
    feats, times, _ = profile_engine(FakeEngine(TRUE, noise=0.0), repeats=1, log=lambda m: None)
    rng = np.random.default_rng(9)
    stalled = rng.random(len(times)) < 0.1
    times = [t * (rng.uniform(3, 20) if s else 1.0) for t, s in zip(times, stalled)]
    coef, q = fit_step_cost(feats, times, robust=True)
    assert np.allclose(coef, TRUE.coefficients(), rtol=1e-6) and q.outliers == stalled.sum()
    plain, _ = fit_step_cost(feats, times)
    assert not np.allclose(plain, TRUE.coefficients(), rtol=0.01)  # the stalls bias a plain fit


@dataclass(slots=True)
class NoisyCost(StepCost):
    noise: float = 0.0
    seed: int = 0

    def step_time(self, batch) -> float:
        rng = _RNG.setdefault(self.seed, np.random.default_rng(self.seed))
        return self.time(batch_features(batch)) * float(rng.lognormal(0, self.noise))


_RNG: dict[int, np.random.Generator] = {}


def write_bench_results(path, runs: list[tuple[Load, list[SimRequest], int | None]], cost: StepCost,
                        shape: EngineShape):
    """Bench's results.json and records.jsonl for runs simulated with a known cost: records as a client would
    have written them (one chunk per token, times on the run's clock), summaries by bench's own summarize()."""
    path.mkdir(parents=True)
    summaries, lines = [], []
    for i, (load, reqs, users) in enumerate(runs):
        run = Simulation(cost, shape).run(reqs, users=users)
        recs = [RequestRecord(index=k, run=i, sent=o.arrival, end=o.finish, chunk_times=list(o.token_times),
                              chunk_tokens=[1] * len(o.token_times), input_len=o.prompt_len, output_len=o.output_len,
                              prompt_tokens=o.prompt_len, output_tokens=len(o.token_times), finish_reason="length")
                for k, o in enumerate(run.outcomes)]
        s = summarize(recs, load=load.to_dict())
        s["run"] = i
        summaries.append(s)
        lines += [r.to_json() for r in recs]
    (path / "records.jsonl").write_text("\n".join(lines) + "\n")
    (path / "results.json").write_text(json.dumps({"schema": "inferlab.bench.results/1", "runs": summaries,
                                                   "records": "records.jsonl"}))
    return path / "results.json"


def test_blackbox_calibration_recovers_known_coefficients(tmp_path):
    """Bench runs of a server whose steps follow a known model (plus 3% noise and a 5 ms request overhead):
    one stream over prompt lengths 16..700 (some chunked), then concurrency 2, 4, 8, 16."""
    true = StepCost(intercept=0.020, per_prefill_token=4e-4, per_decode_seq=1.5e-3, per_attended=3e-7,
                    request_overhead=0.005)
    cost = NoisyCost(**{c: getattr(true, c) for c in COEFFICIENTS}, noise=0.03, seed=1)
    shape = EngineShape(max_num_seqs=16, max_num_batched_tokens=512, num_blocks=4000)
    rng = np.random.default_rng(2)
    one = [SimRequest(f"a{i}", 0.0, rng.integers(1000, 30000, int(p)).tolist(), 16)
           for i, p in enumerate(rng.integers(16, 700, 40))]
    runs = [(Load("concurrency", 1), one, 1)]
    for c in (2, 4, 8, 16):
        reqs = [SimRequest(f"c{c}-{i}", 0.0, rng.integers(1000, 30000, 128).tolist(), 64) for i in range(6 * c)]
        runs.append((Load("concurrency", c), reqs, c))
    results = write_bench_results(tmp_path / "bench", runs, cost, shape)
    got = calibrate_blackbox([results], shape, model={}, hardware={})
    assert got.per_sampled_row == 0.0  # folded into per_decode_seq: not identifiable from outside
    assert got.intercept == pytest.approx(true.intercept, rel=0.15)
    assert got.per_prefill_token == pytest.approx(true.per_prefill_token, rel=0.15)
    assert got.per_decode_seq == pytest.approx(true.per_decode_seq, rel=0.15)
    assert got.request_overhead == pytest.approx(true.request_overhead, abs=0.003)
    # The attention term is small next to the others here; it must at least be of the right order.
    assert 0.3 * true.per_attended < got.per_attended < 3 * true.per_attended
    assert got.fit.n > 80 and got.fit.rel_abs_p50 < 0.06
    assert any("itl p50" in r["label"] for r in got.fit.rows) and any("throughput" in r["label"] for r in got.fit.rows)


def test_served_calibration_recovers_known_coefficients(tmp_path):
    """A step trace as `inferlab serve --step-trace` writes it, from a server whose step periods follow a known model
    (with a prefill step's own fixed cost, prefill attention priced per (query, key) pair, 3% noise, a few stalled
    steps, idle spells after 5% of the steps): the fit recovers the model."""
    true = StepCost(intercept=0.011, per_prefill_token=4.5e-4, per_decode_seq=1e-3, per_attended=1e-6,
                    per_prefill_step=0.010, per_prefill_pair=5e-7)
    rng = np.random.default_rng(3)
    header = {"model": "m", "dtype": "bfloat16", "kv_bytes_per_token": 100, "max_num_seqs": 8,
              "max_num_batched_tokens": 512, "max_prefill_tokens_with_decodes": None, "block_size": 16,
              "num_blocks": 999, "enable_prefix_caching": True}
    rows, t, stalled = [], 0.0, 0
    for i in range(3000):
        k = int(rng.integers(0, 9))
        # A tenth of the prefill chunks continue a long prompt, up to 3,584 tokens deep (a depth probe's).
        deep = rng.random() < 0.1
        chunks = [] if k and rng.random() < 0.97 else \
            [(int(rng.integers(1, 8)) * 512, 512, True) if deep else (0, int(rng.integers(16, 512)), True)]
        shape = BatchShape(tuple(chunks), k, int(k * rng.integers(64, 600)))
        period = true.time(shape_features(shape)) * float(rng.lognormal(0, 0.03))
        if rng.random() < 0.01:
            period *= rng.uniform(3, 10)  # another process stalled this step
            stalled += 1
        busy = rng.random() > 0.05
        rows.append({"t": t, "dt": period - 3e-4, "busy": busy, **shape.to_json()})  # 0.3 ms between steps
        t += period if busy else period + rng.uniform(0.1, 2.0)  # an idle spell: dt + the usual gap stands in
    path = tmp_path / "steps.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"schema": "inferlab.step_trace/1", **header}, *rows]) + "\n")
    got = calibrate_served([path], hardware={})
    for c in ("intercept", "per_prefill_token", "per_prefill_step", "per_prefill_pair"):
        assert getattr(got, c) == pytest.approx(getattr(true, c), rel=0.1), c
    # A decode-only step samples every sequence it carries, so only a prefill step's few sampled rows (under 1% of
    # its time here) tell a sampled row from a decoding sequence: the fit recovers their sum, what a sequence adds
    # to a decode step.
    assert got.per_decode_seq + got.per_sampled_row == pytest.approx(true.per_decode_seq, rel=0.1)
    assert got.per_sampled_row < 0.3 * true.per_decode_seq
    assert 0.3 * true.per_attended < got.per_attended < 3 * true.per_attended
    assert got.request_overhead == 0.0 and got.engine["num_blocks"] == 999 and got.source == "served step trace"
    assert got.fit.n == len(rows) and got.fit.outliers >= stalled > 10
    # Stalls left out of the fit are kept in the step noise the simulator draws from: its mean reproduces the
    # traced total time, its top quantile the stalls.
    noise = np.array(got.step_noise)
    assert len(noise) == 100 and (np.diff(noise) >= 0).all() and noise[-1] > 2.5
    total = sum(r["measured"] for r in got.fit.rows) / sum(r["predicted"] for r in got.fit.rows)
    assert noise.mean() == pytest.approx(total, rel=0.03)
    # Without the deep chunks no step attends PAIR_DEPTH keys a token: the pair is left unpriced, not fitted to
    # noise.
    shallow = tmp_path / "shallow.jsonl"
    shallow.write_text("\n".join(json.dumps(r) for r in [{"schema": "inferlab.step_trace/1", **header},
                                                          *(r for r in rows if all(c == 0 for c, _, _ in r["p"]))]))
    assert calibrate_served([shallow], hardware={}).per_prefill_pair == 0.0
    (tmp_path / "other.jsonl").write_text('{"index": 0}\n')
    with pytest.raises(ValueError, match="not a step trace"):
        calibrate_served([tmp_path / "other.jsonl"], hardware={})


def test_profile_file_round_trip_and_errors(tmp_path):
    c = StepCost(intercept=0.01, per_decode_seq=1e-3, source="engine profile", engine={"max_num_seqs": 4},
                 hardware={"name": "cpu", "bandwidth": 1e10, "flops": 1e12})
    c.fit.n = 3
    back = StepCost.load(c.save(tmp_path / "p.json"))
    assert back == c
    (tmp_path / "bad.json").write_text(json.dumps({"intercept": -1}))
    with pytest.raises(ValueError, match="intercept must be a non-negative"):
        StepCost.load(tmp_path / "bad.json")
    (tmp_path / "typo.json").write_text(json.dumps({"intercpt": 1}))
    with pytest.raises(ValueError, match="unknown field.*intercpt"):
        StepCost.load(tmp_path / "typo.json")
    with pytest.raises(ValueError, match="cannot read the step-cost profile"):
        StepCost.load(tmp_path / "missing.json")


def test_scaling_to_other_hardware_follows_the_roofline_terms():
    c = StepCost(intercept=0.01, per_prefill_token=1e-4, per_decode_seq=1e-3, per_attended=1e-8,
                 per_sampled_row=1e-4, request_overhead=0.002, hardware={"name": "a", "bandwidth": 1e11, "flops": 1e13})
    s = c.scaled("b", bandwidth=4e11, flops=1e14)
    assert s.intercept == pytest.approx(0.0025) and s.per_attended == pytest.approx(2.5e-9)  # memory: /4
    assert s.per_prefill_token == pytest.approx(1e-5) and s.per_decode_seq == pytest.approx(1e-4)  # compute: /10
    assert s.request_overhead == 0.002 and s.hardware["name"] == "b"
    with pytest.raises(ValueError, match="does not record its hardware"):
        StepCost().scaled("b", 1.0, 1.0)


def test_a_stretched_profile_takes_every_step_k_times_as_long():
    """Every step term, including any term added later, stretches; the host-side request overhead and the noise's
    shape do not."""
    c = StepCost(**{k: 1e-3 * (i + 1) for i, k in enumerate(COEFFICIENTS)}, step_noise=[0.9, 1.2])
    s = c.stretched(1.05)
    for k in COEFFICIENTS:
        assert getattr(s, k) == pytest.approx(getattr(c, k) * (1.0 if k == "request_overhead" else 1.05)), k
    assert s.step_noise == c.step_noise
    step = StepFeatures(steps=1, prefill_tokens=100, decode_seqs=3, attended=900, sampled_rows=4, prefill_steps=1,
                        prefill_pairs=5000)
    assert s.time(step) == pytest.approx(1.05 * c.time(step))


def test_step_time_ratio_tells_the_typical_step_from_the_total():
    """Ten identical steps as the profile predicts them, two of them stalled to 3x, against a profile whose noise is
    [0.9, 1.0, 1.4] (median 1.0, mean 1.1): the typical step has not moved (median 1.0), but the steps took
    (8 + 6) / 10 = 1.4x the prediction, 1.4 / 1.1 of what the simulator draws for them. validate simulates the
    point again at that total, not at the median."""
    from inferlab.lab.calibrate import step_time_ratio
    from inferlab.lab.simulate_cli import at_host_speed

    cost = StepCost(intercept=0.010, per_decode_seq=1e-3, per_attended=1e-6, step_noise=[0.9, 1.0, 1.4])
    shape = BatchShape((), 2, 300)
    predicted = cost.time(shape_features(shape))
    rows, t = [], 0.0
    for i in range(10):
        period = predicted * (3.0 if i % 5 == 4 else 1.0)
        rows.append({"t": t, "dt": period, "busy": True, **shape.to_json()})
        t += period
    r = step_time_ratio(cost, rows)
    assert r["steps"] == 10 and r["ratio"] == pytest.approx(1.0)
    assert r["by_kind"]["decode"]["ratio"] == pytest.approx(1.0)
    assert r["time_ratio"] == pytest.approx(1.4 / 1.1)
    assert at_host_speed(cost, r).intercept == pytest.approx(0.010 * 1.4 / 1.1)
    assert at_host_speed(cost, {"ratio": 1.2}).intercept == pytest.approx(0.012)  # a file from before the total
    assert at_host_speed(cost, {**r, "time_ratio": 1.01}) is None  # within SPEED_NOTE: nothing to simulate again


def test_memory_and_compute_terms_get_their_own_speeds_when_the_steps_tell_them_apart():
    """Decode steps (mostly the intercept's weight reads) and prefill-carrying steps (mostly prefill tokens), served
    with the memory terms 1.3x the profile and the compute terms 0.9x: least squares on the step times finds both
    factors, and validate's simulation at the measured speed stretches each kind of term by its own."""
    from inferlab.lab.calibrate import step_time_ratio
    from inferlab.lab.simulate_cli import at_host_speed

    cost = StepCost(intercept=0.008, per_prefill_token=5e-4, per_decode_seq=1e-4, per_attended=2e-6,
                    per_prefill_step=1e-3)
    rows, t = [], 0.0
    for i in range(40):
        shape = BatchShape(((0, 40 + 10 * i, True),), 3, 600) if i % 4 == 0 else BatchShape((), 4, 800 + 10 * i)
        memory, compute = cost.parts(shape_features(shape))
        assert memory + compute == pytest.approx(cost.time(shape_features(shape)))
        rows.append({"t": t, "dt": 1.3 * memory + 0.9 * compute, "busy": True, **shape.to_json()})
        t += rows[-1]["dt"]
    r = step_time_ratio(cost, rows)
    assert r["memory_ratio"] == pytest.approx(1.3) and r["compute_ratio"] == pytest.approx(0.9)
    host = at_host_speed(cost, r)
    assert host.intercept == pytest.approx(0.008 * 1.3) and host.per_attended == pytest.approx(2e-6 * 1.3)
    assert host.per_prefill_token == pytest.approx(5e-4 * 0.9) and host.per_decode_seq == pytest.approx(1e-4 * 0.9)
    # Steps all of one shape cannot tell the two apart: no factors, and validate falls back to the total.
    same = [{**rows[1], "t": i * rows[1]["dt"]} for i in range(10)]
    assert step_time_ratio(cost, same)["memory_ratio"] is None


def test_features_of_a_step():
    """A prefill of 20: 20 x 10.5 query-key pairs; then a decode at 21 tokens reads 21 keys."""
    bm = BlockManager(100, 4)
    sched = Scheduler(bm, 8, 64)
    a = Sequence("a", list(range(1000, 1020)), __import__("inferlab.engine.sampling_params",
                                                            fromlist=["SamplingParams"]).SamplingParams(),
                 RequestMetrics(0.0))
    sched.add(a)
    batch = sched.schedule()
    f = batch_features(batch)
    assert f == StepFeatures(1, 20, 0, 0, 1, prefill_steps=1, prefill_pairs=20 * 10.5)
    sched.update_from_output(batch, {a: [7]})
    a.token_ids.append(7)
    assert batch_features(sched.schedule()) == StepFeatures(1, 0, 1, 21, 1)
