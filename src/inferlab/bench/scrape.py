"""--scrape-metrics: read the server's Prometheus /metrics before, during and after a run.

Counters (preemptions, prefix-cache hits and queries, queue-time sums) are differenced between the first and
last scrape; gauges (KV-cache usage, requests waiting and running) are sampled every interval. Names are
matched without their namespace, so vLLM's `vllm:`, SGLang's `sglang:` and inferlab's own series all work.
"""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

# our name -> the unprefixed series names servers use for it, first match wins
COUNTERS = {
    "preemptions": ("num_preemptions_total", "num_preemption_total", "preemptions_total"),
    "prefix_cache_hits": ("prefix_cache_hits_total", "gpu_prefix_cache_hits_total", "cache_hit_tokens_total"),
    "prefix_cache_queries": ("prefix_cache_queries_total", "gpu_prefix_cache_queries_total", "cache_query_tokens_total"),
    "queue_time_sum": ("request_queue_time_seconds_sum", "queue_time_seconds_sum"),
    "queue_time_count": ("request_queue_time_seconds_count", "queue_time_seconds_count"),
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
    return out


def _pick(sample: dict[str, float], names: tuple[str, ...]) -> float | None:
    for n in names:
        for key in (n, "inferlab_" + n):
            if key in sample:
                return sample[key]
    return None


class Scraper:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, interval: float = 1.0):
        self.session = session
        self.url = base_url.rstrip("/") + "/metrics"
        self.interval = interval
        self.samples: list[dict[str, float]] = []
        self.error: str | None = None
        self._task: asyncio.Task | None = None

    async def scrape(self) -> dict[str, float] | None:
        try:
            async with self.session.get(self.url) as resp:
                if resp.status != 200:
                    self.error = f"GET {self.url} answered HTTP {resp.status}"
                    return None
                sample = parse(await resp.text())
        except (aiohttp.ClientError, OSError, ValueError) as e:
            self.error = f"GET {self.url} failed: {e}"
            return None
        self.samples.append(sample)
        return sample

    async def start(self) -> None:
        await self.scrape()
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.scrape()

    async def stop(self) -> dict:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.scrape()
        return self.summary()

    def summary(self) -> dict:
        if len(self.samples) < 2:
            return {"source": self.url, "error": self.error or "fewer than two scrapes"}
        first, last = self.samples[0], self.samples[-1]
        out: dict = {"source": self.url, "scrapes": len(self.samples)}
        for name, keys in COUNTERS.items():
            a, b = _pick(first, keys), _pick(last, keys)
            out[name] = None if a is None or b is None else b - a
        if out["queue_time_count"]:
            out["queue_time_mean_s"] = out["queue_time_sum"] / out["queue_time_count"]
        if out["prefix_cache_queries"]:
            out["prefix_cache_hit_rate"] = out["prefix_cache_hits"] / out["prefix_cache_queries"]
        for name, keys in GAUGES.items():
            vals = [v for v in (_pick(s, keys) for s in self.samples) if v is not None]
            out[name] = {"mean": sum(vals) / len(vals), "max": max(vals)} if vals else None
        out["counters_delta"] = {k[8:]: last[k] - first.get(k, 0.0) for k in last
                                 if k.startswith("__raw__:") and k.endswith("_total") and last[k] != first.get(k, 0.0)}
        return out
