"""Where a served request's time to first token goes, against where the simulator puts it.

    python benchmarks/ttft_split.py VALIDATE_DIR --profile P --card examples/card-cpu.yaml --validation V.json

VALIDATE_DIR is the --output-dir of `inferlab simulate validate` against an inferlab server it started, V.json its
--json (the points' rates, seeds and request counts). Each measured request's TTFT is split as lab/ttft_split.py
says (http, taken, engine, out) and set beside the simulation of the same draw with the profile, one run, where
the profile's request_overhead stands for what lies outside the engine and the rest is the simulated engine time
(taken: the wait for the step in progress is the scheduler's in the simulation). A miss that grows with load in
the engine part is the scheduler's or the step model's; outside it, a request cost the simulator holds constant.
"""

from __future__ import annotations

import numpy as np

from inferlab.engine.step_trace import read_trace_requests
from inferlab.lab.ttft_split import split_run

from validated_points import parse_validation  # benchmarks/, beside this script


def main() -> None:
    v = parse_validation(__doc__)
    cost = v.cost
    served = read_trace_requests(v.folder / "steps.jsonl")
    print(f"request_overhead (the simulation's time outside the engine): {cost.request_overhead * 1e3:.1f} ms")
    print("rate      n | measured p50 ms: http  taken  engine   out  | simulated taken+engine p50 | "
          "measured - simulated, paired p10/p50/p90")
    for p in v.points:
        split = split_run(p.results, served)
        run = v.simulate(p)
        sim = {int(o.request_id[1:]): o.first_token - o.arrival - cost.request_overhead
               for o in run.outcomes if not o.warmup and o.first_token is not None}
        both = sorted(set(split) & set(sim))
        m = np.array([[split[i].http, split[i].taken, split[i].engine, split[i].out] for i in both]) * 1e3
        s = np.array([sim[i] for i in both]) * 1e3
        d = m[:, 1] + m[:, 2] - s
        print(f"{p.rate:<7.4g} {len(both):3d} | {np.median(m[:, 0]):21.1f} {np.median(m[:, 1]):6.1f} "
              f"{np.median(m[:, 2]):7.1f} {np.median(m[:, 3]):5.1f} | {np.median(s):26.1f} | "
              f"{np.percentile(d, 10):.1f} / {np.median(d):.1f} / {np.percentile(d, 90):.1f}")


if __name__ == "__main__":
    main()
