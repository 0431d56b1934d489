"""What the benchmarks that re-read an `inferlab simulate validate` run share: their four arguments, the run's
points, and each point's draw simulated with the profile (one run, as validate's first noise draw).

    VALIDATE_DIR --profile P --card examples/card-cpu.yaml --validation V.json

VALIDATE_DIR is validate's --output-dir (one rate-R/ folder of bench results per point, and the server's
steps.jsonl when validate started an inferlab server), V.json its --json (each point's rate, seed and requests).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path

from inferlab.lab import capacity
from inferlab.lab.card import Card, load_card
from inferlab.lab.sim_workload import card_requests
from inferlab.lab.simulator import SimRun, Simulation, Topology
from inferlab.lab.step_cost import StepCost


@dataclass(frozen=True, slots=True)
class Point:
    rate: float
    seed: int
    requests: int
    results: Path  # the point's bench results.json (records.jsonl beside it)


@dataclass(frozen=True, slots=True)
class Validation:
    folder: Path
    cost: StepCost
    card: Card
    points: list[Point]

    def simulate(self, p: Point, record_steps: bool = False) -> SimRun:
        card_k = replace(self.card, traffic=replace(self.card.traffic, seed=p.seed))
        return Simulation(self.cost, capacity.card_shape(self.card, self.cost), Topology(),
                          record_steps=record_steps).run(card_requests(card_k.traffic, p.requests, rate=p.rate))


def parse_validation(description: str) -> Validation:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("folder", type=Path, help="validate's --output-dir")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--card", required=True)
    ap.add_argument("--validation", required=True, help="validate's --json file (its points' rates and seeds)")
    args = ap.parse_args()
    points = [Point(p["rate"], p["seed"], p["requests"], args.folder / f"rate-{p['rate']:g}" / "results.json")
              for p in json.loads(Path(args.validation).read_text())["points"]]
    return Validation(args.folder, StepCost.load(args.profile), load_card(args.card), points)
