"""Service-level objectives: goodput's per-request test, the CLI's exit-code gate, and `assert_slo` for pytest.

    from inferlab.bench import assert_slo
    assert_slo("bench-results/run/results.json", ttft_p99="500ms", tpot_p99="50ms")
"""

from __future__ import annotations

import json
from pathlib import Path

from inferlab.bench import metrics
from inferlab.bench.records import RequestRecord
from inferlab.common.units import UnitError, format_ms, parse_duration

# Objectives a single request can meet or miss (goodput, as in DistServe and vLLM's --goodput).
REQUEST_SLOS = ("ttft", "tpot", "e2e")
STATS = ("mean", "p50", "p90", "p95", "p99", "max")


class SLOError(UnitError):
    """A badly written objective."""


def _limit(value, what: str) -> float:
    v = parse_duration(value, what)
    if v < 0:
        raise SLOError(f"{what}: {value!r} cannot be negative")
    return v


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """['ttft=500ms', 'tpot=50ms'] -> {'ttft': 0.5, 'tpot': 0.05}."""
    out: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        name = name.strip().lower()
        if not sep:
            raise SLOError(f"--slo {item!r}: write METRIC=DURATION, e.g. ttft=500ms")
        if name not in REQUEST_SLOS:
            raise SLOError(f"--slo {item!r}: unknown metric {name!r}; choose from {', '.join(REQUEST_SLOS)}")
        out[name] = _limit(value, f"--slo {name}")
    return out


def parse_percentile(text: str) -> str:
    p = text.strip().lower()
    if not p.startswith("p"):
        p = "p" + p
    if p not in STATS[1:-1] and p != "max":
        raise SLOError(f"--slo-percentile {text!r}: choose p50, p90, p95, p99 or max")
    return p


def meets(r: RequestRecord, slos: dict[str, float]) -> bool:
    """A request is good when it succeeded and meets every objective. A one-token answer has no TPOT and
    meets a TPOT objective vacuously."""
    if not r.ok:
        return False
    for name, limit in slos.items():
        v = metrics.PER_REQUEST[name](r)
        if v is None:
            if name == "tpot":
                continue
            return False
        if v > limit:
            return False
    return True


def gate(run: dict, slos: dict[str, float], percentile: str = "p99") -> list[str]:
    """The objectives a run summary misses at `percentile`, as messages; empty = passed."""
    misses = []
    for name, limit in slos.items():
        value = run["latency"][name].get(percentile)
        if value is None:
            misses.append(f"{name} {percentile}: no successful samples (limit {format_ms(limit)})")
        elif value > limit:
            misses.append(f"{name} {percentile} = {format_ms(value)} > {format_ms(limit)}")
    return misses


BOOTSTRAP = 400  # resamples for a margin's confidence interval


def margin(samples: dict, slos: dict[str, float], percentile: str = "p99") -> dict:
    """How close a run is to its objectives: `ratio` = the largest of (metric at `percentile`) / limit over the
    objectives, so the gate passes exactly when ratio <= 1; and `ratio_ci`, its 95% bootstrap interval
    (requests resampled with replacement, BOOTSTRAP times, seeded), which --sweep slo uses to put an interval
    on the capacity. Like the gate, it reads successful requests only."""
    import numpy as np

    rng = np.random.default_rng(0)
    point, boots = [], []
    for name, limit in slos.items():
        a = np.asarray(samples[name], dtype=np.float64)
        if a.size == 0 or limit <= 0:
            point.append(np.inf)
            boots.append(np.full(BOOTSTRAP, np.inf))
            continue

        def at(x, axis=None):
            if percentile == "max":
                return np.max(x, axis=axis)
            return np.percentile(x, float(percentile[1:]), axis=axis, method="linear")

        point.append(float(at(a)) / limit)
        idx = rng.integers(0, a.size, (BOOTSTRAP, a.size))
        boots.append(at(a[idx], axis=1) / limit)
    ratio = max(point)
    worst = np.max(np.vstack(boots), axis=0)
    lo, hi = (float(x) for x in np.percentile(worst, [2.5, 97.5]))
    return {"ratio": ratio, "ratio_ci": [lo, hi]}


def _load(results: dict | str | Path) -> dict:
    if isinstance(results, (str, Path)):
        return json.loads(Path(results).read_text(encoding="utf-8"))
    return results


def assert_slo(results: dict | str | Path, run: int | None = None, **objectives: str) -> None:
    """Fail (AssertionError) when a bench result misses an objective. Objectives are `<metric>_<stat>=limit`
    with metric in ttft, ttft_content, tpot, itl, inter_chunk, e2e, e2e_per_output_token, client_delay and stat
    in mean, p50, p90, p95, p99, max, each limit with its unit ('500ms'); or `error_rate=0.01` (a fraction, or '1%'). Every run of a sweep is
    checked unless `run` picks one. `results` is a results.json path or its parsed dict."""
    data = _load(results)
    runs = data["runs"] if "runs" in data else [data]
    if run is not None:
        runs = [runs[run]]
    if not objectives:
        raise SLOError("assert_slo needs at least one objective, e.g. ttft_p99='500ms'")
    misses = []
    for i, summary in enumerate(runs):
        where = f"run {summary.get('load', {}).get('label', i)}"
        for key, limit in objectives.items():
            if key == "error_rate":
                lim = float(str(limit).rstrip("%")) / 100 if str(limit).endswith("%") else float(limit)
                rate = summary["counts"]["error_rate"]
                if rate > lim:
                    misses.append(f"{where}: error_rate {rate:.2%} > {lim:.2%}")
                continue
            name, _, stat = key.rpartition("_")
            if name not in metrics.TIME_METRICS or stat not in STATS:
                raise SLOError(f"assert_slo: cannot read objective {key!r}; write e.g. ttft_p99='500ms'")
            lim = _limit(limit, key)
            value = summary["latency"][name].get(stat)
            if value is None:
                misses.append(f"{where}: {key} has no samples")
            elif value > lim:
                misses.append(f"{where}: {key} = {format_ms(value)} > {format_ms(lim)}")
    if misses:
        raise AssertionError("SLO missed:\n  " + "\n  ".join(misses))
