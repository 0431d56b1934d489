"""How much one draw of requests decides whether a rate meets a card, in simulation (no server, a few minutes).

    python benchmarks/slo_max_draws.py examples/card-cpu.yaml --profile profile.json \
        --rates 1.0,1.23,1.45 --requests 200 --draws 20 --search 400,1000,2000,4000

For each rate, simulates `--draws` draws of the card's traffic (seeds 10000, 10001, ...: the same model, different
arrivals and prompt lengths) of `--requests` each and prints how many meet the card and the spread of their TTFT
p99. Then runs the SLO-max search (`capacity.max_rate`, what `simulate predict` and `validate --max-rate-within`
use) at each `--search` size. A p99 objective near its limit is met by some draws and missed by others; this is
what sized `validate --search-requests` (docs/benchmarks.md, issue 20). With `--draw-max`, also searches the SLO-max
rate of each of that many draws of `--requests` (what `validate --max-rate-within` checks against the server, on
the draw it sends) and prints their spread around the load's.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from inferlab.lab import capacity
from inferlab.lab.capacity import Scenario
from inferlab.lab.card import load_card
from inferlab.lab.step_cost import StepCost


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("card")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--rates", default="1.0,1.23,1.45")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--search", default="400,1000,2000,4000", help="draw sizes for the SLO-max search")
    ap.add_argument("--draw-max", type=int, default=0, metavar="N",
                    help="the SLO-max rate of each of N draws of --requests (seeds 10000, ...)")
    args = ap.parse_args()
    card = load_card(args.card)
    cost = StepCost.load(args.profile)
    shape = capacity.card_shape(card, cost)  # the scheduler `inferlab simulate` runs for this card
    for rate in (float(r) for r in args.rates.split(",")):
        met, p99 = 0, []
        for i in range(args.draws):
            c = replace(card, traffic=replace(card.traffic, seed=10000 + i))
            s = capacity.simulate(Scenario(c, cost, shape, requests=args.requests), rate=rate)
            met += capacity.meets(c, s)
            p99.append(s["latency"]["ttft"]["p99"])
        p99.sort()
        q = lambda f: p99[min(len(p99) - 1, int(f * len(p99)))]  # noqa: E731
        print(f"{rate:g} req/s, {args.requests} requests a draw: card met in {met}/{args.draws} draws; TTFT p99 "
              f"p10 {q(0.1):.2f} s, p50 {q(0.5):.2f} s, p90 {q(0.9):.2f} s", flush=True)
    for n in (int(x) for x in args.search.split(",")):
        t = time.perf_counter()
        m = capacity.max_rate(Scenario(card, cost, shape, requests=n))
        rate = "none" if m.rate is None else f"{m.rate:.3f} req/s"
        print(f"SLO-max search at {n} requests a point: {rate} (saturation {m.saturation:.2f} req/s), "
              f"{time.perf_counter() - t:.0f} s", flush=True)
    rates = []
    for i in range(args.draw_max):
        c = replace(card, traffic=replace(card.traffic, seed=10000 + i))
        rates.append(capacity.max_rate(Scenario(c, cost, shape, requests=args.requests)).rate or 0.0)
    if rates:
        rates.sort()
        q = lambda f: rates[min(len(rates) - 1, int(f * len(rates)))]  # noqa: E731
        print(f"SLO-max rate of each of {len(rates)} draws of {args.requests} requests: min {rates[0]:.3f}, p10 "
              f"{q(0.1):.3f}, p50 {q(0.5):.3f}, p90 {q(0.9):.3f}, max {rates[-1]:.3f} req/s", flush=True)


if __name__ == "__main__":
    main()
