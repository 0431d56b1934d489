"""A self-contained HTML report (inline SVG, no scripts, no network) drawn from results.json alone: latency CDFs,
latency percentiles and throughput against load, the SLO search's goodput curve, per-turn latency of
conversations, and a timeline of requests with the server's metrics overlaid. `render_compare` draws several
results files on the same axes (`inferlab compare --html`).

Every chart is an <svg class="chart"> whose data marks carry class="data", so a browser test can check that
each one drew something; every axis is extended to a round tick beyond its data, so nothing is clipped."""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from inferlab.bench.report import LABELS, STATS
from inferlab.common.units import format_ms

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f",
           "#bcbd22")
W, H, ML, MR, MB = 560, 300, 64, 56, 44
TITLE_H, LEGEND_ROW = 24, 14
LEGEND_PER_ROW = 3


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round ticks from at or below `lo` to at or above `hi`: the axis they span covers all the data."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        lo, hi = 0.0, 1.0
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    if lo < 0 and -lo < step * 0.01:  # a clock's microsecond of noise below zero is not worth a tick below it
        lo = 0.0
    first = math.floor(lo / step + 1e-9) * step
    last = math.ceil(hi / step - 1e-9) * step
    count = int(round((last - first) / step))
    return [round(first + i * step, 12) for i in range(count + 1)]


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


@dataclass
class Series:
    label: str
    xs: list
    ys: list
    right: bool = False  # drawn against the right-hand axis
    markers: bool = False
    dash: bool = False
    color: str | None = None


@dataclass
class Chart:
    title: str
    xlabel: str
    ylabel: str
    series: list[Series] = field(default_factory=list)
    ylabel_right: str = ""
    y_from_zero: bool = True
    spans: list[tuple[float, float, float, str]] = field(default_factory=list)  # (x0, x1, y, color) segments
    vlines: list[tuple[float, str]] = field(default_factory=list)  # (x, label)
    xband: tuple[float, float] | None = None  # a shaded x interval (a confidence interval)
    span_width: float = 2.0

    def render(self) -> str:
        pts = [(x, y) for s in self.series if not s.right for x, y in zip(s.xs, s.ys) if _ok(x) and _ok(y)]
        rpts = [(x, y) for s in self.series if s.right for x, y in zip(s.xs, s.ys) if _ok(x) and _ok(y)]
        span_x = [x for a, b, _, _ in self.spans for x in (a, b)]
        if not pts and not rpts and not self.spans:
            return f'<p class="empty">{html.escape(self.title)}: no data</p>'
        xs = [p[0] for p in pts + rpts] + span_x + [x for x, _ in self.vlines]
        if self.xband:
            xs += list(self.xband)
        ys = [p[1] for p in pts] + [y for _, _, y, _ in self.spans]
        xt = nice_ticks(min(xs), max(xs))
        yt = nice_ticks(0.0 if self.y_from_zero else min(ys or [0.0]), max(ys or [1.0]))
        rt = nice_ticks(0.0, max([p[1] for p in rpts] or [1.0])) if rpts else None
        x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]
        named = [s for s in self.series if s.label]
        longest = max((len(_legend(s)) for s in named), default=0)
        per_row = max(1, min(LEGEND_PER_ROW, int((W - ML - MR) // (longest * 6 + 26))))
        rows = -(-len(named) // per_row) if len(named) > 1 or rpts else 0
        mt = TITLE_H + 6 + LEGEND_ROW * rows
        pw, ph = W - ML - MR, H - mt - MB

        def px(x):
            return ML + (x - x0) / ((x1 - x0) or 1) * pw

        def py(y):
            return mt + ph - (y - y0) / ((y1 - y0) or 1) * ph

        def pr(y):
            return mt + ph - (y - rt[0]) / ((rt[-1] - rt[0]) or 1) * ph

        out = [f'<svg class="chart" data-title="{html.escape(self.title)}" xmlns="http://www.w3.org/2000/svg" '
               f'width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="11">',
               f'<text x="{W / 2}" y="16" text-anchor="middle" font-size="13" font-weight="bold">'
               f'{html.escape(self.title)}</text>']
        if self.xband:
            a, b = self.xband
            out.append(f'<rect class="band" x="{px(a):.1f}" y="{mt}" width="{max(px(b) - px(a), 1):.1f}" '
                       f'height="{ph}" fill="#2ca02c" fill-opacity="0.15"/>')
        for t in xt:
            out.append(f'<line x1="{px(t):.1f}" y1="{mt}" x2="{px(t):.1f}" y2="{mt + ph}" stroke="#eee"/>'
                       f'<text x="{px(t):.1f}" y="{mt + ph + 14}" text-anchor="middle">{_fmt(t)}</text>')
        for t in yt:
            out.append(f'<line x1="{ML}" y1="{py(t):.1f}" x2="{ML + pw}" y2="{py(t):.1f}" stroke="#eee"/>'
                       f'<text x="{ML - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
        if rt:
            for t in rt:
                out.append(f'<text x="{ML + pw + 6}" y="{pr(t) + 4:.1f}" text-anchor="start" fill="#555">'
                           f'{_fmt(t)}</text>')
            out.append(f'<text x="{W - 10}" y="{mt + ph / 2}" text-anchor="middle" fill="#555" '
                       f'transform="rotate(90 {W - 10} {mt + ph / 2})">{html.escape(self.ylabel_right)}</text>')
        out.append(f'<rect x="{ML}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
        out.append(f'<text x="{ML + pw / 2}" y="{H - 8}" text-anchor="middle">{html.escape(self.xlabel)}</text>')
        out.append(f'<text x="14" y="{mt + ph / 2}" text-anchor="middle" transform="rotate(-90 14 {mt + ph / 2})">'
                   f'{html.escape(self.ylabel)}</text>')
        for a, b, y, color in self.spans:
            xa, xb = px(a), px(max(b, a))
            if xb - xa < 1:  # a phase shorter than a pixel (every token in one read) still shows, a pixel long
                xa, xb = (xb - 1, xb) if xb - 1 >= ML else (xa, xa + 1)
            out.append(f'<line class="data" x1="{xa:.1f}" y1="{py(y):.1f}" x2="{xb:.1f}" '
                       f'y2="{py(y):.1f}" stroke="{color}" stroke-width="{self.span_width:.1f}"/>')
        for x, label in self.vlines:
            out.append(f'<line x1="{px(x):.1f}" y1="{mt}" x2="{px(x):.1f}" y2="{mt + ph}" stroke="#2ca02c" '
                       f'stroke-width="1.5" stroke-dasharray="4 3"/><text x="{px(x) + 4:.1f}" y="{mt + 12}" '
                       f'fill="#2ca02c">{html.escape(label)}</text>')
        for i, s in enumerate(self.series):
            color = s.color or PALETTE[i % len(PALETTE)]
            proj = pr if s.right else py
            xy = [(x, y) for x, y in zip(s.xs, s.ys) if _ok(x) and _ok(y)]
            dash = ' stroke-dasharray="5 3"' if s.dash else ""
            if xy:
                p = " ".join(f"{px(x):.1f},{proj(y):.1f}" for x, y in xy)
                out.append(f'<polyline class="data" points="{p}" fill="none" stroke="{color}" '
                           f'stroke-width="1.8"{dash}/>')
            if s.markers and len(xy) <= 60:
                out += [f'<circle class="data" cx="{px(x):.1f}" cy="{proj(y):.1f}" r="3" fill="{color}"/>'
                        for x, y in xy]
        if rows:
            for i, s in enumerate(named):
                color = s.color or PALETTE[self.series.index(s) % len(PALETTE)]
                lx = ML + (i % per_row) * (pw / per_row)
                ly = TITLE_H + 10 + LEGEND_ROW * (i // per_row)
                out.append(f'<line x1="{lx:.1f}" y1="{ly - 4}" x2="{lx + 16:.1f}" y2="{ly - 4}" stroke="{color}" '
                           f'stroke-width="2"/><text x="{lx + 20:.1f}" y="{ly}">{html.escape(_legend(s))}</text>')
        out.append("</svg>")
        return "".join(out)


def _legend(s: Series) -> str:
    return (s.label + (" (right)" if s.right else ""))[:48]


def _ok(v) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


def line_chart(series: list[tuple[str, list[float], list[float]]], title: str, xlabel: str, ylabel: str,
               markers: bool = False, y_from_zero: bool = True) -> str:
    """series: (label, xs, ys). Returns an <svg> element."""
    return Chart(title, xlabel, ylabel, [Series(lb, xs, ys, markers=markers) for lb, xs, ys in series],
                 y_from_zero=y_from_zero).render()


# --- charts of results -----------------------------------------------------------------------------------------

def _ms(v):
    return None if v is None else v * 1e3


def cdf_chart(named_runs: list[tuple[str, dict]], metric: str) -> str:
    series = []
    for label, r in named_runs:
        cdf = (r["latency"].get(metric) or {}).get("cdf") or []
        if cdf:
            series.append(Series(label, [v * 1e3 for v in cdf], [i / (len(cdf) - 1) for i in range(len(cdf))]))
    if not series:
        return ""
    return Chart(f"{LABELS[metric]} CDF", f"{LABELS[metric]} (ms)", "fraction of samples", series).render()


def _load_axis(runs: list[dict]) -> str:
    return "concurrency" if runs[0]["load"]["kind"] == "concurrency" else "offered rate (req/s)"


def latency_vs_load(named: list[tuple[str, list[dict]]]) -> str:
    """p50, p90 and p99 of TTFT, ITL and E2E against the load, one colour per metric, one dash per run set."""
    series = []
    for k, (name, runs) in enumerate(named):
        runs = sorted(runs, key=lambda r: r["load"]["value"] or math.inf)
        xs = [r["load"]["value"] for r in runs]
        for j, m in enumerate(("ttft", "itl", "e2e")):
            for p, pct in enumerate(("p50", "p90", "p99")):
                label = f"{name + ' ' if name else ''}{LABELS[m]} {pct}"
                series.append(Series(label, xs, [_ms(r["latency"][m][pct]) for r in runs], markers=True,
                                     dash=k > 0, color=_shade(PALETTE[j], p)))
    first = named[0][1]
    return Chart("latency percentiles vs load", _load_axis(first), "ms", series).render()


def _shade(color: str, level: int) -> str:
    """The palette colour for p50, lighter for p90 and p99... darker reads as the tail: darker for higher p."""
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    f = (1.0, 0.7, 0.45)[level]
    return "#%02x%02x%02x" % tuple(int(c * f) for c in (r, g, b))


def throughput_vs_load(named: list[tuple[str, list[dict]]]) -> str:
    series = []
    for name, runs in named:
        runs = sorted(runs, key=lambda r: r["load"]["value"] or math.inf)
        xs = [r["load"]["value"] for r in runs]
        pre = name + " " if name else ""
        series.append(Series(pre + "requests/s", xs, [r["throughput"]["requests_per_s"] for r in runs], markers=True))
        series.append(Series(pre + "output tokens/s", xs, [r["throughput"]["output_tokens_per_s"] for r in runs],
                             markers=True, right=True))
    return Chart("throughput vs load", _load_axis(named[0][1]), "requests/s", series,
                 ylabel_right="output tokens/s").render()


def goodput_curve(search: dict) -> str:
    curve = search["curve"]
    xs = [c["rate"] for c in curve]
    series = [Series("goodput req/s", xs, [c["goodput_requests_per_s"] for c in curve], markers=True),
              Series("offered = good", xs, xs, dash=True, color="#999"),
              Series("SLO margin", xs, [c["ratio"] for c in curve], markers=True, right=True, color="#d62728")]
    cap = search.get("capacity")
    iv = search.get("interval") or [None, None]
    return Chart(f"goodput and SLO margin vs rate ({search['percentile']})", "offered rate (req/s)",
                 "good requests/s", series, ylabel_right="metric / limit (1 = on the limit)",
                 vlines=[(cap, f"capacity {cap:.3g} req/s")] if cap else [],
                 xband=(iv[0], iv[1]) if iv[0] is not None and iv[1] is not None else None).render()


def per_turn_chart(run: dict) -> str:
    turns = run.get("by_turn") or []
    if not turns:
        return ""
    xs = [t["turn"] for t in turns]
    series = [Series(f"TTFT {p}", xs, [_ms(t["ttft"][p]) for t in turns], markers=True) for p in ("p50", "p90")]
    series.append(Series("ITL p50", xs, [_ms(t["itl"]["p50"]) for t in turns], markers=True))
    series.append(Series("prompt tokens", xs, [t["input_tokens_mean"] for t in turns], right=True, dash=True,
                         color="#7f7f7f"))
    return Chart(f"latency by turn ({run['load']['label']})", "turn", "ms", series,
                 ylabel_right="prompt tokens (mean)").render()


def timeline_chart(run: dict) -> str:
    """Each request a line at its own height from start to end (light while waiting for its first token,
    dark while streaming), with requests in flight and the server's running and waiting counts overlaid."""
    req = run.get("requests") or {}
    starts = req.get("start") or []
    if not starts:
        return ""
    t0 = run["window"]["start"]
    spans = []
    for i, (s, f, e, ok) in enumerate(zip(starts, req["first_token"], req["end"], req["ok"])):
        end = e if e is not None else s
        if not ok:
            spans.append((s - t0, end - t0, i + 1, "#d62728"))
        elif f is None:
            spans.append((s - t0, end - t0, i + 1, "#aec7e8"))
        else:
            spans.append((s - t0, f - t0, i + 1, "#aec7e8"))
            spans.append((f - t0, end - t0, i + 1, "#1f77b4"))
    series = []
    tl = run["timeline"]
    if tl["t"]:
        series.append(Series("in flight (client)", [t - t0 for t in tl["t"]], tl["concurrency"], right=True,
                             color="#ff7f0e", dash=True))
    sm = run.get("server_metrics") or {}
    ser = sm.get("series") or {}
    if ser.get("t"):
        ts = [t - t0 for t in ser["t"]]
        for key, label, color in (("requests_running", "running (server)", "#2ca02c"),
                                  ("requests_waiting", "waiting (server)", "#9467bd")):
            if any(v is not None for v in ser.get(key) or []):
                series.append(Series(label, ts, ser[key], right=True, color=color))
    every = req.get("sampled_every", 1)
    width = min(6.0, max(1.0, 180 / len(starts)))  # a bar per request while they fit, a hairline beyond
    return Chart(f"requests over time ({run['load']['label']})", "time since the first measured request (s)",
                 "request" + (f" (every {every}th)" if every > 1 else ""), series, spans=spans,
                 ylabel_right="requests", span_width=width).render()


def tokens_timeline(run: dict) -> str:
    tl = run["timeline"]
    if not tl["t"]:
        return ""
    t0 = run["window"]["start"]
    return Chart(f"output tokens/s ({run['load']['label']})", "time since the first measured request (s)",
                 "tokens/s", [Series("output tokens/s", [t - t0 for t in tl["t"]], tl["output_tokens_per_s"])]
                 ).render()


# --- page ------------------------------------------------------------------------------------------------------

def _table(run: dict) -> str:
    rows = ["<tr><th>metric (ms)</th>" + "".join(f"<th>{s}</th>" for s in STATS) + "<th>n</th></tr>"]
    for m, label in LABELS.items():
        st = run["latency"].get(m)
        if st and st["count"]:
            rows.append(f"<tr><td>{label}</td>" + "".join(f"<td>{format_ms(st[s], unit=False)}</td>" for s in STATS)
                        + f"<td>{st['count']}</td></tr>")
    return "<table>" + "".join(rows) + "</table>"


def _cost_table(c: dict | None, what: str) -> str:
    if not c:
        return ""
    return (f"<p>Cost {html.escape(what)} at {c['price_per_hour']:g}/hour (an output token weighs "
            f"{c['output_cost_ratio']:g} input tokens): input {c['input_per_million']:.4g}, output "
            f"{c['output_per_million']:.4g}, all tokens {c['total_per_million']:.4g} per million; "
            f"{c['per_thousand_requests']:.4g} per thousand requests.</p>")


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
    parts.append(_cost_table(run.get("cost"), "at this load"))
    rs = run.get("reasoning")
    if rs:
        parts.append(f"<p>Reasoning streamed apart in {rs['requests']} requests: "
                     f"{rs['reasoning_tokens']['mean']:.1f} reasoning and {rs['answer_tokens']['mean']:.1f} answer "
                     f"tokens per request (mean).</p>")
    sm = run.get("server_metrics") or {}
    if sm.get("prefix_cache_hit_rate") is not None:
        parts.append(f"<p>Server prefix-cache hit rate over the run: {sm['prefix_cache_hit_rate']:.1%} "
                     f"({sm['prefix_cache_hits']:g} of {sm['prefix_cache_queries']:g} prompt tokens).</p>")
    parts.append(_table(run))
    if run.get("by_turn"):
        parts.append("<table><tr><th>turn</th><th>n</th><th>TTFT p50</th><th>TTFT p90</th><th>ITL p50</th>"
                     "<th>prompt tokens</th><th>cached tokens</th></tr>" + "".join(
                         f"<tr><td>{t['turn']}</td><td>{t['count']}</td><td>{format_ms(t['ttft']['p50'])}</td>"
                         f"<td>{format_ms(t['ttft']['p90'])}</td><td>{format_ms(t['itl']['p50'])}</td>"
                         f"<td>{_num(t['input_tokens_mean'])}</td><td>{_num(t['cached_tokens_mean'])}</td></tr>"
                         for t in run["by_turn"]) + "</table>")
    if run["errors"]:
        parts.append("<table><tr><th>error</th><th>count</th><th>sample</th></tr>" + "".join(
            f"<tr><td>{html.escape(k)}</td><td>{e['count']}</td><td>{html.escape(e['sample'] or '')}</td></tr>"
            for k, e in run["errors"].items()) + "</table>")
    for w in run["warnings"]:
        parts.append(f'<p class="warn">warning: {html.escape(w)}</p>')
    parts.append(f'<div class="charts">{timeline_chart(run)}{tokens_timeline(run)}{per_turn_chart(run)}</div>')
    return "".join(parts)


def _num(v) -> str:
    return "–" if v is None else f"{v:.1f}"


def _cdfs(named_runs: list[tuple[str, dict]]) -> str:
    return "".join(cdf_chart(named_runs, m) for m in ("ttft", "itl", "e2e", "ttft_reasoning", "ttft_content"))


def _page(title: str, body: list[str]) -> str:
    style = ("body{font-family:sans-serif;margin:24px;max-width:1200px}table{border-collapse:collapse;margin:8px 0}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td:first-child{text-align:left}"
             ".charts{display:flex;flex-wrap:wrap;gap:12px}.warn{color:#a60}pre{font-size:11px;overflow:auto}")
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>")


def render(results: dict) -> str:
    prov = results["provenance"]
    runs = results["runs"]
    tgt = prov["target"]
    body = [f"<h1>inferlab bench: {html.escape(str(tgt['model']))}</h1>",
            f"<p>{html.escape(tgt['base_url'])} ({tgt['endpoint']}), {html.escape(prov['start_time'])}<br>"
            f"<code>{html.escape(prov['command_line'])}</code></p>",
            "<p>Metric definitions: docs/metrics.md. Latencies of open-loop runs are measured from each request's "
            "scheduled time.</p>"]
    search = results.get("slo_search")
    if search:
        cap, iv = search.get("capacity"), search.get("interval") or [None, None]
        text = ("no rate met the objectives" if cap is None else
                f"highest rate meeting the objectives: <b>{cap:.3g} req/s</b>"
                + (f" (95% interval {iv[0]:.3g} to {iv[1]:.3g})" if iv[1] is not None else " (or higher)"))
        body.append(f"<h2>SLO search</h2><p>{text}; objectives "
                    + ", ".join(f"{k} &le; {v * 1e3:g} ms" for k, v in search["slos"].items())
                    + f" at {search['percentile']}, {search['points']} runs.</p>"
                    + _cost_table(search.get("cost"), "at that rate")
                    + f'<div class="charts">{goodput_curve(search)}</div>')
    if runs:
        body.append('<div class="charts">' + _cdfs([(r["load"]["label"], r) for r in runs]) + "</div>")
    if len(runs) > 1:
        body.append('<h2>against load</h2><div class="charts">' + latency_vs_load([("", runs)])
                    + throughput_vs_load([("", runs)]) + "</div>")
        sat = (results.get("sweep") or {}).get("saturation")
        if sat:
            body.append(f"<p>Throughput stops rising at {html.escape(sat['label'])} "
                        f"({sat['requests_per_s']:.2f} req/s).</p>")
    body += [_run_section(r) for r in runs]
    body.append("<details><summary>provenance</summary><pre>"
                + html.escape(json.dumps(prov, indent=1, default=str)) + "</pre></details>")
    return _page("inferlab bench report", body)


def render_compare(named: list[tuple[str, dict]]) -> str:
    """Several results files on the same axes: CDFs of every load point, and latency and throughput against
    load when a file has more than one point."""
    body = ["<h1>inferlab compare</h1>", "<ul>" + "".join(
        f"<li><b>{html.escape(n)}</b>: {html.escape(str(r['provenance']['target']['model']))} at "
        f"{html.escape(r['provenance']['target']['base_url'])}: <code>{html.escape(r['provenance']['command_line'])}"
        f"</code></li>" for n, r in named) + "</ul>"]
    pairs = [(f"{n}: {run['load']['label']}", run) for n, r in named for run in r["runs"]]
    body.append('<div class="charts">' + _cdfs(pairs) + "</div>")
    multi = [(n, r["runs"]) for n, r in named if len(r["runs"]) > 1]
    if multi:
        body.append('<h2>against load</h2><div class="charts">' + latency_vs_load(multi) + throughput_vs_load(multi)
                    + "</div>")
    return _page("inferlab compare", body)


def write_html(results: dict, path: Path) -> Path:
    Path(path).write_text(render(results), encoding="utf-8")
    return Path(path)
