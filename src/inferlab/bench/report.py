"""Views of results.json: the terminal table and the CSV (the HTML report is in html_report.py)."""

from __future__ import annotations

import csv
from pathlib import Path

from inferlab.bench.metrics import TIME_METRICS
from inferlab.common.units import format_ms

LABELS = {
    "ttft": "TTFT",
    "ttft_reasoning": "TTFT (reasoning)",
    "ttft_content": "TTFT (answer)",
    "tpot": "TPOT",
    "itl": "ITL",
    "inter_chunk": "Inter-chunk",
    "e2e": "E2E",
    "e2e_per_output_token": "E2E / token",
    "client_delay": "Client delay",
}
STATS = ("mean", "std", "p50", "p90", "p95", "p99", "max")


def flat_row(run: dict) -> dict:
    """One load point as a flat dict: the CSV's row and compare's unit of comparison."""
    t, c = run["throughput"], run["counts"]
    row = {
        "run": run.get("run", 0), "load": run["load"]["label"], "load_kind": run["load"]["kind"],
        "load_value": run["load"]["value"], "duration_s": run["window"]["duration"],
        "measured": c["measured"], "completed": c["completed"], "failed": c["failed"], "error_rate": c["error_rate"],
        "requests_per_s": t["requests_per_s"], "input_tokens_per_s": t["input_tokens_per_s"],
        "output_tokens_per_s": t["output_tokens_per_s"], "total_tokens_per_s": t["total_tokens_per_s"],
        "goodput_requests_per_s": run["goodput"]["requests_per_s"] if run["goodput"] else None,
        "goodput_share": run["goodput"]["share"] if run["goodput"] else None,
    }
    for m in TIME_METRICS:
        for s in STATS:
            v = run["latency"].get(m, {}).get(s)  # results written before a metric existed lack it
            row[f"{m}_{s}_ms"] = None if v is None else v * 1e3
    pu = run["per_user"]["output_tokens_per_s"]
    row.update(per_user_tokens_per_s_mean=pu["mean"], per_user_tokens_per_s_p50=pu["p50"],
               input_tokens_mean=run["tokens"]["input"]["mean"], output_tokens_mean=run["tokens"]["output"]["mean"])
    return row


def write_csv(results: dict, path: Path) -> Path:
    rows = [flat_row(r) for r in results["runs"]]
    with open(path, "w", newline="", encoding="utf-8") as f:
        if rows:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return path


def run_table(run: dict):
    from rich.table import Table

    t = Table(title=f"latency, ms  ({run['load']['label']})", title_justify="left", header_style="bold")
    t.add_column("metric", no_wrap=True)
    for s in STATS:
        t.add_column(s, justify="right")
    t.add_column("n", justify="right")
    for m in TIME_METRICS:
        st = run["latency"].get(m)
        if not st or not st["count"]:
            continue
        t.add_row(LABELS[m], *(format_ms(st[s], unit=False) for s in STATS), str(st["count"]))
    return t


def print_results(results: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    prov = results["provenance"]
    tgt = prov["target"]
    con.print(f"[bold]inferlab bench[/] {tgt['model']} at {tgt['base_url']} ({tgt['endpoint']})")
    for run in results["runs"]:
        c, tp = run["counts"], run["throughput"]
        con.print()
        con.print(f"[bold]{run['load']['label']}[/]: {c['completed']} completed, {c['failed']} failed"
                  + (f", {c['cancelled']} cut by interrupt" if c["cancelled"] else "")
                  + (f", {c['warmup']} warmup left out" if c["warmup"] else "")
                  + f" in {run['window']['duration']:.2f} s")
        con.print(f"throughput: {tp['requests_per_s']:.2f} req/s, input {tp['input_tokens_per_s']:.1f} tok/s, "
                  f"output {tp['output_tokens_per_s']:.1f} tok/s, total {tp['total_tokens_per_s']:.1f} tok/s")
        pu = run["per_user"]["output_tokens_per_s"]
        if pu["count"]:
            con.print(f"per user: {pu['mean']:.1f} output tok/s mean, {pu['p50']:.1f} p50")
        tok = run["tokens"]
        if tok["input"]["count"]:
            src = ", ".join(f"{k} {v}" for k, v in tok["token_source"].items())
            con.print(f"tokens per request: input {tok['input']['mean']:.1f} ({tok['input_source']}), "
                      f"output {tok['output']['mean']:.1f} (counted by {src})")
        if run["goodput"]:
            g = run["goodput"]
            objectives = ", ".join(f"{k} <= {v * 1e3:g} ms" for k, v in g["slos"].items())
            con.print(f"goodput: {g['requests_per_s']:.2f} req/s; {g['share']:.1%} of requests meet {objectives}")
        con.print(run_table(run))
        gate = run["slo_gate"]
        if gate:
            con.print(f"SLO gate at {gate['percentile']}: " + ("[green]passed[/]" if gate["passed"] else
                      "[red]missed[/]: " + "; ".join(gate["misses"])))
        if run["errors"]:
            et = Table(title="errors", title_justify="left")
            et.add_column("kind")
            et.add_column("count", justify="right")
            et.add_column("sample message")
            for kind, e in run["errors"].items():
                et.add_row(kind, str(e["count"]), (e["sample"] or "")[:120])
            con.print(et)
        sm = run.get("server_metrics")
        if sm and "error" not in sm:
            parts = []
            for key, what in (("queue_time_mean_s", "queue time"), ("prefill_time_mean_s", "prefill time")):
                if sm.get(key) is not None:  # format_ms keeps 3 digits: 40 us must not print as 0.0 ms
                    parts.append(f"{what} mean {format_ms(sm[key])}")
            if sm.get("kv_cache_usage"):
                parts.append(f"KV cache use max {sm['kv_cache_usage']['max']:.0%}")
            if sm.get("preemptions") is not None:
                parts.append(f"preemptions {sm['preemptions']:g}")
            if sm.get("prefix_cache_hit_rate") is not None:
                parts.append(f"prefix-cache hit rate {sm['prefix_cache_hit_rate']:.1%}")
            if sm.get("kv_transfer_bytes"):
                parts.append(f"KV handed over {sm['kv_transfer_bytes'] / 2**20:.1f} MiB"
                             f" ({sm['kv_transfers']:g} copies, {format_ms(sm['kv_transfer_seconds'])} copying)")
            con.print("server: " + (", ".join(parts) or "no known series"))
            for role, c in sm.get("by_role", {}).items():
                con.print(f"  {role}: " + ", ".join(
                    f"{label} {c[key]:g}" for key, label in (
                        ("prompt_tokens_total", "prompt tokens"), ("generation_tokens_total", "generated tokens"),
                        ("engine_step_seconds_total", "busy s"), ("num_requests_running", "running max"),
                        ("kv_cache_usage_perc", "KV use max"), ("kv_transfer_bytes_total", "KV bytes"),
                        ("kv_transfer_stalls_total", "transfer stalls")) if key in c))
        elif sm:
            con.print(f"server metrics: {sm['error']}")
        for w in run["warnings"]:
            con.print(f"[yellow]warning:[/] {w}")
    sweep = results.get("sweep")
    if sweep:
        st = Table(title="sweep", title_justify="left", header_style="bold")
        for col in ("load", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "E2E p99",
                    "goodput", "errors"):
            st.add_column(col, justify="right" if col != "load" else "left")
        for run in results["runs"]:
            lat = run["latency"]
            g = run["goodput"]
            st.add_row(run["load"]["label"], f"{run['throughput']['requests_per_s']:.2f}",
                       f"{run['throughput']['output_tokens_per_s']:.1f}",
                       *(format_ms(lat[m][s], unit=False) for m, s in (("ttft", "p50"), ("ttft", "p99"), ("tpot", "p50"),
                                                                       ("tpot", "p99"), ("e2e", "p99"))),
                       f"{g['share']:.0%}" if g else "–", str(run["counts"]["failed"]))
        con.print()
        con.print(st)
        sat = sweep["saturation"]
        con.print("saturation: " + (f"throughput stops rising at {sat['label']} ({sat['requests_per_s']:.2f} req/s)"
                                    if sat else "not reached"))
        if results["provenance"].get("slos"):
            top = sweep["max_load_meeting_slos"]
            con.print("highest load meeting the SLOs: " + (top["label"] if top else "none"))
