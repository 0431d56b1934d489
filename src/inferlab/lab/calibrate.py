"""Calibrating the step-cost model, two ways.

(a) From inferlab's own engine, offline: a short profile that steps `LLMEngine` through prefill-only steps of
    several prompt lengths (past the step budget, so chunks too), decode batches of several sizes and contexts, and
    mixed steps; each step's features come from the batch the engine's scheduler returned (captured by wrapping the
    engine instance's `scheduler.schedule`, not by changing the engine) and its time is `engine.last_step_time`.
    Every coefficient is identifiable from such a design.
(b) Black-box, from `inferlab bench` results of any OpenAI-compatible server:
      - one stream (concurrency 1): each request's TTFT is its prompt's prefill steps (chunked by the step budget)
        plus the request overhead, and its TPOT is one decode step at its mean context;
      - concurrency c > 1: the run's median ITL is one decode step of c sequences at the mean context;
      - the same runs' throughput: their whole duration is the sum of their steps (about output tokens / c steps).
    Each measurement is a sum of step features, so the fit stays linear. The sampler's per-row cost cannot be told
    apart from a decode's from the outside (every decode samples one row), so it is folded into per_decode_seq.
(c) Served, from the step trace of inferlab's server under load (`inferlab serve --step-trace`, engine/step_trace.py):
    every step's batch and its period, from its start to the next step's start while the engine had work. It sees
    what the offline profile cannot: on a small CPU the server's HTTP and streaming work shares the cores with the
    forward (measured on the 2-core machine: a batch-1 decode step takes 8.4 ms offline and 11.9 ms served, the
    gap between steps adding 0.3 ms more), and it is fitted on the batches the workload really forms.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from inferlab.bench.records import read_records
from inferlab.engine.step_trace import BatchShape, read_step_trace
from inferlab.lab.simulator import EngineShape
from inferlab.lab.step_cost import StepCost, StepFeatures, batch_features, chunk_features, fit_step_cost, \
    FEATURES, shape_features, with_coefficients


# --- (a) the engine profile ------------------------------------------------------------------------------------

def profile_plan(max_num_seqs: int, budget: int) -> list[tuple[str, list[int], int]]:
    """Scenarios (label, prompt lengths, output tokens): prefills alone, decode batches, and mixes."""
    plan: list[tuple[str, list[int], int]] = []
    for p in sorted({16, 64, 128, 256, min(512, budget), budget + budget // 2}):
        plan.append((f"prefill {p}", [p], 2))
    b = 1
    while b <= max_num_seqs:
        for ctx in (32, 512):
            plan.append((f"decode {b} x ctx {ctx}", [ctx] * b, 8))
        b *= 2
    # Many short prompts finish their prefill in one step: sampled rows apart from prefill tokens and decodes.
    for k in sorted({4, min(16, max_num_seqs), min(64, max_num_seqs)}):
        plan.append((f"{k} prompts of 2", [2] * k, 2))
    plan.append(("mixed", [48, 48, 48, 48, 300, 40, 200], 10))
    return plan


def profile_engine(engine, repeats: int = 3, log=print) -> tuple[list[StepFeatures], list[float], list[str]]:
    """Run the profile on an LLMEngine; returns each step's features, seconds and scenario label.

    The plan is deterministic, so the k-th step of a scenario carries the same batch in every pass; each step's
    time is the minimum over `repeats` passes (after a warm-up pass), which filters out what a shared machine adds
    (noise there only ever makes a step slower), as the hardware probe's best-of-N does."""
    from inferlab.engine.sampling_params import SamplingParams

    sched = engine.scheduler
    captured: list[StepFeatures] = []
    original = sched.schedule

    def schedule():
        batch = original()
        captured.append(batch_features(batch) if batch else StepFeatures())
        return batch

    sched.schedule = schedule  # this engine instance only: the profile watches, the engine is unchanged
    best: dict[tuple[str, int], tuple[StepFeatures, float]] = {}
    plan = profile_plan(engine.config.max_num_seqs, engine.config.max_num_batched_tokens)
    try:
        for rep in range(repeats + 1):
            rng = np.random.default_rng(rep)  # new prompts each pass: no prefix-cache hits across passes
            # Pass 0 warms up (allocations, kernel selection) on a long prefill and a decode batch, and is dropped.
            for label, prompts, out in plan if rep else [plan[4], plan[-1]]:
                t0 = time.perf_counter()
                for i, p in enumerate(prompts):
                    engine.add_request(f"{label}-{rep}-{i}", rng.integers(100, 20000, p).tolist(),
                                       SamplingParams(max_tokens=out, ignore_eos=True, temperature=1.0))
                k = 0
                while engine.has_work():
                    captured.clear()
                    engine.step()
                    if rep and captured and captured[0].steps:
                        key = (label, k)
                        prev = best.get(key)
                        if prev is not None and prev[0] != captured[0]:
                            raise RuntimeError(f"profile step {key} changed its batch between passes")
                        if prev is None or engine.last_step_time < prev[1]:
                            best[key] = (captured[0], engine.last_step_time)
                        k += 1
                if rep:
                    log(f"  pass {rep}: {label}: {k} steps, {time.perf_counter() - t0:.2f} s")
    finally:
        del sched.schedule
    keys = list(best)
    return [best[k][0] for k in keys], [best[k][1] for k in keys], [k[0] for k in keys]


def calibrate_engine(config, repeats: int = 3, log=print) -> StepCost:
    from inferlab.engine.llm_engine import LLMEngine
    from inferlab.lab.hardware import probe_this_machine

    if config.num_threads is None and config.device in ("auto", "cpu"):
        # One thread count for every step of the profile: the engine's adapter would otherwise step down on a noisy
        # step and time part of the plan with fewer threads than the server it stands for will use.
        from dataclasses import replace

        from inferlab.common.cpu_budget import cpu_budget

        config = replace(config, num_threads=cpu_budget().threads)
    engine = LLMEngine(config)
    log(f"profiling the engine ({engine.model_name}, {engine.dtype}, {engine.block_manager.num_blocks} KV blocks, "
        f"{config.num_threads or 'default'} threads)")
    feats, times, labels = profile_engine(engine, repeats, log)
    coef, q = fit_step_cost(feats, times, labels=labels, fixed_zero=("request_overhead", *unidentified(feats)),
                            robust=True)
    keep_features(q, feats)
    dtype = "bf16" if "bfloat16" in str(engine.dtype) else "fp32"
    hw = probe_this_machine(str(engine.device))
    c = engine.config
    return with_coefficients(
        coef, source="engine profile", fit=q,
        engine=shape_dict(EngineShape(c.max_num_seqs, c.max_num_batched_tokens, c.max_prefill_tokens_with_decodes,
                                      c.block_size, engine.block_manager.num_blocks, c.enable_prefix_caching,
                                      decode_stall_ratio=c.decode_stall_ratio)),
        model={"name": engine.model_name, "dtype": dtype,
               "kv_bytes_per_token": engine.kv_bytes_per_token},
        hardware={"name": hw.name, "bandwidth": hw.bandwidth, "flops": hw.peak_flops(dtype)},
        notes=[f"{len(times)} engine steps, each the best of {repeats} passes of LLMEngine.last_step_time (schedule + "
               f"forward + sample + append); request_overhead is not visible offline and is 0"])


PAIR_DEPTH = 512  # keys a prefill token must attend, in some measured step, for the fit to price a pair


def unidentified(feats: list[StepFeatures]) -> tuple[str, ...]:
    """Terms the measurements cannot pin down, left at 0 rather than fitted to noise. A prefill (query, key) pair
    costs 0.58 µs served on the 2-core machine: a quarter of a token's 1.03 ms once its queries attend ~500 keys.
    Shallower, the fit cannot tell it from the per-token cost: on prompts of 64-256 tokens (at most ~250 keys a
    token) it priced a pair at 0.98 µs, and a profile with that price over-predicted 256-1024-token prompts' TTFT by
    15%. `calibrate served` adds a depth probe (depth_probe.py) that reaches past PAIR_DEPTH."""
    deepest = max((f.prefill_pairs / f.prefill_tokens for f in feats if f.prefill_tokens), default=0.0)
    return ("per_prefill_pair",) if deepest < PAIR_DEPTH else ()


def keep_features(q, feats: list[StepFeatures]) -> None:
    """The profile keeps every measurement's features beside its time, so it can be refitted or audited later."""
    for row, f in zip(q.rows, feats):
        row["features"] = dict(zip(FEATURES, f.vector().tolist()))


def shape_dict(s: EngineShape) -> dict:
    from dataclasses import asdict

    return asdict(s)


def shape_from(d: dict) -> EngineShape:
    names = set(EngineShape.__dataclass_fields__)
    return EngineShape(**{k: v for k, v in d.items() if k in names})


# --- (b) black-box, from bench results ---------------------------------------------------------------------------

def prefill_features(prompt: int, budget: int) -> StepFeatures:
    """The steps one prompt's prefill takes alone: chunks of the step budget, the last one sampling."""
    f, done = StepFeatures(), 0
    while done < prompt:
        n = min(budget, prompt - done)
        f = f + chunk_features(done, n, done + n >= prompt) + StepFeatures(steps=1, prefill_steps=1)
        done += n
    return f


def blackbox_measurements(results_paths: list[str | Path], budget: int, max_num_seqs: int | None = None
                          ) -> tuple[list[StepFeatures], list[float], list[str]]:
    """`max_num_seqs`: the server's running-sequence limit. Users beyond it wait for a slot rather than decode, so a
    step carries at most that many (a concurrency-8 run of a 4-slot server has 4-sequence steps)."""
    slots = float(max_num_seqs) if max_num_seqs else float("inf")
    feats: list[StepFeatures] = []
    times: list[float] = []
    labels: list[str] = []
    for path in results_paths:
        path = Path(path)
        try:
            results = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read bench results {path}: {e}") from None
        if not str(results.get("schema", "")).startswith("inferlab.bench.results"):
            raise ValueError(f"{path}: not an `inferlab bench` results.json")
        rec_path = path.parent / results.get("records", "records.jsonl")
        records = list(read_records(rec_path)) if rec_path.exists() else []
        for run in results["runs"]:
            load = run["load"]
            runs_recs = [r for r in records if r.run == run.get("run", 0) and r.ok and not r.warmup]
            name = f"{path.parent.name}:{load['label']}"
            if load["kind"] == "concurrency" and load["value"] == 1:
                for r in runs_recs:
                    p = r.prompt_tokens or r.input_len
                    n = r.output_tokens or 0
                    ttft = _ttft(r)
                    if p and ttft and ttft > 0:
                        feats.append(prefill_features(p, budget) + StepFeatures(requests=1))
                        times.append(ttft)
                        labels.append(f"{name} ttft (prompt {p})")
                    if p and n >= 2 and r.end is not None and ttft:
                        tpot = (r.end - r.start - ttft) / (n - 1)
                        if tpot > 0:
                            feats.append(StepFeatures(1, 0, 1, p + n / 2, 1))
                            times.append(tpot)
                            labels.append(f"{name} tpot (prompt {p})")
                continue
            itl = run["latency"]["itl"].get("p50")
            users = load["value"] if load["kind"] == "concurrency" else _mean_concurrency(run)
            ins = run["tokens"]["input"].get("mean")
            outs = run["tokens"]["output"].get("mean")
            if itl and users and ins and outs:
                c = min(max(1.0, float(users)), slots)
                feats.append(StepFeatures(1, 0, c, c * (ins + outs / 2), c))
                times.append(itl)
                labels.append(f"{name} itl p50")
            if load["kind"] == "concurrency" and runs_recs and run["window"]["duration"] > 0:
                f = StepFeatures()
                for r in runs_recs:
                    p, n = r.prompt_tokens or r.input_len or 0, r.output_tokens or 0
                    f = f + chunk_features(0, p, True) + StepFeatures(0, 0, max(n - 1, 0),
                                                                        max(n - 1, 0) * (p + n / 2), max(n - 1, 0),
                                                                        prefill_steps=1)
                total_out = sum(r.output_tokens or 0 for r in runs_recs)
                f = f + StepFeatures(steps=total_out / min(load["value"], slots))
                feats.append(f)
                times.append(run["window"]["duration"])
                labels.append(f"{name} duration (throughput)")
    if not feats:
        raise ValueError("no usable measurements: calibrate from bench runs at concurrency 1 (TTFT and TPOT against "
                         "prompt length) and at a few higher concurrencies (ITL and throughput)")
    return feats, times, labels


def _ttft(r) -> float | None:
    for t, k in zip(r.chunk_times, r.chunk_tokens):
        if k > 0 and r.start is not None:
            return t - r.start
    return None


def _mean_concurrency(run: dict) -> float | None:
    """Open loop: requests in flight on average = throughput x mean E2E (Little's law)."""
    e2e = run["latency"]["e2e"].get("mean")
    return None if not e2e else run["throughput"]["requests_per_s"] * e2e


def calibrate_blackbox(results_paths: list[str | Path], shape: EngineShape, model: dict, hardware: dict,
                       command: str = "") -> StepCost:
    feats, times, labels = blackbox_measurements(results_paths, shape.max_num_batched_tokens, shape.max_num_seqs)
    # From outside, a prefill step's fixed cost shows up once per TTFT, like the request overhead: it is folded in.
    coef, q = fit_step_cost(feats, times, labels=labels,
                            fixed_zero=("per_sampled_row", "per_prefill_step", *unidentified(feats)),
                            robust=True)
    keep_features(q, feats)
    return with_coefficients(
        coef, source="black-box bench", command=command, fit=q, engine=shape_dict(shape), model=model,
        hardware=hardware,
        notes=[f"{len(times)} measurements from {len(results_paths)} bench result file(s); the sampler's per-row "
               f"cost is folded into per_decode_seq, a prefill step's fixed cost into request_overhead "
               f"(indistinguishable from outside)",
               "scheduler settings are what the caller declared for the server, not observed"])


# --- (c) served, from the server's step trace --------------------------------------------------------------------

NOISE_QUANTILES = 100


def trace_measurements(rows: list[dict], windows: list[tuple[float, float]] | None = None
                       ) -> tuple[list[StepFeatures], list[float], list[str]]:
    """One measurement per traced step: its features and its period, from its start to the next step's start. A step
    before an idle spell has no next step to measure to: its own duration plus the median gap between busy steps
    stands in (at light load that is most steps, and on a disaggregated prefill worker nearly every prefill). Steps
    that started outside `windows`, when given, are left out."""
    feats: list[StepFeatures] = []
    times: list[float] = []
    labels: list[str] = []
    gaps = [nxt["t"] - row["t"] - row["dt"] for row, nxt in zip(rows, rows[1:]) if row["busy"]]
    gap = float(np.median(gaps)) if gaps else 0.0
    for row, nxt in zip(rows, [*rows[1:], None]):
        period = nxt["t"] - row["t"] if row["busy"] and nxt is not None else row["dt"] + gap
        if period <= 0 or (windows is not None and not any(a <= row["t"] <= b for a, b in windows)):
            continue
        shape = BatchShape.from_json(row)
        prefill = sum(n for _, n, _ in shape.chunks)
        kind = ("mixed" if shape.num_decodes else "prefill") if shape.chunks else "decode"
        feats.append(shape_features(shape))
        times.append(period)
        labels.append(f"{kind} (batch {shape.num_decodes} decodes, {prefill} prefill tokens)")
    return feats, times, labels


def calibrate_served(trace_paths: list[str | Path], hardware: dict, command: str = "",
                     windows: list[tuple[float, float]] | None = None) -> StepCost:
    """Fit the step cost to one or more step traces of the same engine settings (a disaggregated server's prefill
    and decode worker traces together: each worker is one such engine on its own core). `windows`: only the steps
    that started within these (start, end) spans of time.perf_counter (CLOCK_MONOTONIC, shared by the processes of
    one machine), e.g. the bench runs a calibration may use."""
    feats: list[StepFeatures] = []
    times: list[float] = []
    labels: list[str] = []
    header: dict = {}
    for path in trace_paths:
        h, rows = read_step_trace(path)
        header = header or h
        f, t, lb = trace_measurements(rows, windows)
        feats += f
        times += t
        labels += lb
    if len(times) < 10:
        raise ValueError(f"{len(times)} traced steps with a period: serve some load with --step-trace first "
                         f"(`inferlab simulate calibrate served CARD` does both)")
    coef, q = fit_step_cost(feats, times, labels=labels, fixed_zero=("request_overhead", *unidentified(feats)),
                            robust=True, weights=kind_weights(labels))
    keep_features(q, feats)
    shape = EngineShape(header["max_num_seqs"], header["max_num_batched_tokens"],
                        header["max_prefill_tokens_with_decodes"], header["block_size"], header["num_blocks"],
                        header["enable_prefix_caching"], decode_stall_ratio=header.get("decode_stall_ratio"))
    dtype = "bf16" if header.get("dtype") == "bfloat16" else "fp32"
    # The robust fit describes a typical step. The rest of what the machine does to steps (its noise, the stalls
    # other processes cause: 5-7% of the served time on the 2-core machine) is kept as the distribution of
    # measured / predicted, which the simulator draws from for every step: queues feel the mean, ITL p99 the tail.
    ratio = np.sort([r["measured"] / r["predicted"] for r in q.rows if r["predicted"] > 0])
    noise = [float(v) for v in np.quantile(ratio, (np.arange(NOISE_QUANTILES) + 0.5) / NOISE_QUANTILES)]
    return with_coefficients(
        coef, source="served step trace", command=command, fit=q, engine=shape_dict(shape), hardware=hardware,
        step_noise=noise,
        model={"name": header.get("model"), "dtype": dtype, "kv_bytes_per_token": header.get("kv_bytes_per_token")},
        notes=[f"{len(times)} served steps from {len(trace_paths)} trace file(s), each timed from its start to the "
               f"next step's start (server overhead between and during steps included)",
               f"step_noise: {NOISE_QUANTILES} quantiles of measured / predicted (mean {ratio.mean():.3f}, p99 "
               f"{np.quantile(ratio, 0.99):.2f})"])


def kind_weights(labels: list[str]) -> list[float]:
    """Each kind of traced step (decode, prefill, mixed: trace_measurements' labels) weighs by the square root of
    its count, not its count: a decode-heavy trace has a hundred decode steps for every prefill, and TTFT is all
    prefill. (Equal weights per kind let thirty noisy prefills pull the decode fit 80% off, seen.)"""
    kinds = [lb.split(" (")[0] for lb in labels]
    count = {k: kinds.count(k) for k in set(kinds)}
    return [1 / np.sqrt(count[k]) for k in kinds]


def memory_compute_ratios(cost: StepCost, feats: list, measured: np.ndarray) -> dict:
    """The two factors (memory terms, compute terms) that best stretch the profile's predictions onto the measured
    step times, by least squares: {"memory_ratio", "compute_ratio"}, both None where the steps cannot tell them
    apart or a factor comes out non-positive. A shared host's memory and arithmetic need not move together: one
    validation's decode steps (mostly weight reads) ran x1.12-1.38 the profile while its prefill-carrying steps
    ran x0.97-1.05, which no single factor describes; with the two, every p50 but a saturated point's TTFT came
    within 10% (docs/benchmarks.md, issue 20, 2026-12-05)."""
    parts = np.array([cost.parts(f) for f in feats], dtype=np.float64).reshape(-1, 2)
    none = {"memory_ratio": None, "compute_ratio": None}
    if len(parts) < 2 or np.linalg.matrix_rank(parts) < 2:
        return none
    (a, b), *_ = np.linalg.lstsq(parts, measured, rcond=None)
    return {"memory_ratio": float(a), "compute_ratio": float(b)} if a > 0 and b > 0 else none


def step_time_ratio(cost: StepCost, rows: list[dict], windows: list[tuple[float, float]] | None = None) -> dict:
    """How a server's traced steps (read_step_trace's rows) ran against a profile: the median over steps of
    measured / predicted period, relative to the profile's own median (its step_noise), overall and per kind of
    step. 1.0: the steps run as when the profile was fitted. On a shared host the same server drifts by 20% in an
    hour, and every latency the simulator predicts drifts with it; this is the check that tells a stale profile
    from a wrong model. The median says whether the typical step moved, whatever a few stalls did; `time_ratio`,
    the steps' total time against the simulator's for the same steps, is the speed that queues feel."""
    feats, times, labels = trace_measurements(rows, windows)
    kept = [(t, p, lb.split(" (")[0]) for f, t, lb in zip(feats, times, labels) if (p := cost.time(f)) > 0]
    if not kept:
        return {"steps": 0, "ratio": None, "time_ratio": None, "by_kind": {}}
    base = float(np.median(cost.step_noise)) if cost.step_noise else 1.0
    measured, predicted = np.array([t for t, _, _ in kept]), np.array([p for _, p, _ in kept])
    ratio = measured / predicted / base
    kinds = np.array([k for _, _, k in kept])
    # The simulator stretches each step by a draw from the profile's noise, so its steps take the noise's mean on
    # top of the prediction; the served steps' total against that is the speed a queue feels.
    mean_noise = float(np.mean(cost.step_noise)) if cost.step_noise else 1.0
    return {"steps": int(len(ratio)), "ratio": float(np.median(ratio)),
            "time_ratio": float(measured.sum() / predicted.sum() / mean_noise),
            **memory_compute_ratios(cost, [f for f in feats if cost.time(f) > 0], measured / mean_noise),
            "by_kind": {k: {"steps": int((kinds == k).sum()), "ratio": float(np.median(ratio[kinds == k]))}
                        for k in sorted(set(kinds.tolist()))}}
