"""A run's summary: the single source of truth that the table, CSV, HTML and `compare` are views of."""

from __future__ import annotations

from collections import Counter

import numpy as np

from inferlab.bench import metrics, slo
from inferlab.bench.records import RequestRecord

TIMELINE_BUCKETS = 200
MAX_SPANS = 2000  # requests drawn one by one in the report's timeline; more are sampled evenly


def summarize(
    records: list[RequestRecord],
    *,
    load: dict,
    slos: dict[str, float] | None = None,
    slo_percentile: str = "p99",
    cache_free: bool = False,
    interrupted: bool = False,
    warnings: list[str] | None = None,
) -> dict:
    """Summarise one load point. Warmup requests and those cut by an interrupt are left out of every
    statistic; failed requests are counted by kind and left out of latency statistics."""
    cancelled = [r for r in records if r.error_kind == "cancelled"]
    warm = [r for r in records if r.warmup and r.error_kind != "cancelled"]
    measured = [r for r in records if not r.warmup and r.error_kind != "cancelled"]
    ok = [r for r in measured if r.ok]
    failed = [r for r in measured if not r.ok]

    start, end = _window(measured)
    duration = max(end - start, 0.0) if measured else 0.0
    samples = metrics.collect(ok)
    in_tokens = [r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in ok]
    in_tokens = [t for t in in_tokens if t is not None]
    out_tokens = [r.output_tokens for r in ok if r.output_tokens is not None]
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)

    summary: dict = {
        "load": load,
        "interrupted": interrupted,
        "window": {"start": start, "end": end, "duration": duration},
        "counts": {
            "measured": len(measured),
            "completed": len(ok),
            "failed": len(failed),
            "cancelled": len(cancelled),
            "warmup": len(warm),
            "error_rate": len(failed) / len(measured) if measured else 0.0,
        },
        "throughput": {
            "requests_per_s": per_s(len(ok)),
            "input_tokens_per_s": per_s(sum(in_tokens)),
            "output_tokens_per_s": per_s(sum(out_tokens)),
            "total_tokens_per_s": per_s(sum(in_tokens) + sum(out_tokens)),
        },
        "latency": {name: metrics.stats(samples[name]) for name in metrics.TIME_METRICS},
        "per_user": {"output_tokens_per_s": metrics.stats(samples["output_tokens_per_s_per_user"])},
        "tokens": _tokens(ok, in_tokens, out_tokens),
        "errors": _errors(failed),
        "goodput": None,
        "slo_gate": None,
        "timeline": _timeline([r for r in records if r.error_kind != "cancelled"]),
        "requests": _request_spans(measured),
        "reasoning": _reasoning(ok),
        "by_turn": _by_turn(ok),
        "warnings": list(warnings or []),
    }
    if slos:
        good = sum(1 for r in measured if slo.meets(r, slos))
        summary["goodput"] = {
            "slos": slos,
            "good": good,
            "total": len(measured),
            "requests_per_s": per_s(good),
            "share": good / len(measured) if measured else 0.0,
        }
        misses = slo.gate(summary, slos, slo_percentile)
        summary["slo_gate"] = {"percentile": slo_percentile, "passed": not misses, "misses": misses,
                               **slo.margin(samples, slos, slo_percentile)}
    summary["warnings"] += _warnings(ok, summary, cache_free)
    return summary


def _window(measured: list[RequestRecord]) -> tuple[float, float]:
    """From the first measured request's latency origin to the last byte any measured request received."""
    starts = [r.start for r in measured if r.start is not None]
    ends = [_last_seen(r) for r in measured]
    ends = [e for e in ends if e is not None]
    if not starts:
        return 0.0, 0.0
    return min(starts), max(ends) if ends else min(starts)


def _last_seen(r: RequestRecord) -> float | None:
    if r.end is not None:
        return r.end
    if r.chunk_times:
        return r.chunk_times[-1]
    return r.sent


def _tokens(ok: list[RequestRecord], in_tokens: list[int], out_tokens: list[int]) -> dict:
    offsets = [r.prompt_tokens - r.input_len for r in ok if r.prompt_tokens is not None and r.input_len is not None]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    reported = [r.prompt_tokens for r in ok if r.prompt_tokens is not None and r.cached_tokens is not None]
    return {
        "input": metrics.stats(in_tokens),
        "output": metrics.stats(out_tokens),
        "input_total": int(sum(in_tokens)),
        "output_total": int(sum(out_tokens)),
        "input_source": "server" if all(r.prompt_tokens is not None for r in ok) and ok else "requested",
        "token_source": dict(Counter(r.token_source for r in ok)),
        # server prompt tokens - requested prompt tokens: the chat template and special tokens, plus any drift
        "prompt_offset": metrics.stats(offsets),
        "cached_total": int(sum(cached)) if cached else None,
        "cached_share": (sum(cached) / sum(reported)) if cached and sum(reported) else None,
    }


def _errors(failed: list[RequestRecord]) -> dict:
    out: dict[str, dict] = {}
    for r in failed:
        e = out.setdefault(r.error_kind or "unknown", {"count": 0, "sample": r.error})
        e["count"] += 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["count"]))


def _timeline(records: list[RequestRecord]) -> dict:
    """Requests in flight and output tokens/s over time, in TIMELINE_BUCKETS buckets of the run clock."""
    spans = [(r.sent, _last_seen(r)) for r in records if r.sent is not None]
    if not spans:
        return {"bucket_s": 0.0, "t": [], "concurrency": [], "output_tokens_per_s": []}
    t0 = min(s for s, _ in spans)
    t1 = max(e for _, e in spans if e is not None)
    width = max((t1 - t0) / TIMELINE_BUCKETS, 1e-3)
    edges = t0 + width * np.arange(TIMELINE_BUCKETS + 1)
    mids = (edges[:-1] + edges[1:]) / 2
    sent = np.array([s for s, _ in spans])
    done = np.array([e if e is not None else t1 for _, e in spans])
    in_flight = (np.searchsorted(np.sort(sent), mids, side="right") - np.searchsorted(np.sort(done), mids, side="right"))
    n = [min(len(r.chunk_times), len(r.chunk_tokens)) for r in records]
    times = np.concatenate([np.asarray(r.chunk_times[:k], dtype=np.float64) for r, k in zip(records, n)])
    toks = np.concatenate([np.asarray(r.chunk_tokens[:k], dtype=np.float64) for r, k in zip(records, n)])
    hist, _ = np.histogram(times, bins=edges, weights=toks)
    return {
        "bucket_s": width,
        "t": [float(x) for x in mids],
        "concurrency": [int(x) for x in in_flight],
        "output_tokens_per_s": [float(x) for x in hist / width],
    }


def _warnings(ok: list[RequestRecord], s: dict, cache_free: bool) -> list[str]:
    out = []
    short = [r for r in ok if r.output_len and r.output_tokens is not None and r.output_tokens < r.output_len]
    if short:
        reasons = Counter(r.finish_reason for r in short).most_common(1)[0][0]
        out.append(
            f"{len(short)} of {len(ok)} requests stopped before their requested output length "
            f"(finish_reason {reasons!r}): the server may not honour ignore_eos; TPOT and throughput are for "
            f"shorter outputs than asked"
        )
    off = s["tokens"]["prompt_offset"]
    # a conversation's chat template adds tokens per message, so its offset grows with the turn by design
    if off["count"] and off["max"] - off["min"] > 2 and not any(r.turn is not None for r in ok):
        out.append(
            f"real prompt lengths drift from the requested ones: the server counted between {off['min']:+.0f} and "
            f"{off['max']:+.0f} tokens more than asked; use --tokenizer with the server's own tokenizer"
        )
    share = s["tokens"]["cached_share"]
    if cache_free and share is not None and share > 0.1:
        out.append(
            f"the server's prefix cache served {share:.0%} of prompt tokens on a workload meant to be cache-free: "
            f"results are faster than cold prompts would be (repeated prompts, or a warm cache from an earlier run)"
        )
    cd = s["latency"]["client_delay"]
    if cd["count"] and cd["p99"] is not None and cd["p99"] > 0.010:
        out.append(
            f"the client fell behind its schedule (client delay p99 {cd['p99'] * 1e3:.1f} ms); latencies include "
            f"this delay, but the offered load was lower than asked: consider --workers"
        )
    if s["tokens"]["token_source"].get("chunks"):
        out.append(
            "some output was counted one token per chunk (no usage from the server and no tokenizer): "
            "ITL is per chunk for those requests"
        )
    return out


def _request_spans(measured: list[RequestRecord]) -> dict:
    """Each measured request's start, first token and end (run clock, seconds), for the report's timeline of
    requests; at most MAX_SPANS of them, evenly sampled, in start order. A failed request has no first token
    and ends at the last byte it received."""
    rs = sorted((r for r in measured if r.start is not None), key=lambda r: r.start)
    step = max(1, -(-len(rs) // MAX_SPANS))
    rs = rs[::step]
    firsts = [metrics.ttft(r) for r in rs]
    return {"sampled_every": step,
            "start": [round(r.start, 6) for r in rs],
            "first_token": [None if f is None else round(r.start + f, 6) for r, f in zip(rs, firsts)],
            "end": [None if (e := _last_seen(r)) is None else round(e, 6) for r in rs],
            "ok": [r.ok for r in rs]}


def _reasoning(ok: list[RequestRecord]) -> dict | None:
    """Reasoning and answer token counts of the requests whose server streamed reasoning apart."""
    rs = [r for r in ok if r.reasoning]
    if not rs:
        return None
    return {"requests": len(rs),
            "reasoning_tokens": metrics.stats([r.reasoning_tokens or 0 for r in rs]),
            "answer_tokens": metrics.stats([metrics.answer_tokens(r) for r in rs if r.output_tokens is not None])}


def _by_turn(ok: list[RequestRecord]) -> list[dict] | None:
    """Conversations: TTFT, ITL and prompt size per turn index (turn 1 is a session's first request)."""
    turns = sorted({r.turn for r in ok if r.turn is not None})
    if not turns:
        return None
    out = []
    for t in turns:
        rs = [r for r in ok if r.turn == t]
        samples = metrics.collect(rs)
        prompt = [r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in rs]
        cached = [r.cached_tokens for r in rs if r.cached_tokens is not None]
        out.append({"turn": t, "count": len(rs),
                    "ttft": _brief(metrics.stats(samples["ttft"])), "itl": _brief(metrics.stats(samples["itl"])),
                    "tpot": _brief(metrics.stats(samples["tpot"])),
                    "input_tokens_mean": float(np.mean([p for p in prompt if p is not None])) if any(
                        p is not None for p in prompt) else None,
                    "cached_tokens_mean": float(np.mean(cached)) if cached else None})
    return out


def _brief(st: dict) -> dict:
    return {k: v for k, v in st.items() if k != "cdf"}
