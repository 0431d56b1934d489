"""The arrival process is what was asked for: rate and gap variability checked on generated schedules."""

import numpy as np
import pytest

from inferlab.bench.arrivals import rng_for, schedule, worker_schedules


def gap_cv(times: np.ndarray) -> float:
    """Coefficient of variation of the gaps between sorted arrival times."""
    g = np.diff(np.sort(times))
    return float(g.std() / g.mean())


def achieved_rate(t: np.ndarray) -> float:
    t = np.sort(t)
    return (t.size - 1) / (t[-1] - t[0])


@pytest.mark.parametrize("kind,burstiness,cv", [("poisson", 1.0, 1.0), ("gamma", 0.25, 2.0), ("gamma", 4.0, 0.5)])
def test_random_processes_hit_rate_and_cv(kind, burstiness, cv):
    t = schedule(20.0, kind, burstiness, n=20000, rng=rng_for(0, 1, 0, 0))
    assert achieved_rate(t) == pytest.approx(20.0, rel=0.04)
    assert gap_cv(t) == pytest.approx(cv, rel=0.06)


def test_constant_rate_has_no_randomness():
    t = schedule(8.0, "constant", n=100, rng=rng_for(0, 1, 0, 0))
    assert achieved_rate(t) == pytest.approx(8.0)
    assert gap_cv(t) == pytest.approx(0.0, abs=1e-9)
    assert t[0] == 0.0


def test_same_seed_same_schedule_and_different_seed_differs():
    a = schedule(5.0, n=100, rng=rng_for(7, 1, 0, 0))
    b = schedule(5.0, n=100, rng=rng_for(7, 1, 0, 0))
    c = schedule(5.0, n=100, rng=rng_for(8, 1, 0, 0))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


@pytest.mark.parametrize("kind", ["poisson", "constant"])
def test_workers_merge_into_the_asked_process(kind):
    parts = worker_schedules(30.0, kind, 1.0, workers=4, seed=3, n=24000)
    assert sum(p.size for p in parts) == 24000
    merged = np.concatenate(parts)
    assert achieved_rate(merged) == pytest.approx(30.0, rel=0.04)
    assert gap_cv(merged) == pytest.approx(1.0 if kind == "poisson" else 0.0, abs=0.05)


def test_worker_streams_are_independent():
    parts = worker_schedules(10.0, "poisson", 1.0, workers=3, seed=3, n=300)
    gaps = [np.diff(p) for p in parts]
    assert not np.allclose(gaps[0], gaps[1]) and not np.allclose(gaps[1], gaps[2])
    assert abs(np.corrcoef(gaps[0], gaps[1])[0, 1]) < 0.3


def test_duration_bounds_the_schedule():
    t = schedule(50.0, duration=10.0, rng=rng_for(1, 1, 0, 0))
    assert t.max() < 10.0
    assert t.size == pytest.approx(500, rel=0.15)
    assert schedule(4.0, "constant", duration=1.0, rng=rng_for(1, 1, 0, 0)).tolist() == [0.0, 0.25, 0.5, 0.75]


def test_bad_rates_are_refused():
    with pytest.raises(ValueError, match="positive"):
        schedule(0.0, n=3, rng=rng_for(0))
    with pytest.raises(ValueError, match="burstiness"):
        schedule(1.0, "gamma", 0.0, n=3, rng=rng_for(0))
    with pytest.raises(ValueError, match="unknown arrival"):
        schedule(1.0, "weibull", n=3, rng=rng_for(0))
    assert schedule(float("inf"), n=3, rng=rng_for(0)).tolist() == [0.0, 0.0, 0.0]
