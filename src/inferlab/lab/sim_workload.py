"""Simulated requests for a workload card's traffic, drawn the way `inferlab bench` draws them.

Lengths come from bench's own LengthDist with bench's random stream for the workload (seed, STREAM_WORKLOAD, part),
and open-loop arrival times from bench's arrivals.schedule with its stream (seed, STREAM_ARRIVALS, run, worker 0),
so a simulated load point sees the same prompt/output lengths and the same arrival times as the bench run of the
same card, seed and point (one bench worker). Prompt token ids are random (no two prompts share a prefix by
chance), except a shared-prefix group's first tokens, which are common to the group as in bench's prefix groups.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from inferlab.bench.arrivals import STREAM_ARRIVALS, STREAM_WORKLOAD, rng_for, schedule
from inferlab.bench.workload import LengthDist
from inferlab.lab.card import Length, Traffic
from inferlab.lab.simulator import SAMPLED_TOKEN, SimRequest

VOCAB = (1000, 30000)  # token ids drawn for prompts (SAMPLED_TOKEN lies outside)


def length_dist(ln: Length) -> LengthDist:
    return LengthDist.parse(ln.bench_arg())


def card_requests(traffic: Traffic, n: int, *, rate: float | None = None, arrival: str | None = None,
                  burstiness: float | None = None, seed: int | None = None, run: int = 0,
                  warmup: int | None = None) -> list[SimRequest]:
    """n measured requests (plus the card's warmup) of the card's lengths; open-loop arrivals at `rate` (default
    the card's) unless the traffic is closed loop and no rate is given."""
    seed = traffic.seed if seed is None else seed
    warmup = traffic.warmup if warmup is None else warmup
    total = n + warmup
    rng = rng_for(seed, STREAM_WORKLOAD, run)
    ins = length_dist(traffic.input_len).sample(total, rng).tolist()
    outs = length_dist(traffic.output_len).sample(total, rng).tolist()
    rate = traffic.rate if rate is None else rate
    kind = arrival or traffic.open_loop_arrival
    if rate is not None and not math.isinf(rate):
        times = schedule(rate, kind, traffic.burstiness if burstiness is None else burstiness, n=total,
                         rng=rng_for(seed, STREAM_ARRIVALS, run, 0)).tolist()
    else:
        times = [0.0] * total
    ids = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(7, run)))
    groups: list[int | None] = [None] * total
    prefixes: list[list[int]] = []
    plen = traffic.prefix_len if traffic.prefix_share > 0 else 0
    if plen:
        prefixes = [ids.integers(*VOCAB, plen).tolist() for _ in range(traffic.prefix_groups)]
        groups = ids.integers(0, traffic.prefix_groups, total).tolist()
    out = []
    for i in range(total):
        pre = prefixes[groups[i]] if plen else []
        body = ids.integers(*VOCAB, max(ins[i] - len(pre), 1)).tolist()
        out.append(SimRequest(f"r{i}", float(times[i]), pre + body, int(outs[i]), groups[i], warmup=i < warmup))
    return out


def trace_requests(path: str | Path, speed: float = 1.0, block_size: int = 512, seed: int = 0) -> list[SimRequest]:
    """A bench trace file (JSONL: timestamp, input_len, output_len, optional hash_ids naming shared blocks of
    `block_size` tokens; Mooncake's input_length/output_length accepted), replayed `speed` times faster."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"trace file not found: {p}")
    rng = np.random.default_rng(seed)
    blocks: dict = {}
    out = []
    for no, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ts = float(row["timestamp"])
            n = int(row.get("input_len", row.get("input_length")))
            m = int(row.get("output_len", row.get("output_length")))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise ValueError(f"{p}:{no}: needs JSON with timestamp, input_len and output_len") from None
        if n < 1 or m < 1 or ts < 0:
            raise ValueError(f"{p}:{no}: lengths must be positive and the timestamp non-negative")
        prompt: list[int] = []
        for h in row.get("hash_ids") or []:
            if h not in blocks:
                blocks[h] = rng.integers(*VOCAB, block_size).tolist()
            prompt += blocks[h]
        prompt = prompt[:n] + rng.integers(*VOCAB, max(0, n - len(prompt))).tolist()
        group = row["hash_ids"][0] if row.get("hash_ids") else None
        out.append(SimRequest(f"t{len(out)}", ts / speed, prompt, m, group if isinstance(group, int) else None))
    if not out:
        raise ValueError(f"{p}: no requests in the trace")
    t0 = min(r.arrival for r in out)
    for r in out:
        r.arrival -= t0
    out.sort(key=lambda r: r.arrival)
    assert SAMPLED_TOKEN < VOCAB[0]
    return out
