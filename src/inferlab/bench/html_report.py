"""A self-contained HTML report (inline SVG, no scripts, no network) drawn from results.json alone:
latency CDFs, throughput and latency against load for sweeps, and a timeline of concurrency and tokens/s."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from inferlab.bench.report import LABELS, STATS
from inferlab.common.units import format_ms

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f",
           "#bcbd22")
W, H, ML, MR, MT, MB = 560, 300, 64, 16, 28, 44


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks, t = [], start
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    return ticks


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.0f}"
    if abs(v) >= 1:
        return f"{v:.1f}".rstrip("0").rstrip(".")
    return f"{v:.3g}"


def line_chart(series: list[tuple[str, list[float], list[float]]], title: str, xlabel: str, ylabel: str,
               markers: bool = False, y_from_zero: bool = True) -> str:
    """series: (label, xs, ys). Returns an <svg> element."""
    pts = [(x, y) for _, xs, ys in series for x, y in zip(xs, ys) if x is not None and y is not None]
    if not pts:
        return f'<p class="empty">{html.escape(title)}: no data</p>'
    xs_all, ys_all = [p[0] for p in pts], [p[1] for p in pts]
    xt = _nice_ticks(min(xs_all), max(xs_all))
    yt = _nice_ticks(0.0 if y_from_zero else min(ys_all), max(ys_all))
    x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]
    pw, ph = W - ML - MR, H - MT - MB

    def px(x):
        return ML + (x - x0) / ((x1 - x0) or 1) * pw

    def py(y):
        return MT + ph - (y - y0) / ((y1 - y0) or 1) * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
           f'font-family="sans-serif" font-size="11">',
           f'<text x="{W / 2}" y="16" text-anchor="middle" font-size="13" font-weight="bold">{html.escape(title)}</text>']
    for t in xt:
        out.append(f'<line x1="{px(t):.1f}" y1="{MT}" x2="{px(t):.1f}" y2="{MT + ph}" stroke="#eee"/>'
                   f'<text x="{px(t):.1f}" y="{MT + ph + 14}" text-anchor="middle">{_fmt(t)}</text>')
    for t in yt:
        out.append(f'<line x1="{ML}" y1="{py(t):.1f}" x2="{ML + pw}" y2="{py(t):.1f}" stroke="#eee"/>'
                   f'<text x="{ML - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    out.append(f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    out.append(f'<text x="{ML + pw / 2}" y="{H - 8}" text-anchor="middle">{html.escape(xlabel)}</text>')
    out.append(f'<text x="14" y="{MT + ph / 2}" text-anchor="middle" transform="rotate(-90 14 {MT + ph / 2})">'
               f'{html.escape(ylabel)}</text>')
    for i, (label, xs, ys) in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        p = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys) if x is not None and y is not None)
        out.append(f'<polyline points="{p}" fill="none" stroke="{color}" stroke-width="1.8"/>')
        if markers:
            out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>'
                    for x, y in zip(xs, ys) if x is not None and y is not None]
        if len(series) > 1:
            ly = MT + 12 + 14 * i
            out.append(f'<line x1="{ML + 8}" y1="{ly - 4}" x2="{ML + 24}" y2="{ly - 4}" stroke="{color}" '
                       f'stroke-width="2"/><text x="{ML + 28}" y="{ly}">{html.escape(label)}</text>')
    out.append("</svg>")
    return "".join(out)


def _cdf_chart(runs: list[dict], metric: str) -> str:
    series = []
    for r in runs:
        cdf = r["latency"][metric]["cdf"]
        if cdf:
            series.append((r["load"]["label"], [v * 1e3 for v in cdf], [i / (len(cdf) - 1) for i in range(len(cdf))]))
    return line_chart(series, f"{LABELS[metric]} CDF", f"{LABELS[metric]} (ms)", "fraction of samples")


def _sweep_charts(runs: list[dict]) -> str:
    xs = [r["load"]["value"] for r in runs]
    kind = runs[0]["load"]["kind"]
    xl = "concurrency" if kind == "concurrency" else "offered rate (req/s)"
    tput = line_chart([("requests/s", xs, [r["throughput"]["requests_per_s"] for r in runs])],
                      "request throughput vs load", xl, "requests/s", markers=True)
    toks = line_chart([("output tokens/s", xs, [r["throughput"]["output_tokens_per_s"] for r in runs])],
                      "output throughput vs load", xl, "tokens/s", markers=True)
    lat_series = []
    for m in ("ttft", "tpot", "e2e"):
        for p in ("p50", "p99"):
            ys = [None if r["latency"][m][p] is None else r["latency"][m][p] * 1e3 for r in runs]
            lat_series.append((f"{LABELS[m]} {p}", xs, ys))
    lat = line_chart(lat_series, "latency vs load", xl, "ms", markers=True)
    return tput + toks + lat


def _timeline(run: dict) -> str:
    tl = run["timeline"]
    if not tl["t"]:
        return ""
    t0 = run["window"]["start"]
    ts = [t - t0 for t in tl["t"]]
    return (line_chart([("in flight", ts, tl["concurrency"])], f"requests in flight ({run['load']['label']})",
                       "time since the first measured request (s)", "requests")
            + line_chart([("output tokens/s", ts, tl["output_tokens_per_s"])],
                         f"output tokens/s ({run['load']['label']})", "time since the first measured request (s)",
                         "tokens/s"))


def _table(run: dict) -> str:
    rows = ["<tr><th>metric (ms)</th>" + "".join(f"<th>{s}</th>" for s in STATS) + "<th>n</th></tr>"]
    for m, label in LABELS.items():
        st = run["latency"][m]
        if st["count"]:
            rows.append(f"<tr><td>{label}</td>" + "".join(f"<td>{format_ms(st[s], unit=False)}</td>" for s in STATS)
                        + f"<td>{st['count']}</td></tr>")
    return "<table>" + "".join(rows) + "</table>"


def _run_section(run: dict) -> str:
    c, tp = run["counts"], run["throughput"]
    parts = [f"<h2>{html.escape(run['load']['label'])}</h2>",
             f"<p>{c['completed']} completed, {c['failed']} failed, {c['warmup']} warmup left out, "
             f"{c['cancelled']} cut by interrupt; window {run['window']['duration']:.2f} s.<br>"
             f"Throughput {tp['requests_per_s']:.2f} req/s, input {tp['input_tokens_per_s']:.1f} tok/s, "
             f"output {tp['output_tokens_per_s']:.1f} tok/s.</p>"]
    if run["goodput"]:
        g = run["goodput"]
        parts.append(f"<p>Goodput {g['requests_per_s']:.2f} req/s: {g['share']:.1%} of requests meet "
                     + ", ".join(f"{k} &le; {v * 1e3:g} ms" for k, v in g["slos"].items()) + ".</p>")
    parts.append(_table(run))
    if run["errors"]:
        parts.append("<table><tr><th>error</th><th>count</th><th>sample</th></tr>" + "".join(
            f"<tr><td>{html.escape(k)}</td><td>{e['count']}</td><td>{html.escape(e['sample'] or '')}</td></tr>"
            for k, e in run["errors"].items()) + "</table>")
    for w in run["warnings"]:
        parts.append(f'<p class="warn">warning: {html.escape(w)}</p>')
    parts.append(f'<div class="charts">{_timeline(run)}</div>')
    return "".join(parts)


def render(results: dict) -> str:
    prov = results["provenance"]
    runs = results["runs"]
    tgt = prov["target"]
    body = [f"<h1>inferlab bench: {html.escape(str(tgt['model']))}</h1>",
            f"<p>{html.escape(tgt['base_url'])} ({tgt['endpoint']}), {html.escape(prov['start_time'])}<br>"
            f"<code>{html.escape(prov['command_line'])}</code></p>",
            "<p>Metric definitions: docs/metrics.md. Latencies of open-loop runs are measured from each request's "
            "scheduled time.</p>"]
    if runs:
        body.append('<div class="charts">' + "".join(_cdf_chart(runs, m) for m in ("ttft", "itl", "e2e")) + "</div>")
    if len(runs) > 1:
        body.append('<h2>sweep</h2><div class="charts">' + _sweep_charts(runs) + "</div>")
        sat = (results.get("sweep") or {}).get("saturation")
        if sat:
            body.append(f"<p>Throughput stops rising at {html.escape(sat['label'])} "
                        f"({sat['requests_per_s']:.2f} req/s).</p>")
    body += [_run_section(r) for r in runs]
    body.append("<details><summary>provenance</summary><pre>"
                + html.escape(json.dumps(prov, indent=1, default=str)) + "</pre></details>")
    style = ("body{font-family:sans-serif;margin:24px;max-width:1200px}table{border-collapse:collapse;margin:8px 0}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td:first-child{text-align:left}"
             ".charts{display:flex;flex-wrap:wrap;gap:12px}.warn{color:#a60}pre{font-size:11px;overflow:auto}")
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>inferlab bench report</title>'
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>")


def write_html(results: dict, path: Path) -> Path:
    Path(path).write_text(render(results), encoding="utf-8")
    return Path(path)
