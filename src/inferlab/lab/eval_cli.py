"""`inferlab eval`: quality of one engine config, optionally against a baseline config, as a table and JSON.

  inferlab eval --quantization int4 --baseline "--quantization none" --json-out eval.json --max-ppl-increase 0.1

Exit status: 0 when the quality gate passes (or none is set), 1 when it fails, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

from inferlab.engine.config import EngineConfig
from inferlab.lab.eval import EvalSettings, Gate, compare, evaluate


def add_arguments(p: argparse.ArgumentParser) -> None:
    EngineConfig.add_cli_args(p)
    g = p.add_argument_group("evaluation")
    g.add_argument("--baseline", default=None, metavar="FLAGS",
                   help="engine flags of the baseline, applied over the evaluated config's, e.g. "
                        "\"--quantization none\" or \"--dtype float32\"")
    g.add_argument("--baseline-result", type=Path, default=None, metavar="JSON",
                   help="compare with a previous `inferlab eval --json-out` file instead of running a baseline")
    g.add_argument("--json-out", "--output", dest="json_out", type=Path, default=None, help="write the results here")
    g.add_argument("--window", type=int, default=512,
                   help="perplexity window in tokens: consecutive windows, each token scored once (see lab/eval.py)")
    g.add_argument("--task-max-tokens", type=int, default=16)
    g.add_argument("--max-prompts", type=int, default=None, help="use only the first N tasks and N continuations")
    g.add_argument("--continuation-prompts", type=int, default=24, help="prompts for the greedy agreement")
    g.add_argument("--continuation-tokens", type=int, default=32, help="N: tokens compared per prompt")
    g.add_argument("--corpus", default=None, help="folder of text files (default: the shipped corpus)")
    g.add_argument("--tasks", default=None, help="JSON-lines task file (default: the shipped tasks)")
    q = p.add_argument_group("quality gate (relative to the baseline; exit 1 when not met)")
    q.add_argument("--max-ppl-increase", type=float, default=None, help="e.g. 0.02 for +2%%")
    q.add_argument("--max-accuracy-drop", type=float, default=None, help="absolute, e.g. 0.05")
    q.add_argument("--min-agreement", type=float, default=None, help="share of identical continuations, e.g. 0.5")


def _settings(args: argparse.Namespace) -> EvalSettings:
    return EvalSettings(**{f.name: getattr(args, f.name) for f in fields(EvalSettings)})


def baseline_config(config: EngineConfig, flags: str) -> EngineConfig:
    """The evaluated config with `flags` (engine CLI flags) applied over it; unknown flags are an error."""
    p = argparse.ArgumentParser(prog="--baseline", add_help=False, exit_on_error=False)
    EngineConfig.add_cli_args(p)
    p.set_defaults(**config.to_dict())
    try:
        ns, extra = p.parse_known_args(shlex.split(flags))
    except (argparse.ArgumentError, ValueError) as e:
        raise ValueError(f"--baseline {flags!r}: {e}") from None
    if extra:
        raise ValueError(f"--baseline {flags!r}: not engine flags: {' '.join(extra)}")
    return EngineConfig.from_cli_args(ns)


def run_config(config: EngineConfig, settings: EvalSettings) -> dict:
    """Load the engine for `config`, evaluate it, and free it before returning."""
    from inferlab import LLM

    t0 = time.perf_counter()
    llm = LLM(**config.to_dict())
    load_s = time.perf_counter() - t0
    try:
        res = evaluate(llm, settings)
        res.update(config=config.to_dict(), quant_path=llm.engine.quant_path, weight_bytes=llm.engine.weight_bytes)
        res["seconds"]["load"] = load_s
        return res
    finally:
        del llm
        gc.collect()


def run(args: argparse.Namespace) -> int:
    config = EngineConfig.from_cli_args(args)
    settings = _settings(args)
    gate = Gate(args.max_ppl_increase, args.max_accuracy_drop, args.min_agreement)
    try:
        base_cfg = baseline_config(config, args.baseline) if args.baseline else None
        base_prev = json.loads(args.baseline_result.read_text()) if args.baseline_result else None
    except (ValueError, OSError) as e:
        print(f"inferlab eval: {e}", file=sys.stderr)
        return 2
    if base_cfg and base_prev:
        print("inferlab eval: give --baseline or --baseline-result, not both", file=sys.stderr)
        return 2
    report = run_config(config, settings)
    baseline = base_prev or (run_config(base_cfg, settings) if base_cfg else None)
    if baseline is not None:
        report["baseline"] = {k: v for k, v in baseline.items() if k != "baseline"}
        try:
            report.update(compare(report, baseline))
        except ValueError as e:
            print(f"inferlab eval: {e}", file=sys.stderr)
            return 2
    failures = gate.check(report)
    report["gate"] = {**asdict(gate), "passed": not failures, "failures": failures}
    print_report(report)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=1))
    return 1 if failures else 0


def _describe(r: dict) -> str:
    c = r.get("config", {})
    q = c.get("quantization", "?")
    g = f" g{c.get('quant_group_size')}" if q == "int4" else ""
    kv = c.get("kv_cache_dtype", "auto")
    return f"{q}{g} / {c.get('dtype', '?')}" + ("" if kv == "auto" else f" / KV {kv}")


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    base = report.get("baseline")
    t = Table(title="inferlab eval")
    t.add_column("metric")
    t.add_column(_describe(report), justify="right")
    if base:
        t.add_column(f"baseline: {_describe(base)}", justify="right")
        t.add_column("delta", justify="right")

    def row(name: str, get, fmt: str, relative: bool = False) -> None:
        v = get(report)
        cells = [name, format(v, fmt)]
        if base:
            b = get(base)
            cells += [format(b, fmt), f"{v / b - 1:+.2%}" if relative else format(v - b, "+" + fmt)]
        t.add_row(*cells)

    row("weights (MiB)", lambda r: r["weight_bytes"] / 2**20, ".1f")
    row(f"perplexity (window {report['perplexity']['window']})", lambda r: r["perplexity"]["perplexity"], ".3f", True)
    for kind in report["perplexity"]["by_kind"]:
        row(f"  {kind}", lambda r, k=kind: r["perplexity"]["by_kind"][k], ".3f", True)
    row(f"task accuracy ({report['tasks']['total']} tasks)", lambda r: r["tasks"]["accuracy"], ".1%")
    for cat in report["tasks"]["by_category"]:
        row(f"  {cat}", lambda r, c=cat: r["tasks"]["by_category"][c], ".1%")
    console.print(t)
    if "agreement" in report:
        a = report["agreement"]
        tia = a["task_answers_identical"]
        console.print(f"greedy agreement with the baseline: {a['agreement']:.1%} of {a['num_prompts']} continuations "
                      f"identical over {a['tokens']} tokens; mean first divergence at token "
                      f"{a['mean_first_divergence']:.1f}" + ("" if tia is None else f"; task answers identical: {tia:.1%}"))
    console.print(f"path: {report.get('quant_path', '?')}")
    g = report["gate"]
    if g["failures"]:
        console.print("[bold red]quality gate FAILED:[/] " + "; ".join(g["failures"]))
    elif any(g[k] is not None for k in ("max_ppl_increase", "max_accuracy_drop", "min_agreement")):
        console.print("[bold green]quality gate passed[/]")
