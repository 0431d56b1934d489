"""Hypotheses about a serving bottleneck from bench results: symptom -> likely causes -> the measurement that
would confirm each -> the next experiment.

These are hypotheses, not findings: latency symptoms have several causes each, and only the named measurement
tells them apart. A rule fires on a symptom; where the results already hold the confirming measurement (scraped
server metrics), the hypothesis says so and cites it.

"Poor" needs a reference. With objectives (from the results' SLOs or a card), poor means over the limit. With a
sweep (several load points), poor means grown by more than DEGRADED times from the lightest load. A single run
without objectives gives only the load-independent checks (errors, client delay, tails, KV pressure).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inferlab.common.units import format_ms

DEGRADED = 2.0  # a latency that grew this many times from the lightest load point counts as degraded
TAIL_RATIO = 4.0  # p99 / p50 above this is a heavy tail
PLATEAU = 1.10  # throughput that rose less than 10% between the two heaviest points has stopped rising


@dataclass(slots=True)
class RunView:
    """What the rules read from one load point. Built by `runs_from_results`, the one place that knows the
    bench results format."""

    label: str
    load: float | None  # concurrency or rate, whichever the run varied; None if unknown
    latency: dict[str, dict]  # metric -> bench stats (p50, p90, p99, ...), seconds
    requests_per_s: float | None = None
    output_tokens_per_s: float | None = None
    error_rate: float = 0.0
    errors: dict[str, dict] = field(default_factory=dict)  # kind -> {count, sample}
    input_mean: float | None = None
    output_mean: float | None = None
    cached_share: float | None = None
    goodput_share: float | None = None
    slos: dict[str, float] = field(default_factory=dict)  # per-request limits the run used, seconds
    warnings: list[str] = field(default_factory=list)
    server: dict[str, float] = field(default_factory=dict)  # normalised scraped metrics, see _server_metrics
    machine: dict = field(default_factory=dict)  # bench's CPU accounting of the load point (bench/machine.py)

    def stat(self, metric: str, key: str = "p50") -> float | None:
        return (self.latency.get(metric) or {}).get(key)


@dataclass(slots=True)
class Hypothesis:
    title: str
    symptom: str
    causes: list[str]  # candidate explanations, most likely first
    evidence: list[str]  # measurements already in the results that bear on it
    confirm: str  # the measurement that would confirm or refute it
    next_experiment: str
    vary: str | None = None  # a suggested `inferlab experiment --vary` axis
    supported: bool = False  # the results already hold evidence for it (beyond the symptom)


@dataclass(slots=True)
class Diagnosis:
    runs: list[RunView]
    hypotheses: list[Hypothesis]
    reference: str  # how "poor" was judged
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return {"disclaimer": DISCLAIMER, "reference": self.reference, "notes": self.notes,
                "hypotheses": [asdict(h) for h in self.hypotheses],
                "runs": [{"label": r.label, "load": r.load} for r in self.runs]}


DISCLAIMER = ("These are hypotheses drawn from symptoms, not conclusions. Each names the measurement that would "
              "confirm or refute it; run that before acting on it.")


# --- the adapter: bench results -> RunView ---------------------------------------------------------------------

_SERVER_KEYS = {
    # normalised name -> accepted source names: bench's scrape summary (bench/scrape.py), vLLM metric names, or
    # already-normalised values
    "queue_time_mean": ("queue_time_mean", "queue_time_mean_s", "vllm:request_queue_time_seconds"),
    "prefill_time_mean": ("prefill_time_mean", "prefill_time_mean_s", "vllm:request_prefill_time_seconds"),
    "kv_cache_usage": ("kv_cache_usage", "vllm:kv_cache_usage_perc"),
    "preemptions": ("preemptions", "vllm:num_preemptions", "vllm:num_preemptions_total"),
    "num_waiting": ("num_waiting", "requests_waiting", "vllm:num_requests_waiting"),
    "num_running": ("num_running", "requests_running", "vllm:num_requests_running"),
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate",),
    "prefix_cache_hits": ("prefix_cache_hits", "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total"),
    "prefix_cache_queries": ("prefix_cache_queries", "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total"),
    "step_time_mean": ("step_time_mean",),
}


def _number(v) -> float | None:
    """A scraped value: a number; a gauge sampled over the run {mean, max} (-> max: pressure shows at the peak);
    a histogram {sum, count} (-> mean); or a counter {delta}."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, dict):
        if "sum" in v and "count" in v:
            return v["sum"] / v["count"] if v["count"] else None
        for k in ("max", "delta", "mean", "after", "value"):
            if k in v:
                return _number(v[k])
    return None


def _server_metrics(raw: dict | None) -> dict[str, float]:
    out: dict[str, float] = {}
    if not raw:
        return out
    for name, sources in _SERVER_KEYS.items():
        for src in sources:
            if src in raw and (v := _number(raw[src])) is not None:
                out[name] = v
                break
    if "prefix_cache_hit_rate" not in out and out.get("prefix_cache_queries"):
        out["prefix_cache_hit_rate"] = out.get("prefix_cache_hits", 0.0) / out["prefix_cache_queries"]
    # inferlab's own engine counters, as bench's scrape reports every counter that moved
    delta = raw.get("counters_delta") or raw
    steps = _number(delta.get("inferlab:engine_steps_total", delta.get("inferlab:engine_steps")))
    secs = _number(delta.get("inferlab:engine_step_seconds_total", delta.get("inferlab:engine_step_seconds")))
    if "step_time_mean" not in out and steps and secs is not None:
        out["step_time_mean"] = secs / steps
    return out


def _load_value(load: dict) -> float | None:
    for k in ("concurrency", "rate", "value"):
        v = load.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v != float("inf"):
            return float(v)
    return None


def runs_from_results(results: dict) -> list[RunView]:
    """Bench's results.json (one run, or a sweep under "runs") -> one RunView per load point, lightest first."""
    runs = results.get("runs") or [results]
    views = []
    for i, r in enumerate(runs):
        load = r.get("load") or {}
        tokens = r.get("tokens") or {}
        good = r.get("goodput") or {}
        server = r.get("server_metrics") or (results.get("server_metrics") if len(runs) == 1 else None)
        views.append(RunView(
            label=str(load.get("label", i)), load=_load_value(load), latency=r.get("latency") or {},
            requests_per_s=(r.get("throughput") or {}).get("requests_per_s"),
            output_tokens_per_s=(r.get("throughput") or {}).get("output_tokens_per_s"),
            error_rate=(r.get("counts") or {}).get("error_rate", 0.0), errors=r.get("errors") or {},
            input_mean=(tokens.get("input") or {}).get("mean"), output_mean=(tokens.get("output") or {}).get("mean"),
            cached_share=tokens.get("cached_share"), goodput_share=good.get("share"),
            slos=dict(good.get("slos") or {}), warnings=list(r.get("warnings") or []),
            server=_server_metrics(server), machine=dict(r.get("machine") or {}),
        ))
    if all(v.load is not None for v in views):
        views.sort(key=lambda v: v.load)
    return views


# --- rules ---------------------------------------------------------------------------------------------------


class _Judge:
    """Decides whether a latency metric is poor at the heaviest load point, and says why."""

    def __init__(self, runs: list[RunView], objectives: dict[str, dict[str, float]]):
        self.runs, self.obj = runs, objectives
        self.first, self.last = runs[0], runs[-1]
        self.sweep = len(runs) >= 2

    def poor(self, metric: str) -> tuple[bool | None, str]:
        targets = self.obj.get(metric)
        if targets:
            for key, limit in sorted(targets.items(), key=lambda kv: -_rank(kv[0])):
                v = self.last.stat(metric, key)
                if v is not None and v > limit:
                    return True, f"{metric} {key} {format_ms(v)} > objective {format_ms(limit)}"
            key = max(targets, key=_rank)
            return False, f"{metric} {key} {format_ms(self.last.stat(metric, key))} within objective {format_ms(targets[key])}"
        if self.sweep:
            a, b = self.first.stat(metric), self.last.stat(metric)
            if a and b is not None:
                grew = b / a
                verdict = grew > DEGRADED
                return verdict, (f"{metric} p50 {format_ms(a)} at load {self.first.label} -> {format_ms(b)} at load "
                                 f"{self.last.label} (x{grew:.1f})")
        return None, f"{metric} p50 {format_ms(self.last.stat(metric))} (no objective or sweep to judge it by)"


def _rank(key: str) -> float:
    return {"mean": 50.0, "max": 100.0}.get(key, float(key[1:]) if key.startswith("p") else 0.0)


def diagnose(results: dict, objectives: dict[str, dict[str, float]] | None = None,
             prefix_share: float = 0.0) -> Diagnosis:
    """Apply the rules to bench results. `objectives`: metric -> {percentile: seconds} (a card's latency
    objectives); without them, the per-request SLOs the run used are taken at p99. `prefix_share`: the share of
    each prompt meant to be served from the prefix cache (a card's traffic.prefix.share)."""
    runs = runs_from_results(results)
    if not runs:
        raise ValueError("the results hold no runs")
    obj = dict(objectives or {})
    if not obj:
        obj = {m: {"p99": v} for m, v in runs[-1].slos.items()}
    judge = _Judge(runs, obj)
    reference = ("objectives: " + ", ".join(f"{m} {k} {format_ms(v)}" for m, t in obj.items() for k, v in t.items())
                 if obj else ("a sweep: change from the lightest load point" if judge.sweep else
                              "none (a single run without objectives: give --card or bench --slo, or sweep the load)"))
    hyps: list[Hypothesis] = []
    last = runs[-1]
    s = last.server
    ttft_bad, ttft_why = judge.poor("ttft")
    tpot_bad, tpot_why = judge.poor("tpot")
    if tpot_bad is None:
        tpot_bad, tpot_why = judge.poor("itl")

    # 1. High TTFT, normal (or unjudged) decode: the wait before the first token.
    if ttft_bad and not tpot_bad:
        ev = []
        q, pf = s.get("queue_time_mean"), s.get("prefill_time_mean")
        ttft_mean = last.stat("ttft", "mean")
        if q is not None and ttft_mean:
            ev.append(f"server queue time mean {format_ms(q)} = {q / ttft_mean:.0%} of TTFT mean {format_ms(ttft_mean)}")
        if pf is not None:
            ev.append(f"server prefill time mean {format_ms(pf)}")
        if s.get("num_waiting"):
            ev.append(f"up to {s['num_waiting']:.0f} requests waiting (server gauge, sampled during the run)")
        if last.input_mean:
            ev.append(f"prompts average {last.input_mean:.0f} tokens")
        causes = ["queueing: requests wait for a slot (max_num_seqs) or for KV blocks before prefill",
                  "long prompts: prefill time grows with prompt length",
                  "prefill starved by the token budget: chunked prefill of max_num_batched_tokens per step"]
        if q is not None and ttft_mean and q / ttft_mean > 0.5:
            causes.insert(0, causes.pop(0))
        elif pf is not None and ttft_mean and pf / ttft_mean > 0.5:
            causes.insert(0, causes.pop(1))
        hyps.append(Hypothesis(
            "high TTFT with normal decode speed: waiting or prefill" if tpot_bad is False else
            "high TTFT: waiting or prefill", f"{ttft_why}; {tpot_why}", causes, ev,
            "split TTFT into queue time and prefill time (vllm:request_queue_time_seconds and "
            "vllm:request_prefill_time_seconds via bench --scrape-metrics), and plot TTFT against prompt length "
            "from the per-request records",
            "if queueing: raise max_num_seqs or the KV cache, or shed load earlier (--max-queue); if prefill: "
            "vary max_num_batched_tokens and the input length",
            vary="max_num_batched_tokens=256,512,1024", supported=q is not None or pf is not None,
        ))

    # 2. Normal (or unjudged) TTFT, poor decode: each step is slow.
    if tpot_bad and not ttft_bad:
        ev = []
        if s.get("kv_cache_usage") is not None:
            ev.append(f"KV cache usage {s['kv_cache_usage']:.0%}")
        if s.get("preemptions"):
            ev.append(f"{s['preemptions']:.0f} preemptions during the run")
        if s.get("num_running"):
            ev.append(f"up to {s['num_running']:.0f} requests running (server gauge, sampled during the run)")
        if s.get("step_time_mean") is not None:
            ev.append(f"engine step mean {format_ms(s['step_time_mean'])}")
        kv_pressure = (s.get("kv_cache_usage") or 0) > 0.9 or (s.get("preemptions") or 0) > 0
        causes = ["decode is memory-bandwidth-bound: every step reads all weights (compare TPOT with "
                  "`inferlab fit`'s decode lower bound)",
                  "batch contention: more running sequences per step make each step longer",
                  "KV pressure: preemption and recomputation when the KV cache fills"]
        if kv_pressure:
            causes.insert(0, causes.pop(2))
        hyps.append(Hypothesis(
            "normal TTFT with slow decode: the step itself" if ttft_bad is False else "slow decode: the step itself",
            f"{tpot_why}; {ttft_why}", causes, ev,
            "compare TPOT p50 with `inferlab fit --concurrency N` decode lower bound (near it: bandwidth-bound); "
            "read vllm:kv_cache_usage_perc and vllm:num_preemptions; vary concurrency and watch TPOT",
            "vary quantization (fewer bytes per step) and max_num_seqs (smaller batches); with KV pressure, "
            "raise kv_cache_memory",
            vary="quantization=none,int8,int4", supported=bool(ev) and (kv_pressure or bool(s.get("step_time_mean"))),
        ))

    # 3. Both poor: either the server is saturated (requests queue) or every step is slow (nothing queues, yet
    # prefill and decode both crawl). Queueing evidence decides which hypothesis leads.
    if ttft_bad and tpot_bad:
        ev = []
        rps = [r.requests_per_s for r in runs if r.requests_per_s is not None]
        plateau = len(rps) >= 2 and rps[-1] < rps[-2] * PLATEAU
        if len(rps) >= 2:
            ev.append(f"throughput {rps[-2]:.2f} -> {rps[-1]:.2f} requests/s over the two heaviest load points"
                      + (" (stopped rising)" if plateau else ""))
        rejected = {k: v for k, v in last.errors.items() if "429" in k or "rate" in k or "reject" in k}
        if rejected:
            ev.append(f"admission control rejected requests: {rejected}")
        waiting, q = s.get("num_waiting"), s.get("queue_time_mean")
        if waiting:
            ev.append(f"up to {waiting:.0f} request(s) waiting (server gauge, sampled during the run)")
        ttft_mean = last.stat("ttft", "mean")
        queueing = (waiting or 0) > 1 or (q is not None and ttft_mean and q / ttft_mean > 0.5)
        saturation = Hypothesis(
            "TTFT and decode both degrade: the server is saturated", f"{ttft_why}; {tpot_why}",
            ["saturation: offered load beyond capacity, so queues grow without bound",
             "no admission control: the server accepts more than it can serve within the objectives"],
            ev,
            "sweep the load (bench --sweep) and find where throughput stops rising while latency keeps growing",
            "operate below the knee: set --max-queue so excess load is rejected quickly, add replicas, or "
            "raise capacity (quantization, max_num_seqs)",
            vary="max_num_seqs=8,16,32", supported=plateau or bool(rejected) or bool(queueing),
        )
        step_ev = []
        if s.get("step_time_mean") is not None:
            step_ev.append(f"engine step mean {format_ms(s['step_time_mean'])}")
        if q is not None:
            step_ev.append(f"server queue time mean {format_ms(q)}" + (f" of TTFT mean {format_ms(ttft_mean)}" if ttft_mean
                                                                 else ""))
        slow_steps = Hypothesis(
            "TTFT and decode both slow without queueing: every engine step is slow", f"{ttft_why}; {tpot_why}",
            ["the step is far from the hardware's limit (per-step overhead, kernels below the roofline)",
             "the model reads too many bytes per token for this machine's bandwidth",
             "other processes compete for the same cores or memory bandwidth"],
            step_ev,
            "compare TPOT p50 with `inferlab fit`'s decode lower bound for this batch (far above it: overhead or "
            "contention, not bandwidth); check the machine's load during the run; profile one engine step",
            "vary quantization (fewer bytes per step) and the thread count; rerun on an idle machine",
            vary="quantization=none,int8,int4", supported=not queueing and bool(step_ev),
        )
        hyps += [saturation, slow_steps] if queueing or plateau or rejected else [slow_steps, saturation]

    # 4. Throughput still rising while the tail breaks the objective: the batching policy.
    if judge.sweep:
        rps = [r.requests_per_s for r in runs if r.requests_per_s is not None]
        rising = len(rps) >= 2 and rps[-1] > rps[0] * PLATEAU
        tails = []
        for metric in ("ttft", "itl", "e2e"):
            p50, p99 = last.stat(metric, "p50"), last.stat(metric, "p99")
            limit = (obj.get(metric) or {}).get("p99")
            over = limit is not None and p99 is not None and p99 > limit
            heavy = p50 and p99 is not None and p99 / p50 > TAIL_RATIO
            if over or (heavy and not limit):
                tails.append(f"{metric} p99 {format_ms(p99)} vs p50 {format_ms(p50)}"
                             + (f" (objective {format_ms(limit)})" if limit else ""))
        if rising and tails:
            hyps.append(Hypothesis(
                "throughput still rises but the tail breaks: the batching policy",
                f"throughput {rps[0]:.2f} -> {rps[-1]:.2f} requests/s while " + "; ".join(tails),
                ["large prefill chunks stall the running decodes (one long step hits every stream's ITL)",
                 "the scheduler admits new requests ahead of running ones, trading tail latency for batch size"],
                [],
                "look for ITL spikes that coincide with prefills (inter-chunk max against prompt arrivals in the "
                "records); compare ITL p99 with max_num_batched_tokens halved",
                "vary max_num_batched_tokens (smaller prefill chunks) and max_num_seqs",
                vary="max_num_batched_tokens=128,256,512",
            ))

    # Load-independent checks. A busy machine comes first: it invalidates every other reading.
    busy = [r for r in runs if r.machine.get("contaminated")]
    if busy:
        worst = max(busy, key=lambda r: r.machine.get("foreign_cpu_share") or 0)
        m = worst.machine
        ev = [f"load point {r.label}: other processes used {r.machine['foreign_cpu_share']:.0%} of the machine's CPU"
              + (f", the server {r.machine['server_cpu_share']:.0%}" if r.machine.get("server_cpu_share") is not None
                 else "") for r in busy]
        if m.get("cpu_pressure_some_avg") is not None:
            ev.append(f"CPU pressure (some) {m['cpu_pressure_some_avg']:.0f}% at load point {worst.label}")
        hyps.insert(0, Hypothesis(
            "the machine was busy: the results are contaminated",
            f"{len(busy)} of {len(runs)} load point(s) ran beside other CPU work",
            ["other processes (a compile, another benchmark, a noisy VM neighbour) took CPU from the server",
             "OpenMP threads that spin at barriers stall when a neighbour takes a core, far beyond the CPU lost"],
            ev,
            "rerun on a quiet machine and compare; `machine.foreign_cpu_share` in results.json must stay below 10%",
            "rerun the contaminated load points (inferlab experiment repeats them), or run bench and the server on "
            "a dedicated machine", supported=True,
        ))
    cd = (last.latency.get("client_delay") or {}).get("p99")
    bound = [r for r in runs if r.machine.get("client_bound")]
    if (cd is not None and cd > 0.010) or bound:
        hyps.append(Hypothesis(
            "the load generator fell behind",
            f"client delay p99 {format_ms(cd)} (requests sent late)" if cd is not None and cd > 0.010 else
            f"bench used {bound[-1].machine['bench_cpu_cores']:.2f} CPU cores at load point {bound[-1].label}",
            ["the client process is CPU-bound, so the offered load was lower than asked"],
            [f"load point {r.label}: bench used {r.machine['bench_cpu_cores']:.2f} CPU cores (client-bound)"
             for r in bound],
            "rerun with bench --workers 2 (or more) and compare client delay and latencies",
            "spread the load over worker processes; until then, latencies include client-side queueing",
            supported=True,
        ))
    if last.error_rate > 0:
        kinds = ", ".join(f"{k} x{v.get('count')}" for k, v in last.errors.items())
        causes = []
        if any("timeout" in k for k in last.errors):
            causes.append("requests exceed the server's or the client's timeout under this load")
        if any("429" in k or "reject" in k for k in last.errors):
            causes.append("admission control sheds load (a bounded queue is full)")
        if any("connect" in k or "disconnect" in k or "reset" in k for k in last.errors):
            causes.append("the server crashed or dropped connections (check its log and memory)")
        hyps.append(Hypothesis(
            "requests fail", f"error rate {last.error_rate:.1%} ({kinds})",
            causes or ["see the sample messages in the results' errors section"], [],
            "read the server log around the first failure; rerun at lower load to see if errors vanish",
            "fix the failure before tuning latency: failed requests are left out of the latency statistics",
            supported=True,
        ))
    for r in runs:
        if any("stopped before their requested output length" in w for w in r.warnings):
            hyps.append(Hypothesis(
                "outputs shorter than asked", f"run {r.label}: outputs ended early",
                ["the server ignores ignore_eos, so TPOT and throughput describe shorter outputs"], [],
                "compare requested and received output lengths in the records",
                "use a server that honours ignore_eos, or compare runs only at equal output lengths",
                supported=True,
            ))
            break
    hit = s.get("prefix_cache_hit_rate", last.cached_share)
    if prefix_share > 0.05 and hit is not None and hit < prefix_share / 4:
        hyps.append(Hypothesis(
            "the shared prefixes are not served from cache",
            f"{prefix_share:.0%} of each prompt is a shared prefix, but the prefix cache served {hit:.0%}",
            ["prefix caching is off (enable_prefix_caching)", "the cache evicts prefixes before reuse (too little "
             "KV memory for the number of groups)", "tenants are isolated, so groups do not share"], [],
            "read vllm:prefix_cache_hits / vllm:prefix_cache_queries over a run with one prefix group",
            "vary enable_prefix_caching and kv_cache_memory", vary="enable_prefix_caching=true,false",
            supported=True,
        ))
    notes = []
    if not any(r.server for r in runs):
        notes.append("no scraped server metrics in the results: rerun bench with --scrape-metrics to confirm "
                     "queueing, KV pressure and preemptions directly")
    if not hyps:
        notes.append("no symptom matched a rule: the run meets its objectives, or there is nothing to judge "
                     "it by (" + reference + ")")
    return Diagnosis(runs, hyps, reference, notes)
