"""A trace of the engine's steps as it serves: what each step carried and when it ran, one JSON line per step.

`inferlab serve --step-trace FILE` writes it; `inferlab simulate calibrate served` fits the simulator's step-cost
model to it. An offline profile times `LLMEngine.step` alone; a served step also pays for what runs between steps on
the same cores (the server's HTTP and streaming work, draining new requests, publishing outputs), which at one
stream was ~3 ms of an ~11 ms step on the 2-core machine. The trace keeps each step's start, so the time from one
step's start to the next one's (when the engine had work throughout) is the served step period, overhead included.

The first line is a header (the scheduler settings and KV shape the simulator needs); then per step:
  t   start (time.perf_counter of the engine's process)
  dt  the step itself (LLMEngine.step: schedule, forward, sample, append)
  busy  whether work was left after it (so the next step started as soon as the server loop came round)
  p   [num_computed, num_new, samples] of each sequence with more than one new token (prefill chunks, verification)
  d   decoding sequences (one new token each); da: the keys they attend, sum of (num_computed + 1)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from inferlab.engine.scheduler import ScheduledBatch

SCHEMA = "inferlab.step_trace/1"


@dataclass(slots=True, frozen=True)
class BatchShape:
    """A scheduled batch reduced to what its cost depends on, read before the step moves num_computed_tokens."""

    chunks: tuple[tuple[int, int, bool], ...] = ()  # (num_computed, num_new, samples) of multi-token queries
    num_decodes: int = 0
    decode_context: int = 0  # keys the decodes attend: sum of (num_computed + 1)

    @classmethod
    def of(cls, batch: ScheduledBatch) -> "BatchShape":
        chunks, k, ctx = [], 0, 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            c = seq.num_computed_tokens
            if n == 1 and c + 1 >= seq.num_tokens:  # a decode (or a prompt's last token alone: the same cost)
                k += 1
                ctx += c + 1
            else:
                chunks.append((c, n, c + n >= seq.num_tokens))
        return cls(tuple(chunks), k, ctx)

    def to_json(self) -> dict:
        return {"p": [list(c) for c in self.chunks], "d": self.num_decodes, "da": self.decode_context}

    @classmethod
    def from_json(cls, row: dict) -> "BatchShape":
        return cls(tuple((int(c), int(n), bool(s)) for c, n, s in row.get("p", ())), int(row.get("d", 0)),
                   int(row.get("da", 0)))


class StepTrace:
    """Appends the engine's steps to a file. Line-buffered: a killed server leaves every finished step behind."""

    def __init__(self, path: str | Path, header: dict):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("w", encoding="utf-8", buffering=1)
        self._f.write(json.dumps({"schema": SCHEMA, **header}) + "\n")

    def record(self, t0: float, dt: float, shape: BatchShape, busy_after: bool) -> None:
        self._f.write(json.dumps({"t": round(t0, 6), "dt": round(dt, 6), "busy": busy_after, **shape.to_json()},
                                 separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._f.close()


def read_step_trace(path: str | Path) -> tuple[dict, list[dict]]:
    """The header and the step rows of a trace file."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"cannot read the step trace {p}: {e.strerror or e}") from None
    try:
        rows = [json.loads(line) for line in lines if line.strip()]
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not a step trace (line {e.lineno}: {e.msg})") from None
    if not rows or rows[0].get("schema") != SCHEMA:
        raise ValueError(f"{p}: not a step trace (no {SCHEMA} header; write one with `inferlab serve --step-trace`)")
    return rows[0], rows[1:]
