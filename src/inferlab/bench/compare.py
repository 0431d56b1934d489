"""`inferlab compare A.json B.json`: two bench runs side by side, with B's change against A."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from inferlab.bench.report import flat_row

# (column of flat_row, label, higher is better)
ROWS = [
    ("requests_per_s", "requests/s", True),
    ("output_tokens_per_s", "output tokens/s", True),
    ("input_tokens_per_s", "input tokens/s", True),
    ("goodput_requests_per_s", "goodput req/s", True),
    ("goodput_share", "share meeting SLOs", True),
    ("per_user_tokens_per_s_mean", "per-user tokens/s", True),
    ("error_rate", "error rate", False),
    *[(f"{m}_{s}_ms", f"{m.upper() if m in ('ttft', 'tpot', 'itl', 'e2e') else m} {s} (ms)", False)
      for m in ("ttft", "tpot", "itl", "e2e") for s in ("p50", "p90", "p99")],
    ("client_delay_p99_ms", "client delay p99 (ms)", False),
    ("output_tokens_mean", "output tokens/request", True),
]


def load_results(path: str | Path) -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    if not p.is_file():
        raise FileNotFoundError(f"no bench results at {path}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e.msg})") from None
    if not isinstance(data, dict) or "runs" not in data:
        raise ValueError(f"{p}: not an inferlab bench results file (no 'runs')")
    return data


def compare_rows(a: dict, b: dict) -> list[dict]:
    """Rows of (label, a, b, delta, relative change, better?) for two run summaries."""
    ra, rb = flat_row(a), flat_row(b)
    out = []
    for key, label, higher in ROWS:
        va, vb = ra.get(key), rb.get(key)
        if va is None and vb is None:
            continue
        delta = None if va is None or vb is None else vb - va
        rel = None if delta is None or not va else delta / abs(va)
        better = None if not delta else (delta > 0) == higher
        out.append({"metric": label, "a": va, "b": vb, "delta": delta, "change": rel, "better": better})
    return out


def _num(v) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.0f}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="baseline: a results.json or its folder")
    p.add_argument("b", help="candidate: a results.json or its folder")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument("--html", default=None, metavar="PATH",
                   help="also write an HTML page drawing both runs on the same axes (CDFs, latency vs load)")


def run(args: argparse.Namespace) -> int:
    try:
        a, b = load_results(args.a), load_results(args.b)
    except (FileNotFoundError, ValueError) as e:
        print(f"inferlab compare: error: {e}", file=sys.stderr)
        return 2
    pairs = list(zip(a["runs"], b["runs"]))
    if args.html:
        from inferlab.bench.html_report import render_compare

        Path(args.html).write_text(render_compare([("A", a), ("B", b)]), encoding="utf-8")
        print(f"html: {args.html}", file=sys.stderr)
    if args.json:
        print(json.dumps([{"a_load": x["load"]["label"], "b_load": y["load"]["label"], "rows": compare_rows(x, y)}
                          for x, y in pairs], indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    con = Console()
    for name, r in (("A", a), ("B", b)):
        t = r["provenance"]["target"]
        con.print(f"[bold]{name}[/]: {t['model']} at {t['base_url']} -- {r['provenance']['command_line']}")
    if len(a["runs"]) != len(b["runs"]):
        con.print(f"[yellow]A has {len(a['runs'])} load points and B {len(b['runs'])}: comparing the first "
                  f"{len(pairs)}[/]")
    for x, y in pairs:
        title = x["load"]["label"] if x["load"]["label"] == y["load"]["label"] else \
            f"{x['load']['label']} vs {y['load']['label']}"
        t = Table(title=title, title_justify="left", header_style="bold")
        for col in ("metric", "A", "B", "B - A", "change"):
            t.add_column(col, justify="left" if col == "metric" else "right")
        for row in compare_rows(x, y):
            color = "" if row["better"] is None else ("green" if row["better"] else "red")
            change = "-" if row["change"] is None else f"{row['change']:+.1%}"
            t.add_row(row["metric"], _num(row["a"]), _num(row["b"]), _num(row["delta"]),
                      f"[{color}]{change}[/]" if color else change)
        con.print(t)
    return 0
