"""`inferlab experiment CARD.yaml --vary quantization=none,int8,int4 [--vary max_num_seqs=4,16]`: one server
start per config, the card's workload with repeats, quality against the baseline, one markdown report."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("card", help="the workload card (YAML)")
    p.add_argument("--vary", action="append", default=[], metavar="KEY=V1,V2",
                   help="a server option and the values to try, one at a time from the baseline (repeatable)")
    p.add_argument("--repeats", type=int, default=3, help="bench runs per config, for the spread (default 3)")
    p.add_argument("--requests", type=int, default=None, help="measured requests per run (default: the card's)")
    p.add_argument("--busy-retries", type=int, default=2,
                   help="times a run measured on a busy machine (another process used >= 10%% of the CPU) is "
                        "measured again before it is kept and flagged (default 2; 0 = flag only)")
    p.add_argument("--combine", action="store_true", help="finally try the best value of each variable together")
    p.add_argument("--no-quality", action="store_true", help="skip `inferlab eval` (the verdict then cannot "
                                                             "accept a config when the card has a quality floor)")
    p.add_argument("--eval-args", default="", help="extra flags for `inferlab eval`, e.g. '--max-prompts 20'")
    p.add_argument("--output-dir", default=None,
                   help="where state, bench results and the report go (default experiment-results/<card name>); "
                        "rerunning with the same directory resumes")
    p.add_argument("--restart", action="store_true", help="discard the state of an earlier run in --output-dir")
    p.add_argument("--report", default=None, help="report path (default OUTPUT_DIR/report.md)")


def run(args: argparse.Namespace) -> int:
    from inferlab.lab.card import load_card
    from inferlab.lab.experiment import Experiment, ExperimentError, eval_quality, parse_vary

    try:
        card = load_card(args.card)
        variations = parse_vary(args.vary, card)
        if args.repeats < 1 or (args.requests is not None and args.requests < 1):
            raise ExperimentError("--repeats and --requests must be at least 1")
    except ValueError as e:
        print(f"inferlab experiment: {e}", file=sys.stderr)
        return 2
    out = Path(args.output_dir or Path("experiment-results") / card.name)
    quality = None
    if not args.no_quality:
        model = card.server.model if card.server.kind == "inferlab" else None
        extra = shlex.split(args.eval_args)

        def quality(point, baseline, pdir):
            if card.server.kind != "inferlab":
                return None, "not measured: `inferlab eval` runs inferlab's engine, not an external one"
            return eval_quality(point, baseline, pdir, model, extra)

    exp = Experiment(card, variations, out, repeats=args.repeats, combine=args.combine, requests=args.requests,
                     quality=quality, busy_retries=args.busy_retries)
    try:
        results = exp.run(restart=args.restart)
    except ExperimentError as e:
        print(f"inferlab experiment: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: {out / 'state.json'} keeps the configs measured so far; rerun the same command to "
              f"resume", file=sys.stderr)
        return 130
    path = write_report(exp, results, args, Path(args.report) if args.report else out / "report.md")
    print(f"report: {path}")
    return 0


def write_report(exp, results, args, path: Path) -> Path:
    from inferlab.lab.diagnose import diagnose
    from inferlab.lab.diagnose_cli import load_results
    from inferlab.lab.report import render

    card = exp.card
    base = next((r for r in results if r.id == "baseline" and r.status == "measured"), None)
    diagnosis = None
    if base and base.results_paths:
        diagnosis = diagnose(load_results(base.results_paths[0]), card.objectives.latency, card.traffic.prefix_share)
    command = shlex.join(["inferlab", "experiment", args.card, *sum((["--vary", v] for v in args.vary), []),
                          "--repeats", str(args.repeats)]
                         + (["--requests", str(args.requests)] if args.requests else [])
                         + (["--combine"] if args.combine else []) + (["--no-quality"] if args.no_quality else [])
                         + (["--eval-args", args.eval_args] if args.eval_args and not args.no_quality else []))
    lines, machine = fit_lines(card, results)
    text = render(card, results, exp.variations, repeats=exp.repeats, requests=exp.requests, command=command,
                  diagnosis=diagnosis, fit_lines=lines, machine=machine)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def fit_lines(card, results) -> tuple[list[str], str]:
    """The roofline's word on each measured config of inferlab's own server: the decode lower bound on this
    hardware against the measured TPOT, and the predicted weight bytes against the server's own count."""
    if card.server.kind != "inferlab":
        return [], ""
    from inferlab.lab.fit import FitRequest, fit
    from inferlab.lab.hardware import resolve_hardware
    from inferlab.lab.model_presets import resolve_model

    try:
        spec = resolve_model(card.server.model)
        hw = resolve_hardware(card.hardware or "this machine")
    except (ValueError, FileNotFoundError, RuntimeError):
        return [], ""
    t = card.traffic
    ctx = max(16, round(t.input_len.expected + t.output_len.expected))
    lines = []
    for r in results:
        if r.status != "measured":
            continue
        q = r.config.get("quantization", "none")
        batch = min(t.concurrency or 1, int(r.config.get("max_num_seqs", 1 << 30)))
        rep = fit(spec, hw, FitRequest(context=ctx, concurrency=batch, quantization=q,
                                       quant_group_size=int(r.config.get("quant_group_size", 32))))
        bound = rep.decode[-1].step_ms / 1e3
        tpot = (r.metric("tpot.p50") or {}).get("mean")
        w = r.memory.get("weight_bytes")
        part = (f"`{r.id}`: decode lower bound at batch {batch}, context {ctx}: {bound * 1e3:.2f} ms/step "
                f"({rep.decode[-1].bound}-bound)")
        if tpot:
            part += f"; measured TPOT p50 {tpot * 1e3:.1f} ms = {bound / tpot:.0%} of the roofline"
        if w:
            part += (f"; weights predicted {rep.weights[q].total / 1e6:.0f} MB, server reports {w / 1e6:.0f} MB "
                     "(rotary tables and quantization scales included there)")
        lines.append(part)
    if lines:
        lines.insert(0, f"Roofline on {hw.name}: {hw.bandwidth / 1e9:.1f} GB/s read bandwidth, "
                        f"{hw.flops.get('bf16', 0) / 1e9:.0f} GFLOP/s bf16 ({'measured' if hw.measured else 'datasheet'}). "
                        "Batch: the smaller of the card's concurrency and max_num_seqs, an upper bound on the running batch.")
    return lines, hw.name
