"""How much a profile's request overhead moves a card's predictions on one draw (simulation only, seconds).

    python benchmarks/request_overhead_sensitivity.py examples/card-cpu-long.yaml --profile profile.json \
        --seed 3 --requests 200 --rates 0.2055,0.278 --overheads 0,6.7,19.8

`calibrate served` fits the request overhead (HTTP and the first write, outside the engine's steps) as the
difference of two TTFT p50s at its lowest rate; three calibrations of one server within an hour gave 0.6, 6.7 and
19.8 ms. Every TTFT carries it, so where a card's binding objective is a TTFT percentile near its limit (the long
card's 1 s TTFT p50 rises 7% from 0.85x to 1.15x its SLO-max), those milliseconds move the verdict. For each
overhead: the draw's TTFT p50 at each rate, whether it meets the card, and the draw's SLO-max rate, as
`validate --max-rate-within` simulates them (docs/benchmarks.md, issue 20).

    python benchmarks/request_overhead_sensitivity.py examples/card-cpu.yaml --profile profile.json \
        --refit <calibrate's --output-dir>[:<its profile>] ... --rate 1 --requests 60

refits the overhead from each calibration folder's lowest-rate run, simulated with the folder's own profile
(or --profile) (seed card seed + 1000, as `calibrate served`
runs it) both ways: paired request by request (calibrate's fit) and as the difference of the TTFT p50s (before).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from inferlab.lab import capacity
from inferlab.lab.card import load_card
from inferlab.lab.step_cost import StepCost


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("card")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--seed", type=int, default=None, help="the draw's seed (validate's JSON: max_rate.draw.seed)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rates", default=None, help="requests/s, comma-separated (the bracket's two)")
    ap.add_argument("--overheads", default="0", help="request overheads to try, ms, comma-separated")
    ap.add_argument("--refit", nargs="+", default=None, metavar="DIR[:PROFILE]",
                    help="calibration folders to refit, each with its own profile")
    ap.add_argument("--rate", type=float, default=1.0, help="with --refit: the calibration's lowest rate")
    args = ap.parse_args()
    if args.refit:
        refit(args)
        return
    if args.seed is None or args.rates is None:
        ap.error("give --seed and --rates (or --refit)")
    card = load_card(args.card)
    draw = replace(card, traffic=replace(card.traffic, seed=args.seed))
    arrival = card.traffic.open_loop_arrival  # as validate runs it
    profile = StepCost.load(args.profile)
    print(f"the profile's own request overhead: {profile.request_overhead * 1e3:.1f} ms")
    for ms in (float(x) for x in args.overheads.split(",")):
        cost = StepCost.from_dict({**profile.to_dict(), "request_overhead": ms / 1e3})
        sc = capacity.Scenario(draw, cost, capacity.card_shape(card, cost), requests=args.requests, arrival=arrival)
        cells = []
        for rate in (float(r) for r in args.rates.split(",")):
            s = capacity.simulate(sc, rate=rate)
            cells.append(f"{rate:g} req/s TTFT p50 {s['latency']['ttft']['p50'] * 1e3:.1f} ms "
                         f"({'meets' if capacity.meets(card, s) else 'misses'} the card)")
        m = capacity.max_rate(sc).rate
        print(f"overhead {ms:g} ms: {'; '.join(cells)}; the draw's SLO-max "
              f"{'none' if m is None else f'{m:.3f} req/s'}", flush=True)


def refit(args) -> None:
    import json
    from pathlib import Path

    from inferlab.lab.simulate_cli import fit_request_overhead

    card = load_card(args.card)
    card = replace(card, traffic=replace(card.traffic, seed=card.traffic.seed + 1000))  # calibrate's first seed
    for spec in args.refit:
        folder, _, own = spec.partition(":")
        profile = StepCost.load(own or args.profile)
        path = Path(folder) / f"rate-{args.rate:g}" / "results.json"
        measured = {**json.loads(path.read_text())["runs"][0], "path": str(path)}
        fits = []
        for m in (measured, {k: v for k, v in measured.items() if k != "path"}):  # without records: the p50s
            cost = StepCost.from_dict({**profile.to_dict(), "request_overhead": 0.0})
            fit_request_overhead(cost, card, args.rate, args.requests, m)
            fits.append(cost.request_overhead * 1e3)
        print(f"{folder}: paired {fits[0]:.1f} ms, p50s {fits[1]:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
