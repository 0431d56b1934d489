"""A simulated run summarised in the shape of a bench run summary (results.json's runs[i]), with bench's own metric
definitions (bench.metrics.stats, the same TTFT/TPOT/ITL/E2E formulas), so the card's `evaluate`, reports and
`inferlab compare`-style views read a prediction exactly as they read a measurement.

Latency origins are the arrival times (open loop: the scheduled time, as bench uses; closed loop: the send time).
Rejected requests (admission limit, too long) count as failed requests: in the error rate and against goodput.
"""

from __future__ import annotations

import numpy as np

from inferlab.bench import metrics
from inferlab.lab.simulator import RequestOutcome, SimRun

METRICS = ("ttft", "tpot", "itl", "e2e")


def request_latencies(o: RequestOutcome) -> dict[str, float | None]:
    ttft = None if o.first_token is None else o.first_token - o.arrival
    e2e = None if o.finish is None else o.finish - o.arrival
    n = len(o.token_times)
    tpot = None if ttft is None or e2e is None or n < 2 else (e2e - ttft) / (n - 1)
    return {"ttft": ttft, "tpot": tpot, "e2e": e2e}


def meets(o: RequestOutcome, slos: dict[str, float]) -> bool:
    if o.rejected or o.finish is None:
        return False
    lat = request_latencies(o)
    return all(lat[m] is not None and lat[m] <= limit for m, limit in slos.items())


def summarize(run: SimRun, *, load: dict, slos: dict[str, float] | None = None) -> dict:
    measured = [o for o in run.outcomes if not o.warmup]
    ok = [o for o in measured if not o.rejected and o.finish is not None]
    lat = [request_latencies(o) for o in ok]
    itl = np.concatenate([np.diff(o.token_times) for o in ok]) if ok else np.empty(0)
    starts = [o.arrival for o in measured]
    ends = [o.departure for o in measured]
    duration = max(ends) - min(starts) if measured else 0.0
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    out_tokens = sum(len(o.token_times) for o in ok)
    in_tokens = sum(o.prompt_len for o in ok)
    rejected = [o for o in measured if o.rejected]
    sojourn = [o.departure - o.arrival for o in run.outcomes]
    s: dict = {
        "load": load,
        "simulated": True,
        "window": {"start": min(starts) if starts else 0.0, "end": max(ends) if ends else 0.0, "duration": duration},
        "counts": {"measured": len(measured), "completed": len(ok), "failed": len(rejected),
                   "rejected_queue_full": sum(1 for o in rejected if o.rejected == "queue full"),
                   "rejected_too_long": sum(1 for o in rejected if o.rejected == "too long"),
                   "error_rate": len(rejected) / len(measured) if measured else 0.0},
        "throughput": {"requests_per_s": per_s(len(ok)), "input_tokens_per_s": per_s(in_tokens),
                       "output_tokens_per_s": per_s(out_tokens), "total_tokens_per_s": per_s(in_tokens + out_tokens)},
        "latency": {m: metrics.stats([x[m] for x in lat if x[m] is not None]) for m in ("ttft", "tpot", "e2e")},
        "engine": {"preemptions": run.num_preemptions, "prefix_hit_share": run.prefix_hit_share,
                   "utilisation": {k: v / run.end_time if run.end_time else 0.0 for k, v in run.busy.items()},
                   "kv_transfer": metrics.stats([o.kv_transfer for o in ok if o.kv_transfer])},
        # Little's law over the whole run (warmup included): L from the instances' queues, lambda x W from requests.
        "little": {"mean_in_system": run.mean_in_system,
                   "arrival_rate": len(run.outcomes) / run.end_time if run.end_time else 0.0,
                   "mean_time_in_system": float(np.mean(sojourn)) if sojourn else 0.0},
        "goodput": None,
    }
    s["latency"]["itl"] = metrics.stats(itl)
    if slos:
        good = sum(1 for o in measured if meets(o, slos))
        s["goodput"] = {"slos": slos, "good": good, "total": len(measured), "requests_per_s": per_s(good),
                        "share": good / len(measured) if measured else 0.0}
    return s
