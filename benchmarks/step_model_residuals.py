"""Where a served step-cost fit errs: measured / predicted step period by kind of step, on other traces.

    python benchmarks/step_model_residuals.py CAL/steps.jsonl VAL/steps.jsonl [VAL2/steps.jsonl ...]

Fits the step cost to the first trace as `inferlab simulate calibrate served` fits its own (engine step traces, from
`inferlab serve --step-trace` or the steps.jsonl that calibrate and validate leave in their --output-dir), then
prints for each trace the median of measured / predicted period for decode-only steps, prefill-only steps and mixed
steps (a prefill chunk beside decodes) by how many rows they sample, each over the fit's own median (1.000: the
kind runs as the profile says; the simulator's noise draws carry the rest). A kind whose ratio drifts with its
decodes is priced with the wrong term. To see another revision's model on the same traces, check out its
src/inferlab/lab/step_cost.py and run this again.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np

from inferlab.engine.step_trace import read_step_trace
from inferlab.lab.calibrate import calibrate_served, trace_measurements
from inferlab.lab.step_cost import COEFFICIENTS


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
        for f, t, label in zip(feats, times, labels):
            kind = label.split(" (")[0]
            if kind == "mixed":
                kind = f"mixed, {min(int(f.sampled_rows), 4)}{'+' if f.sampled_rows >= 4 else ''} sampled"
            by[kind].append(t / cost.time(f) / base)
        print(path)
        for kind in sorted(by):
            r = np.array(by[kind])
            print(f"  {kind:22s} {len(r):6d} steps  x{np.median(r):.3f}  (p10 {np.quantile(r, 0.1):.3f}, "
                  f"p90 {np.quantile(r, 0.9):.3f})")


if __name__ == "__main__":
    main()
