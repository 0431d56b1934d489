"""What the depth probe changes, on runs already made (no server, about a minute).

    python benchmarks/depth_probe_ablation.py simulate-calibrate --card examples/card-cpu.yaml --rates 1,3 \
        --requests 60 --validate val-long.json:examples/card-cpu-long.yaml val-short.json:examples/card-cpu.yaml

Fits the step cost to a `calibrate served` run's step trace twice: whole, and cut at the depth probe's first step
(the fit as it was before the probe), each with its request overhead from the lowest calibration rate, as
`calibrate served` does. Then predicts every point of the given `simulate validate --json` files (run from the
same working directory, as their result paths are relative) with both, on the very draws measured, and each
card's SLO-max rate on a 2,000-request search; where validate recorded how the steps ran against the profile, the
point also at the speed they ran (validate's at_measured_speed). `--free-fit TRACE...` also fits step traces with the prefill pair
priced whatever their depth, to show what a trace alone says of it (docs/benchmarks.md, issue 20).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from inferlab.engine.step_trace import read_step_trace
from inferlab.lab import calibrate, capacity
from inferlab.lab.capacity import Scenario, card_shape
from inferlab.lab.card import load_card
from inferlab.lab.simulate_cli import at_host_speed, compare, fit_request_overhead, measured_speed
from inferlab.lab.step_cost import fit_step_cost, with_coefficients

SHOWN = ("ttft p50", "ttft p99", "itl p50", "itl p99", "output_tokens_per_s")


def describe(cost) -> str:
    return (f"{cost.intercept * 1e3:.2f} ms a step, {cost.per_prefill_token * 1e3:.3f} ms a prefill token, "
            f"{cost.per_prefill_pair * 1e6:.3f} µs a pair, request overhead {cost.request_overhead * 1e3:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("calibration", help="a `calibrate served --output-dir` folder (steps.jsonl, rate-*/)")
    ap.add_argument("--card", required=True, help="the card it was calibrated on")
    ap.add_argument("--rates", required=True, help="its calibration rates")
    ap.add_argument("--requests", type=int, default=60, help="its requests per rate")
    ap.add_argument("--validate", nargs="*", default=[], metavar="JSON:CARD")
    ap.add_argument("--free-fit", nargs="*", default=[], metavar="TRACE")
    args = ap.parse_args()

    for trace in args.free_fit:
        feats, times, labels = calibrate.trace_measurements(read_step_trace(trace)[1])
        coef, _ = fit_step_cost(feats, times, labels=labels, fixed_zero=("request_overhead",), robust=True,
                                weights=calibrate.kind_weights(labels))
        cost = with_coefficients(coef)
        deepest = max(f.prefill_pairs / f.prefill_tokens for f in feats if f.prefill_tokens)
        print(f"{trace} (deepest {deepest:.0f} keys a prefill token), the pair free: {describe(cost)}")

    folder = Path(args.calibration)
    trace = folder / "steps.jsonl"
    rows = read_step_trace(trace)[1]
    probe = next(r["t"] for r in rows if any(c == 0 and n >= 512 for c, n, _ in r["p"]))
    card = load_card(args.card)
    rate = min(float(r) for r in args.rates.split(","))
    measured = json.loads((folder / f"rate-{rate:g}" / "results.json").read_text())["runs"][0]
    card_k = replace(card, traffic=replace(card.traffic, seed=card.traffic.seed + 1000))  # calibrate's first seed
    profiles = {}
    fits = (("with the probe", None), ("without", [(rows[0]["t"], probe - 1e-9)]))
    for name, windows in fits:
        # The hardware is not what this compares: 1 B/s and 1 FLOP/s stand in for it.
        cost = calibrate.calibrate_served([trace], {"name": "this host", "bandwidth": 1.0, "flops": 1.0},
                                          windows=windows)
        fit_request_overhead(cost, card_k, rate, args.requests, measured)
        profiles[name] = cost
        print(f"{name}: {describe(cost)}")

    for spec in args.validate:
        path, card_path = spec.split(":", 1)
        vcard = load_card(card_path)
        print(f"\n{card_path} ({path})")
        for (name, windows), cost in zip(fits, profiles.values()):
            sc = Scenario(vcard, cost, card_shape(vcard, cost), requests=2000)
            print(f"  {name}: SLO-max {capacity.max_rate(sc).rate:.3g} req/s")
            for pt in json.loads(Path(path).read_text())["points"]:
                run = json.loads(Path(pt["results"]).read_text())["runs"][0]
                drawn = replace(vcard, traffic=replace(vcard.traffic, seed=pt["seed"]))
                predicted = capacity.simulate(replace(sc, card=drawn, arrival="poisson", requests=pt["requests"]),
                                              rate=pt["rate"])
                errors = {m["metric"]: m["rel_error"] for m in compare(run, predicted)["metrics"]}
                print(f"    {pt['rate']:g} req/s: " + ", ".join(f"{k} {errors[k]:+.0%}" for k in SHOWN)
                      + f"; meets the card {capacity.meets(vcard, run)} / {capacity.meets(vcard, predicted)}")
                host = at_host_speed(cost, pt.get("steps_vs_profile") or {}) if windows is None else None
                if host is not None:  # validate's at_measured_speed, for runs made before validate printed it
                    again = capacity.simulate(replace(sc, cost=host, card=drawn, arrival="poisson",
                                                      requests=pt["requests"]), rate=pt["rate"])
                    errors = {m["metric"]: m["rel_error"] for m in compare(run, again)["metrics"]}
                    print(f"      at the steps' measured speed (x{measured_speed(pt['steps_vs_profile']):.3f}): "
                          + ", ".join(f"{k} {errors[k]:+.0%}" for k in SHOWN)
                          + f"; meets the card {capacity.meets(vcard, again)}")


if __name__ == "__main__":
    main()
