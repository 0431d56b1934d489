"""--sweep slo: the highest request rate whose objectives still hold at --slo-percentile.

The search is a pure function of the points measured so far (`next_rate`), so it is tested without a server:
1. bracket: from the starting rate, double while the objectives hold (halve while they do not) until one rate
   passes and a higher one fails;
2. bisect the bracket until its width is under `tolerance` of its lower end;
3. measure both ends of the final bracket again until each has `repeats` runs: near the boundary a single run
   can pass or fail by chance. A rate's verdict is the majority of its runs (ties fail); a flipped end reopens
   the bisection.

The estimate (`estimate`) is the rate where the SLO margin (metric at the percentile / limit, the largest over
the objectives; 1 = on the limit) crosses 1, interpolated linearly between the last passing and first failing
rate from the mean margin of their runs; its interval is the same crossing for the 2.5% and 97.5% bootstrap
bounds of the margin (summary's slo_gate.ratio_ci), clipped to the measured rates around it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_DOUBLINGS = 20


@dataclass(slots=True)
class SearchConfig:
    start: float = 1.0  # first rate tried (req/s)
    tolerance: float = 0.03  # stop bisecting when (hi - lo) / lo is below this
    repeats: int = 3  # runs at each end of the final bracket
    max_points: int = 30  # a hard stop on the number of runs


@dataclass(slots=True)
class Point:
    rate: float
    passed: bool
    ratio: float  # margin: metric at the percentile / limit (largest over objectives)
    ratio_lo: float
    ratio_hi: float
    goodput: float  # good requests per second
    run: int  # index into results["runs"]


def point_from_run(run: dict, index: int) -> Point:
    g = run["slo_gate"]
    lo, hi = g.get("ratio_ci") or [None, None]
    inf = math.inf
    return Point(rate=run["load"]["value"], passed=bool(g["passed"]),
                 ratio=inf if g.get("ratio") is None else g["ratio"],
                 ratio_lo=inf if lo is None else lo, ratio_hi=inf if hi is None else hi,
                 goodput=run["goodput"]["requests_per_s"] if run.get("goodput") else 0.0, run=index)


def _by_rate(points: list[Point]) -> dict[float, list[Point]]:
    out: dict[float, list[Point]] = {}
    for p in points:
        out.setdefault(p.rate, []).append(p)
    return dict(sorted(out.items()))


def verdicts(points: list[Point]) -> dict[float, bool]:
    """Each rate's verdict: passed in more than half of its runs."""
    return {r: 2 * sum(p.passed for p in ps) > len(ps) for r, ps in _by_rate(points).items()}


def bracket(points: list[Point]) -> tuple[float | None, float | None]:
    """(highest passing rate below the lowest failing one, lowest failing rate)."""
    v = verdicts(points)
    fails = [r for r, ok in v.items() if not ok]
    hi = min(fails) if fails else None
    passes = [r for r, ok in v.items() if ok and (hi is None or r < hi)]
    return (max(passes) if passes else None), hi


def next_rate(points: list[Point], cfg: SearchConfig) -> float | None:
    """The next rate to measure, or None when the search is done."""
    if not points:
        return cfg.start
    if len(points) >= cfg.max_points:
        return None
    lo, hi = bracket(points)
    runs = {r: len(ps) for r, ps in _by_rate(points).items()}
    if hi is None:  # everything passed so far: go up
        top = max(runs)
        return None if top >= cfg.start * 2 ** MAX_DOUBLINGS else top * 2
    if lo is None:  # everything failed: go down
        bottom = min(runs)
        return None if bottom <= cfg.start / 2 ** MAX_DOUBLINGS else bottom / 2
    if (hi - lo) / lo > cfg.tolerance:
        return (lo + hi) / 2
    for r in (lo, hi):
        if runs[r] < cfg.repeats:
            return r
    return None


def _crossing(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Rate where the margin crosses 1 on the line through (rate, margin) points a (below 1) and b."""
    (ra, ma), (rb, mb) = a, b
    if ma >= 1:
        return ra
    if mb <= 1:
        return rb
    if not math.isfinite(mb):  # no latency at all at b: nothing to interpolate, keep to what was measured
        return ra
    return ra + (1 - ma) / (mb - ma) * (rb - ra)


def estimate(points: list[Point], percentile: str) -> dict:
    """The capacity under the objectives, its interval, and the goodput curve (one entry per rate)."""
    by = _by_rate(points)
    v = verdicts(points)
    lo, hi = bracket(points)
    curve = [{"rate": r, "runs": len(ps), "passed": v[r], "passes": sum(p.passed for p in ps),
              "goodput_requests_per_s": sum(p.goodput for p in ps) / len(ps),
              "ratio": _mean([p.ratio for p in ps]), "ratio_ci": [_mean([p.ratio_lo for p in ps]),
                                                                 _mean([p.ratio_hi for p in ps])],
              "runs_index": [p.run for p in ps]} for r, ps in by.items()]
    out = {"percentile": percentile, "bracket": [lo, hi], "capacity": None, "interval": None, "curve": curve,
           "points": len(points)}
    if lo is None:
        out["note"] = "no rate met the objectives"
        return out
    if hi is None:
        out.update(capacity=lo, interval=[lo, None], note="every rate met the objectives: the capacity is higher")
        return out
    a, b = next(c for c in curve if c["rate"] == lo), next(c for c in curve if c["rate"] == hi)
    cap = _crossing((lo, a["ratio"]), (hi, b["ratio"]))
    # The pessimistic margin (upper bound) crosses 1 sooner: the interval's low end; the optimistic one later.
    low = _crossing((lo, a["ratio_ci"][1]), (hi, b["ratio_ci"][1]))
    high = _crossing((lo, a["ratio_ci"][0]), (hi, b["ratio_ci"][0]))
    clip = lambda x: min(max(x, lo), hi)  # noqa: E731
    out.update(capacity=clip(cap), interval=[clip(min(low, cap)), clip(max(high, cap))])
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if all(math.isfinite(x) for x in xs) else math.inf
