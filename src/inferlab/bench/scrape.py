"""--scrape-metrics: read the server's Prometheus /metrics before, during and after a run.

Counters (preemptions, prefix-cache hits and queries, queue-time sums) are differenced between the first and
last scrape; gauges (KV-cache usage, requests waiting and running) are sampled every interval. Names are
matched without their namespace, so vLLM's `vllm:`, SGLang's `sglang:` and inferlab's own series all work.
A disaggregated server (`inferlab serve --disaggregate`) labels its engine series with `role` (prefill, decode):
the totals sum over roles, and `by_role` gives each role's counter differences and gauge maxima apart, with the
KV hand-offs' bytes and copy time.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

# our name -> the unprefixed series names servers use for it, first match wins
COUNTERS = {
    "preemptions": ("num_preemptions_total", "num_preemption_total", "preemptions_total"),
    "prefix_cache_hits": ("prefix_cache_hits_total", "gpu_prefix_cache_hits_total", "cache_hit_tokens_total"),
    "prefix_cache_queries": ("prefix_cache_queries_total", "gpu_prefix_cache_queries_total", "cache_query_tokens_total"),
    "kv_transfers": ("kv_transfers_total",),
    "kv_transfer_bytes": ("kv_transfer_bytes_total",),
    "kv_transfer_seconds": ("kv_transfer_seconds_total",),
}
# our name -> histogram family names (vLLM's; each exported as _bucket, _sum and _count series): the mean over
# the run is Δ_sum / Δ_count. vLLM observes these when a request finishes. Its queue time is the WAITING phase
# only: a request the scheduler admits at once but whose prefill waits behind other work shows it as prefill
# time, not queue time, so both are read.
HISTOGRAMS = {
    "queue_time": ("request_queue_time_seconds", "queue_time_seconds"),
    "prefill_time": ("request_prefill_time_seconds",),
    "decode_time": ("request_decode_time_seconds",),
    "inference_time": ("request_inference_time_seconds",),
    "ttft": ("time_to_first_token_seconds",),
    "e2e": ("e2e_request_latency_seconds",),
}
GAUGES = {
    "kv_cache_usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc", "token_usage", "kv_cache_usage"),
    "requests_waiting": ("num_requests_waiting", "num_queue_reqs", "requests_waiting"),
    "requests_running": ("num_requests_running", "num_running_reqs", "requests_running"),
}


def parse(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name without namespace: value summed over label sets}."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name.split(":", 1)[1] if ":" in s.name else s.name
            out[name] = out.get(name, 0.0) + float(s.value)
            out.setdefault("__raw__:" + s.name, 0.0)
            out["__raw__:" + s.name] += float(s.value)
            if "role" in s.labels:
                key = f"__role__:{s.labels['role']}:{name}"
                out[key] = out.get(key, 0.0) + float(s.value)
    return out


def _by_role(first: dict[str, float], samples: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per role: counters (`*_total`) as differences over the run, gauges as their maximum over the scrapes."""
    last = samples[-1]
    out: dict[str, dict[str, float]] = {}
    for key in last:
        if not key.startswith("__role__:"):
            continue
        _, role, name = key.split(":", 2)
        if name.endswith("_total"):
            value = last[key] - first.get(key, 0.0)
        elif name.endswith(("_bucket", "_sum", "_count")):
            continue
        else:
            value = max(s.get(key, 0.0) for s in samples)
        out.setdefault(role, {})[name] = value
    return out


def _pick(sample: dict[str, float], names: tuple[str, ...]) -> float | None:
    for n in names:
        for key in (n, "inferlab_" + n):
            if key in sample:
                return sample[key]
    return None


def _hist(sample: dict[str, float], names: tuple[str, ...]) -> tuple[float, float] | None:
    """(sum, count) of the first histogram family present."""
    for n in names:
        total, count = _pick(sample, (n + "_sum",)), _pick(sample, (n + "_count",))
        if total is not None and count is not None:
            return total, count
    return None


class Scraper:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, interval: float = 1.0):
        self.session = session
        self.url = base_url.rstrip("/") + "/metrics"
        self.interval = interval
        self.samples: list[dict[str, float]] = []
        self.times: list[float] = []  # perf_counter at each sample's answer
        self.error: str | None = None
        self._task: asyncio.Task | None = None

    async def scrape(self) -> dict[str, float] | None:
        try:
            async with self.session.get(self.url) as resp:
                if resp.status != 200:
                    self.error = f"GET {self.url} answered HTTP {resp.status}"
                    return None
                sample = parse(await resp.text())
                t = time.perf_counter()
        except (aiohttp.ClientError, OSError, ValueError) as e:
            self.error = f"GET {self.url} failed: {e}"
            return None
        self.samples.append(sample)
        self.times.append(t)
        return sample

    async def start(self) -> None:
        await self.scrape()
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.scrape()

    async def stop(self, t0: float | None = None) -> dict:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.scrape()
        return self.summary(t0)

    def summary(self, t0: float | None = None) -> dict:
        """Counter and histogram differences between the first and last scrape, gauges sampled, and `series`:
        every scrape on the run clock (seconds from `t0`, the run's clock origin) for the report's timeline."""
        if len(self.samples) < 2:
            return {"source": self.url, "error": self.error or "fewer than two scrapes"}
        first, last = self.samples[0], self.samples[-1]
        out: dict = {"source": self.url, "scrapes": len(self.samples)}
        # A labelled series appears at its first observation: one absent before the run started from zero
        # (a histogram whose label set was first observed during the run was read as unknown before).
        for name, keys in COUNTERS.items():
            a, b = _pick(first, keys), _pick(last, keys)
            out[name] = None if b is None else b - (a or 0.0)
        for name, keys in HISTOGRAMS.items():
            a, b = _hist(first, keys), _hist(last, keys)
            if b is None:
                continue
            a = a or (0.0, 0.0)
            total, count = b[0] - a[0], b[1] - a[1]
            out[f"{name}_sum"], out[f"{name}_count"] = total, count
            if count > 0:
                out[f"{name}_mean_s"] = total / count
        if by_role := _by_role(first, self.samples):
            out["by_role"] = by_role
        if out["prefix_cache_queries"]:
            out["prefix_cache_hit_rate"] = out["prefix_cache_hits"] / out["prefix_cache_queries"]
        for name, keys in GAUGES.items():
            vals = [v for v in (_pick(s, keys) for s in self.samples) if v is not None]
            out[name] = {"mean": sum(vals) / len(vals), "max": max(vals)} if vals else None
        out["counters_delta"] = {k[8:]: last[k] - first.get(k, 0.0) for k in last
                                 if k.startswith("__raw__:") and k.endswith("_total") and last[k] != first.get(k, 0.0)}
        if len(self.times) != len(self.samples):  # samples given without their times: no series
            return out
        origin = self.times[0] if t0 is None else t0
        series: dict[str, list] = {"t": [round(t - origin, 4) for t in self.times]}
        for name, keys in GAUGES.items():
            series[name] = [_pick(s, keys) for s in self.samples]
        hits = [_pick(s, COUNTERS["prefix_cache_hits"]) for s in self.samples]
        queries = [_pick(s, COUNTERS["prefix_cache_queries"]) for s in self.samples]
        if all(h is not None for h in hits) and all(q is not None for q in queries):
            # the hit rate between consecutive scrapes: what the cache did in that interval
            series["prefix_cache_hit_rate"] = [None] + [
                (h1 - h0) / (q1 - q0) if q1 > q0 else None
                for h0, h1, q0, q1 in zip(hits, hits[1:], queries, queries[1:])]
        out["series"] = series
        return out
