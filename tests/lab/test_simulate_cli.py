"""`inferlab simulate predict` end to end on a synthetic profile, the capacity searches' answers checked by
re-simulation, and the workload drawn as bench draws it. Model-free."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from inferlab.bench.arrivals import worker_schedules
from inferlab.cli import main
from inferlab.lab import capacity
from inferlab.lab.card import load_card
from inferlab.lab.calibrate import shape_from
from inferlab.lab.sim_workload import card_requests
from inferlab.lab.simulate_cli import compare, max_rate_verdict
from inferlab.lab.step_cost import COEFFICIENTS, StepCost

CARD = """
version: 1
name: tiny
contract: {endpoint: completions, streaming: true}
traffic:
  arrival: poisson
  rate: 1/s
  requests: 50
  seed: 3
  input_len: {dist: uniform, min: 32, max: 160}
  output_len: 24
objectives:
  ttft: {p99: 400ms}
  tpot: {p99: 60ms}
  goodput: {min_share: 0.9}
server: {kind: inferlab, config: {max_num_seqs: 4}}
"""


@pytest.fixture
def setup(tmp_path):
    card = tmp_path / "card.yaml"
    card.write_text(CARD)
    prof = StepCost(intercept=0.012, per_prefill_token=4e-4, per_decode_seq=1.5e-3, per_attended=2e-8,
                    per_sampled_row=3e-4, request_overhead=0.002, source="synthetic",
                    engine={"max_num_seqs": 16, "max_num_batched_tokens": 256, "block_size": 16, "num_blocks": 2000,
                            "max_queue": 256},
                    model={"name": "x", "dtype": "bf16", "kv_bytes_per_token": 18432},
                    hardware={"name": "cpu", "bandwidth": 2e10, "flops": 5e11})
    path = prof.save(tmp_path / "profile.json")
    return card, path, tmp_path


def test_predict_writes_points_max_rate_replicas_and_disaggregation(setup, capsys):
    card, profile, tmp = setup
    out = tmp / "pred.json"
    rc = main(["simulate", "predict", str(card), "--profile", str(profile), "--rates", "1,3", "--requests", "150",
               "--search-requests", "300", "--target-rate", "12", "--disaggregate", "2", "--json", str(out), "--html", str(tmp / "p.html")])
    assert rc == 0
    d = json.loads(out.read_text())
    assert [p["rate"] for p in d["points"]] == [1.0, 3.0]
    assert d["search_requests"] == 300  # the searches' draw, not the table's 150
    assert d["engine"]["max_num_seqs"] == 4  # the card's server config beats the profile's
    for p in d["points"]:
        lit = p["little"]
        assert lit["mean_in_system"] == pytest.approx(lit["arrival_rate"] * lit["mean_time_in_system"], rel=1e-9)
    m = d["max_rate"]
    assert 0 < m["rate"] <= m["saturation"] and m["at_max"]["meets_card"]
    assert {r["topology"] for r in d["disaggregation"]} == {"2 replicas (least-loaded)", "1P+1D (least-loaded)"}
    assert d["replicas_for_target"]["replicas"] >= 2
    page = (tmp / "p.html").read_text()
    assert page.count("<svg") == 3 and "1P+1D" in page
    text = capsys.readouterr().out
    assert "highest rate meeting the card's objectives" in text and "replicas needed for 12 req/s" in text


def test_predict_closed_loop_users(setup):
    """--users N simulates N concurrent streams (what `inferlab bench --concurrency N` measures) on the topology,
    instead of a sweep of open-loop rates."""
    card, profile, tmp = setup
    out = tmp / "users.json"
    assert main(["simulate", "predict", str(card), "--profile", str(profile), "--users", "2,8", "--replicas", "2",
                 "--no-search", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [p["load"] for p in d["points"]] == ["concurrency 2", "concurrency 8"]
    assert all(p["topology"] == "2 replicas (least-loaded)" and p["requests_per_s"] > 0 for p in d["points"])
    assert "saturation_requests_per_s" not in d
    assert main(["simulate", "predict", str(card), "--profile", str(profile), "--users", "0"]) == 2


def test_searches_answer_what_they_claim(setup):
    card_path, profile, _ = setup
    card = load_card(card_path)
    cost = StepCost.load(profile)
    shape = shape_from(cost.engine)
    shape.max_num_seqs = 4
    sc = capacity.Scenario(card, cost, shape, requests=150)
    m = capacity.max_rate(sc)
    assert capacity.meets(card, capacity.simulate(sc, rate=m.rate))
    assert not capacity.meets(card, capacity.simulate(sc, rate=m.rate * 1.15))  # the boundary, within the search
    n, s = capacity.replicas_for(sc, rate=2.5 * m.rate)
    assert n >= 2 and capacity.meets(card, s)
    assert not capacity.meets(card, capacity.simulate(sc.with_topology(replicas=n - 1), rate=2.5 * m.rate))


def test_the_slo_max_of_a_draw_is_searched_past_saturation(setup):
    """A draw of a few dozen requests can meet the card above the rate the server sustains (its queue has not
    grown far by its last request): the load's answer stays capped at saturation, the draw's own (what validate
    benches on both sides of) is where that draw stops meeting the card."""
    card_path, profile, tmp = setup
    loose = tmp / "loose.yaml"  # a TTFT objective a queue takes a while to break
    loose.write_text(CARD.replace("ttft: {p99: 400ms}", "ttft: {p99: 2s}"))
    card, cost = load_card(loose), StepCost.load(profile)
    sc = capacity.Scenario(card, cost, capacity.card_shape(card, cost), requests=40)
    capped, draw = capacity.max_rate(sc), capacity.max_rate(sc, past_saturation=True)
    assert capped.rate <= capped.saturation < draw.rate  # so the checks below test the search past it
    assert capacity.meets(card, capacity.simulate(sc, rate=draw.rate))
    assert not capacity.meets(card, capacity.simulate(sc, rate=draw.rate * 1.03))


def test_workload_is_benchs_draw(setup):
    """Same seed and load point as `inferlab bench` (one worker): the same arrival times and lengths."""
    card = load_card(setup[0])
    reqs = card_requests(card.traffic, 50, rate=2.0, arrival="poisson", run=1)
    bench_times = worker_schedules(2.0, "poisson", 1.0, workers=1, seed=3, run=1, n=50)[0]
    assert np.allclose([r.arrival for r in reqs], bench_times)
    from inferlab.bench.arrivals import STREAM_WORKLOAD, rng_for
    from inferlab.bench.workload import LengthDist

    assert [len(r.prompt_token_ids) for r in reqs] == \
        LengthDist.parse("uniform:32,160").sample(50, rng_for(3, STREAM_WORKLOAD, 1)).tolist()


def test_compare_reports_relative_errors():
    def summary(ttft, rps):
        lat = {m: {"p50": ttft, "p99": 2 * ttft} for m in ("ttft", "itl", "tpot", "e2e")}
        return {"latency": lat, "throughput": {"requests_per_s": rps, "output_tokens_per_s": 10 * rps},
                "goodput": {"share": 1.0}}

    rows = {r["metric"]: r for r in compare(summary(0.1, 2.0), summary(0.11, 1.5))["metrics"]}
    assert rows["ttft p50"]["rel_error"] == pytest.approx(0.1)
    assert rows["requests_per_s"]["rel_error"] == pytest.approx(-0.25)
    assert rows["goodput share"]["rel_error"] == 0.0


def test_the_max_rate_check_brackets_the_prediction():
    bracket = (2.0, 1.7, 2.3)
    points = lambda lo, hi: [{"rate": 1.7, "meets_measured": lo}, {"rate": 2.3, "meets_measured": hi}]
    v = max_rate_verdict(bracket, 0.15, points(True, False))
    assert v["within"] and "within 15% of the prediction" in v["verdict"]
    assert not max_rate_verdict(bracket, 0.15, points(False, False))["within"]
    assert "below the lower bound" in max_rate_verdict(bracket, 0.15, points(False, False))["verdict"]
    assert "above the upper bound" in max_rate_verdict(bracket, 0.15, points(True, True))["verdict"]
    assert "undetermined" in max_rate_verdict(bracket, 0.15, points(True, None))["verdict"]


def test_the_nearest_objective_is_the_one_closest_to_or_furthest_past_its_limit(setup):
    from inferlab.lab.simulate_cli import nearest_objective

    card = load_card(setup[0])  # ttft p99 <= 400 ms, tpot p99 <= 60 ms, goodput >= 0.9 of requests

    def summary(ttft, tpot, share):
        lat = {m: {"p50": 0.01, "p90": 0.01, "p99": 0.01} for m in ("ttft", "itl", "tpot", "e2e")}
        lat["ttft"]["p99"], lat["tpot"]["p99"] = ttft, tpot
        return {"latency": lat, "throughput": {"requests_per_s": 1.0, "output_tokens_per_s": 10.0},
                "goodput": {"share": share, "requests_per_s": share}, "counts": {"errors": 0, "measured": 10}}

    near = nearest_objective(card, summary(0.38, 0.030, 1.0), summary(0.42, 0.030, 1.0))
    assert near["objective"].startswith("ttft p99") and near["predicted"] == pytest.approx(-0.05)
    assert near["measured"] == pytest.approx(0.05)
    near = nearest_objective(card, summary(0.2, 0.030, 0.72), summary(0.2, 0.030, 0.9))
    assert near["objective"].startswith("goodput") and near["predicted"] == pytest.approx(0.2)
    assert near["measured"] == pytest.approx(0.0)


def test_the_request_overhead_is_fitted_request_by_request(setup, tmp_path):
    """calibrate's request overhead pairs each measured request with the simulated one of the same draw: a known
    overhead (5 ms) comes back to 0.1 ms although a fifth of the requests were held up 150 ms (a host's stalls),
    which moves the difference of the two TTFT p50s (the fit before, and the fallback without records) by more
    than 3 ms. Records of another draw are not paired. The "measured" run is the simulator's, with the overhead."""
    from inferlab.bench.records import RequestRecord
    from inferlab.lab.simulate_cli import fit_request_overhead
    from inferlab.lab.simulator import Simulation, Topology

    card, profile, _ = setup
    c, cost = load_card(card), StepCost.load(profile)
    truth = StepCost.from_dict({**cost.to_dict(), "request_overhead": 0.005})
    run = Simulation(truth, shape_from(cost.engine), Topology()).run(
        card_requests(c.traffic, 60, rate=1.0, arrival="poisson"))
    records, ttfts = [], []
    for o in run.outcomes:
        i = int(o.request_id[1:])
        stall = 0.15 if i % 5 == 0 else 0.0
        records.append(RequestRecord(index=i, warmup=o.warmup, scheduled=o.arrival, sent=o.arrival,
                                     end=o.finish + stall, chunk_times=[o.first_token + stall], chunk_tokens=[1],
                                     input_len=o.prompt_len))
        if not o.warmup:
            ttfts.append(o.first_token + stall - o.arrival)
    (tmp_path / "records.jsonl").write_text("".join(r.to_json() + "\n" for r in records))
    measured = {"latency": {"ttft": {"p50": float(np.median(ttfts))}}, "path": str(tmp_path / "results.json")}

    def fitted(measured_):
        fit = StepCost.from_dict({**cost.to_dict(), "request_overhead": 0.0})
        fit_request_overhead(fit, c, 1.0, 60, measured_)
        return fit.request_overhead, fit.notes[-1]

    overhead, note = fitted(measured)
    assert overhead == pytest.approx(0.005, abs=1e-4) and "median over 60 requests" in note
    overhead, note = fitted({"latency": measured["latency"]})  # no records: the p50s
    assert abs(overhead - 0.005) > 0.003 and "TTFT p50" in note
    other = replace(c, traffic=replace(c.traffic, seed=c.traffic.seed + 1))
    assert [r.input_len for r in records] != [len(q.prompt_token_ids) for q in  # pairing them would mean nothing
                                              card_requests(other.traffic, 60, rate=1.0, arrival="poisson")]
    fit = StepCost.from_dict({**cost.to_dict(), "request_overhead": 0.0})
    fit_request_overhead(fit, other, 1.0, 60, measured)
    assert "TTFT p50" in fit.notes[-1]


def test_the_request_overhead_from_requests_served_alone_is_free_of_queueing(setup, tmp_path):
    """A step model that misprices decodes (the server's decode-only steps cost 50 ms a sequence more than the
    profile says) leaves the requests queued at 1 req/s paired with simulated ones that started sooner, and the
    overhead fitted there takes up the difference; served one at a time (calibrate served --alone), each
    request's TTFT is its prefill alone, which the mispricing does not touch, and the known overhead (5 ms) comes
    back."""
    from inferlab.bench.records import RequestRecord
    from inferlab.lab.simulate_cli import fit_request_overhead
    from inferlab.lab.simulator import Simulation, Topology

    card, profile, _ = setup
    c, cost = load_card(card), StepCost.load(profile)
    truth = StepCost.from_dict({**cost.to_dict(), "request_overhead": 0.005,
                                "per_decode_seq": cost.per_decode_seq + 0.05})

    def measured_run(rate, folder):
        reqs = card_requests(c.traffic, 60, rate=math.inf if rate is None else rate, arrival="poisson")
        run = Simulation(truth, shape_from(cost.engine), Topology()).run(reqs, users=1 if rate is None else None)
        records = [RequestRecord(index=int(o.request_id[1:]), warmup=o.warmup, scheduled=o.arrival, sent=o.arrival,
                                 end=o.finish, chunk_times=[o.first_token], chunk_tokens=[1], input_len=o.prompt_len)
                   for o in run.outcomes]
        folder.mkdir()
        (folder / "records.jsonl").write_text("".join(r.to_json() + "\n" for r in records))
        return {"latency": {"ttft": {"p50": 0.0}}, "path": str(folder / "results.json")}

    fitted = {}
    for rate, folder in ((1.0, tmp_path / "rate"), (None, tmp_path / "alone")):
        fit = StepCost.from_dict({**cost.to_dict(), "request_overhead": 0.0})
        fit_request_overhead(fit, c, rate, 60, measured_run(rate, folder))
        fitted[rate] = fit.request_overhead, fit.notes[-1]
    assert fitted[1.0][0] > 0.005 + 0.02 and "at 1 req/s" in fitted[1.0][1]
    assert fitted[None][0] == pytest.approx(0.005, abs=1e-6) and "served one at a time" in fitted[None][1]


def test_bad_input_is_named(setup, capsys):
    card, profile, tmp = setup
    assert main(["simulate", "predict", str(card), "--profile", str(tmp / "nope.json")]) == 2
    assert "cannot read the step-cost profile" in capsys.readouterr().err
    assert main(["simulate", "predict", str(card), "--profile", str(profile), "--rates", "1,x"]) == 2
    assert "--rates '1,x'" in capsys.readouterr().err
    assert main(["simulate", "predict", str(card), "--profile", str(profile), "--router", "random"]) == 2
    assert "unknown router 'random'" in capsys.readouterr().err
    assert main(["simulate", "validate", str(card), "--profile", str(profile), "--max-rate-within", "1.5"]) == 2
    assert "--max-rate-within 1.5: give a fraction between 0 and 1" in capsys.readouterr().err
    assert main(["simulate", "validate", str(card), "--profile", str(profile), "--max-rate-within", "0.15",
                 "--search-requests", "0"]) == 2
    assert "--search-requests 0: give at least one request" in capsys.readouterr().err
    assert main(["simulate", "predict", str(card), "--profile", str(profile), "--search-requests", "0"]) == 2
    assert "--search-requests 0: give at least one request" in capsys.readouterr().err
    assert main(["simulate", "validate", str(card), "--profile", str(profile), "--rates", "1", "--leave-one-out"]) == 2
    assert "--leave-one-out needs at least two rates" in capsys.readouterr().err
    assert main(["simulate", "calibrate", "served", str(card), "--rates", "1", "--depth-probe", "-1"]) == 2
    assert "--depth-probe -1: give a prompt length in tokens, or 0 for no probe" in capsys.readouterr().err
    assert main(["simulate", "calibrate", "served", str(card), "--rates", "1", "--alone", "-1"]) == 2
    assert "--alone -1: give a number of requests" in capsys.readouterr().err


def test_trace_replay_keeps_times_lengths_and_shared_blocks(setup, tmp_path):
    from inferlab.lab.sim_workload import trace_requests

    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"timestamp": 10.0, "input_len": 40, "output_len": 5, "hash_ids": [1, 2]},
        {"timestamp": 12.0, "input_length": 50, "output_length": 3, "hash_ids": [1, 3]},
        {"timestamp": 11.0, "input_len": 8, "output_len": 2}]) + "\n")
    reqs = trace_requests(path, speed=2.0, block_size=16)
    assert [r.arrival for r in reqs] == [0.0, 0.5, 1.0]
    assert [len(r.prompt_token_ids) for r in reqs] == [40, 8, 50] and [r.output_len for r in reqs] == [5, 2, 3]
    assert reqs[0].prompt_token_ids[:16] == reqs[2].prompt_token_ids[:16]  # hash id 1: the same block
    assert reqs[0].prompt_token_ids[16:32] != reqs[2].prompt_token_ids[16:32]
    card = load_card(setup[0])
    sc = capacity.Scenario(card, StepCost.load(setup[1]), shape_from(StepCost.load(setup[1]).engine), trace=reqs)
    s = capacity.simulate(sc, speed=1.0)
    assert s["counts"]["completed"] == 3 and s["load"]["kind"] == "trace"
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: needs JSON with timestamp, input_len and output_len"):
        trace_requests(tmp_path / "bad.jsonl")


def _serve_with_fake_server(card: Path) -> None:
    """The card's server becomes `inferlab fake-server` (10 ms to the first token, 2 ms a token): a real HTTP server
    for validate to bench, without a model."""
    import sys

    import yaml

    d = yaml.safe_load(card.read_text())
    d["server"] = {"kind": "command", "ready_timeout": "120s",
                   "command": f"{sys.executable} -m inferlab fake-server --port {{port}} --ttft 10ms --itl 2ms"}
    card.write_text(yaml.safe_dump(d))


def test_validate_benches_each_rate_with_its_own_seed(setup, tmp_path):
    """validate against a real server (`inferlab fake-server`, 10 ms to the first token, 2 ms a token): each rate is
    a fresh draw (seed + i), so no point finds its prompts in the server's prefix cache from an earlier one, and the
    simulation of each point draws what bench sent."""
    card, profile, _ = setup
    _serve_with_fake_server(card)
    out = tmp_path / "val.json"
    assert main(["simulate", "validate", str(card), "--profile", str(profile), "--rates", "4,8", "--requests", "6",
                 "--output-dir", str(tmp_path / "runs"), "--json", str(out)]) == 0
    points = json.loads(out.read_text())["points"]
    assert [p["seed"] for p in points] == [3, 4]
    prompts = []
    for p in points:
        results = json.loads(open(p["results"]).read())
        assert results["provenance"]["seed"] == p["seed"]
        assert next(m for m in p["metrics"] if m["metric"] == "ttft p50")["measured"] >= 0.010
        prompts.append(results["runs"][0]["tokens"]["input"]["mean"])
    assert prompts[0] != prompts[1]  # different draws


def test_validate_brackets_the_slo_max_rate_of_the_draw_it_sends(setup, tmp_path):
    """validate simulates the SLO-max rate of one draw of --bracket-requests requests (the seed after the rates'),
    then benches that draw at both bracket rates: the same prompt lengths and arrival gaps, scaled by the rate, in
    other words (text seeds 1 and 2), so the second point finds nothing of the first in the prefix cache. The load's
    SLO-max, searched on --search-requests, is reported beside it. Against `inferlab fake-server`."""
    from inferlab.bench.records import read_records

    card, profile, _ = setup
    _serve_with_fake_server(card)
    out = tmp_path / "val.json"
    assert main(["simulate", "validate", str(card), "--profile", str(profile), "--rates", "4", "--requests", "6",
                 "--search-requests", "300", "--max-rate-within", "0.15", "--bracket-requests", "30",
                 "--output-dir", str(tmp_path / "runs"), "--json", str(out)]) == 0
    got = json.loads(out.read_text())["max_rate"]
    c, cost = load_card(card), StepCost.load(profile)
    sc = capacity.Scenario(c, cost, capacity.card_shape(c, cost))
    draw = replace(c, traffic=replace(c.traffic, seed=c.traffic.seed + 1))
    assert got["draw"] == {"seed": c.traffic.seed + 1, "requests": 30}
    assert got["predicted"] == pytest.approx(capacity.max_rate(replace(sc, card=draw, requests=30),
                                                               past_saturation=True).rate)
    assert got["load_predicted"] == pytest.approx(capacity.max_rate(replace(sc, requests=300)).rate)
    assert got["predicted"] != pytest.approx(got["load_predicted"], rel=0.05)  # so the checks above can fail
    points = json.loads(out.read_text())["points"]
    assert [p["rate"] for p in points] == [4, round(got["lower"], 4), round(got["upper"], 4)]
    assert [(p["seed"], p["text_seed"]) for p in points] == [(3, None), (4, 1), (4, 2)]
    assert [p["meets_predicted"] for p in points[1:]] == [True, False]  # the draw's own SLO-max lies between
    # what the bracket asked of the model: the objective the simulation put nearest its limit, inside it at the
    # lower rate and past it at the upper
    assert points[1]["nearest_objective"]["predicted"] <= 0 < points[2]["nearest_objective"]["predicted"]
    records = []
    for p, n in zip(points, (6, 30, 30)):
        results = json.loads(open(p["results"]).read())
        assert results["runs"][0]["counts"]["measured"] == n and p["simulated_requests"] == n
        assert results["provenance"]["text_seed"] == p["text_seed"]
        records.append(sorted(read_records(Path(p["results"]).parent / "records.jsonl"), key=lambda r: r.index))
    lo, hi = records[1:]
    assert [r.input_len for r in lo] == [r.input_len for r in hi]
    assert [r.scheduled * points[1]["rate"] for r in lo] == pytest.approx([r.scheduled * points[2]["rate"]
                                                                          for r in hi], abs=1e-6)
    assert hi[0].prompt_tokens == lo[0].prompt_tokens and records[0][0].input_len != lo[0].input_len


def test_a_server_that_runs_as_simulated_passes_the_bracket_on_every_draw(setup, tmp_path, monkeypatch):
    """A server whose every request runs as the simulator says (here, the simulator itself) meets the card below its
    draw's SLO-max and misses it above, whatever the draw: the bracket fails only where the model (or the host)
    does. Around the load's SLO-max instead, with each rate a fresh draw as before, some draws of 40 requests
    put this same perfect server on the wrong side."""
    from inferlab.lab import simulate_cli

    card, profile, _ = setup
    _serve_with_fake_server(card)  # no step trace to read: bench is replaced below
    c, cost = load_card(card), StepCost.load(profile)
    real_simulate = capacity.simulate

    def perfect_server(card_, loads, out_dir, base_url=None, server_config=None, arrival=None, burstiness=None):
        return [(lp.rate, k, {**real_simulate(capacity.Scenario(k, cost, capacity.card_shape(c, cost),
                                                                requests=lp.requests, arrival=arrival),
                                              rate=lp.rate), "path": None, "window": (0.0, 1.0)})
                for lp in loads for k in [replace(card_, traffic=replace(card_.traffic, seed=lp.seed))]]

    monkeypatch.setattr(simulate_cli, "bench_rates", perfect_server)
    wrong_side_of_the_load = 0
    for seed in range(3, 9):
        card.write_text(card.read_text().replace(f"seed: {seed - 1}", f"seed: {seed}") if seed > 3 else
                        card.read_text())
        out = tmp_path / f"val-{seed}.json"
        assert main(["simulate", "validate", str(card), "--profile", str(profile), "--max-rate-within", "0.15",
                     "--bracket-requests", "40", "--search-requests", "400", "--json", str(out)]) == 0
        got = json.loads(out.read_text())["max_rate"]
        assert got["draw"]["seed"] == seed and got["within"], got["verdict"]
        sc = capacity.Scenario(load_card(card), cost, capacity.card_shape(c, cost), requests=40)
        fresh = [replace(sc.card, traffic=replace(sc.card.traffic, seed=seed + 50 + k)) for k in (0, 1)]
        meets = [capacity.meets(sc.card, real_simulate(replace(sc, card=f), rate=got["load_predicted"] * x))
                 for f, x in zip(fresh, (0.85, 1.15))]
        wrong_side_of_the_load += meets != [True, False]
    assert wrong_side_of_the_load > 0


def test_leave_one_out_simulates_the_scheduler_the_server_ran(setup, tmp_path, monkeypatch):
    """--leave-one-out refits the step cost to the server's own trace at the other rates, and simulates the engine
    that trace's header describes (here 2 sequences and a decode-stall ratio of 1.5), not the profile's (16
    sequences, no bound): a profile from an older engine must not decide the schedule being predicted. Model-free:
    bench is replaced by a trace of known steps and a measured run drawn from the simulator itself."""
    from inferlab.lab import simulate_cli

    card, profile, _ = setup
    header = {"schema": "inferlab.step_trace/1", "model": "m", "dtype": "bfloat16", "kv_bytes_per_token": 100,
              "max_num_seqs": 2, "max_num_batched_tokens": 256, "max_prefill_tokens_with_decodes": None,
              "block_size": 16, "num_blocks": 500, "enable_prefix_caching": True, "decode_stall_ratio": 1.5}
    base = capacity.Scenario(load_card(card), StepCost.load(profile), shape_from(StepCost.load(profile).engine),
                             requests=20)
    real_simulate = capacity.simulate

    def fake_bench_rates(card_, loads, out_dir, base_url=None, server_config=None, arrival=None, burstiness=None):
        rows, points, t = [], [], 0.0
        for lp in loads:
            rate = lp.rate
            t0 = t
            for k in range(60):  # decode steps of 1-2 sequences and a prefill every tenth step
                chunks = [[0, 100, True]] if k % 10 == 0 else []
                d = 1 + k % 2
                dt = 0.010 + 0.001 * d + (0.05 if chunks else 0.0)
                rows.append({"t": t, "dt": dt - 3e-4, "busy": True, "p": chunks, "d": d, "da": 150 * d})
                t += dt
            measured = real_simulate(replace(base, card=card_), rate=rate)
            points.append((rate, card_, {**measured, "path": None, "window": (t0, t)}))
        Path(server_config["step_trace"]).parent.mkdir(parents=True, exist_ok=True)
        Path(server_config["step_trace"]).write_text("\n".join(json.dumps(r) for r in [header, *rows]) + "\n")
        return points

    shapes = []

    def recording_simulate(sc, **kw):
        shapes.append(sc.shape)
        return real_simulate(sc, **kw)

    monkeypatch.setattr(simulate_cli, "bench_rates", fake_bench_rates)
    monkeypatch.setattr(capacity, "simulate", recording_simulate)
    out = tmp_path / "val.json"
    assert main(["simulate", "validate", str(card), "--profile", str(profile), "--rates", "1,2", "--requests", "20",
                 "--leave-one-out", "--output-dir", str(tmp_path / "runs"), "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())["points"]) == 2
    assert shapes and all(s.max_num_seqs == 2 and s.decode_stall_ratio == 1.5 and s.num_blocks == 500
                          for s in shapes)


@pytest.mark.parametrize("decode, mixed, says", [(1.0, 1.0, None), (1.25, 1.25, "stale profile"),
                                                 (1.0, 1.3, "calibration's did not")])
def test_validate_says_how_the_servers_steps_ran_against_the_profile(setup, tmp_path, monkeypatch, capsys, decode,
                                                                     mixed, says):
    """validate starts the card's inferlab server with its step trace on and reports, per point, the median of each
    step's measured period over the profile's prediction for that step, per kind: a host that has slowed since the
    calibration (every step 1.25x) is named as a stale profile; decodes on time but steps with a prefill 1.3x, as
    a profile fitted to another load's prompts; all on time, nothing. Where the steps ran off the profile, the point
    is also simulated at the speed they ran: when the host's speed is all that moved, that reproduces the
    measurement. Model-free: bench is replaced by a trace of known steps and a simulated measurement."""
    from inferlab.engine.step_trace import BatchShape
    from inferlab.lab import simulate_cli
    from inferlab.lab.step_cost import shape_features

    card, profile, _ = setup
    cost = StepCost.load(profile)
    header = {"schema": "inferlab.step_trace/1", "model": "m", "dtype": "bfloat16", "kv_bytes_per_token": 100,
              "max_num_seqs": 4, "max_num_batched_tokens": 256, "max_prefill_tokens_with_decodes": None,
              "block_size": 16, "num_blocks": 500, "enable_prefix_caching": True}
    real_simulate = capacity.simulate
    # The server as measured: the profile's steps at the trace's speed when every kind ran at one speed.
    speed = decode if decode == mixed else 1.0
    truth = StepCost.from_dict({**cost.to_dict(), **{c: getattr(cost, c) * speed for c in COEFFICIENTS
                                                     if c != "request_overhead"}})
    base = capacity.Scenario(load_card(card), truth, capacity.card_shape(load_card(card), cost), requests=20)

    def fake_bench_rates(card_, loads, out_dir, base_url=None, server_config=None, arrival=None, burstiness=None):
        assert base_url is None and server_config["step_trace"]  # the trace is on without --leave-one-out
        rows, points, t = [], [], 0.0
        for lp in loads:
            rate = lp.rate
            t0 = t
            for k in range(40):
                row = {"t": t, "busy": True, "p": [[0, 64, True]] if k % 2 == 0 else [], "d": 1 + k % 3,
                       "da": 90 * (1 + k % 3)}
                row["dt"] = (mixed if row["p"] else decode) * cost.time(shape_features(BatchShape.from_json(row)))
                rows.append(row)
                t += row["dt"]
            points.append((rate, card_, {**real_simulate(replace(base, card=card_), rate=rate), "path": None,
                                         "window": (t0, t - 1e-9)}))
        Path(server_config["step_trace"]).parent.mkdir(parents=True, exist_ok=True)
        Path(server_config["step_trace"]).write_text("\n".join(json.dumps(r) for r in [header, *rows]) + "\n")
        return points

    monkeypatch.setattr(simulate_cli, "bench_rates", fake_bench_rates)
    out = tmp_path / "val.json"
    assert main(["simulate", "validate", str(card), "--profile", str(profile), "--rates", "1,2", "--requests", "20",
                 "--output-dir", str(tmp_path / "runs"), "--json", str(out)]) == 0
    for p in json.loads(out.read_text())["points"]:
        r = p["steps_vs_profile"]
        assert r["steps"] == 40 and r["by_kind"]["mixed"]["steps"] == 20 and set(r["by_kind"]) == {"decode", "mixed"}
        assert r["by_kind"]["decode"]["ratio"] == pytest.approx(decode)
        assert r["by_kind"]["mixed"]["ratio"] == pytest.approx(mixed)
        assert p["speed_band"]["itl p50"]["slower"] > 0 > p["speed_band"]["itl p50"]["faster"]
        again = p.get("at_measured_speed")
        assert (again is None) == (decode == mixed == 1.0)
        if speed != 1.0:
            ttft = {m["metric"]: m["rel_error"] for m in p["metrics"]}["ttft p50"]
            assert ttft < -0.1  # the profile's prediction: the host's slowdown read as the model's error
            assert again["ratio"] == pytest.approx(speed)
            assert all(m["rel_error"] == pytest.approx(0, abs=1e-6) for m in again["metrics"]
                       if m["rel_error"] is not None)
            assert again["meets_predicted"] == p["meets_measured"]
    printed = capsys.readouterr().out
    for text in ("stale profile", "calibration's did not"):
        assert (text in printed) == (text == says)
    assert ("at that speed the simulation gives ttft p50" in printed) == (says is not None)
    assert "with every step 3% faster / slower than the profile" in printed


def test_speed_band_moves_light_load_by_the_step_and_saturation_by_its_rate(setup):
    """validate's speed band (the point simulated with every step 3% faster and 3% slower) against what holds
    whatever the model: at light load a token's gap is one step, so ITL p50 moves by the step's 3%, and throughput
    is the arrival rate, so it does not move; with all requests queued at once, throughput is what the steps
    deliver, so it moves by 1/(1 -+ 3%), and TTFT p50, time spent queueing behind steps, by about the step's 3%."""
    from inferlab.lab.simulate_cli import SPEED_BAND, speed_band

    card, profile, _ = setup
    cost = StepCost.load(profile)
    c = load_card(card)
    sc = capacity.Scenario(c, cost, capacity.card_shape(c, cost), requests=60)

    def band(rate):
        def simulate_at(k):
            return capacity.simulate(replace(sc, cost=cost.stretched(k)), rate=rate)
        return speed_band(simulate_at, capacity.simulate(sc, rate=rate))

    light = band(0.5)
    assert light["itl p50"]["faster"] == pytest.approx(-SPEED_BAND, abs=0.002)
    assert light["itl p50"]["slower"] == pytest.approx(SPEED_BAND, abs=0.002)
    assert abs(light["output_tokens_per_s"]["faster"]) < 0.002 and abs(light["output_tokens_per_s"]["slower"]) < 0.002
    flood = band(1000.0)
    assert flood["output_tokens_per_s"]["faster"] == pytest.approx(1 / (1 - SPEED_BAND) - 1, abs=0.003)
    assert flood["output_tokens_per_s"]["slower"] == pytest.approx(1 / (1 + SPEED_BAND) - 1, abs=0.003)
    assert flood["ttft p50"]["faster"] == pytest.approx(-SPEED_BAND, abs=0.005)
    assert flood["ttft p50"]["slower"] == pytest.approx(SPEED_BAND, abs=0.005)


def test_noise_draws_give_each_figure_as_the_median_over_runs_with_their_own_noise(setup):
    """With noise_draws K a point is simulated K times, run i drawing its step noise from seed NOISE_SEED + i, and
    each figure is the median over the runs; compare() gives the runs' p10-p90 beside it."""
    from inferlab.lab.sim_summary import summarize
    from inferlab.lab.simulator import NOISE_SEED, Simulation

    card_path, prof, _ = setup
    card = load_card(card_path)
    cost = replace(StepCost.load(prof), step_noise=[0.6, 0.9, 1.0, 1.1, 1.8])
    sc = capacity.Scenario(card, cost, capacity.card_shape(card, cost), requests=60)
    rate = 0.8 * capacity.saturation(sc)
    reqs = card_requests(card.traffic, 60, rate=rate, arrival=card.traffic.open_loop_arrival)
    runs = [summarize(Simulation(cost, sc.shape, sc.topology, noise_seed=NOISE_SEED + i).run(reqs),
                      load={}, slos=card.objectives.request_slos()) for i in range(5)]
    p50s = [r["latency"]["ttft"]["p50"] for r in runs]
    assert len(set(p50s)) == 5  # the noise moves the figure, or this proves nothing

    one, five = capacity.simulate(sc, rate=rate), capacity.simulate(replace(sc, noise_draws=5), rate=rate)
    assert one["latency"]["ttft"]["p50"] == p50s[0] and "noise_draws" not in one
    assert five["latency"]["ttft"]["p50"] == pytest.approx(float(np.median(p50s)))
    assert five["latency"]["itl"]["p99"] == pytest.approx(float(np.median([r["latency"]["itl"]["p99"] for r in runs])))
    assert five["counts"]["measured"] == 60 and isinstance(five["counts"]["measured"], int)
    assert five["noise_draws"]["latency"]["ttft"]["p50"] == pytest.approx(p50s)

    rows = {r["metric"]: r for r in compare(one, five)["metrics"]}
    assert rows["ttft p50"]["noise_band"] == pytest.approx([np.percentile(p50s, 10), np.percentile(p50s, 90)])
    assert "noise_band" not in rows["requests_per_s"]
    assert "noise_band" not in {k for r in compare(five, one)["metrics"] for k in r}
    with pytest.raises(ValueError, match="noise_draws 0"):
        capacity.simulate(replace(sc, noise_draws=0), rate=rate)


def test_the_step_trace_gives_the_way_in_as_the_overhead_and_the_way_out_as_delivery(setup, tmp_path):
    """With the server's step trace, the overhead is the way in, each request's start to the engine taking it (2 ms
    to the server, 1 to the engine), and the way out is kept as delivery quantiles (2 ms here, and 6 ms for the
    requests of another run passed as `others`): a profile that underprices prefill by 30% leaves the
    simulation-paired fit (no trace) holding the difference in its overhead."""
    import json

    from inferlab.bench.records import RequestRecord
    from inferlab.lab.simulate_cli import fit_request_overhead
    from inferlab.lab.simulator import Simulation, Topology

    card, profile, _ = setup
    c, cost = load_card(card), StepCost.load(profile)
    truth = StepCost.from_dict({**cost.to_dict(), "request_overhead": 0.0,
                                "per_prefill_token": cost.per_prefill_token * 1.3})
    run = Simulation(truth, shape_from(cost.engine), Topology()).run(
        card_requests(c.traffic, 30, rate=math.inf, arrival="poisson"), users=1)
    origin, records, rows = 50.0, [], []
    for o in run.outcomes:
        engine = o.first_token - o.arrival
        sent = o.arrival + 0.005 * (len(records))  # each request 5 ms later than the simulation's (its overhead)
        a = origin + sent + 0.002
        f = a + 0.001 + engine
        records.append(RequestRecord(index=int(o.request_id[1:]), warmup=o.warmup, scheduled=sent, sent=sent,
                                     chunk_times=[f + 0.002 - origin], chunk_tokens=[1], end=f + 1 - origin,
                                     input_len=o.prompt_len, prompt_tokens=o.prompt_len))
        rows.append({"req": o.request_id, "n": o.prompt_len, "o": 1, "a": a, "q": a + 0.001, "s": a + 0.001,
                     "f": f, "e": f + 1})
    (tmp_path / "records.jsonl").write_text("".join(r.to_json() + "\n" for r in records))
    (tmp_path / "results.json").write_text(json.dumps({"runs": [{"clock_origin": origin}]}))
    trace = tmp_path / "steps.jsonl"
    trace.write_text(json.dumps({"schema": "inferlab.step_trace/1"}) + "\n" + "".join(json.dumps(r) + "\n"
                                                                                       for r in rows))
    measured = {"latency": {"ttft": {"p50": 0.0}}, "path": str(tmp_path / "results.json")}

    def fitted(tr, others=()):
        fit = StepCost.from_dict({**cost.to_dict(), "request_overhead": 0.0})
        fit_request_overhead(fit, c, None, 30, measured, tr, others)
        return fit

    fit = fitted(trace)
    # (records keep times to 0.1 µs)
    assert fit.request_overhead == pytest.approx(0.003, abs=1e-6) and "from the step trace" in fit.notes[-1]
    assert fit.delivery == pytest.approx([0.002] * 20, abs=1e-6)
    other = tmp_path / "other"
    other.mkdir()
    (other / "records.jsonl").write_text("".join(replace(r, chunk_times=[r.chunk_times[0] + 0.004]).to_json() + "\n"
                                                 for r in records))
    (other / "results.json").write_text((tmp_path / "results.json").read_text())
    fit = fitted(trace, [{"path": str(other / "results.json")}])
    assert fit.request_overhead == pytest.approx(0.003, abs=1e-6)  # the way in: of the run named, only
    assert sorted(set(np.round(fit.delivery, 5))) == [0.002, 0.006]  # the way out: of both runs
    fit = fitted(None)
    assert fit.request_overhead > 0.005 + 0.005 and "measured - simulated" in fit.notes[-1] and not fit.delivery
