"""Raw per-request records: what the client saw, with no interpretation. Every metric is derived from these.

Times are seconds on a monotonic clock (time.perf_counter, CLOCK_MONOTONIC on Linux, shared by all processes
of the machine) measured from the run's clock origin, which the results file states as an absolute value so
records can be lined up with a server's own timestamps (the fake server's /stats, for one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Iterator

# Where a chunk's token count came from, best first.
TOKEN_SOURCES = ("usage", "tokenizer", "chunks")


@dataclass(slots=True)
class RequestRecord:
    index: int  # position in the workload
    run: int = 0  # load point of a sweep
    worker: int = 0
    request_id: str = ""  # sent as X-Request-Id
    warmup: bool = False
    scheduled: float | None = None  # open loop: when the request was due; None in closed loop
    sent: float | None = None  # when the client began sending it
    end: float | None = None  # arrival of the last byte of the response
    # One entry per SSE event with a payload (role-only and usage-only events carry 0 tokens).
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    first_content: float | None = None  # arrival of the first non-reasoning output, when reasoning was streamed apart
    first_reasoning: float | None = None  # arrival of the first reasoning token, when reasoning was streamed apart
    reasoning: bool = False  # the server streamed reasoning separately from the answer
    reasoning_tokens: int | None = None  # output tokens that came as reasoning (when streamed apart)
    token_source: str = "chunks"  # usage | tokenizer | chunks: where chunk_tokens came from
    input_len: int | None = None  # prompt tokens the workload asked for (by the bench tokenizer)
    output_len: int | None = None  # max_tokens asked for
    prompt_tokens: int | None = None  # as reported by the server's usage
    output_tokens: int | None = None  # the server's final usage when given, else the sum of chunk_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens when the server reports it
    finish_reason: str | None = None
    error_kind: str | None = None  # None = success; "cancelled" = cut by an interrupt (not a server error)
    error: str | None = None  # a sample of the message
    http_status: int | None = None
    session: int | None = None  # conversations: which session this turn belongs to
    turn: int | None = None  # conversations: 1 for a session's first request, 2 for its next, ...

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @property
    def start(self) -> float | None:
        """The latency clock's origin: the scheduled time in open loop (so client-side queueing is counted),
        the send time in closed loop."""
        return self.scheduled if self.scheduled is not None else self.sent

    def to_json(self) -> str:
        # Written on the event loop as each request ends: no dataclasses.asdict (it deep-copies every list).
        d = {name: getattr(self, name) for name in _FIELDS}
        d["chunk_times"] = [round(t, 7) for t in self.chunk_times]
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> "RequestRecord":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


_FIELDS = tuple(f.name for f in fields(RequestRecord))


def read_records(path: str | Path) -> Iterator[RequestRecord]:
    """Read a records JSONL file; a torn last line (the writer was killed mid-write) is skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield RequestRecord.from_dict(json.loads(line))
            except json.JSONDecodeError:
                continue
