"""A served step trace by step shape: decode-only steps by their number of sequences, prefill and mixed steps by
their prompt tokens (in bins of 64), each with the median time the step took (`dt`) and its period (start to the
next step's start: what the simulator's cost model fits). Trace only, milliseconds.

    python benchmarks/step_periods.py simulate-calibrate/steps.jsonl

It showed where the linear step-cost model misfit the AMX Xeon (docs/benchmarks.md, issue 20, "On the Xeon with
AMX"): decode steps of one to four sequences at 11.8, 17.7, 18.8 and 18.3 ms while the engine switched to oneDNN's
GEMM at two rows, 11.7, 14.2, 15.7 and 18.4 with inferlab's kernel to three.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np

from inferlab.engine.step_trace import read_step_trace

BIN = 64  # prompt tokens a bin of prefill and mixed steps spans


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", help="a steps.jsonl from `inferlab serve --step-trace` (calibrate served writes one)")
    ap.add_argument("--max-gap", type=float, default=1.0, help="seconds; longer periods are idle time, left out")
    args = ap.parse_args()
    _, rows = read_step_trace(args.trace)
    groups: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for step, after in zip(rows, rows[1:]):
        period = after["t"] - step["t"]
        if period > args.max_gap:
            continue
        tokens = sum(n for _, n, _ in step["p"])
        if not step["p"]:
            key = ("decode", step["d"])
        else:
            key = ("prefill" if step["d"] == 0 else f"mixed, {step['d']} decodes", tokens // BIN * BIN)
        groups[key].append((step["dt"], period))
    print("| steps | decodes, or prompt tokens from | n | dt p50 (ms) | period p50 (ms) | period p90 (ms) |")
    print("|---|---|---|---|---|---|")
    for (kind, size), values in sorted(groups.items()):
        v = np.array(values) * 1e3
        print(f"| {kind} | {size} | {len(v)} | {np.median(v[:, 0]):.2f} | {np.median(v[:, 1]):.2f} | "
              f"{np.percentile(v[:, 1], 90):.2f} |")


if __name__ == "__main__":
    main()
