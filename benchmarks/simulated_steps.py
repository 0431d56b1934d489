"""One validated point, step by step: what the server's steps carried against what the simulation's did, the
point's latencies with the simulated engines' prefill budget started three ways, and at the speed the served steps
ran (simulation only, seconds).

    python benchmarks/simulated_steps.py examples/card-cpu-long.yaml --profile profile.json \
        --point simulate-validate/rate-1 --trace simulate-validate/steps.jsonl

--point is one bench output folder of `inferlab simulate validate` (results.json and records.jsonl; the draw's
seed and rate are read from it), --trace the step trace its server wrote. The budget starts:
  primed  fitted to the profile's step costs (simulator.prime_budget), as `simulate` runs;
  cold    fresh, as a server's first steps: no bound until four steps of each kind;
  server  fed the served steps before the point, the state the server's own budget was in.
On examples/card-cpu-long.yaml at 1 req/s (docs/benchmarks.md, issue 20), with src/ before 62f3b40 and 2b53936
(`git worktree add /tmp/old de5196e`, then PYTHONPATH=/tmp/old/src and --starts cold), the simulated budget lost its
bound for eight steps (500-token chunks beside decodes, ~600 ms) that the server never took, and the run's TTFT
p50 and ITL p50 came out 11% and 14% under the served ones; after them, 1% and 1%.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np

from inferlab.engine.step_trace import BatchShape, read_step_trace
from inferlab.lab import capacity, simulator
from inferlab.lab.calibrate import step_time_ratio
from inferlab.lab.card import load_card
from inferlab.lab.sim_workload import card_requests
from inferlab.lab.simulate_cli import compare
from inferlab.lab.step_cost import StepCost

METRICS = ("ttft p50", "ttft p99", "itl p50", "itl p99", "output_tokens_per_s")


def composition(steps: list[tuple[float, int, int]]) -> dict:
    """(seconds, prefill tokens, decodes) of each step -> what a reader compares."""
    kinds = Counter("mixed" if p and d else "prefill" if p else "decode" for _, p, d in steps)
    mixed = [(t, p, d) for t, p, d in steps if p and d]
    decode = [d for _, p, d in steps if d and not p]
    return {"steps": len(steps), "busy s": sum(t for t, _, _ in steps), **{f"{k} steps": kinds[k] for k in
            ("decode", "mixed", "prefill")},
            "decodes a decode-only step": np.mean(decode) if decode else 0.0,
            "decodes a mixed step": np.mean([d for _, _, d in mixed]) if mixed else 0.0,
            "prefill tokens a mixed step": np.mean([p for _, p, _ in mixed]) if mixed else 0.0,
            "mixed steps >= 256 prefill tokens": sum(p >= 256 for _, p, _ in mixed),
            "mixed step ms p99": 1e3 * np.percentile([t for t, _, _ in mixed], 99) if mixed else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("card")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--point", required=True, help="one bench output folder of validate")
    ap.add_argument("--trace", required=True, help="the step trace of the server that ran it")
    ap.add_argument("--starts", default="primed,cold,server")
    args = ap.parse_args()
    card = load_card(args.card)
    cost = StepCost.load(args.profile)
    results = json.loads((Path(args.point) / "results.json").read_text())
    run = results["runs"][0]
    seed, rate, n = results["provenance"]["seed"], run["load"]["value"], run["counts"]["measured"]
    draw = replace(card, traffic=replace(card.traffic, seed=seed))
    shape = capacity.card_shape(card, cost)
    _, rows = read_step_trace(args.trace)
    t0 = run["clock_origin"]
    records = [json.loads(line) for line in (Path(args.point) / "records.jsonl").read_text().splitlines()]
    end = t0 + max(r["end"] for r in records)
    served = [r for r in rows if t0 <= r["t"] <= end]
    before = [r for r in rows if r["t"] < t0]
    print(f"{args.point}: seed {seed}, {rate:g} req/s, {n} requests; {len(served)} served steps, "
          f"{len(before)} before it")

    def start_from_history(budget, *_):
        for r in before:
            b = BatchShape.from_json(r)
            budget.observe(b.num_decodes, b.decode_context, sum(c[1] for c in b.chunks), r["dt"])

    # (src/ before 2b53936 has no prime_budget and starts every budget cold: give it --starts cold)
    starts = {"primed": getattr(simulator, "prime_budget", None), "cold": lambda *_: None,
              "server": start_from_history}
    tables = {"served": composition([(r["dt"], sum(c[1] for c in r.get("p", [])), r.get("d", 0))
                                     for r in served])}
    errors = {}
    for name in args.starts.split(","):
        simulator.prime_budget = starts[name]  # what Instance calls on its fresh budget
        sc = capacity.Scenario(draw, cost, shape, requests=n, arrival=card.traffic.open_loop_arrival)
        predicted = capacity.simulate(sc, rate=rate)
        errors[name] = {m["metric"]: (m["measured"], m["predicted"], m["rel_error"])
                        for m in compare(run, predicted)["metrics"]}
        reqs = card_requests(draw.traffic, n, rate=rate, arrival=card.traffic.open_loop_arrival)
        sim = simulator.Simulation(cost, shape, record_steps=True).run(reqs)
        tables[f"simulated, {name}"] = composition(
            [(s.end - s.start, sum(k for k in s.num_new_tokens if k > 1), sum(k == 1 for k in s.num_new_tokens))
             for s in sim.steps])
    keys = list(tables["served"])
    print(f"\n{'':36s}" + "".join(f"{k:>20s}" for k in tables))
    for k in keys:
        print(f"{k:36s}" + "".join(f"{t[k]:20.4g}" for t in tables.values()))
    print(f"\n{'measured / predicted (error)':36s}" + "".join(f"{k:>26s}" for k in errors))
    for m in METRICS:
        cells = []
        for e in errors.values():
            a, b, rel = e[m]
            scale = 1e3 if m != "output_tokens_per_s" else 1.0
            cells.append(f"{a * scale:.4g} / {b * scale:.4g} ({rel * 100:+.1f}%)")
        print(f"{m:36s}" + "".join(f"{c:>26s}" for c in cells))

    # The point again at the speed its served steps ran (validate's at_measured_speed): by their median, and by
    # their total time, which is what a queue feels.
    simulator.prime_budget = starts["primed"]
    r = step_time_ratio(cost, rows, windows=[(t0, end)])
    print(f"\nthe served steps against the profile: median x{r['ratio']:.4f}, total x{r['time_ratio']:.4f}")
    speeds = [("profile's", 1.0, None), ("median's", r["ratio"], None), ("total's", r["time_ratio"], None)]
    if r.get("memory_ratio"):  # memory and compute terms each at its own speed (validate's choice where it can)
        speeds.append(("memory / compute", r["memory_ratio"], r["compute_ratio"]))
    for name, k, kc in speeds:
        sc = capacity.Scenario(draw, cost.stretched(k, kc), shape, requests=n,
                               arrival=card.traffic.open_loop_arrival)
        e = {m["metric"]: m["rel_error"] for m in compare(run, capacity.simulate(sc, rate=rate))["metrics"]}
        speed = f"x{k:.3f}" if kc is None else f"x{k:.3f} / x{kc:.3f}"
        print(f"  at the {name} speed ({speed}): " + ", ".join(f"{m} {e[m]:+.1%}" for m in METRICS))


if __name__ == "__main__":
    main()
