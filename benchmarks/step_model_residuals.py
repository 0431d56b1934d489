"""Where a served step-cost fit errs: measured / predicted step period by kind of step, on other traces.

    python benchmarks/step_model_residuals.py CAL/steps.jsonl VAL/steps.jsonl [VAL2/steps.jsonl ...]

Fits the step cost to the first trace as `inferlab simulate calibrate served` fits its own (engine step traces, from
`inferlab serve --step-trace` or the steps.jsonl that calibrate and validate leave in their --output-dir), then
prints for each trace the median of measured / predicted period for decode-only steps, prefill-only steps and mixed
steps (a prefill chunk beside decodes) by how many rows they sample, each over the fit's own median (1.000: the
kind runs as the profile says; the simulator's noise draws carry the rest). A kind whose ratio drifts with its
decodes is priced with the wrong term. Then the same for decode-only and mixed steps by how deep their decodes
read (keys per decode): a ratio that climbs with depth is a key priced too low. To see another revision's model on
the same traces, check out its src/inferlab/lab/step_cost.py and run this again; to see what a calibration's
traffic identifies, fit two calibrations' traces against the same validation traces.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np

from inferlab.engine.step_trace import read_step_trace
from inferlab.lab.calibrate import calibrate_served, trace_measurements
from inferlab.lab.step_cost import COEFFICIENTS


DEPTHS = (0, 300, 700, 1500)  # keys per decode: the short card's decodes, the long card's, the depth probe's


def depth_name(i: int) -> str:
    return f"{DEPTHS[i]}-{DEPTHS[i + 1]}" if i + 1 < len(DEPTHS) else f"{DEPTHS[i]}+"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("calibration", help="the step trace to fit")
    ap.add_argument("traces", nargs="*", help="step traces to check the fit against")
    args = ap.parse_args()
    cost = calibrate_served([args.calibration], hardware={})
    print("fit: " + ", ".join(f"{c} {getattr(cost, c) * 1e3:.4g} ms" for c in COEFFICIENTS if getattr(cost, c)))
    print(f"     R^2 {cost.fit.r2:.3f}, |relative residual| p50 {cost.fit.rel_abs_p50:.3f}")
    base = float(np.median(cost.step_noise))
    for path in [args.calibration, *args.traces]:
        feats, times, labels = trace_measurements(read_step_trace(path)[1])
        by: dict[str, list[float]] = defaultdict(list)
        deep: dict[tuple[str, int], list[float]] = defaultdict(list)
        for f, t, label in zip(feats, times, labels):
            kind = label.split(" (")[0]
            ratio = t / cost.time(f) / base
            # Beside a chunk a decode counts as a prefill token and a sampled row (shape_features): keys per
            # sampled row there, which a chunk ending its prompt (one more sampled row) makes a little shallower.
            decodes = f.decode_seqs if kind == "decode" else (f.sampled_rows if kind == "mixed" else 0)
            if decodes and f.attended:
                deep[kind, int(np.searchsorted(DEPTHS, f.attended / decodes, side="right")) - 1].append(ratio)
            if kind == "mixed":
                kind = f"mixed, {min(int(f.sampled_rows), 4)}{'+' if f.sampled_rows >= 4 else ''} sampled"
            by[kind].append(ratio)
        print(path)
        rows = [(kind, by[kind]) for kind in sorted(by)]
        rows += [(f"{kind}, decodes {depth_name(i)} keys deep", deep[kind, i]) for kind, i in sorted(deep)]
        for name, r in rows:
            print(f"  {name:36s} {len(r):6d} steps  x{np.median(r):.3f}  (p10 {np.quantile(r, 0.1):.3f}, "
                  f"p90 {np.quantile(r, 0.9):.3f})")


if __name__ == "__main__":
    main()
