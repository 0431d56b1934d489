"""Open-loop arrival schedules: when each request is due, as offsets in seconds from the run's start.

Each worker process draws from its own random stream (a distinct SeedSequence spawn key), so N workers at
R/N each merge into one process of rate R. Reusing one seed in every worker is a classic fault: the workers
send in lockstep and the merged schedule is neither Poisson nor at the asked rate.
"""

from __future__ import annotations

import math

import numpy as np

ARRIVALS = ("poisson", "gamma", "constant")

# Spawn keys keep the workload's randomness and each (run, worker)'s arrivals independent of one another.
STREAM_WORKLOAD = 0
STREAM_ARRIVALS = 1
STREAM_TEXT = 2  # synthetic prompts' words, when drawn apart from their lengths (--text-seed)


def rng_for(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


def _gaps(n: int, rate: float, kind: str, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    if kind == "poisson":
        return rng.exponential(1.0 / rate, n)
    if kind == "gamma":
        # shape k, scale 1/(k*rate): mean 1/rate, coefficient of variation 1/sqrt(k); k = 1 is Poisson.
        return rng.gamma(burstiness, 1.0 / (rate * burstiness), n)
    if kind == "constant":
        return np.full(n, 1.0 / rate)
    raise ValueError(f"unknown arrival process {kind!r}; choose from {', '.join(ARRIVALS)}")


def schedule(
    rate: float,
    kind: str = "poisson",
    burstiness: float = 1.0,
    *,
    n: int | None = None,
    duration: float | None = None,
    rng: np.random.Generator,
    phase: float = 0.0,
) -> np.ndarray:
    """Arrival offsets for `n` requests or for all arrivals before `duration` (whichever ends first).
    Poisson and gamma are renewal processes started at 0 (the first arrival is one gap in); a constant rate
    starts at `phase` gaps (worker k of N uses phase k/N so their merged schedule stays evenly spaced).
    rate = inf sends everything at once."""
    if n is None and duration is None:
        raise ValueError("an arrival schedule needs a number of requests or a duration")
    if not rate > 0:
        raise ValueError(f"the request rate must be positive, got {rate}")
    if kind == "gamma" and not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        if n is None:
            raise ValueError("an infinite rate needs a number of requests, not a duration")
        return np.zeros(n)
    if kind == "constant":
        count = n if n is not None else int(math.floor(duration * rate - phase)) + 1
        t = (np.arange(count) + phase) / rate
        return t if duration is None else t[t < duration]
    if n is not None:
        t = np.cumsum(_gaps(n, rate, kind, burstiness, rng))
        return t if duration is None else t[t < duration]
    parts, last = [], 0.0
    batch = max(16, int(duration * rate * 1.2))
    while last < duration:
        t = last + np.cumsum(_gaps(batch, rate, kind, burstiness, rng))
        parts.append(t)
        last = float(t[-1])
    t = np.concatenate(parts)
    return t[t < duration]


def worker_schedules(
    rate: float,
    kind: str,
    burstiness: float,
    *,
    workers: int,
    seed: int,
    run: int = 0,
    n: int | None = None,
    duration: float | None = None,
) -> list[np.ndarray]:
    """One schedule per worker at rate/workers each, from independent streams. With `n`, the requests are
    split as evenly as possible (worker k gets requests k, k + workers, ...)."""
    out = []
    for w in range(workers):
        nw = None if n is None else len(range(w, n, workers))
        out.append(schedule(rate / workers, kind, burstiness, n=nw, duration=duration,
                            rng=rng_for(seed, STREAM_ARRIVALS, run, w), phase=w / workers))
    return out
