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
  cap  the bound on prefill tokens beside decodes the step was scheduled under (absent: none); drain: the prefill
       budget's held drain rate then (absent: none held; engine/step_budget.py)

and, as each request finishes, a line of its times on the same clock:
  req  its id; n: prompt tokens; o: output tokens
  a   arrival (the server's: before it tokenized the prompt); q: taken by the engine; s: first scheduled;
  f   first token sampled; e: finished
A client on the same machine stamps its requests with the same clock (bench's records, from their clock origin), so
a request's time to first token splits into the server's way in (a, q), the engine's queue and prefill (q to f),
and the way out (f to the client's first chunk): what a simulator's step costs must explain is q to f only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from inferlab.engine.scheduler import ScheduledBatch
from inferlab.engine.sequence import Sequence

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

    def record(self, t0: float, dt: float, shape: BatchShape, busy_after: bool, prefill_cap: int | None = None,
               drain: int = 0) -> None:
        row = {"t": round(t0, 6), "dt": round(dt, 6), "busy": busy_after, **shape.to_json()}
        if prefill_cap is not None:
            row["cap"] = prefill_cap
        if drain:
            row["drain"] = drain
        self._f.write(json.dumps(row, separators=(",", ":")) + "\n")

    def record_request(self, seq: Sequence) -> None:
        m = seq.metrics
        row = {"req": seq.request_id, "n": seq.num_prompt_tokens, "o": seq.num_output_tokens}
        for key, t in (("a", m.arrival_time), ("q", m.queued_time), ("s", m.first_scheduled_time),
                       ("f", m.first_token_time), ("e", m.finished_time)):
            if t is not None:
                row[key] = round(t, 6)
        self._f.write(json.dumps(row, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._f.close()


def read_step_trace(path: str | Path) -> tuple[dict, list[dict]]:
    """The header and the step rows of a trace file."""
    header, rows = _read(path)
    return header, [r for r in rows if "req" not in r]


def read_trace_requests(path: str | Path) -> list[dict]:
    """The finished requests' rows of a trace file (see the module docstring), in the order they finished."""
    return [r for r in _read(path)[1] if "req" in r]


def _read(path: str | Path) -> tuple[dict, list[dict]]:
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
