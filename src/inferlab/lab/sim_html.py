"""The predictions as an offline HTML page: latency percentiles, throughput and goodput against the offered rate
(bench's own SVG line chart), the SLO-max rate, and the disaggregation comparison. A view of predict's JSON."""

from __future__ import annotations

import html
import json
from pathlib import Path

from inferlab.bench.html_report import line_chart


def render(pred: dict) -> str:
    pts = [p for p in pred["points"] if p.get("rate") is not None]
    rates = [p["rate"] for p in pts]
    ms = lambda key: [None if p[key] is None else p[key] * 1e3 for p in pts]  # noqa: E731
    charts = [
        line_chart([("TTFT p50", rates, ms("ttft_p50")), ("TTFT p99", rates, ms("ttft_p99"))],
                   "TTFT against rate", "requests/s", "ms", markers=True),
        line_chart([("ITL p50", rates, ms("itl_p50")), ("ITL p99", rates, ms("itl_p99")),
                    ("TPOT p99", rates, ms("tpot_p99"))], "ITL and TPOT against rate", "requests/s", "ms", markers=True),
        line_chart([("completed", rates, [p["requests_per_s"] for p in pts]),
                    ("good (meets SLOs)", rates, [p["goodput_requests_per_s"] for p in pts])],
                   "throughput and goodput", "offered requests/s", "requests/s", markers=True),
    ]
    body = [f"<h1>inferlab simulate: {html.escape(pred['card'])}</h1>",
            f"<p>topology: {html.escape(str(pred['topology']))}</p>",
            "<ul>" + "".join(f"<li>{html.escape(a)}</li>" for a in pred["assumptions"]) + "</ul>",
            '<div class="charts">' + "".join(charts) + "</div>"]
    m = pred.get("max_rate")
    if m:
        body.append(f"<p>Highest rate meeting the card's objectives: <b>"
                    f"{'none' if m['rate'] is None else format(m['rate'], '.3g') + ' req/s'}</b> "
                    f"(saturation {m['saturation']:.3g} req/s).</p>")
    if pred.get("disaggregation"):
        rows = "".join(f"<tr><td>{html.escape(r['topology'])}</td><td>{r['max_rate'] or 0:.3g}</td>"
                       f"<td>{r['saturation']:.3g}</td></tr>" for r in pred["disaggregation"])
        body.append("<h2>colocated vs disaggregated</h2><table><tr><th>topology</th><th>SLO-max req/s</th>"
                    f"<th>saturation req/s</th></tr>{rows}</table>")
    body.append("<details><summary>predictions (JSON)</summary><pre>"
                + html.escape(json.dumps(pred, indent=1, default=str)) + "</pre></details>")
    style = ("body{font-family:sans-serif;margin:24px;max-width:1200px}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:3px 8px}.charts{display:flex;flex-wrap:wrap;gap:12px}"
             "pre{font-size:11px;overflow:auto}")
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>inferlab simulate</title><style>{style}</style>'
            f"</head><body>{''.join(body)}</body></html>")


def write_html(pred: dict, path: str | Path) -> Path:
    p = Path(path)
    p.write_text(render(pred), encoding="utf-8")
    return p
