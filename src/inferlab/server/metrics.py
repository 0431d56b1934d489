"""Prometheus metrics under vLLM v1's names and labels, so existing vLLM dashboards work unchanged.

Gauges and engine counters are read from the latest EngineStats snapshot at scrape time (a custom collector), so
the engine loop never touches Prometheus. Per-request histograms are observed when a request finishes, from the
engine's own timestamps. What vLLM lacks carries the `inferlab:` prefix.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inferlab.engine.cpu_threads import FALLBACK_REASONS
from inferlab.engine.outputs import EngineStats, RequestMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM v1's buckets (vllm/v1/metrics/loggers.py); ITL and TTFT get a few finer ones below 10 ms for small models.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0]
_QUEUE_BUCKETS = [0.001, 0.005, 0.01, 0.05, 0.1] + _REQUEST_BUCKETS

LABELS = ["model_name", "engine"]
# inferlab:requests_rejected_total{reason}: refused before reaching the engine (docs/metrics.md).
REJECT_REASONS = ("queue_full", "invalid", "unauthorized", "body_too_large")
# inferlab:request_errors_total{stage}: tokenize (prompt/chat template, server pool), add (engine admission),
# sample, detokenize (incl. stop checks), engine (in flight when the engine stopped), shutdown (a second signal).
ERROR_STAGES = ("tokenize", "add", "sample", "detokenize", "engine", "shutdown")


class ServerMetrics:
    def __init__(self, model_name: str):
        disable_created_metrics()  # as vLLM: no `_created` series beside every counter and histogram
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name, "engine": "0"}
        lv = (model_name, "0")
        r = self.registry

        def hist(name: str, doc: str, buckets: list[float]):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*lv)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _REQUEST_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                          _QUEUE_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.", _REQUEST_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                            _REQUEST_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                           _REQUEST_BUCKETS)
        self.prompt_len = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", _pow125(1 << 20))
        self.gen_len = hist("vllm:request_generation_tokens", "Number of generation tokens processed.", _pow125(1 << 20))
        self.param_max_tokens = hist("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                     _pow125(1 << 20))
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                LABELS + ["finished_reason"], registry=r)
        self._success_by_reason = {
            reason: self._success.labels(*lv, reason) for reason in ("stop", "length", "abort", "error")
        }
        self._rejected = Counter("inferlab:requests_rejected", "Requests refused before reaching the engine.",
                                 LABELS + ["reason"], registry=r)
        self._rejected_by_reason = {reason: self._rejected.labels(*lv, reason) for reason in REJECT_REASONS}
        self._errors = Counter("inferlab:request_errors", "Accepted requests that failed on the server (a 5xx or an "
                               "error event), by the stage that failed.", LABELS + ["stage"], registry=r)
        self._errors_by_stage = {stage: self._errors.labels(*lv, stage) for stage in ERROR_STAGES}
        self.timeouts = Counter("inferlab:request_timeouts", "Requests aborted by --request-timeout.", LABELS,
                                registry=r).labels(*lv)
        self.engine = _EngineCollector(self.labels)
        r.register(self.engine)

    def request_finished(self, finish_reason: str, m: RequestMetrics | None, num_prompt: int, num_output: int,
                         max_tokens: int) -> None:
        self._success_by_reason.get(finish_reason, self._success_by_reason["error"]).inc()
        self.prompt_len.observe(num_prompt)
        self.gen_len.observe(num_output)
        self.param_max_tokens.observe(max_tokens)
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        t = m.token_times
        # Once per request, not per step: the engine keeps the timestamps, so the hot loop stays untouched.
        for a, b in zip(t, t[1:]):
            self.itl.observe(b - a)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.inference.observe(m.finished_time - m.first_scheduled_time)
            if m.first_token_time is not None:
                self.decode.observe(m.finished_time - m.first_token_time)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                self.prefill.observe(m.first_token_time - m.first_scheduled_time)

    def rejected(self, reason: str) -> None:
        self._rejected_by_reason[reason].inc()

    def request_failed(self, stage: str | None, n: int = 1) -> None:
        self._errors_by_stage.get(stage or "engine", self._errors_by_stage["engine"]).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Reads the engine's last published EngineStats at scrape time."""

    def __init__(self, labels: dict[str, str]):
        self.labels = labels
        self.stats = EngineStats()
        self.extra_gauges: dict[str, float] = {}  # set by the server: queue depth, in flight
        self.block_size = 0  # set by the server: vllm:cache_config_info's block_size (0: not exported)
        self.started = time.time()

    def collect(self) -> Iterator[Metric]:
        """Disaggregated serving (server/disagg_engine.py) reports each worker's stats apart: every engine series
        then carries a `role` label (prefill, decode); summing over it gives the server's totals."""
        top = self.stats
        parts = list(top.by_role.items()) or [(None, top)]
        names = list(self.labels) + (["role"] if top.by_role else [])
        values = list(self.labels.values())

        def family(kind, name: str, doc: str, value: Callable[[EngineStats], float]) -> Metric:
            m = kind(name, doc, labels=names)
            for role, s in parts:
                m.add_metric(values + ([role] if role else []), value(s))
            return m

        def gauge(name: str, doc: str, value: Callable[[EngineStats], float]) -> Metric:
            return family(GaugeMetricFamily, name, doc, value)

        def counter(name: str, doc: str, value: Callable[[EngineStats], float]) -> Metric:
            return family(CounterMetricFamily, name, doc, value)

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", lambda s: s.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lambda s: s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda s: s.kv_cache_usage)
        # For inference gateways' endpoint pickers (docs/scaleout.md): vLLM v0's name of the same gauge, which
        # Gateway API Inference Extension releases before vLLM v1 read; LoRA info with no adapters (inferlab serves
        # none), so a picker configured for LoRA affinity finds the series it scrapes; the block size its
        # prefix-aware scorer needs.
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM v0's name of vllm:kv_cache_usage_perc).",
                    lambda s: s.kv_cache_usage)
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests (inferlab serves no "
                                 "adapters).", labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        lora.add_metric(["0", "", ""], self.started)
        yield lora
        if self.block_size:
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache config.",
                                     labels=["block_size", "num_gpu_blocks"])
            info.add_metric([str(self.block_size), str(top.num_kv_blocks)], 1.0)
            yield info
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", lambda s: s.num_preemptions_total)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", lambda s: s.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", lambda s: s.generation_tokens_total)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      lambda s: s.prefix_cache_queries_total)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      lambda s: s.prefix_cache_hits_total)
        yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", lambda s: s.spec_num_drafts_total)
        yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", lambda s: s.spec_num_draft_tokens_total)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                      lambda s: s.spec_num_accepted_tokens_total)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=names + ["position"])
        for role, s in parts:
            for pos, n in enumerate(s.spec_accepted_per_pos_total):
                per_pos.add_metric(values + ([role] if role else []) + [str(pos)], n)
        yield per_pos
        yield gauge("inferlab:num_kv_blocks", "KV blocks in the pool.", lambda s: s.num_kv_blocks)
        yield gauge("inferlab:num_free_kv_blocks", "KV blocks free (cached-but-unreferenced count as free).",
                    lambda s: s.num_free_kv_blocks)
        yield gauge("inferlab:kv_cache_bytes", "Bytes of the KV pool.", lambda s: s.kv_cache_bytes)
        yield gauge("inferlab:weight_bytes", "Bytes of model weights as loaded.", lambda s: s.weight_bytes)
        yield gauge("inferlab:packed_weight_bytes", "Bytes the packed weight copies for the CPU kernels add to "
                    "the weights, net of the plain weights they replace (--pack-weights).",
                    lambda s: s.packed_weight_bytes)
        rss = GaugeMetricFamily("inferlab:peak_rss_bytes", "Peak resident set size of the server process.",
                                labels=list(self.labels))
        rss.add_metric(values, _peak_rss_bytes())
        yield rss
        yield counter("inferlab:engine_steps", "Engine steps run.", lambda s: s.num_steps_total)
        yield counter("inferlab:engine_step_seconds", "Seconds spent inside engine.step().", lambda s: s.step_time_seconds_total)
        if top.kv_transfers_total or top.by_role:
            yield counter("inferlab:kv_transfers", "KV hand-offs between prefill and decode (prefill: sent, decode: "
                          "received).", lambda s: s.kv_transfers_total)
            yield counter("inferlab:kv_transfer_bytes", "KV bytes handed from prefill to decode (decode: blocks its "
                          "prefix cache held are not copied).", lambda s: s.kv_transfer_bytes_total)
            yield counter("inferlab:kv_transfer_seconds", "Seconds spent copying KV for hand-offs (prefill: into the "
                          "transfer buffer, decode: out of it).", lambda s: s.kv_transfer_seconds_total)
            yield counter("inferlab:kv_transfer_stalls", "Hand-offs the prefill side could not send at once for "
                          "want of transfer-buffer room (backpressure from decode).", lambda s: s.kv_transfer_stalls_total)
            yield gauge("inferlab:kv_transfer_pending", "Requests whose KV waits: to be sent (prefill), to be "
                        "admitted (decode).", lambda s: s.kv_transfer_pending)
            yield gauge("inferlab:kv_transfer_buffer_free_blocks", "Free blocks of the KV transfer buffer (reported "
                        "by prefill, which owns its free list; 0 on decode).", lambda s: s.kv_transfer_free_blocks)
        if top.cpu_threads:
            yield gauge("inferlab:cpu_threads", "Intra-op CPU threads the engine runs with now (fewer while the "
                        "machine is busy).", lambda s: s.cpu_threads)
            yield gauge("inferlab:cpu_threads_max", "CPU threads the engine returns to on a quiet machine (the "
                        "affinity mask and cgroup quota allow).", lambda s: s.cpu_threads_max)
            fb = CounterMetricFamily("inferlab:cpu_fallbacks", "Steps down to fewer CPU threads, by reason (stall, "
                                     "slow, contended).", labels=names + ["reason"])
            for role, s in parts:
                for reason in FALLBACK_REASONS:
                    fb.add_metric(values + ([role] if role else []) + [reason], s.cpu_fallbacks_total.get(reason, 0))
            yield fb
            yield counter("inferlab:cpu_recoveries", "Returns to more CPU threads once measured faster.",
                          lambda s: s.cpu_recoveries_total)
        for name, value in self.extra_gauges.items():  # the server's own: no role
            g = GaugeMetricFamily(name, _EXTRA_DOCS.get(name, name), labels=list(self.labels))
            g.add_metric(values, value)
            yield g


_EXTRA_DOCS = {
    "inferlab:num_requests_in_flight": "Requests accepted by the server and not yet finished.",
    "inferlab:max_queue": "The bound on waiting requests (--max-queue); beyond it requests get 429.",
}


def _peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _pow125(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to limit: vLLM's build_1_2_5_buckets."""
    out, mag = [], 1
    while True:
        for m in (1, 2, 5):
            if m * mag > limit:
                return out
            out.append(float(m * mag))
        mag *= 10
