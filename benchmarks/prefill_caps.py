"""The prefill budget's decisions, served against simulated: the cap beside decodes, step by step.

    python benchmarks/prefill_caps.py VALIDATE_DIR --profile P --card examples/card-cpu.yaml --validation V.json

VALIDATE_DIR is the --output-dir of `inferlab simulate validate` against an inferlab server it started (its
steps.jsonl carries each step's prefill cap and the budget's held drain rate), V.json its --json. For each point,
the steps that carried a prefill chunk beside decodes, by how many decodes: the chunk's and the cap's p50, served
and in the simulation of the same draw (one run). Then the budget (engine/step_budget.py) replayed over the server's
own steps, fed their measured durations, their periods, the profile's cost of each and that cost times a draw of
its noise, and the simulation's own budget as it decided: each the median slack (the stall bound's tokens, before
the floor and the drain rate) by decodes, and the median of its fitted coefficients. A replay that gives the
server's caps whatever it is fed, while the simulation's own budget does not, says the simulation's steps differ,
not its step costs.
"""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np

from inferlab.engine.step_budget import PrefillBudget
from inferlab.engine.step_trace import BatchShape, read_step_trace
from inferlab.lab.step_cost import shape_features

from validated_points import parse_validation  # benchmarks/, beside this script

GAP = 0.00035  # s between a step's end and the next one's start, for a step before an idle spell (traces: ~0.35 ms)


def caps(steps: list[tuple[int, int, int | None]]) -> str:
    """(decodes, prefill tokens, cap) per step -> chunk and cap p50 of the mixed steps, by decodes (4 means 4+)."""
    by = defaultdict(list)
    for d, p, cap in steps:
        if d and p:
            by[min(d, 4)].append((p, -1 if cap is None else cap))
    return "; ".join(f"{d} decodes: {len(v)} steps, chunk {np.median([p for p, _ in v]):.0f}, "
                     f"cap {np.median([c for _, c in v]):.0f}" for d, v in sorted(by.items()))


def slack(coef: np.ndarray, decodes: int, keys: int, ratio: float) -> float:
    return (ratio - 1.0) * float(coef[:3] @ np.array([1.0, decodes, keys / 1024.0])) / coef[3]


def report(name: str, coefs: list[np.ndarray], slacks: dict[int, list[float]]) -> None:
    if not coefs:
        print(f"  {name:16s} no bound in this window")
        return
    c = np.median(np.array(coefs), axis=0) * 1e3
    by = ", ".join(f"{d} decodes {np.median(v):.1f}" for d, v in sorted(slacks.items()))
    print(f"  {name:16s} {c[0]:.2f} ms + {c[1]:.2f} ms a decode + {c[2]:.2f} ms per 1,024 keys + {c[3]:.3f} ms a "
          f"prefill token | slack p50 {by}")


def main() -> None:
    v = parse_validation(__doc__)
    cost = v.cost
    header, rows = read_step_trace(v.folder / "steps.jsonl")
    ratio = header.get("decode_stall_ratio")
    if ratio is None:
        raise SystemExit("the server ran without a decode-stall bound: no prefill budget to compare")
    noise = np.array(cost.step_noise or [1.0])
    for p in v.points:
        results = json.loads(p.results.read_text())["runs"][0]
        start, end = results["window"]["start"], results["window"]["end"]
        lo, hi = results["clock_origin"] + start, results["clock_origin"] + end
        window = [r for r in rows if lo <= r["t"] <= hi]
        print(f"{p.rate:g} req/s")
        print("  served:    " + caps([(r["d"], sum(n for _, n, _ in r["p"]), r.get("cap")) for r in window]))

        # the simulation's own budget, read as it decides
        coefs, slacks = [], defaultdict(list)
        tokens = PrefillBudget.tokens

        def logged(self, decodes, attended, backlog=0):
            c = self.coefficients()
            if c is not None and decodes and c[3] > 0:
                coefs.append(c)
                slacks[min(decodes, 3)].append(slack(c, decodes, attended, ratio))
            return tokens(self, decodes, attended, backlog)

        PrefillBudget.tokens = logged
        try:
            run = v.simulate(p, record_steps=True)
        finally:
            PrefillBudget.tokens = tokens
        print("  simulated: " + caps([(sum(n == 1 for n in s.num_new_tokens), sum(n for n in s.num_new_tokens if n > 1),
                                       s.prefill_cap) for s in run.steps]))

        rng = np.random.default_rng(0)
        for feed in ("measured dt", "measured period", "profile", "profile + noise"):
            b, fc, fs = PrefillBudget(ratio), [], defaultdict(list)
            for r, nxt in zip(rows, [*rows[1:], None]):
                shape = BatchShape.from_json(r)
                prefill = sum(n for _, n, _ in shape.chunks)
                if shape.num_decodes and prefill and lo <= r["t"] <= hi and (c := b.coefficients()) is not None \
                        and c[3] > 0:
                    fc.append(c)
                    fs[min(shape.num_decodes, 3)].append(slack(c, shape.num_decodes, shape.decode_context, ratio))
                if feed == "measured dt":
                    t = r["dt"]
                elif feed == "measured period":
                    t = nxt["t"] - r["t"] if nxt is not None and r["busy"] else r["dt"] + GAP
                else:
                    t = cost.time(shape_features(shape))
                    if feed == "profile + noise":
                        t *= noise[rng.integers(len(noise))]
                b.observe(shape.num_decodes, shape.decode_context, prefill, t)
            report(f"replay, {feed}", fc, fs)
        report("simulation", coefs, slacks)


if __name__ == "__main__":
    main()
