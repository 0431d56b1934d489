"""The host's speed through one `inferlab simulate` calibration or validation: each bench run of its output folder
(load points, and the speed probes that 862b4e2..a70a4d6 ran before each point) in the order they ran, their steps
against the profile (step_time_ratio: median and total), and the total by quarters of their time. Simulation
only, seconds.

    python benchmarks/speed_probes.py --profile profile.json simulate-validate

On the short card (docs/benchmarks.md, issue 20, 2026-12-04 17:24-18:16) it showed ten-second probes reading the
host -6% to +7% off the speed of the point that followed them, and a calibration probe whose stalls (a quarter
at x1.12) moved its total 3% and not its median.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from inferlab.engine.step_trace import read_step_trace
from inferlab.lab.calibrate import step_time_ratio
from inferlab.lab.step_cost import StepCost


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", required=True)
    ap.add_argument("folder", help="a calibrate served or validate --output-dir (steps.jsonl, rate-*/, probe-*/)")
    ap.add_argument("--quarters", type=int, default=4)
    args = ap.parse_args()
    # Profiles calibrated by 862b4e2..a70a4d6 carry their probes' speed_reference, which StepCost no longer has.
    d = json.loads(Path(args.profile).read_text())
    d.pop("speed_reference", None)
    cost = StepCost.from_dict(d)
    folder = Path(args.folder)
    rows = read_step_trace(folder / "steps.jsonl")[1]
    runs = []
    for results in folder.glob("*/**/results.json"):
        run = json.loads(results.read_text())["runs"][0]
        records = [json.loads(line) for line in results.with_name("records.jsonl").read_text().splitlines()]
        t0 = run["clock_origin"]
        name = next(p.name for p in results.parents if p.parent == folder)
        runs.append((t0, t0 + max(r["end"] for r in records), name))
    print(f"{'':14s}{'starts':>9s}{'lasts':>8s}{'steps':>7s}{'median':>8s}{'total':>8s}   total by quarters")
    for t0, end, name in sorted(runs):
        r = step_time_ratio(cost, rows, windows=[(t0, end)])
        parts = []
        for k in range(args.quarters):
            q = step_time_ratio(cost, rows, windows=[(t0 + (end - t0) * k / args.quarters,
                                                      t0 + (end - t0) * (k + 1) / args.quarters)])
            parts.append(f"{q['time_ratio']:.3f}" if q["time_ratio"] else "-")
        print(f"{name:14s}{t0 - rows[0]['t']:8.0f}s{end - t0:7.0f}s{r['steps']:7d}{r['ratio']:8.3f}"
              f"{r['time_ratio']:8.3f}   {' '.join(parts)}")


if __name__ == "__main__":
    main()
