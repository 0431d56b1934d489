"""Multi-turn conversations: sessions whose turns resend the growing history.

A session is a list of user turns. A user (one closed-loop slot) runs a session turn by turn: each request
carries every earlier user turn and the model's *actual* answers to them (so the server's prefix cache can
serve the history), then the user waits a think time before the next turn. Sessions come from a file (JSONL
`{"turns": [...]}` or ShareGPT conversations, whose recorded assistant replies are dropped and only their
lengths kept) or are synthetic (`--turns`, `--first-turn-len`, `--input-len`, `--output-len`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from inferlab.bench.arrivals import STREAM_WORKLOAD, rng_for
from inferlab.bench.tokenizer import BenchTokenizer
from inferlab.bench.workload import LengthDist, WorkloadError, _read_jsonl, exact_texts, read_sharegpt
from inferlab.common.units import UnitError, parse_duration


@dataclass(slots=True)
class Turn:
    user: str
    output_len: int | None = None  # max_tokens; None leaves it to the server
    input_len: int | None = None  # tokens of this user message alone (the bench tokenizer's count)


@dataclass(slots=True)
class Session:
    turns: list[Turn]
    system: str | None = None


@dataclass(slots=True, frozen=True)
class ThinkTime:
    """Seconds a user waits between receiving an answer and sending the next turn: 'D' (fixed),
    'exponential:MEAN', 'uniform:LO,HI' or 'lognormal:MEDIAN,SIGMA', each duration with its unit ('2s')."""

    kind: str = "fixed"
    a: float = 0.0
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "ThinkTime":
        s = text.strip().lower()
        kind, sep, rest = s.partition(":")
        try:
            if not sep:
                return cls("fixed", parse_duration(s, "--think-time", bare="s"))
            parts = rest.split(",")
            if kind == "exponential" and len(parts) == 1:
                return cls(kind, parse_duration(parts[0], "--think-time", bare="s"))
            if kind == "uniform" and len(parts) == 2:
                lo, hi = (parse_duration(p, "--think-time", bare="s") for p in parts)
                if hi < lo:
                    raise WorkloadError(f"--think-time {text!r}: uniform:LO,HI needs LO <= HI")
                return cls(kind, lo, hi)
            if kind == "lognormal" and len(parts) == 2:
                return cls(kind, parse_duration(parts[0], "--think-time", bare="s"), float(parts[1]))
        except (UnitError, ValueError) as e:
            raise WorkloadError(f"--think-time {text!r}: {e}") from None
        raise WorkloadError(f"--think-time {text!r}: write D, exponential:MEAN, uniform:LO,HI or "
                            f"lognormal:MEDIAN,SIGMA (durations such as 2s or 500ms)")

    def sample(self, rng: np.random.Generator) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "exponential":
            return float(rng.exponential(self.a)) if self.a > 0 else 0.0
        if self.kind == "uniform":
            return float(rng.uniform(self.a, self.b))
        return float(rng.lognormal(math.log(self.a), self.b)) if self.a > 0 else 0.0

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"{self.a:g}s"
        if self.kind == "exponential":
            return f"exponential:{self.a:g}s"
        if self.kind == "uniform":
            return f"uniform:{self.a:g}s,{self.b:g}s"
        return f"lognormal:{self.a:g}s,{self.b:g}"


def think_rng(seed: int, session: int, turn: int) -> np.random.Generator:
    """Each (session, turn) draws its own think time: the same seed gives the same pauses, whatever the
    order in which users reach them."""
    return rng_for(seed, STREAM_WORKLOAD, 3, session * 4096 + turn)


def synthetic_sessions(n: int, turns: LengthDist, first_len: LengthDist, input_len: LengthDist,
                       output_len: LengthDist, tok: BenchTokenizer, seed: int, part: int = 0) -> list[Session]:
    """`n` sessions of random plain-word user turns: the first of `first_len` tokens (a document, a long
    question), the later ones of `input_len`. No two sessions share text, so any cache hit is a session's own
    history."""
    if tok is None:
        raise WorkloadError("synthetic conversations need a tokenizer: drop --tokenizer none, or use --dataset")
    rng = rng_for(seed, STREAM_WORKLOAD, 4, part)
    counts = turns.sample(n, rng).tolist()
    firsts = first_len.sample(n, rng).tolist()
    later = input_len.sample(max(sum(counts) - n, 1), rng).tolist()
    outs = output_len.sample(sum(counts), rng).tolist()
    lengths, k = [], 0
    for c, f in zip(counts, firsts):
        lengths.append(f)
        lengths += later[k:k + c - 1]
        k += c - 1
    texts, real = exact_texts(tok, lengths, rng)
    sessions, i = [], 0
    for c in counts:
        sessions.append(Session([Turn(texts[i + j], outs[i + j], real[i + j]) for j in range(c)]))
        i += c
    return sessions


def file_sessions(path: str | Path, tok: BenchTokenizer | None, output_len: int | None) -> list[Session]:
    """Sessions from a file: a ShareGPT JSON list (human turns become the user turns; each recorded reply
    gives only its length, the output length of that turn unless --output-len is given) or JSONL, one
    session per line: {"turns": [{"user": str, "output_len": int}, ...] | [str, ...], "system": str}."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"workload file not found: {path}")
    if path.suffix == ".json":
        return _sharegpt_sessions(path, tok, output_len)
    out = []
    for no, row in _read_jsonl(path):
        where = f"{path}:{no}"
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns:
            raise WorkloadError(f"{where}: a session needs a non-empty 'turns' list")
        ts = []
        for i, t in enumerate(turns):
            if isinstance(t, str):
                t = {"user": t}
            if not isinstance(t, dict) or not isinstance(t.get("user"), str) or not t["user"]:
                raise WorkloadError(f"{where}: turn {i} needs a 'user' string")
            n = t.get("output_len", t.get("max_tokens"))
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
                raise WorkloadError(f"{where}: turn {i}: 'output_len' must be a positive integer, got {n!r}")
            ts.append(Turn(t["user"], output_len or n, tok.count(t["user"]) if tok else None))
        system = row.get("system")
        if system is not None and not isinstance(system, str):
            raise WorkloadError(f"{where}: 'system' must be a string")
        out.append(Session(ts, system))
    return out


def _sharegpt_sessions(path: Path, tok: BenchTokenizer | None, output_len: int | None) -> list[Session]:
    out = []
    for conv in read_sharegpt(path):
        system, ts = None, []
        for m in conv:
            role, text = m["role"], m["content"]
            if role == "system" and not ts:
                system = text
            elif role == "user" and text:
                ts.append(Turn(text, output_len, tok.count(text) if tok else None))
            elif role == "assistant" and ts and output_len is None and text:
                ts[-1].output_len = tok.count(text) if tok else None
        if ts:
            out.append(Session(ts, system))
    if not out:
        raise WorkloadError(f"{path}: no conversation has a user turn")
    return out


@dataclass(slots=True)
class History:
    """A running session's messages: what its next request sends."""

    messages: list[dict] = field(default_factory=list)
    input_len: int = 0  # bench-tokenizer tokens of every message's content so far

    def ask(self, turn: Turn) -> tuple[list[dict], int | None]:
        self.messages.append({"role": "user", "content": turn.user})
        if turn.input_len is not None:
            self.input_len += turn.input_len
        return list(self.messages), (self.input_len if turn.input_len is not None else None)

    def answer(self, text: str, tokens: int | None) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self.input_len += tokens or 0
