"""Questions answered by simulation for a workload card: latency and goodput against arrival rate, the highest rate
that meets the card's objectives, replicas needed for a target rate, colocated against disaggregated serving.

"Meets the card" means every latency objective, the goodput objective and the error-rate objective pass on the
simulated run (`card.evaluate`, the same checks a bench run gets); throughput floors are left out, since they are
a property of the offered load rather than of the server. Each search point reuses the same seed (common random
numbers), so two rates differ by their load, not by their draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from inferlab.lab.calibrate import shape_from
from inferlab.lab.card import Card, Check, evaluate
from inferlab.lab.sim_summary import summarize
from inferlab.lab.sim_workload import card_requests
from inferlab.lab.simulator import NOISE_SEED, EngineShape, Simulation, SimRequest, Topology
from inferlab.lab.step_cost import StepCost

CHECK_KINDS = ("latency", "goodput", "reliability")


@dataclass(slots=True)
class Scenario:
    """Everything one simulated point needs besides its load."""

    card: Card
    cost: StepCost
    shape: EngineShape
    topology: Topology = field(default_factory=Topology)
    requests: int = 400  # measured requests per point
    arrival: str | None = None  # None: the card's (poisson for a closed-loop card run open)
    burstiness: float | None = None
    trace: list[SimRequest] | None = None  # replay these instead of drawing from the card
    # Runs of each point, each with its own draws of the profile's step noise; every figure is their median. On a
    # draw of a few dozen requests near saturation, the noise alone moves TTFT p50 by ~8% (sd over 16 noise seeds,
    # examples/card-cpu.yaml at 2 req/s, 60 requests): one run is one sample of what the server may do there.
    noise_draws: int = 1

    def with_topology(self, **kw) -> "Scenario":
        return replace(self, topology=replace(self.topology, **kw))


def card_shape(card: Card, cost: StepCost, max_queue: int | None = None) -> EngineShape:
    """The scheduler the card's server would run: the profile's settings, with the card's own server config (and
    an admission limit, when given) over them."""
    shape = shape_from(cost.engine)
    if max_queue is not None:
        shape.max_queue = max_queue
    for k, v in card.server.config.items():
        k = k.replace("-", "_")
        if hasattr(shape, k):
            setattr(shape, k, v)
    return shape


def simulate(sc: Scenario, rate: float | None = None, users: int | None = None, speed: float = 1.0) -> dict:
    """One point: open loop at `rate`, closed loop with `users`, or the trace at `speed`x. A bench-shaped summary."""
    card = sc.card
    if sc.trace is not None:
        reqs = [replace(r, arrival=r.arrival / speed) for r in sc.trace]
        load = {"kind": "trace", "value": speed, "label": f"trace x{speed:g}"}
    elif users is not None:
        reqs = card_requests(card.traffic, max(sc.requests, 4 * users), rate=math.inf)
        load = {"kind": "concurrency", "value": users, "label": f"concurrency {users}"}
    else:
        arrival = sc.arrival or card.traffic.open_loop_arrival
        reqs = card_requests(card.traffic, sc.requests, rate=rate, arrival=arrival, burstiness=sc.burstiness)
        label = f"{arrival} {rate:g} req/s"
        load = {"kind": "rate", "value": rate, "arrival": arrival, "label": label}
    if sc.noise_draws < 1:
        raise ValueError(f"noise_draws {sc.noise_draws}: give at least one run a point")
    runs = [summarize(Simulation(sc.cost, sc.shape, sc.topology, noise_seed=NOISE_SEED + i).run(reqs, users=users),
                      load=load, slos=card.objectives.request_slos()) for i in range(sc.noise_draws)]
    s = median_summary(runs)
    s["topology"] = sc.topology.describe()
    if sc.noise_draws > 1:  # each run's own percentiles, for the spread the step noise alone gives
        s["noise_draws"] = {"count": sc.noise_draws, "latency": {
            m: {q: [r["latency"][m][q] for r in runs] for q in ("p50", "p90", "p99")}
            for m in ("ttft", "itl", "tpot", "e2e")}}
    return s


def median_summary(runs: list[dict]) -> dict:
    """Summaries of one point's runs as one: each number the median over the runs (an integer stays one), each
    list of numbers (a CDF) the element-wise median, anything else the first run's."""
    first = runs[0]
    if len(runs) == 1:
        return first
    out = {}
    for k, v in first.items():
        vs = [r[k] for r in runs]
        if isinstance(v, dict):
            out[k] = median_summary(vs)
        elif isinstance(v, bool) or v is None or isinstance(v, str):
            out[k] = v
        elif isinstance(v, (int, float, np.floating, np.integer)) and all(x is not None for x in vs):
            m = float(np.median(vs))
            out[k] = int(round(m)) if isinstance(v, (int, np.integer)) else m
        elif isinstance(v, list) and v and all(isinstance(x, list) and len(x) == len(v) for x in vs):
            out[k] = [float(m) for m in np.median(np.array(vs, dtype=float), axis=0)]
        else:
            out[k] = v
    return out


def checks(card: Card, summary: dict) -> list[Check]:
    return [c for c in evaluate(card.objectives, summary) if c.kind in CHECK_KINDS]


def meets(card: Card, summary: dict) -> bool:
    return all(c.passed is True for c in checks(card, summary))


def saturation(sc: Scenario) -> float:
    """Requests/s the topology completes when it is never idle: a closed loop of enough users to fill every slot."""
    t = sc.topology
    n_inst = (t.prefill + t.decode) if t.disaggregated else t.replicas
    users = max(2, sc.shape.max_num_seqs * n_inst * 2)
    return simulate(sc, users=users)["throughput"]["requests_per_s"]


@dataclass(slots=True)
class MaxRate:
    rate: float | None  # highest rate found meeting the card; None: not even the lowest tried
    saturation: float  # requests/s at full load
    summary: dict | None  # at `rate`
    tried: list[tuple[float, bool]]


def max_rate(sc: Scenario, rel_tol: float = 0.02, past_saturation: bool = False) -> MaxRate:
    """Bisection on the rate between 0 and the saturation throughput: a rate above what the topology completes
    cannot meet latency objectives for long (queues grow without bound), though a finite run near saturation
    may still pass, so the answer is capped there. `past_saturation`: the SLO-max of this very draw instead, the
    rate where it stops meeting the card wherever that lies (validate benches the draw on both sides of it; a
    draw of 40 requests met a card at 1.15x saturation)."""
    sat = saturation(sc)
    tried: list[tuple[float, bool]] = []
    lo, hi, best = 0.0, sat, None
    probe = sat * 0.05
    s = simulate(sc, rate=probe)
    tried.append((probe, meets(sc.card, s)))
    if not tried[-1][1]:
        return MaxRate(None, sat, s, tried)
    lo, best = probe, s
    while past_saturation:  # double the rate from saturation until the draw fails, up to 32x saturation
        s = simulate(sc, rate=hi)
        tried.append((hi, meets(sc.card, s)))
        if not tried[-1][1]:
            break
        if hi >= 32 * sat:
            return MaxRate(hi, sat, s, tried)
        lo, hi, best = hi, 2 * hi, s
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        s = simulate(sc, rate=mid)
        ok = meets(sc.card, s)
        tried.append((mid, ok))
        if ok:
            lo, best = mid, s
        else:
            hi = mid
    return MaxRate(lo, sat, best, tried)


def replicas_for(sc: Scenario, rate: float, max_replicas: int = 32) -> tuple[int | None, dict | None]:
    """Fewest colocated replicas (behind sc's router) that meet the card at `rate`."""
    for n in range(1, max_replicas + 1):
        s = simulate(sc.with_topology(replicas=n, prefill=0, decode=0), rate=rate)
        if meets(sc.card, s):
            return n, s
    return None, None


def disaggregation(sc: Scenario, instances: int) -> list[tuple[Topology, MaxRate]]:
    """The SLO-max rate of `instances` colocated replicas against every P+D split of the same instance count."""
    out = [(replace(sc.topology, replicas=instances, prefill=0, decode=0), None)]
    out += [(replace(sc.topology, prefill=p, decode=instances - p), None) for p in range(1, instances)]
    return [(t, max_rate(replace(sc, topology=t))) for t, _ in out]
