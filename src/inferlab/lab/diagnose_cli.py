"""`inferlab diagnose RESULTS.json [--card CARD.yaml]`: hypotheses about the bottleneck, each with the
measurement that would confirm it and the next experiment."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from inferlab.lab.diagnose import DISCLAIMER, Diagnosis, diagnose


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", help="a bench results.json (one run or a sweep), or a bench output folder")
    p.add_argument("--card", default=None, help="workload card whose objectives judge the latencies")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")


def load_results(path: str | Path) -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"cannot read {p}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not JSON ({e.msg} at line {e.lineno}); give bench's results.json") from None
    if not isinstance(data, dict) or not ("runs" in data or "latency" in data):
        raise ValueError(f"{p} does not look like bench results (no 'runs' or 'latency')")
    return data


def run(args: argparse.Namespace) -> int:
    try:
        results = load_results(args.results)
        objectives, prefix_share = None, 0.0
        if args.card:
            from inferlab.lab.card import load_card

            card = load_card(args.card)
            objectives, prefix_share = card.objectives.latency, card.traffic.prefix_share
        d = diagnose(results, objectives, prefix_share)
    except ValueError as e:  # CardError is a ValueError
        print(f"inferlab diagnose: {e}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(d.to_dict(), sys.stdout, indent=2)
        print()
    else:
        print_diagnosis(d)
    return 0


def print_diagnosis(d: Diagnosis) -> None:
    from rich.console import Console

    c = Console()
    c.print(f"[bold]Diagnosis[/] of {len(d.runs)} load point(s); judged against {d.reference}")
    c.print(f"[yellow]{DISCLAIMER}[/]\n")
    for i, h in enumerate(d.hypotheses, 1):
        tag = "[green]supported by the scraped data[/]" if h.supported else "[dim]consistent with the symptom[/]"
        c.print(f"[bold]Hypothesis {i}: {h.title}[/]  ({tag})")
        c.print(f"  symptom: {h.symptom}")
        c.print("  possible causes:")
        for cause in h.causes:
            c.print(f"    - {cause}")
        for e in h.evidence:
            c.print(f"  evidence: {e}")
        c.print(f"  to confirm: {h.confirm}")
        c.print(f"  next experiment: {h.next_experiment}"
                + (f"  (e.g. inferlab experiment CARD --vary {h.vary})" if h.vary else ""))
        c.print()
    for n in d.notes:
        c.print(f"[dim]note: {n}[/]")
