"""The `inferlab` command. Each subcommand lives beside the code it drives and is imported only when used,
so `inferlab bench` starts without loading torch."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). The module defines add_arguments(parser) and run(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("inferlab.engine.demo", "answer chat prompts offline on a model (default: the bundled one), with a throughput line"),
    "serve": ("inferlab.scaleout.cli", "start the OpenAI-compatible streaming server (--replicas N: on Ray Serve)"),
    "bench": ("inferlab.bench.cli", "load-test any OpenAI-compatible server and report latency percentiles"),
    "fake-server": ("inferlab.bench.fake_server_cli", "a deterministic OpenAI-compatible server with known timings"),
    "compare": ("inferlab.bench.compare", "show two bench result files side by side with deltas"),
    "eval": ("inferlab.lab.eval_cli", "quality evaluation: perplexity, task accuracy, greedy agreement"),
    "fit": ("inferlab.lab.fit_cli", "memory fit and roofline estimates for a model on a hardware preset"),
    "experiment": ("inferlab.lab.experiment_cli", "one-variable-at-a-time experiments from a workload card"),
    "diagnose": ("inferlab.lab.diagnose_cli", "hypotheses about bottlenecks from bench results"),
    "simulate": ("inferlab.lab.simulate_cli", "predict latency, goodput and capacity with the engine's own scheduler"),
}


def _top_parser() -> argparse.ArgumentParser:
    from inferlab import __version__

    p = argparse.ArgumentParser(prog="inferlab", description="LLM inference engineering: serve, measure, decide.")
    p.add_argument("--version", action="version", version=f"inferlab {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        parser = _top_parser()
        if not argv:
            parser.print_help()
            return 2
        parser.parse_args(argv)  # --help / --version / an unknown command: argparse prints and exits
        return 2
    name, rest = argv[0], argv[1:]
    if name == "bench" and any(a == "--card" or a.startswith("--card=") for a in rest):
        # A workload card is the lab's: the lab turns it into bench flags and runs bench (bench imports no lab).
        from inferlab.lab.bench_card_cli import main as bench_card

        return _interruptible(bench_card, rest)
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"inferlab {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    return _interruptible(module.run, parser.parse_args(rest))


def _interruptible(run, arg) -> int:
    try:
        return int(run(arg) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
