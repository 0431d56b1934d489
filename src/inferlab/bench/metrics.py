"""Metric definitions: one function per number, each matching its entry in docs/metrics.md.

Per-request metrics are computed from a RequestRecord; distributions are summarised by `stats`. All values
are in seconds (or tokens, or tokens per second) and None where a metric is undefined for that request.
"""

from __future__ import annotations

import numpy as np

from inferlab.bench.records import RequestRecord

PERCENTILES = (50, 90, 95, 99)
CDF_POINTS = 101  # quantiles 0%, 1%, ..., 100% kept in the summary so reports can draw CDFs without the records


def _first_token_index(r: RequestRecord) -> int | None:
    for i, k in enumerate(r.chunk_tokens):
        if k > 0:
            return i
    return None


def ttft(r: RequestRecord) -> float | None:
    """Time to first token: arrival of the first chunk carrying an output token (answer or reasoning) minus the
    latency clock's origin (scheduled time in open loop, send time in closed loop)."""
    i = _first_token_index(r)
    if i is None or r.start is None:
        return None
    return r.chunk_times[i] - r.start


def ttft_content(r: RequestRecord) -> float | None:
    """TTFT of the first non-reasoning token; defined only when the server streamed reasoning separately."""
    if not r.reasoning or r.first_content is None or r.start is None:
        return None
    return r.first_content - r.start


def ttft_reasoning(r: RequestRecord) -> float | None:
    """Time to the first reasoning token; defined only when the server streamed reasoning separately."""
    if not r.reasoning or r.first_reasoning is None or r.start is None:
        return None
    return r.first_reasoning - r.start


def answer_tokens(r: RequestRecord) -> int | None:
    """Output tokens that are the answer: all of them, less those streamed as reasoning."""
    if r.output_tokens is None:
        return None
    return r.output_tokens - (r.reasoning_tokens or 0)


def e2e(r: RequestRecord) -> float | None:
    """End-to-end latency: arrival of the end of the response minus the latency clock's origin."""
    if r.end is None or r.start is None:
        return None
    return r.end - r.start


def tpot(r: RequestRecord) -> float | None:
    """Time per output token after the first: (E2E - TTFT) / (output tokens - 1), as vLLM defines it."""
    t, e, n = ttft(r), e2e(r), r.output_tokens
    if t is None or e is None or n is None or n < 2:
        return None
    return (e - t) / (n - 1)


def e2e_per_output_token(r: RequestRecord) -> float | None:
    """E2E / output tokens (what LLMPerf calls inter-token latency; it includes the first token's wait)."""
    e, n = e2e(r), r.output_tokens
    if e is None or not n:
        return None
    return e / n


def output_tokens_per_s_per_user(r: RequestRecord) -> float | None:
    """The decode speed one user sees: (output tokens - 1) / (E2E - TTFT) = 1 / TPOT."""
    t = tpot(r)
    return None if t is None or t <= 0 else 1.0 / t


def client_delay(r: RequestRecord) -> float | None:
    """Open loop only: how late the client actually sent a request after its scheduled time."""
    if r.scheduled is None or r.sent is None:
        return None
    return r.sent - r.scheduled


def itl_samples(r: RequestRecord) -> np.ndarray:
    """Inter-token latency, one sample per token after the first. A chunk carrying k tokens that arrived `gap`
    after the previous token-carrying chunk contributes k samples of gap/k; the first chunk's extra k-1 tokens
    arrived with the first token and contribute k-1 zeros. So a request yields output tokens - 1 samples whose
    sum is the time from first to last token."""
    times = np.asarray(r.chunk_times, dtype=np.float64)
    toks = np.asarray(r.chunk_tokens, dtype=np.int64)
    keep = toks > 0
    times, toks = times[keep], toks[keep]
    if toks.size == 0:
        return np.empty(0)
    gaps = np.diff(times)
    later = np.repeat(gaps / toks[1:], toks[1:])
    return np.concatenate([np.zeros(int(toks[0]) - 1), later])


def inter_chunk_samples(r: RequestRecord) -> np.ndarray:
    """Inter-chunk latency: gaps between consecutive token-carrying chunks, one sample per gap."""
    times = np.asarray(r.chunk_times, dtype=np.float64)[np.asarray(r.chunk_tokens, dtype=np.int64) > 0]
    return np.diff(times)


# name -> per-request function; the order is the order of the report's table.
PER_REQUEST = {
    "ttft": ttft,
    "ttft_reasoning": ttft_reasoning,
    "ttft_content": ttft_content,
    "tpot": tpot,
    "e2e": e2e,
    "e2e_per_output_token": e2e_per_output_token,
    "output_tokens_per_s_per_user": output_tokens_per_s_per_user,
    "client_delay": client_delay,
}
PER_TOKEN = {"itl": itl_samples, "inter_chunk": inter_chunk_samples}
TIME_METRICS = ("ttft", "ttft_reasoning", "ttft_content", "tpot", "itl", "inter_chunk", "e2e", "e2e_per_output_token", "client_delay")


def stats(values: np.ndarray | list[float]) -> dict:
    """count, mean, population std, min, p50/p90/p95/p99 (numpy's linear interpolation between closest ranks),
    max, and the 0..100% quantiles for CDF plots. Empty input gives count 0 and None elsewhere."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {"count": 0, "mean": None, "std": None, "min": None, **{f"p{p}": None for p in PERCENTILES},
                "max": None, "cdf": []}
    q = np.percentile(a, np.linspace(0, 100, CDF_POINTS))
    out = {"count": int(a.size), "mean": float(a.mean()), "std": float(a.std()), "min": float(a.min())}
    out.update({f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES})
    out["max"] = float(a.max())
    out["cdf"] = [float(x) for x in q]
    return out


def collect(records: list[RequestRecord]) -> dict[str, np.ndarray]:
    """Every metric's samples over the given (successful) records."""
    out: dict[str, np.ndarray] = {}
    for name, fn in PER_REQUEST.items():
        vals = [v for v in (fn(r) for r in records) if v is not None]
        out[name] = np.asarray(vals, dtype=np.float64)
    for name, fn in PER_TOKEN.items():
        parts = [fn(r) for r in records]
        out[name] = np.concatenate(parts) if parts else np.empty(0)
    return out
