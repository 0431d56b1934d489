"""--sweep slo: the search on made-up points (no server), then against a fake server whose capacity is known,
and the cost figures worked out by hand."""

import heapq
import math

import numpy as np
import pytest

from inferlab.bench.cost import cost
from inferlab.bench.slo_search import Point, SearchConfig, estimate, next_rate


def oracle(capacity: float):
    """A server whose margin rises linearly with the rate and crosses 1 at `capacity`."""
    def measure(rate: float, i: int) -> Point:
        m = rate / capacity
        return Point(rate, m <= 1, m, m * 0.95, m * 1.05, min(rate, capacity), i)
    return measure


def test_search_brackets_bisects_and_repeats_the_ends():
    cfg = SearchConfig(start=1.0, tolerance=0.02, repeats=2)
    measure, points = oracle(37.3), []
    while (r := next_rate(points, cfg)) is not None:
        points.append(measure(r, len(points)))
    rates = [p.rate for p in points]
    assert rates[:7] == [1, 2, 4, 8, 16, 32, 64]  # doubling until the first miss
    est = estimate(points, "p99")
    lo, hi = est["bracket"]
    assert lo < 37.3 < hi and (hi - lo) / lo <= 0.02
    assert rates.count(lo) == 2 and rates.count(hi) == 2  # both ends measured again
    assert est["capacity"] == pytest.approx(37.3, rel=1e-9)  # the margin is linear: interpolation is exact
    a, b = est["interval"]
    assert lo <= a <= 37.3 <= b <= hi
    assert [c["rate"] for c in est["curve"]] == sorted({p.rate for p in points})


def test_search_goes_down_and_reports_no_capacity():
    cfg = SearchConfig(start=8.0, tolerance=0.05, repeats=1)
    measure, points = oracle(3.0), []
    while (r := next_rate(points, cfg)) is not None:
        points.append(measure(r, len(points)))
    assert [p.rate for p in points][:3] == [8, 4, 2]
    assert estimate(points, "p99")["capacity"] == pytest.approx(3.0)
    fail = [Point(1.0, False, 2.0, 1.9, 2.1, 0.0, 0)]
    assert estimate(fail, "p99")["capacity"] is None


def test_a_flipped_end_reopens_the_bracket():
    cfg = SearchConfig(start=1.0, tolerance=1.0, repeats=3)
    pts = [Point(1, True, 0.5, 0.4, 0.6, 1, 0), Point(2, False, 1.5, 1.4, 1.6, 1, 1)]
    assert next_rate(pts, cfg) == 1  # narrow enough: repeat the ends
    pts += [Point(1, False, 1.1, 1.0, 1.2, 1, 2), Point(1, False, 1.1, 1.0, 1.2, 1, 3)]
    assert next_rate(pts, cfg) == 0.5  # 1 req/s now fails by majority: search lower


def queued_e2e_p90(rate: float, requests: int = 60, slots: int = 8, service: float = 0.1) -> float:
    """The fake server's p90 E2E under constant arrivals, by a D/D/c queue: each request starts when it arrives or
    when the first of the slots frees, whichever is later, and holds its slot for `service` seconds."""
    free, e2e = [0.0] * slots, []
    for i in range(requests):
        start = max(i / rate, heapq.heappop(free))
        heapq.heappush(free, start + service)
        e2e.append(start + service - i / rate)
    return float(np.percentile(e2e, 90))


def test_search_finds_the_fake_servers_capacity(fake, bench):
    # 8 slots, each request 80 ms to its first token + 2 x 10 ms: 100 ms of service, so 80 requests/s at most.
    # Constant arrivals below that never queue (E2E = 100 ms); above it the queue grows with every request, and of
    # 60 requests the p90 reaches the 200 ms SLO at the rate the queue model gives (96 req/s). The SLO leaves 100 ms
    # over the service time: a loaded machine's scheduling delays (20 ms and more under the full suite) must not
    # fail rates far below capacity.
    lo, hi = 1.0, 1000.0
    while hi / lo > 1.001:
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if queued_e2e_p90(mid) <= 0.2 else (lo, mid)
    url, _ = fake(ttft=0.08, itl=0.01, max_concurrency=8)
    rc, res, _ = bench("--base-url", url, "--sweep", "slo", "--rate", "30", "--arrival", "constant",
                       "--slo", "e2e=200ms", "--slo-percentile", "p90", "--num-requests", "60", "--input-len", "8",
                       "--output-len", "3", "--slo-repeats", "2", "--price-per-hour", "3.6")
    assert rc == 0 and res["slo_passed"] is True
    s = res["slo_search"]
    assert 95 < lo < 97 and s["capacity"] == pytest.approx(lo, rel=0.06)
    a, b = s["interval"]
    assert a <= s["capacity"] <= b
    assert len(s["curve"]) >= 4 and any(not c["passed"] for c in s["curve"])
    below = [c for c in s["curve"] if c["rate"] < 80]
    assert below and all(c["passed"] for c in below)
    for c in below:  # without a queue every request is good: goodput is the rate, less the last one's E2E
        assert c["goodput_requests_per_s"] >= 0.8 * c["rate"]
    # cost at the capacity: rate x mean tokens per request, priced as in test_cost_split_spends_the_hour
    c = s["cost"]
    assert c["per_thousand_requests"] == pytest.approx(1e-3 / s["capacity"] * 1e3)
    assert all(r["cost"] for r in res["runs"])


def test_cost_split_spends_the_hour():
    c = cost(3.6, input_tokens_per_s=100.0, output_tokens_per_s=50.0, requests_per_s=2.0, output_cost_ratio=4.0)
    # 1e-3 per second; c_in = 1e-3 / (100 + 4 * 50) per token
    assert c["input_per_million"] == pytest.approx(1e-3 / 300 * 1e6)
    assert c["output_per_million"] == pytest.approx(4e-3 / 300 * 1e6)
    spent = c["input_per_million"] * 100 / 1e6 + c["output_per_million"] * 50 / 1e6
    assert spent == pytest.approx(1e-3)  # the split spends exactly the price per second
    assert c["total_per_million"] == pytest.approx(1e-3 / 150 * 1e6)
    assert c["per_thousand_requests"] == pytest.approx(0.5)
    assert cost(1.0, 0.0, 0.0, 0.0) is None and not math.isnan(c["input_per_million"])


def test_slo_sweep_needs_objectives(bench, capsys):
    rc, _, _ = bench("--base-url", "http://127.0.0.1:9", "--sweep", "slo")
    assert rc == 2 and "give them with --slo" in capsys.readouterr().err
