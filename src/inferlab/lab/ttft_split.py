"""A served request's time to first token in parts: bench's record of it beside the engine's (the step trace's
request lines, engine/step_trace.py), both on the machine's monotonic clock.

    http    its due time (open loop; sent, closed loop) to the server's arrival: client queue, connection, parsing
    taken   the server's arrival to the engine taking it: tokenizing, then the engine loop's next pass (after the
            step in progress, under load)
    engine  the engine taking it to its first token sampled: the scheduler's queue and the prefill steps
    out     the first token sampled to the client reading it: publishing, the SSE write, the client's loop

The simulator's request_overhead stands for what lies outside the engine (http + taken + out of a request that
finds the engine idle); the rest is the scheduler and the step costs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from inferlab.bench import metrics
from inferlab.bench.records import RequestRecord, read_records

MATCH_SLACK = 1e-3  # s: the server's arrival stamp may precede bench's send stamp by this much (two processes)


@dataclass(slots=True, frozen=True)
class TTFTSplit:
    http: float
    taken: float
    engine: float
    out: float

    @property
    def outside(self) -> float:
        """What a request pays outside the engine: all but the engine's queue and prefill."""
        return self.http + self.taken + self.out


def split_ttft(records: list[RequestRecord], clock_origin: float, served: list[dict]) -> dict[int, TTFTSplit]:
    """Record index -> its parts, for the measured records with a first token. Each record pairs with the first
    unpaired finished request of its prompt length (the server's usage) that the server received after bench sent
    it and sampled a first token for before bench read one; a record with no such request is left out. (Without
    the second bound, a record whose own request was missing from the trace paired with a later run's request of
    its length: a calibration on the Zen 4 EPYC kept a delivery of -52 s and validate refused its profile.)"""
    free = sorted((r for r in served if "f" in r and "q" in r), key=lambda r: r["a"])
    out = {}
    for rec in sorted(records, key=lambda r: r.sent if r.sent is not None else float("inf")):
        ttft = metrics.ttft(rec)
        if rec.warmup or ttft is None or rec.sent is None or rec.start is None:
            continue
        sent, start = clock_origin + rec.sent, clock_origin + rec.start
        for i, row in enumerate(free):
            if (row["n"] == rec.prompt_tokens and row["a"] >= sent - MATCH_SLACK
                    and row["f"] <= start + ttft + MATCH_SLACK):
                del free[i]
                out[rec.index] = TTFTSplit(row["a"] - start, row["q"] - row["a"], row["f"] - row["q"],
                                           max(0.0, start + ttft - row["f"]))
                break
    return out


def split_run(results_path: str | Path, served: list[dict]) -> dict[int, TTFTSplit]:
    """split_ttft for one bench run: its results.json (the clock origin) and the records.jsonl beside it."""
    p = Path(results_path)
    origin = json.loads(p.read_text(encoding="utf-8"))["runs"][0]["clock_origin"]
    return split_ttft(list(read_records(p.with_name("records.jsonl"))), origin, served)
