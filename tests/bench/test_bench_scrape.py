"""--scrape-metrics on vLLM's own exposition, written by prometheus_client exactly as vLLM registers its series
(histograms as _bucket/_sum/_count with engine and model_name labels, counters with _total)."""

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from inferlab.bench.scrape import Scraper, parse


class VLLM:
    def __init__(self):
        self.reg = CollectorRegistry()
        labels = ["model_name", "engine"]
        b = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0]
        self.queue = Histogram("vllm:request_queue_time_seconds", "WAITING phase", labels, buckets=b, registry=self.reg)
        self.prefill = Histogram("vllm:request_prefill_time_seconds", "PREFILL phase", labels, buckets=b,
                                 registry=self.reg)
        self.hits = Counter("vllm:prefix_cache_hits", "hits", labels, registry=self.reg)
        self.queries = Counter("vllm:prefix_cache_queries", "queries", labels, registry=self.reg)
        self.waiting = Gauge("vllm:num_requests_waiting", "waiting", labels, registry=self.reg)

    def text(self) -> str:
        return generate_latest(self.reg).decode()


def test_vllm_histograms_counters_and_gauges():
    v = VLLM()
    for engine in ("0", "1"):  # two engines: series are summed over label sets
        v.queue.labels("m", engine).observe(0.25)
        v.hits.labels("m", engine).inc(10)
        v.queries.labels("m", engine).inc(40)
    v.waiting.labels("m", "0").set(0)
    s = Scraper(None, "http://x")
    s.samples.append(parse(v.text()))
    s.times.append(100.0)
    # The prefill histogram has no series yet (a label set appears at its first observation): it counts from 0.
    assert "request_prefill_time_seconds_count" not in s.samples[0]
    # during the run: 4 requests queue 0.1, 0.2, 0.3 and 1.4 s, prefill 2 s each; 300 of 400 tokens hit
    for q in (0.1, 0.2, 0.3, 1.4):
        v.queue.labels("m", "0").observe(q)
        v.prefill.labels("m", "1").observe(2.0)
    v.hits.labels("m", "0").inc(300)
    v.queries.labels("m", "1").inc(400)
    v.waiting.labels("m", "0").set(3)
    s.samples.append(parse(v.text()))
    s.times.append(101.5)
    out = s.summary(t0=99.0)
    assert out["queue_time_count"] == 4 and out["queue_time_mean_s"] == pytest.approx(0.5)
    assert out["prefill_time_mean_s"] == pytest.approx(2.0)
    assert out["prefix_cache_hit_rate"] == pytest.approx(0.75)
    assert out["requests_waiting"] == {"mean": 1.5, "max": 3.0}
    assert out["series"]["t"] == [1.0, 2.5] and out["series"]["prefix_cache_hit_rate"] == [None, 0.75]


def test_role_labelled_series_are_summed_and_kept_apart_by_role():
    """inferlab serve --disaggregate: every engine series carries role=prefill|decode."""
    reg = CollectorRegistry()
    labels = ["model_name", "engine", "role"]
    gen = Counter("vllm:generation_tokens", "generated", labels, registry=reg)
    kv = Counter("inferlab:kv_transfer_bytes", "bytes", labels, registry=reg)
    secs = Counter("inferlab:kv_transfer_seconds", "s", labels, registry=reg)
    running = Gauge("vllm:num_requests_running", "running", labels, registry=reg)
    for role in ("prefill", "decode"):
        gen.labels("m", "0", role).inc(0)
        kv.labels("m", "0", role).inc(0)
        secs.labels("m", "0", role).inc(0)
    s = Scraper(None, "http://x")
    s.samples.append(parse(generate_latest(reg).decode()))
    gen.labels("m", "0", "prefill").inc(5)
    gen.labels("m", "0", "decode").inc(155)
    kv.labels("m", "0", "prefill").inc(1000)
    kv.labels("m", "0", "decode").inc(800)
    secs.labels("m", "0", "prefill").inc(0.5)
    running.labels("m", "0", "decode").set(7)
    s.samples.append(parse(generate_latest(reg).decode()))
    running.labels("m", "0", "decode").set(2)
    s.samples.append(parse(generate_latest(reg).decode()))
    out = s.summary()
    assert out["kv_transfer_bytes"] == 1800 and out["kv_transfer_seconds"] == pytest.approx(0.5)
    assert out["by_role"]["prefill"]["generation_tokens_total"] == 5
    assert out["by_role"]["decode"]["generation_tokens_total"] == 155
    assert out["by_role"]["decode"]["kv_transfer_bytes_total"] == 800
    assert out["by_role"]["decode"]["num_requests_running"] == 7  # the maximum over the scrapes
