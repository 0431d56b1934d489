"""The experiment report: markdown, in the shape an inference engineer writes one. Workload assumptions and
missing measurements; the objective and the baseline; the main bottleneck hypothesis and how it was tested; the
ranked experiments with their trade-offs; the acceptance verdict on quality, tail latency, reliability and cost.
It is a view of the experiment's state.json, which holds every figure it shows."""

from __future__ import annotations

import datetime as dt
import shlex

from inferlab.common.units import format_ms
from inferlab.bench.launcher import config_flags, fill_template
from inferlab.lab.card import Card, Check, card_bench_argv
from inferlab.lab.experiment import PointResult, Variation, rank, score, verdict


def _spread(m: dict | None, fmt=lambda v: f"{v:.2f}") -> str:
    if not m:
        return "–"
    if m["n"] < 2 or m["max"] == m["min"]:
        return fmt(m["mean"])
    return f"{fmt(m['mean'])} ({fmt(m['min'])}–{fmt(m['max'])})"


def _lat(r: PointResult, key: str) -> str:
    return _spread(r.metric(key), lambda x: format_ms(x, unit=False))


def _share(m: dict | None, digits: int = 0) -> str:
    return "–" if not m else f"{m['mean']:.{digits}%}"


def _mb(x) -> str:
    return "–" if x is None else f"{x / 1e6:.0f}"


def _pct(a: float | None, b: float | None) -> str:
    if a is None or not b:
        return "–"
    return f"{(a / b - 1) * 100:+.0f}%"


def _quality_cells(r: PointResult, base: PointResult | None) -> tuple[str, str, str]:
    q, bq = r.quality or {}, (base.quality if base else None) or {}
    ppl = q.get("perplexity")
    d_ppl = "–" if ppl is None else (f"{ppl:.2f}" + (f" ({_pct(ppl, bq.get('perplexity'))})" if r.id != "baseline"
                                                       and bq.get("perplexity") else ""))
    acc = q.get("task_accuracy")
    d_acc = "–" if acc is None else f"{acc:.2f}" + (
        f" ({acc - bq['task_accuracy']:+.2f})" if r.id != "baseline" and bq.get("task_accuracy") is not None else "")
    agr = q.get("greedy_agreement")
    return d_ppl, d_acc, "1.00" if r.id == "baseline" and q else ("–" if agr is None else f"{agr:.2f}")


def _check_rows(checks: list[Check]) -> list[str]:
    rows = ["| objective | measured | met |", "|---|---|---|"]
    for c in checks:
        if c.measured is None:
            v = "not measured"
        elif c.kind == "latency":
            v = f"{c.measured * 1e3:.1f} ms"
        elif c.kind == "quality" and "perplexity" in c.objective:
            v = f"{c.measured:+.2f}%"
        else:
            v = f"{c.measured:.3g}"
        met = {True: "yes", False: "**no**", None: "?"}[c.passed]
        rows.append(f"| {c.objective} | {v}{' (' + c.note + ')' if c.note else ''} | {met} |")
    return rows


def _tradeoff(r: PointResult, base: PointResult | None) -> str:
    if base is None or r.id == "baseline" or r.status != "measured":
        return ""
    parts = []
    for key, label in (("goodput_rps", "goodput"), ("requests_per_s", "throughput"),
                       ("output_tokens_per_s", "output tok/s"), ("ttft.p99", "TTFT p99"), ("itl.p50", "ITL p50"),
                       ("e2e.p99", "E2E p99")):
        a, b = r.metric(key), base.metric(key)
        if a and b and b["mean"]:
            parts.append(f"{label} {_pct(a['mean'], b['mean'])}")
    for key, label in (("weight_bytes", "weights"), ("peak_rss_bytes", "peak RSS")):
        a, b = r.memory.get(key), base.memory.get(key)
        if a and b:
            parts.append(f"{label} {_pct(a, b)}")
    q, bq = r.quality or {}, base.quality or {}
    if q.get("perplexity") and bq.get("perplexity"):
        parts.append(f"perplexity {_pct(q['perplexity'], bq['perplexity'])}")
    return ", ".join(parts)


def render(card: Card, results: list[PointResult], variations: list[Variation], *, repeats: int,
           requests: int | None, command: str, diagnosis=None, fit_lines: list[str] | None = None,
           machine: str = "") -> str:
    base = next((r for r in results if r.id == "baseline"), None)
    ranked = rank(card, results)
    t = card.traffic
    L: list[str] = []
    L.append(f"# Experiment report: {card.name}")
    L.append("")
    L.append(f"Written {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} by `{command}`"
             + (f" on {machine}" if machine else "") + ".")
    if card.description:
        L += ["", f"> {card.description.strip()}"]

    # 1. Workload assumptions and missing measurements
    L += ["", "## 1. Workload assumptions and missing measurements", ""]
    load = (f"closed loop, {t.concurrency} concurrent users" if t.closed_loop else
            f"open loop, {t.arrival} arrivals at {t.rate:g} req/s" + (f" (burstiness {t.burstiness:g})"
                                                                     if t.arrival == "gamma" else "")
            + (f", at most {t.concurrency} in flight" if t.concurrency else ""))
    n_req = requests if requests is not None else t.requests
    L.append(f"- Traffic: {load}; {n_req} measured requests per run after {t.warmup} warm-up requests; "
             f"{repeats} run(s) per config, each with new prompts (seeds {t.seed}..{t.seed + repeats - 1}).")
    L.append(f"- Prompts: {t.input_len.bench_arg()} tokens, outputs {t.output_len.bench_arg()} tokens "
             f"(ignore_eos, so lengths are honoured); "
             + (f"{t.prefix_share:.0%} of each prompt is a prefix shared within {t.prefix_groups} group(s)."
                if t.prefix_share else "no shared prefix (cache-free)."))
    L.append(f"- API: {card.endpoint}, {'streaming' if card.streaming else 'not streaming'}; server: "
             f"{card.server.kind}" + (f" (`{card.server.command}`)" if card.server.command else "")
             + f"; baseline config `{card.server.config}`.")
    L.append("- Varied one at a time from the baseline: "
             + ("; ".join(f"`{v.key}` ∈ {{{', '.join(map(str, v.values))}}}" for v in variations) or "nothing")
             + (". The best values were then combined." if any(r.id == "combined" for r in results) else "."))
    missing = []
    if t.dataset is None:
        missing.append("prompts are synthetic (exact token lengths, random words): real traffic's content, "
                       "length mix and prefix reuse may differ")
    if repeats < 2:
        missing.append("one run per config: no spread across repeats, so small differences are not significant")
    if any(r.quality is None for r in results if r.status == "measured") and card.quality:
        notes = {r.quality_note for r in results if r.quality is None and r.status == "measured"}
        missing.append("quality: " + "; ".join(sorted(notes)))
    if not any(r.memory for r in results):
        missing.append("server memory (the server does not report inferlab:weight_bytes / peak RSS)")
    if not any(any(rep.get("server_metrics") for rep in r.repeats) for r in results):
        missing.append("server-side metrics (queue time, KV usage, preemptions) were not scraped")
    busy = [f"{r.id} ({r.busy_repeats})" for r in results if r.busy_repeats]
    if busy:
        missing.append(f"a quiet machine: repeats of {', '.join(busy)} ran beside other CPU work even after "
                       f"re-measurement; their figures are contaminated (bench's `machine` section)")
    failed = [r.id for r in results if r.status != "measured"]
    if failed:
        missing.append(f"configs that failed to run: {', '.join(failed)} (see their server.log)")
    missing.append("cost per request in money: only throughput and memory are measured here")
    L += [f"- Missing: {m}." for m in missing]

    # 2. Objective and baseline
    L += ["", "## 2. Objective and baseline", ""]
    obj = [f"{m} {k} ≤ {v * 1e3:g} ms" for m, tg in card.objectives.latency.items() for k, v in tg.items()]
    o = card.objectives
    if o.min_requests_per_s:
        obj.append(f"throughput ≥ {o.min_requests_per_s:g} req/s")
    if o.min_output_tokens_per_s:
        obj.append(f"throughput ≥ {o.min_output_tokens_per_s:g} output tok/s")
    if o.goodput_min_share is not None:
        obj.append(f"goodput ≥ {o.goodput_min_share:.0%} of requests meeting "
                   + ", ".join(f"{m} ≤ {v * 1e3:g} ms" for m, v in o.request_slos().items()))
    if o.max_error_rate is not None:
        obj.append(f"error rate ≤ {o.max_error_rate:.1%}")
    if card.quality:
        obj.append("quality floor: " + ", ".join(f"{k} {v:g}" for k, v in card.quality.items()))
    L.append("Objectives (from the card): " + "; ".join(obj) + ".")
    if base is not None and base.status == "measured":
        bv = verdict(card, base, base)
        L += ["", f"Baseline `{base.config}` — {bv.status}:", ""]
        L += _check_rows(bv.checks)
        L.append("")
        L.append(f"Baseline figures: {_spread(base.metric('requests_per_s'))} req/s, "
                 f"{_spread(base.metric('output_tokens_per_s'), lambda v: f'{v:.1f}')} output tok/s; TTFT p50/p99 "
                 f"{_lat(base, 'ttft.p50')}/{_lat(base, 'ttft.p99')} ms; ITL p50/p99 {_lat(base, 'itl.p50')}/"
                 f"{_lat(base, 'itl.p99')} ms; E2E p99 {_lat(base, 'e2e.p99')} ms"
                 + (f"; weights {_mb(base.memory.get('weight_bytes'))} MB, peak RSS "
                    f"{_mb(base.memory.get('peak_rss_bytes'))} MB" if base.memory else "") + ".")
    elif base is not None:
        L.append(f"\nThe baseline failed to run: {base.error}")

    # 3. Bottleneck hypothesis
    L += ["", "## 3. Main bottleneck hypothesis and how it was tested", ""]
    if diagnosis is not None and diagnosis.hypotheses:
        h = diagnosis.hypotheses[0]
        L.append(f"_Hypothesis, from `inferlab diagnose` on the baseline's first run (a hypothesis, not a "
                 f"finding):_ **{h.title}**. Symptom: {h.symptom}. Likely causes: {'; '.join(h.causes[:2])}.")
        if h.evidence:
            L.append(f"Evidence in the scraped metrics: {'; '.join(h.evidence)}.")
        L.append(f"What would confirm it: {h.confirm}.")
        key = h.vary.split("=")[0] if h.vary else None
        tested = [v for v in variations if v.key == key]
        if tested:
            rows = [r for r in results if key in r.changes and r.status == "measured"]
            best = max(rows, key=score, default=None)
            if best and base:
                L.append(f"Tested by varying `{key}`: the best value, `{best.changes[key]}`, changed "
                         f"{_tradeoff(best, base) or 'nothing measurable'} against the baseline.")
            elif not rows:
                L.append(f"To be tested by varying `{key}`, but those configs failed to run (section 4): "
                         f"untested.")
        else:
            L.append(f"Not tested by this experiment; next: {h.next_experiment} "
                     f"(`inferlab experiment CARD --vary {h.vary}`)." if h.vary else f"Next: {h.next_experiment}.")
        for other in diagnosis.hypotheses[1:]:
            L.append(f"- Also possible: {other.title} ({other.symptom}).")
    elif diagnosis is not None:
        L.append("`inferlab diagnose` found no symptom on the baseline: " + "; ".join(diagnosis.notes))
    else:
        L.append("No baseline results to diagnose.")
    for line in fit_lines or []:
        L.append(f"- {line}")

    # 4. Ranked experiments
    L += ["", "## 4. Ranked experiments", "",
          "Mean over repeats, with the range across repeats in parentheses; latencies in ms. Configs below the "
          "quality floor are rejected whatever their speed.", "",
          "| # | config | verdict | goodput req/s | good share | req/s | out tok/s | TTFT p50 | TTFT p99 | ITL p50 | "
          "ITL p99 | E2E p99 | errors | weights MB | peak RSS MB | perplexity | task acc | agreement |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, (r, v) in enumerate(ranked, 1):
        if r.status != "measured":
            L.append(f"| {i} | `{r.id}` | failed to run | " + " | ".join(["–"] * 15) + " |")
            continue
        ppl, acc, agr = _quality_cells(r, base)
        share = r.metric("goodput_share")
        err = r.metric("error_rate")
        L.append(
            f"| {i} | `{r.id}` | {v.status} | {_spread(r.metric('goodput_rps'))} | "
            f"{_share(share)} | {_spread(r.metric('requests_per_s'))} | "
            f"{_spread(r.metric('output_tokens_per_s'), lambda x: f'{x:.1f}')} | {_lat(r, 'ttft.p50')} | "
            f"{_lat(r, 'ttft.p99')} | {_lat(r, 'itl.p50')} | {_lat(r, 'itl.p99')} | {_lat(r, 'e2e.p99')} | "
            f"{_share(err, 1)} | {_mb(r.memory.get('weight_bytes'))} | "
            f"{_mb(r.memory.get('peak_rss_bytes'))} | {ppl} | {acc} | {agr} |")
    L += ["", "Trade-offs against the baseline:", ""]
    for r, v in ranked:
        if r.id == "baseline":
            continue
        if r.status != "measured":
            L.append(f"- `{r.id}`: did not run: {str(r.error).splitlines()[0]}")
            continue
        missed = [c.objective for c in v.checks if c.passed is False]
        L.append(f"- `{r.id}`: {_tradeoff(r, base) or 'no difference measured'}."
                 + (f" Misses: {'; '.join(missed)}." if missed else ""))

    # 5. Verdict
    L += ["", "## 5. Acceptance verdict", ""]
    accepted = [(r, v) for r, v in ranked if v.accepted]
    pick, pv = (accepted[0] if accepted else (ranked[0] if ranked else (None, None)))
    if pick is None:
        L.append("Nothing was measured.")
    else:
        word = {True: "pass", False: "**fail**", None: "not measured"}
        cost = (f"{_spread(pick.metric('output_tokens_per_s'), lambda x: f'{x:.1f}')} output tok/s on this machine"
                + (f", {_mb(pick.memory.get('peak_rss_bytes'))} MB peak RSS" if pick.memory else ""))
        lead = (f"Recommended: **`{pick.id}`** (`{pick.config}`)." if accepted else
                f"**No config meets the card.** The closest is `{pick.id}` ({pv.status}).")
        L += [lead, "",
              f"- Quality: {word[pv.quality_ok] if card.quality else 'no floor in the card'}.",
              f"- Tail latency and throughput objectives: {word[pv.latency_ok]}"
              + (f" (missed: {'; '.join(c.objective for c in pv.checks if c.passed is False and c.kind != 'quality')})"
                 if pv.latency_ok is False else "") + ".",
              f"- Reliability: {word[pv.reliability_ok]} (error rate {_spread(pick.metric('error_rate'), lambda x: f'{x:.1%}')}).",
              f"- Cost: {cost}."]
        rejected = [r.id for r, v in ranked if v.status.startswith("rejected")]
        if rejected:
            L.append(f"- Rejected whatever their speed: {', '.join(f'`{x}`' for x in rejected)}.")

    # Reproduce
    L += ["", "## Reproduce", "", "```", command]
    L += _by_hand(card, requests)
    L += ["```", ""]
    return "\n".join(L)


def _by_hand(card: Card, requests: int | None) -> list[str]:
    """One baseline run by hand. A `command` server has no bench flag to start it: the report gives its command
    line on a fixed port, then bench pointed at that port."""
    s = card.server
    if s.kind != "command":
        return ["# one run of the baseline by hand:",
                "inferlab bench " + shlex.join(card_bench_argv(card, requests=requests))]
    port = 8000
    serve = fill_template(s.command, port) + config_flags(s.config)
    return ["# one run of the baseline by hand: start the server, wait for its /health, then measure it",
            shlex.join(serve) + " &",
            "inferlab bench " + shlex.join(card_bench_argv(card, base_url=f"http://127.0.0.1:{port}",
                                                           requests=requests))]
