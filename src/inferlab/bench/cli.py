"""`inferlab bench`: load-test any OpenAI-compatible server and report latency percentiles.

Exit status: 0 done; 1 an --slo objective was missed at --slo-percentile (for a sweep: no load met them all);
2 bad flags or a fault before load started (unreachable server, refused key); 130 interrupted (the results
are still written).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shlex
import sys
from pathlib import Path

from inferlab.bench.arrivals import ARRIVALS
from inferlab.common.units import parse_duration


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of requests per second (or 'inf')") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"the rate must be positive, got {text}")
    return v


def _seconds(text: str) -> float:
    v = parse_duration(text, "duration", bare="s")  # these flags were always seconds: --timeout 600
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return v


def _length(text: str):
    from inferlab.bench.workload import LengthDist, WorkloadError

    try:
        return LengthDist.parse(text)
    except WorkloadError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _json_object(text: str) -> dict:
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e.msg}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"top_p\": 0.9}'")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("examples:\n"
                "  inferlab bench --base-url http://localhost:8000 --concurrency 16 --num-requests 200\n"
                "  inferlab bench --base-url http://localhost:8000 --rate 4 --duration 60s --slo ttft=500ms --slo tpot=50ms\n"
                "  inferlab bench --base-url http://localhost:8000 --sweep auto --slo ttft=1s\n"
                "  inferlab bench            # starts inferlab's own server on the bundled model and measures it\n"
                "  inferlab bench --card card.yaml   # a workload card's run (the lab's); flags beside it override it")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default=None, help="server to measure, e.g. http://localhost:8000 "
                                                    "(default: start inferlab's server on a free loopback port)")
    t.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    t.add_argument("--model", default=None, help="model name to request (default: the first one on /v1/models)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)")
    t.add_argument("--serve-args", default="", help="flags for the embedded `inferlab serve`, e.g. "
                                                      "\"--model m.gguf --max-num-seqs 32\"")
    t.add_argument("--server-timeout", type=_seconds, default=600.0, help="wait this long for the embedded server")

    r = p.add_argument_group("requests")
    r.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="stream responses (without streaming only E2E is measured)")
    r.add_argument("--usage-stats", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for stream_options include_usage and continuous_usage_stats (token counts per chunk)")
    r.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so the server produces the full output length (vLLM's extension)")
    r.add_argument("--temperature", type=float, default=None)
    r.add_argument("--extra-body", type=_json_object, default={}, help="JSON merged into every request body")
    r.add_argument("--timeout", type=_seconds, default=600.0, help="per-request limit (default 600 s)")

    ld = p.add_argument_group("load")
    mode = ld.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=_positive_int, default=None,
                      help="closed loop: N users, each sending its next request when the last ends (default 8)")
    mode.add_argument("--rate", type=_rate, default=None, help="open loop: requests per second ('inf': all at once)")
    ld.add_argument("--arrival", choices=ARRIVALS, default=None,
                    help="open-loop arrivals (default poisson; gamma when --burstiness is given)")
    ld.add_argument("--burstiness", type=_rate, default=None,
                    help="gamma shape: 1 = Poisson, < 1 burstier, > 1 smoother (gap CV = 1/sqrt(burstiness))")
    ld.add_argument("--max-concurrency", type=_positive_int, default=None,
                    help="open loop: cap requests in flight; waiting counts as client delay, inside the latencies")
    ld.add_argument("--num-requests", type=_positive_int, default=None,
                    help=f"requests per load point, warmup excluded (default {100}, or the file's size)")
    ld.add_argument("--duration", type=_seconds, default=None, help="stop sending after this long, e.g. 60s")
    ld.add_argument("--warmup", type=int, default=0, help="first N requests are sent but left out of the statistics")
    ld.add_argument("--seed", type=int, default=0, help="same seed, same prompts and arrival times")
    ld.add_argument("--text-seed", type=int, default=None,
                    help="draw synthetic prompts' words from this seed instead: the same lengths and arrival times "
                         "as --seed, with text no run of another text seed has put in the server's prefix cache")
    ld.add_argument("--sweep", default=None, help="several load points: 'concurrency:1,4,16', 'rate:1,2,4', a bare "
                                                  "list (rates with --rate, else concurrencies), 'auto' (double "
                                                  "the concurrency until throughput stops rising), or 'slo' (search "
                                                  "the highest rate meeting --slo at --slo-percentile, from --rate)")
    ld.add_argument("--sweep-max", type=_positive_int, default=1024, help="highest concurrency for --sweep auto")
    ld.add_argument("--workers", type=_positive_int, default=1,
                    help="spread the load over N local processes (independent random streams, records merged)")

    w = p.add_argument_group("workload")
    w.add_argument("--input-len", type=_length, default=None,
                   help="prompt tokens: N, uniform:LO,HI, normal:MEAN,STD or lognormal:MEDIAN,SIGMA (default 128)")
    w.add_argument("--output-len", type=_length, default=None, help="output tokens, same forms (default 64)")
    w.add_argument("--prefix-groups", type=int, default=0, help="G groups of prompts sharing a prefix")
    w.add_argument("--prefix-len", type=int, default=0, help="P tokens of shared prefix per group")
    w.add_argument("--dataset", default=None, help="a workload file instead of synthetic prompts")
    w.add_argument("--dataset-format", choices=["jsonl", "sharegpt", "trace", "conversations"], default=None,
                   help="jsonl: {prompt|messages, output_len}; sharegpt: conversations (every turn); trace: "
                        "{timestamp, input_len, output_len[, hash_ids]} replayed on its own schedule; "
                        "conversations: sessions whose turns resend the growing history with the model's answers "
                        "(a ShareGPT .json, a JSONL of {turns: [...]}, or synthetic without --dataset) "
                        "(default: sharegpt for .json, else jsonl)")
    w.add_argument("--turns", type=_length, default=None, help="conversations: turns per synthetic session, N or "
                                                               "uniform:LO,HI (default 4)")
    w.add_argument("--first-turn-len", type=_length, default=None,
                   help="conversations: tokens of a synthetic session's first user turn, e.g. a document "
                        "(default: --input-len, which sizes the later turns)")
    w.add_argument("--think-time", default="0", help="conversations: pause before each next turn: D, "
                                                     "exponential:MEAN, uniform:LO,HI or lognormal:MEDIAN,SIGMA "
                                                     "(e.g. exponential:2s; default 0)")
    w.add_argument("--trace-time-unit", choices=["s", "ms"], default="s")
    w.add_argument("--trace-speed", type=_rate, default=1.0, help="replay a trace this many times faster")
    w.add_argument("--tokenizer", default=None, help="HF folder, tokenizer.json or GGUF file for prompt lengths and "
                                                     "token counts, or 'none' (default: the bundled model's)")

    s = p.add_argument_group("objectives")
    s.add_argument("--slo", action="append", default=[], metavar="METRIC=DURATION",
                   help="ttft, tpot or e2e, e.g. --slo ttft=500ms --slo tpot=50ms: goodput counts requests meeting "
                        "all; the exit status is 1 when one is missed at --slo-percentile")
    s.add_argument("--slo-percentile", default="p99", help="p50, p90, p95, p99 or max (default p99)")
    s.add_argument("--slo-tolerance", type=_rate, default=0.03,
                   help="--sweep slo: bisect until the bracket is narrower than this share of its rate (default 0.03)")
    s.add_argument("--slo-repeats", type=_positive_int, default=3,
                   help="--sweep slo: runs at each end of the final bracket (default 3)")
    s.add_argument("--price-per-hour", type=_rate, default=None,
                   help="what the server costs per hour (any currency): adds cost per million input and output "
                        "tokens at each load point and at the --sweep slo capacity")
    s.add_argument("--output-cost-ratio", type=_rate, default=4.0,
                   help="with --price-per-hour: an output token costs this many input tokens (default 4)")

    o = p.add_argument_group("output")
    o.add_argument("--output-dir", default=None, help="where results go (default bench-results/<date-time>)")
    o.add_argument("--html", action=argparse.BooleanOptionalAction, default=True, help="write report.html")
    o.add_argument("--scrape-metrics", action="store_true",
                   help="read the server's Prometheus /metrics during the run (queue time, KV use, preemptions, "
                        "prefix-cache hits)")
    o.add_argument("--scrape-interval", type=_seconds, default=1.0)
    o.add_argument("--quiet", action="store_true", help="no progress bar and no table; print the results path")


def _fail(msg: str) -> int:
    print(f"inferlab bench: error: {msg}", file=sys.stderr)
    return 2


def _loads(args) -> list:
    from inferlab.bench.runner import Load

    arrival = args.arrival or ("gamma" if args.burstiness is not None else "poisson")
    burst = args.burstiness if args.burstiness is not None else 1.0
    if arrival == "gamma" and args.burstiness is None:
        raise ValueError("--arrival gamma needs --burstiness")

    def rate(v: float):
        return Load("rate", v, arrival, burst, args.max_concurrency)

    if args.sweep is None:
        if args.rate is not None:
            return [rate(args.rate)]
        if args.dataset_format == "trace" and args.concurrency is None:
            return [Load("trace", args.trace_speed, max_concurrency=args.max_concurrency)]
        return [Load("concurrency", args.concurrency or 8)]
    spec = args.sweep.strip().lower()
    if spec == "slo":
        return [rate(args.rate or 1.0)]
    if spec == "auto":
        if args.rate is not None:
            raise ValueError("--sweep auto raises the concurrency; drop --rate")
        return [Load("concurrency", args.concurrency or 1)]
    kind, _, values = spec.rpartition(":")
    kind = kind or ("rate" if args.rate is not None else "concurrency")
    if kind not in ("rate", "concurrency"):
        raise ValueError(f"--sweep {args.sweep!r}: write concurrency:1,4,16, rate:1,2,4 or auto")
    try:
        vals = [_rate(v) if kind == "rate" else _positive_int(v) for v in values.split(",") if v.strip()]
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"--sweep {args.sweep!r}: {e}") from None
    if not vals:
        raise ValueError(f"--sweep {args.sweep!r}: no values")
    return [rate(v) if kind == "rate" else Load("concurrency", v) for v in vals]


def build_config(args: argparse.Namespace, argv: list[str] | None = None):
    """Flags -> BenchConfig; ValueError (with the flag named) on a bad combination."""
    from inferlab.bench.benchmark import BenchConfig, WorkloadConfig
    from inferlab.bench.client import Target
    from inferlab.bench.slo import parse_percentile, parse_slos
    from inferlab.bench.conversation import ThinkTime
    from inferlab.bench.slo_search import SearchConfig
    from inferlab.bench.workload import LengthDist

    if args.base_url is not None and not args.base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url {args.base_url!r}: give a URL such as http://localhost:8000")
    if args.prefix_groups < 0 or args.prefix_len < 0 or args.warmup < 0:
        raise ValueError("--prefix-groups, --prefix-len and --warmup cannot be negative")
    if args.prefix_groups and args.dataset:
        raise ValueError("--prefix-groups builds synthetic prompts; it cannot be combined with --dataset")
    if args.dataset_format and args.dataset_format != "conversations" and not args.dataset:
        raise ValueError("--dataset-format needs --dataset PATH")
    conversations = args.dataset_format == "conversations"
    if args.text_seed is not None and (args.dataset or conversations):
        raise ValueError("--text-seed draws synthetic prompts' words; it has no effect on --dataset or "
                         "conversations: drop it")
    if not conversations and (args.turns or args.first_turn_len or args.think_time != "0"):
        raise ValueError("--turns, --first-turn-len and --think-time shape conversations: add "
                         "--dataset-format conversations")
    if conversations and (args.rate is not None or args.workers > 1 or args.prefix_groups):
        raise ValueError("--dataset-format conversations runs N users (--concurrency) in one process: drop --rate, "
                         "--workers and --prefix-groups")
    sweep = (args.sweep or "").strip().lower()
    if sweep == "slo" and not args.slo:
        raise ValueError("--sweep slo searches the highest rate meeting the objectives: give them with --slo, "
                         "e.g. --slo ttft=500ms")
    if sweep == "slo" and args.concurrency is not None:
        raise ValueError("--sweep slo searches a request rate: drop --concurrency (start it with --rate)")
    if args.dataset and not Path(args.dataset).is_file():
        raise ValueError(f"--dataset {args.dataset}: file not found")
    if args.duration is not None and args.rate is not None and math.isinf(args.rate):
        raise ValueError("--rate inf sends everything at once: give --num-requests, not --duration")
    fmt = args.dataset_format or ("sharegpt" if args.dataset and args.dataset.endswith(".json") else "jsonl")
    from inferlab.bench.client import api_root

    target = Target(base_url=api_root(args.base_url) if args.base_url else "", endpoint=args.endpoint,
                    model=args.model or "", api_key=args.api_key, stream=args.stream, usage_stats=args.usage_stats,
                    ignore_eos=args.ignore_eos, temperature=args.temperature, extra_body=args.extra_body,
                    timeout=args.timeout)
    wl = WorkloadConfig(input_len=args.input_len or LengthDist("fixed", 128),
                        output_len=args.output_len or LengthDist("fixed", 64), output_len_given=args.output_len is not None,
                        prefix_groups=args.prefix_groups, prefix_len=args.prefix_len, dataset=args.dataset,
                        dataset_format=fmt, trace_time_unit=args.trace_time_unit, tokenizer=args.tokenizer,
                        conversations=conversations, turns=args.turns or LengthDist("fixed", 4),
                        first_turn_len=args.first_turn_len, think_time=ThinkTime.parse(args.think_time),
                        text_seed=args.text_seed)
    out = Path(args.output_dir or Path("bench-results") / dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    args.dataset_format = fmt
    return BenchConfig(
        target=target, loads=_loads(args), workload=wl, base_url=target.base_url or None,
        serve_args=shlex.split(args.serve_args), server_timeout=args.server_timeout,
        auto_sweep=(args.sweep or "").strip().lower() == "auto", sweep_max=args.sweep_max,
        num_requests=args.num_requests, duration=args.duration, warmup=args.warmup, seed=args.seed,
        workers=args.workers, slos=parse_slos(args.slo), slo_percentile=parse_percentile(args.slo_percentile),
        # a conversation's headline is the server's prefix-cache hit rate, which only /metrics gives
        scrape_metrics=args.scrape_metrics or conversations, scrape_interval=args.scrape_interval, output_dir=out,
        quiet=args.quiet, argv=list(argv if argv is not None else sys.argv[2:]),
        slo_search=SearchConfig(start=args.rate or 1.0, tolerance=args.slo_tolerance, repeats=args.slo_repeats)
        if sweep == "slo" else None,
        price_per_hour=args.price_per_hour, output_cost_ratio=args.output_cost_ratio,
    )


def run(args: argparse.Namespace) -> int:
    from inferlab.bench.benchmark import Benchmark
    from inferlab.bench.client import BenchError
    from inferlab.bench.launcher import LaunchError
    from inferlab.bench.slo import SLOError
    from inferlab.bench.tokenizer import TokenizerError
    from inferlab.bench.workload import WorkloadError

    try:
        cfg = build_config(args)
    except (ValueError, SLOError, WorkloadError) as e:
        return _fail(str(e))
    from inferlab.bench.runner import new_loop_runner

    make_loop, _ = new_loop_runner()
    loop = make_loop()
    try:
        outcome = loop.run_until_complete(Benchmark(cfg).run())
    except (BenchError, LaunchError, TokenizerError, WorkloadError) as e:
        return _fail(str(e))
    finally:
        loop.close()
    from inferlab.bench import report

    results = outcome.results
    csv_path = report.write_csv(results, cfg.output_dir / "results.csv")
    html_path = None
    if args.html:
        from inferlab.bench.html_report import write_html

        html_path = write_html(results, cfg.output_dir / "report.html")
    if not cfg.quiet:
        report.print_results(results)
    print(f"results: {outcome.path}")
    from inferlab.bench.machine import verdict_lines

    for line in verdict_lines(results):
        print(line, file=sys.stderr)
    print(f"records: {cfg.output_dir / results['records']}   csv: {csv_path}" + (f"   html: {html_path}" if html_path else ""))
    if outcome.interrupted:
        print("interrupted: the summary covers what was measured before the interrupt", file=sys.stderr)
        return 130
    if results["slo_passed"] is False:
        return 1
    return 0
