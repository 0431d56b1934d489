"""`inferlab simulate`: calibrate a step-cost profile, predict a workload card's latency, goodput and capacity with
the engine's own scheduler, and validate the prediction against the real server.

  inferlab simulate calibrate engine -o profile.json [engine flags]        # profile inferlab's engine offline
  inferlab simulate calibrate bench RUN/results.json ... -o profile.json    # black-box, from bench runs
  inferlab simulate calibrate served CARD --rates 0.5,2 -o profile.json     # the card's server's own steps, served
  inferlab simulate calibrate trace steps.jsonl ... -o profile.json         # from `inferlab serve --step-trace`
  inferlab simulate predict CARD --profile profile.json [--rates 0.5,1,2] [--replicas 2] [--disaggregate 2]
  inferlab simulate validate CARD --profile profile.json --rates 0.3,0.6   # bench the real server, compare
  inferlab simulate validate CARD --profile profile.json --max-rate-within 0.15   # and check the SLO-max rate
  inferlab simulate validate CARD --profile profile.json --rates 0.5,2,4 --leave-one-out   # each from the others
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from inferlab.common.units import UnitError, format_ms, parse_bytes, parse_duration

ROUTER_HELP = "round-robin | least-loaded | prefix-affinity"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n\n", 1)[1]
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    cal = sub.add_parser("calibrate", help="fit a step-cost profile").add_subparsers(dest="source", required=True,
                                                                                    metavar="SOURCE")
    eng = cal.add_parser("engine", help="profile inferlab's engine offline (a minute or two on a small CPU)")
    eng.add_argument("-o", "--output", default="step-cost.json")
    eng.add_argument("--repeats", type=int, default=1, help="passes over the profile plan after a warm-up pass")
    from inferlab.engine.config import EngineConfig

    EngineConfig.add_cli_args(eng)
    bb = cal.add_parser("bench", help="black-box, from `inferlab bench` results.json files of any server")
    bb.add_argument("results", nargs="+", help="results.json files: concurrency 1 with varied prompt lengths, and a "
                                               "few higher concurrencies")
    bb.add_argument("-o", "--output", default="step-cost.json")
    bb.add_argument("--max-num-seqs", type=int, default=64, help="the server's running-sequence limit")
    bb.add_argument("--max-num-batched-tokens", type=int, default=512, help="the server's step token budget")
    bb.add_argument("--max-prefill-tokens-with-decodes", type=int, default=None)
    bb.add_argument("--block-size", type=int, default=16)
    bb.add_argument("--num-blocks", type=int, default=4096, help="KV blocks of the server's pool")
    bb.add_argument("--max-queue", type=int, default=256, help="the server's waiting-queue bound (429 beyond)")
    bb.add_argument("--model", default=None, help="preset, GGUF or HF folder for KV bytes per token (default bundled)")
    bb.add_argument("--hardware", default="this machine", help="where the server ran (a preset or 'this machine')")
    sv = cal.add_parser("served", help="serve the card's load at a few rates with a step trace, fit to it "
                                       "(inferlab's server: the most accurate profile)")
    sv.add_argument("card", help="workload card (YAML) whose server is inferlab's")
    sv.add_argument("--rates", required=True, help="requests/s to serve, comma-separated (validate at others)")
    sv.add_argument("--requests", type=int, default=60, help="measured requests per rate")
    sv.add_argument("--output-dir", default="simulate-calibrate", help="bench results and the step trace go here")
    sv.add_argument("-o", "--output", default="step-cost.json")
    sv.add_argument("--depth-probe", type=int, default=4096, metavar="TOKENS",
                    help="then serve prompts of 512, 1024, ... up to this many tokens, one at a time, then each "
                         "beside a short prompt, so that the fit sees prefill attention and decodes deeper than the "
                         "card's and the profile predicts longer prompts (~50 s on a 2-core CPU at 4096); 0: the "
                         "card's load only")
    sv.add_argument("--alone", type=int, default=20, metavar="N",
                    help="then N of the card's requests one at a time: what their TTFTs exceed their simulated "
                         "ones by is the request overhead (HTTP, tokenization, the first write); 0: take it from the "
                         "lowest rate's requests, where queueing mixes in the step model's errors")
    tr = cal.add_parser("trace", help="fit to step traces written by `inferlab serve --step-trace`")
    tr.add_argument("traces", nargs="+", help="trace files of one engine setting (a disaggregated server's worker "
                                              "traces together)")
    tr.add_argument("-o", "--output", default="step-cost.json")

    for name, helptext in (("predict", "predict a card's latency, goodput and capacity"),
                           ("validate", "bench the real server at rates the calibration did not use and compare")):
        q = sub.add_parser(name, help=helptext)
        q.add_argument("card", help="workload card (YAML)")
        q.add_argument("--profile", required=True, help="step-cost profile from `inferlab simulate calibrate`")
        q.add_argument("--rates", default=None, help="requests/s to simulate, comma-separated (default: a sweep "
                                                     "up to saturation)")
        q.add_argument("--requests", type=int, default=400, help="measured requests per simulated point")
        q.add_argument("--search-requests", type=int, default=2000,
                       help="simulated requests a point in the searches (SLO-max rate, replicas, disaggregation), "
                            "whatever --requests is: enough for a p99 objective to be the load's, not one draw's")
        q.add_argument("--arrival", choices=["poisson", "gamma", "constant"], default=None)
        q.add_argument("--burstiness", type=float, default=None)
        q.add_argument("--max-queue", type=int, default=None, help="admission limit (default: the profile's)")
        q.add_argument("--json", default=None, help="write the predictions here")
        q.add_argument("--noise-draws", type=int, default=9 if name == "validate" else 1,
                       help="runs of each point with their own draws of the profile's step noise, each figure their "
                            "median (validate: also their p10-p90 beside what was measured; a draw of a few dozen "
                            "requests near saturation moves by ~8%% with the noise alone)")
        if name == "validate":
            q.add_argument("--base-url", default=None, help="a running server (default: start the card's)")
            q.add_argument("--output-dir", default="simulate-validate", help="bench results go here")
            q.add_argument("--max-rate-within", type=float, default=None, metavar="FRACTION",
                           help="also check the predicted SLO-max rate: simulate it for one draw of the card "
                                "(--bracket-requests; the load's, on --search-requests, is printed beside it), then "
                                "bench that draw at (1 - F) and (1 + F) times it; the measured maximum lies within "
                                "F of the prediction when the card passes at the first and fails at the second")
            q.add_argument("--bracket-requests", type=int, default=200,
                           help="measured requests in the draw benched at both bracket rates (the same lengths and "
                                "arrival gaps, scaled by the rate, in different words)")
            q.add_argument("--leave-one-out", action="store_true",
                           help="predict each rate from the server's own steps at the other rates (the card's "
                                "inferlab server, started here with --step-trace) instead of --profile's "
                                "coefficients: calibration and prediction a few minutes apart, never the same run")
            continue
        q.add_argument("--users", default=None, help="closed loop instead of rates: concurrent users (streams), "
                                                     "comma-separated, as `inferlab bench --concurrency`")
        q.add_argument("--replicas", type=int, default=1)
        q.add_argument("--router", default="least-loaded", help=ROUTER_HELP)
        q.add_argument("--prefill", type=int, default=0, help="P prefill instances (disaggregated; with --decode)")
        q.add_argument("--decode", type=int, default=0, help="D decode instances")
        q.add_argument("--link-bandwidth", default="10GB", help="KV link bytes per second, e.g. 10GB (per second)")
        q.add_argument("--link-latency", default="0ms")
        q.add_argument("--target-rate", type=float, default=None, help="replicas needed for this many requests/s")
        q.add_argument("--disaggregate", type=int, default=None, metavar="N",
                       help="compare N colocated replicas against every P+D split of N instances")
        q.add_argument("--hardware", default=None, help="scale the profile to this hardware preset (roofline)")
        q.add_argument("--trace", default=None, help="replay a bench trace file (timestamp, input_len, output_len)")
        q.add_argument("--trace-speeds", default="1", help="trace replay speed-ups, comma-separated")
        q.add_argument("--no-search", action="store_true", help="skip the SLO-max rate search")
        q.add_argument("--html", default=None, help="write an HTML page of the predictions (charts) here")


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "calibrate":
            return _calibrate(args)
        if args.action == "predict":
            return _predict(args)
        return _validate(args)
    except (ValueError, UnitError) as e:
        print(f"inferlab simulate: error: {e}", file=sys.stderr)
        return 2


# --- calibrate ---------------------------------------------------------------------------------------------------

def _calibrate(args) -> int:
    from inferlab.lab.calibrate import calibrate_blackbox, calibrate_engine

    command = shlex.join(["inferlab", "simulate", *sys.argv[2:]]) if len(sys.argv) > 2 else ""
    if args.source == "served":
        cost = _calibrate_served(args, command)
    elif args.source == "trace":
        from inferlab.lab.calibrate import calibrate_served

        cost = calibrate_served(args.traces, _this_machine(), command)
    elif args.source == "engine":
        from inferlab.engine.config import EngineConfig

        cost = calibrate_engine(EngineConfig.from_cli_args(args), args.repeats, log=lambda m: print(m, file=sys.stderr))
        cost.command = command
    else:
        from inferlab.lab.hardware import resolve_hardware
        from inferlab.lab.model_presets import resolve_model
        from inferlab.lab.simulator import EngineShape

        shape = EngineShape(args.max_num_seqs, args.max_num_batched_tokens, args.max_prefill_tokens_with_decodes,
                            args.block_size, args.num_blocks, True, args.max_queue)
        shape.validate()
        spec = resolve_model(args.model)
        hw = resolve_hardware(args.hardware)
        dtype = "bf16"
        hardware = {"name": hw.name, "bandwidth": hw.bandwidth, "flops": hw.peak_flops(dtype)}
        cost = calibrate_blackbox(args.results, shape, {"name": spec.name, "dtype": dtype,
                                                        "kv_bytes_per_token": spec.kv_bytes_per_token(2)},
                                  hardware, command)
    path = cost.save(args.output)
    print_profile(cost)
    print(f"profile: {path}")
    return 0


def _this_machine() -> dict:
    from inferlab.lab.hardware import probe_this_machine

    hw = probe_this_machine("cpu")
    return {"name": hw.name, "bandwidth": hw.bandwidth, "flops": hw.peak_flops("bf16")}


def _calibrate_served(args, command: str):
    """Serve the card's load at each rate with the step trace on (then the depth probe), fit the step cost to the
    trace, then the request overhead to the lowest rate's TTFT (fit_request_overhead)."""
    from inferlab.lab.calibrate import calibrate_served
    from inferlab.lab.card import load_card, start_server
    from inferlab.lab.depth_probe import BESIDE, probe_depths

    card = load_card(args.card)
    if card.server.kind != "inferlab":
        raise ValueError(f"{args.card}: `calibrate served` needs the card's server to be inferlab's (it reads the "
                         f"engine's step trace); for another server use `calibrate bench`")
    if args.depth_probe < 0:
        raise ValueError(f"--depth-probe {args.depth_probe}: give a prompt length in tokens, or 0 for no probe")
    if args.alone < 0:
        raise ValueError(f"--alone {args.alone}: give a number of requests, or 0 to fit the overhead at the lowest rate")
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / "steps.jsonl"
    rates = _rates(args.rates) or []
    print(f"starting the card's server ({card.server.kind}) with a step trace ...", file=sys.stderr)
    with start_server(card.server, config={**card.server.config, "step_trace": str(trace)},
                      log_path=out_dir / "server.log") as srv:
        # Seeds apart from validate's (card seed + i): a calibration prompt never sits in the prefix cache of a
        # validation run on the same server, or the other way round.
        points = bench_rates(card, [LoadPoint(r, args.requests, card.traffic.seed + 1000 + i)
                                    for i, r in enumerate(rates)], out_dir, base_url=srv.base_url)
        alone = bench_rates(card, [LoadPoint(0.0, args.alone, card.traffic.seed + 2000, users=1)], out_dir,
                            base_url=srv.base_url) if args.alone else []
        probed = probe_depths(srv.base_url, args.depth_probe, api_key=srv.api_key,
                              log=lambda m: print(m, file=sys.stderr)) if args.depth_probe else []
    cost = calibrate_served([trace], _this_machine(), command)
    if probed:
        cost.notes.append(f"depth probe: prompts of {', '.join(map(str, sorted(set(probed))))} tokens served alone "
                          f"after the card's load, {len(probed)} in all, then each beside a prompt of {BESIDE} "
                          f"tokens (depth_probe.py)")
    others = [m for _, _, m in points]
    if alone:
        _, card_k, measured = alone[0]
        fit_request_overhead(cost, card_k, None, args.alone, measured, trace, others)
    elif points:
        rate, card_k, measured = min(points, key=lambda p: p[0])
        fit_request_overhead(cost, card_k, rate, args.requests, measured, trace, others)
    return cost


DELIVERY_QUANTILES = 20  # of the tokens' delivery times a served profile keeps


def fit_request_overhead(cost, card, rate: float | None, requests: int, measured: dict,
                         trace: Path | None = None, others: list[dict] = ()) -> None:
    """The request overhead (the way in: HTTP, tokenization; without a trace, the way out too) from one
    calibration run of `card` (as run: its seed), `requests` requests at `rate`, or one at a time (rate None: a
    closed loop of one user).

    With the server's step trace (its request lines, lab/ttft_split.py), the way in is measured: the median over
    the run's requests of the time from their start to the engine taking them. And so is the way out, over these
    requests and those of the `others` runs (the calibration's rates): the profile keeps DELIVERY_QUANTILES
    quantiles of the time from a first token's sampling to the client reading it, which the simulator adds to
    every token. Its tail is the client's inter-token tail that steps do not make: on the short card the server's
    steps gave ITL p99 25.6-40.6 ms, the client read 30.0-47.1 (docs/benchmarks.md). Else the simulation without an
    overhead is bench's draw request by request, and the overhead is the median of measured - simulated TTFT; that
    pairs each request with itself but charges the overhead with the step model's error for the request's prefill:
    two calibrations on the Xeon found 4.9 and 1.7 ms over requests served alone where their traces measured 3.8
    and 3.4 (docs/benchmarks.md). Under a queue, TTFT amplifies every error of the step model (seen: +7 ms at 1 req/s,
    +173 ms at 3 req/s), so requests served alone are best: they queue behind nothing."""
    from statistics import median

    import numpy as np

    where = "served one at a time" if rate is None else f"at {rate:g} req/s"
    if trace is not None and measured.get("path"):
        from inferlab.engine.step_trace import read_trace_requests
        from inferlab.lab.ttft_split import split_run

        served = read_trace_requests(trace)
        parts = split_run(measured["path"], served)
        if parts:
            cost.request_overhead = median(p.http + p.taken for p in parts.values())
            outs = [p.out for p in parts.values()]
            for m in others:
                if m.get("path"):
                    outs += [p.out for p in split_run(m["path"], served).values()]
            cost.delivery = [float(v) for v in np.quantile(
                outs, (np.arange(DELIVERY_QUANTILES) + 0.5) / DELIVERY_QUANTILES)]
            cost.notes.append(f"request_overhead: median over {len(parts)} requests {where} of their start to the "
                              f"engine taking them, from the step trace ({cost.request_overhead * 1e3:.1f} ms); "
                              f"delivery: {DELIVERY_QUANTILES} quantiles of {len(outs)} first tokens' sampling to "
                              f"the client reading them (median {median(outs) * 1e3:.1f} ms, max "
                              f"{max(outs) * 1e3:.1f})")
            return
    from inferlab.bench import metrics
    from inferlab.bench.records import read_records
    from inferlab.lab.calibrate import shape_from
    from inferlab.lab.sim_summary import request_latencies, summarize
    from inferlab.lab.sim_workload import card_requests
    from inferlab.lab.simulator import Simulation, Topology
    from inferlab.lab.step_cost import StepCost

    without = StepCost.from_dict({**cost.to_dict(), "request_overhead": 0.0})
    reqs = card_requests(card.traffic, requests, rate=math.inf if rate is None else rate)
    run = Simulation(without, shape_from(cost.engine), Topology()).run(reqs, users=1 if rate is None else None)
    simulated = {o.request_id: (o.prompt_len, request_latencies(o)["ttft"]) for o in run.outcomes if not o.warmup}
    records = Path(measured["path"]).with_name("records.jsonl") if measured.get("path") else None
    diffs = []
    for r in read_records(records) if records is not None and records.is_file() else ():
        prompt_len, simulated_ttft = simulated.get(f"r{r.index}", (None, None))
        t = metrics.ttft(r)
        if r.warmup or t is None or simulated_ttft is None:
            continue
        if r.input_len is not None and r.input_len != prompt_len:  # not the draw simulated: pair nothing
            diffs = []
            break
        diffs.append(t - simulated_ttft)
    if diffs:
        cost.request_overhead = max(0.0, median(diffs))
        cost.notes.append(f"request_overhead: median over {len(diffs)} requests of measured - simulated TTFT "
                          f"{where} ({cost.request_overhead * 1e3:.1f} ms)")
        return
    m = measured["latency"]["ttft"].get("p50")
    load = {"kind": "concurrency", "value": 1} if rate is None else {"kind": "rate", "value": rate}
    p = summarize(run, load=load, slos={})["latency"]["ttft"].get("p50")
    if m is not None and p is not None:
        cost.request_overhead = max(0.0, m - p)
        cost.notes.append(f"request_overhead: measured - simulated TTFT p50 {where} ({m * 1e3:.1f} - {p * 1e3:.1f} ms)")


def print_profile(cost) -> None:
    from rich.table import Table

    t = Table(title=f"step-cost model ({cost.source})")
    t.add_column("term")
    t.add_column("coefficient", justify="right")
    for name, unit, scale in (("intercept", "ms / step", 1e3), ("per_prefill_token", "µs / prefill token", 1e6),
                              ("per_decode_seq", "µs / decoding sequence", 1e6),
                              ("per_attended", "ns / key a decode reads", 1e9),
                              ("per_sampled_row", "µs / sampled row", 1e6),
                              ("request_overhead", "ms / request", 1e3),
                              ("per_prefill_step", "ms / step with a prefill", 1e3),
                              ("per_prefill_pair", "ns / prefill (query, key) pair", 1e9)):
        t.add_row(name, f"{getattr(cost, name) * scale:.3f} {unit}")
    q = cost.fit
    _console().print(t)
    if q.rows:
        groups: dict[str, list[float]] = {}
        for r in q.rows:
            groups.setdefault(r["label"].split(" (")[0], []).append(r["predicted"] / r["measured"] - 1)
        g = Table(title="residuals by measurement kind: predicted / measured - 1")
        for col in ("measurements", "n", "median", "worst"):
            g.add_column(col, justify="left" if col == "measurements" else "right")
        for name, errs in groups.items():
            errs.sort()
            g.add_row(name, str(len(errs)), f"{errs[len(errs) // 2]:+.0%}", f"{max(errs, key=abs):+.0%}")
        _console().print(g)
    if q.n:
        print(f"fit: {q.n} measurements, R² {q.r2:.4f}; relative residuals |pred-meas|/meas p50 "
              f"{q.rel_abs_p50:.1%}, p90 {q.rel_abs_p90:.1%}, max {q.rel_abs_max:.1%}; mean signed {q.rel_mean:+.1%}"
              + (f"; {q.outliers} left out of the fit as outliers" if q.outliers else ""))


def _console():
    from rich.console import Console

    # A pipe or a log file gets the full table rather than 80 columns of ellipses.
    return Console() if sys.stdout.isatty() else Console(width=180)


# --- predict -----------------------------------------------------------------------------------------------------

def _scenario(args):
    from inferlab.lab.capacity import Scenario, card_shape
    from inferlab.lab.card import load_card
    from inferlab.lab.step_cost import StepCost

    card = load_card(args.card)
    cost = StepCost.load(args.profile)
    if args.noise_draws < 1:
        raise ValueError(f"--noise-draws {args.noise_draws}: give at least one run a point")
    return Scenario(card, cost, card_shape(card, cost, args.max_queue), requests=args.requests,
                    arrival=args.arrival, burstiness=args.burstiness, noise_draws=args.noise_draws)


def _rates(text: str | None) -> list[float] | None:
    if not text:
        return None
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--rates {text!r}: write requests/s separated by commas, e.g. 0.5,1,2") from None
    if any(not r > 0 for r in rates):
        raise ValueError("--rates: every rate must be positive")
    return rates


def _predict(args) -> int:
    from inferlab.lab import capacity
    from inferlab.lab.simulator import Topology

    if args.search_requests < 1:
        raise ValueError(f"--search-requests {args.search_requests}: give at least one request")
    sc = _scenario(args)
    if args.hardware:
        from inferlab.lab.hardware import resolve_hardware

        hw = resolve_hardware(args.hardware)
        sc = replace(sc, cost=sc.cost.scaled(hw.name, hw.bandwidth, hw.peak_flops(sc.cost.model.get("dtype", "bf16"))))
    kvpt = float(sc.cost.model.get("kv_bytes_per_token") or 0)
    sc.topology = Topology(args.replicas, args.router, args.prefill, args.decode, kvpt,
                           parse_bytes(args.link_bandwidth, "--link-bandwidth"),
                           parse_duration(args.link_latency, "--link-latency"))
    sc.topology.validate()
    out: dict = {"card": sc.card.name, "profile": args.profile, "cost": sc.cost.to_dict(), "engine": asdict(sc.shape),
                 "topology": asdict(sc.topology), "assumptions": assumptions(sc)}
    if args.trace:
        from inferlab.lab.sim_workload import trace_requests

        sc.trace = trace_requests(args.trace)
        points = [capacity.simulate(sc, speed=float(s)) for s in args.trace_speeds.split(",")]
    elif args.users:
        try:
            users = [int(u) for u in args.users.split(",")]
        except ValueError:
            raise ValueError(f"--users {args.users!r}: give whole numbers, comma-separated, e.g. 16,64") from None
        if any(u < 1 for u in users):
            raise ValueError("--users must be >= 1")
        points = [capacity.simulate(sc, users=u) for u in users]
    else:
        sat = capacity.saturation(sc)
        out["saturation_requests_per_s"] = sat
        rates = _rates(args.rates) or [round(sat * f, 3) for f in (0.1, 0.25, 0.5, 0.7, 0.85, 1.0, 1.2)]
        points = [capacity.simulate(sc, rate=r) for r in rates]
    out["points"] = [_compact(sc.card, s) for s in points]
    print_points(out["points"], f"{sc.card.name}: predicted on {sc.topology.describe()} ({sc.cost.source})")
    search = replace(sc, requests=args.search_requests)
    out["search_requests"] = args.search_requests
    if not args.no_search and not args.trace:
        m = capacity.max_rate(search)
        out["max_rate"] = {"rate": m.rate, "saturation": m.saturation, "tried": m.tried,
                           "at_max": _compact(sc.card, m.summary) if m.summary else None}
        print(f"highest rate meeting the card's objectives on {sc.topology.describe()}: "
              + (f"{m.rate:.3g} req/s" if m.rate else "none (even a light load misses them)")
              + f" (saturation {m.saturation:.3g} req/s)")
    if args.target_rate:
        n, s = capacity.replicas_for(search, args.target_rate)
        out["replicas_for_target"] = {"rate": args.target_rate, "router": args.router, "replicas": n,
                                      "at_target": _compact(sc.card, s) if s else None}
        print(f"replicas needed for {args.target_rate:g} req/s ({args.router}): {n if n else 'more than 32'}")
    if args.disaggregate:
        rows = capacity.disaggregation(search, args.disaggregate)
        out["disaggregation"] = [{"topology": t.describe(), "max_rate": m.rate, "saturation": m.saturation,
                                  "at_max": _compact(sc.card, m.summary) if m.summary else None} for t, m in rows]
        print_disagg(out["disaggregation"])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str), encoding="utf-8")
        print(f"predictions: {args.json}")
    if args.html:
        from inferlab.lab.sim_html import write_html

        print(f"html: {write_html(out, args.html)}")
    return 0


def assumptions(sc) -> list[str]:
    c = sc.cost
    return [f"step cost from {c.source} (fit residual p50 {c.fit.rel_abs_p50:.1%})" if c.fit.rel_abs_p50 is not None
            else f"step cost from {c.source}",
            f"scheduler: max_num_seqs {sc.shape.max_num_seqs}, max_num_batched_tokens "
            f"{sc.shape.max_num_batched_tokens}, {sc.shape.num_blocks} KV blocks of {sc.shape.block_size}, "
            f"max_queue {sc.shape.max_queue}",
            "each instance on its own hardware; router and network add no delay; outputs run to their drawn length",
            f"{sc.requests} measured requests per point, the card's seed"]


def _compact(card, s: dict) -> dict:
    from inferlab.lab.capacity import checks

    lat = s["latency"]
    return {"load": s["load"]["label"], "rate": s["load"].get("value"), "topology": s.get("topology"),
            **{f"{m}_{p}": lat[m][p] for m in ("ttft", "itl", "tpot", "e2e") for p in ("p50", "p90", "p99")},
            "requests_per_s": s["throughput"]["requests_per_s"],
            "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
            "goodput_share": (s["goodput"] or {}).get("share"),
            "goodput_requests_per_s": (s["goodput"] or {}).get("requests_per_s"),
            "error_rate": s["counts"]["error_rate"], "preemptions": s["engine"]["preemptions"],
            "little": s["little"],
            "meets_card": all(c.passed is True for c in checks(card, s)),
            "checks": [asdict(c) for c in checks(card, s)]}


def print_points(points: list[dict], title: str) -> None:
    from rich.table import Table

    t = Table(title=title)
    for col in ("load", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TPOT p99", "E2E p99", "req/s", "tok/s",
                "goodput", "errors", "meets card"):
        t.add_column(col, justify="left" if col == "load" else "right")
    for p in points:
        t.add_row(p["load"], format_ms(p["ttft_p50"]), format_ms(p["ttft_p99"]), format_ms(p["itl_p50"]),
                  format_ms(p["itl_p99"]), format_ms(p["tpot_p99"]), format_ms(p["e2e_p99"]),
                  f"{p['requests_per_s']:.2f}", f"{p['output_tokens_per_s']:.1f}",
                  "–" if p["goodput_share"] is None else f"{p['goodput_share']:.0%}", f"{p['error_rate']:.0%}",
                  "yes" if p["meets_card"] else "no")
    _console().print(t)


def print_disagg(rows: list[dict]) -> None:
    from rich.table import Table

    t = Table(title="colocated vs disaggregated (same number of instances)")
    for col in ("topology", "SLO-max rate", "saturation", "TTFT p99 at max", "ITL p99 at max"):
        t.add_column(col)
    for r in rows:
        a = r["at_max"] or {}
        t.add_row(r["topology"], "none" if r["max_rate"] is None else f"{r['max_rate']:.3g} req/s",
                  f"{r['saturation']:.3g} req/s", format_ms(a.get("ttft_p99")), format_ms(a.get("itl_p99")))
    _console().print(t)


# --- validate ----------------------------------------------------------------------------------------------------

VALIDATED = (("ttft", "p50"), ("ttft", "p99"), ("itl", "p50"), ("itl", "p99"), ("tpot", "p50"), ("tpot", "p99"),
             ("e2e", "p50"), ("e2e", "p99"))


def _validate(args) -> int:
    import numpy as np

    from inferlab.lab import capacity
    from inferlab.engine.step_trace import read_step_trace, read_trace_requests
    from inferlab.lab.calibrate import calibrate_served, shape_from, step_time_ratio
    from inferlab.lab.ttft_split import split_run

    sc = _scenario(args)
    rates = _rates(args.rates) or []
    arrival = args.arrival or sc.card.traffic.open_loop_arrival
    bracket = None
    if args.max_rate_within is not None:
        if not 0 < args.max_rate_within < 1:
            raise ValueError(f"--max-rate-within {args.max_rate_within}: give a fraction between 0 and 1, e.g. 0.15")
        for flag in ("search_requests", "bracket_requests"):
            if getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give at least one request")
        # The load's SLO-max rate, as predict answers it: a search on a large simulated draw (on
        # examples/card-cpu.yaml a draw's TTFT p99 decides it, and the answer moves with the draw's size: 1.45 req/s
        # at 400 requests a point, 1.09 / 1.16 / 1.11 at 1,000 / 2,000 / 4,000; docs/benchmarks.md).
        load_max = capacity.max_rate(replace(sc, requests=args.search_requests, noise_draws=1))
        # What is checked against the server is the SLO-max of the very draw it is sent: one seed's lengths and
        # arrival gaps, the gaps scaled by each rate (common random numbers). A draw of a few hundred requests meets
        # a p99 objective well above or below the load's rate by luck (at 1.15x the load's SLO-max, 8 of 20 such
        # draws met examples/card-cpu.yaml), which a bracket around the load's rate cannot tell from a wrong model;
        # on one draw at two rates, only the model (and the host) can put the server on the wrong side.
        draw_seed = sc.card.traffic.seed + len(rates)
        draw_card = replace(sc.card, traffic=replace(sc.card.traffic, seed=draw_seed))
        m = capacity.max_rate(replace(sc, card=draw_card, arrival=arrival, requests=args.bracket_requests),
                              past_saturation=True)
        if m.rate is None:
            raise ValueError("the card's objectives are not met at any simulated rate: no SLO-max rate to check")
        bracket = (m.rate, m.rate * (1 - args.max_rate_within), m.rate * (1 + args.max_rate_within))
    if not rates and bracket is None:
        raise ValueError("validate needs --rates (requests/s the calibration did not use) or --max-rate-within")
    loads = [LoadPoint(r, args.requests, sc.card.traffic.seed + i) for i, r in enumerate(rates)]
    if bracket is not None:  # one draw in two texts, so the second point finds nothing of the first in the cache
        loads += [LoadPoint(round(bracket[1], 4), args.bracket_requests, draw_seed, text_seed=1),
                  LoadPoint(round(bracket[2], 4), args.bracket_requests, draw_seed, text_seed=2)]
    out = {"card": sc.card.name, "profile": args.profile, "base_url": args.base_url,
           "leave_one_out": args.leave_one_out, "points": []}
    if args.leave_one_out and (args.base_url or sc.card.server.kind != "inferlab" or len(loads) < 2):
        raise ValueError("--leave-one-out needs at least two rates and the card's inferlab server started here "
                         "(it reads the server's step trace)")
    # An inferlab server started here always writes its step trace: besides leave-one-out, it tells whether the
    # server's steps ran as the profile says (a stale profile) when a prediction misses.
    trace = Path(args.output_dir) / "steps.jsonl" if args.base_url is None and sc.card.server.kind == "inferlab" \
        else None
    points = bench_rates(sc.card, loads, Path(args.output_dir), base_url=args.base_url, arrival=arrival,
                         burstiness=args.burstiness,
                         server_config=None if trace is None else {**sc.card.server.config, "step_trace": str(trace)})
    steps = read_step_trace(trace)[1] if trace is not None else None
    served = read_trace_requests(trace) if trace is not None else None
    for i, ((rate, card_k, measured), lp) in enumerate(zip(points, loads)):
        cost, shape = sc.cost, sc.shape
        if args.leave_one_out:
            cost = calibrate_served([trace], sc.cost.hardware,
                                    windows=[m["window"] for j, (_, _, m) in enumerate(points) if j != i])
            # the profile's way in and out (a trace's requests are not those of one rate)
            cost.request_overhead, cost.delivery = sc.cost.request_overhead, sc.cost.delivery
            # and the scheduler settings the server ran with (its trace's header), not the profile's
            shape = replace(shape_from(cost.engine), max_queue=sc.shape.max_queue)
        # The same card, seed and load point: the simulated requests are bench's draw (sim_workload).
        predicted = capacity.simulate(replace(sc, cost=cost, shape=shape, card=card_k, arrival=arrival,
                                              requests=lp.requests), rate=rate)
        point = compare(measured, predicted)
        point["speed_band"] = speed_band(
            lambda k: capacity.simulate(replace(sc, cost=cost.stretched(k), shape=shape, card=card_k,
                                                arrival=arrival, requests=lp.requests), rate=rate), predicted)
        point.update(rate=rate, requests=measured["counts"]["measured"],
                     simulated_requests=predicted["counts"]["measured"], seed=lp.seed, text_seed=lp.text_seed,
                     results=measured.get("path"),
                     meets_measured=capacity.meets(sc.card, measured),
                     meets_predicted=capacity.meets(sc.card, predicted),
                     nearest_objective=nearest_objective(sc.card, predicted, measured))
        if steps is not None:
            point["steps_vs_profile"] = r = step_time_ratio(cost, steps, windows=[measured["window"]])
            host = at_host_speed(cost, r)
            if host is not None:
                again = capacity.simulate(replace(sc, cost=host, shape=shape, card=card_k, arrival=arrival,
                                                  requests=lp.requests), rate=rate)
                point["at_measured_speed"] = {"ratio": measured_speed(r), **compare(measured, again),
                                              "meets_predicted": capacity.meets(sc.card, again)}
        if served and measured.get("path"):
            parts = list(split_run(measured["path"], served).values())
            if parts:
                point["ttft_split"] = {k: float(np.median([getattr(p, k) for p in parts]))
                                       for k in ("http", "taken", "engine", "out", "outside")}
                point["ttft_split"].update(requests=len(parts), request_overhead=cost.request_overhead)
                if cost.delivery:
                    point["ttft_split"]["delivery_p50"] = float(np.median(cost.delivery))
        out["points"].append(point)
    print_validation(out["points"])
    print_speed_bands(out["points"])
    if trace is not None:
        print_step_drift(out["points"])
        print_ttft_split(out["points"])
    if bracket is not None:
        out["max_rate"] = {**max_rate_verdict(bracket, args.max_rate_within, out["points"]),
                           "draw": {"seed": draw_seed, "requests": args.bracket_requests},
                           "load_predicted": load_max.rate, "load_search_requests": args.search_requests}
        load = "none" if load_max.rate is None else f"{load_max.rate:.3g} req/s"
        print(f"the load's SLO-max rate (searched on {args.search_requests:,} simulated requests a point): {load}")
        print(out["max_rate"]["verdict"])
        for p in out["points"][-2:]:
            if near := p["nearest_objective"]:
                print(f"    at {p['rate']:g} req/s the objective nearest its limit in the simulation: "
                      f"{near['objective']}, predicted {_margin_words(near['predicted'])}, measured "
                      f"{_margin_words(near['measured'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


@dataclass(frozen=True, slots=True)
class LoadPoint:
    """One measured point: the card's load at `rate` for `requests` requests, drawn with `seed`. Points of one
    server take different seeds, or one seed and different `text_seed`s: the same seed's prompts again would be in
    the server's prefix cache and cost a few tokens each."""
    rate: float
    requests: int
    seed: int
    text_seed: int | None = None  # bench --text-seed: the seed's lengths and arrival times in other words
    users: int = 0  # a closed loop of this many users instead of the rate (results in users-N/)


def bench_rates(card, loads: list[LoadPoint], out_dir: Path, base_url: str | None = None,
                server_config: dict | None = None, arrival: str | None = None,
                burstiness: float | None = None) -> list[tuple[float, object, dict]]:
    """`inferlab bench` at each load point against one server (the card's, started here, unless base_url):
    (rate, the card as run, its measured run)."""
    import asyncio
    import time

    from inferlab.bench.benchmark import Benchmark
    from inferlab.bench.runner import Load
    from inferlab.lab.card import start_server, to_bench_config

    out_dir.mkdir(parents=True, exist_ok=True)
    srv = None
    if base_url is None:  # one server for every rate, started as the card says (as `inferlab experiment` does)
        print(f"starting the card's server ({card.server.kind}) ...", file=sys.stderr)
        srv = start_server(card.server, config=server_config, log_path=out_dir / "server.log")
        base_url = srv.base_url
    arrival = arrival or card.traffic.open_loop_arrival
    points = []
    try:
        for lp in loads:
            rate = lp.rate
            card_k = replace(card, traffic=replace(card.traffic, seed=lp.seed))
            name = f"users-{lp.users}" if lp.users else f"rate-{rate:g}"
            cfg = to_bench_config(card_k, base_url=base_url, output_dir=out_dir / name)
            cfg.loads = [Load("concurrency", lp.users) if lp.users else Load("rate", rate, arrival, burstiness or 1.0)]
            cfg.num_requests, cfg.duration = lp.requests, None
            cfg.workload.text_seed = lp.text_seed
            words = "" if lp.text_seed is None else f", text seed {lp.text_seed}"
            at = f"{lp.users} at a time" if lp.users else f"at {rate:g} req/s"
            print(f"bench {at} ({lp.requests} requests + {cfg.warmup} warmup, seed {lp.seed}{words}) ...",
                  file=sys.stderr)
            t0 = time.perf_counter()  # the clock a step trace stamps steps with (CLOCK_MONOTONIC)
            outcome = asyncio.run(Benchmark(cfg).run())
            measured = {**outcome.results["runs"][0], "path": str(outcome.path), "window": (t0, time.perf_counter())}
            points.append((rate, card_k, measured))
            if outcome.interrupted:
                break
    finally:
        if srv is not None:
            srv.stop()
    return points


STALE = 0.1  # steps this much slower or faster than the profile's: say so
KIND_STEPS = 20  # a kind of step with fewer steps than this at a point is too few to judge


def step_drift_warning(r: dict) -> str | None:
    """What a point's steps-against-profile ratios say, when something is off by more than STALE. Decode steps
    come in every load, so their ratio is the host's speed against the calibration's: off, the profile is stale.
    With decodes on time, a kind of step that is off is one the calibration's load did not form (long prompts'
    prefills, measured, under a profile fitted to short ones): the profile is the wrong one for this load."""
    kinds = {k: v for k, v in r["by_kind"].items() if v["steps"] >= KIND_STEPS}
    host = kinds.get("decode", {"ratio": r["ratio"]})["ratio"]
    if abs(host - 1) > STALE:
        return (f"decode steps ran x{host:.2f} the profile's: the host's speed has moved since the calibration "
                f"(a stale profile); recalibrate, or read the predicted latencies as that much off")
    off = [f"{k} x{v['ratio']:.2f}" for k, v in kinds.items() if abs(v["ratio"] - 1) > STALE]
    if off:
        return (f"{', '.join(off)} against the profile while decodes ran on time: this load forms steps the "
                f"calibration's did not; calibrate on this card's load")
    return None


SPEED_NOTE = 0.03  # steps this much off the profile: also simulate the point at the speed they ran
SPEED_METRICS = ("ttft p50", "ttft p99", "itl p50", "itl p99", "output_tokens_per_s")  # printed of that simulation


def measured_speed(r: dict) -> float | None:
    """How long the server's steps took against the simulator's (step_time_ratio): their total time, which is
    what queues feel; the median, for validate files written before the total was kept."""
    return r.get("time_ratio") or r.get("ratio")


def at_host_speed(cost, r: dict):
    """The profile at the speed the server's steps ran, or None when they ran within SPEED_NOTE of it: its memory
    and compute terms each times its own factor (step_time_ratio's memory_ratio and compute_ratio), or every step
    term times measured_speed where the steps cannot tell the two apart. What it predicts is not a prediction (its
    speed comes from the very measurement), but it separates the model's error from the host's: on a host that
    sped up 9% in the half hour of a run, TTFT p50 +16% from the profile, -3% at the measured speed. The total, not
    the median: near saturation, where a stall's time is never made up, a point whose median step ran x1.03 and
    total x1.045 (the short card at 1.54 req/s) came out TTFT p50 -14% at the median's speed and -3% at the
    total's (docs/benchmarks.md)."""
    memory, compute = r.get("memory_ratio"), r.get("compute_ratio")
    if memory and compute:  # memory and arithmetic each at its own speed
        return cost.stretched(memory, compute) if max(abs(memory - 1), abs(compute - 1)) >= SPEED_NOTE else None
    k = measured_speed(r)
    if not k or abs(k - 1) < SPEED_NOTE:
        return None
    return cost.stretched(k)


SPEED_BAND = 0.03  # validate also simulates each point with every step this much faster and slower


def speed_band(simulate_at, predicted: dict) -> dict:
    """What a host SPEED_BAND faster or slower than the profile would do to a point's prediction: per metric, the
    relative change each way. `simulate_at(k)` simulates the point with every step k times as long. Light load
    barely moves; near saturation a queue amplifies the host: on the short card at 1.54 req/s, TTFT p50 moves
    4-5% for each 1% of step time, so a prediction there is only as good as the host's speed stays."""
    out: dict[str, dict[str, float | None]] = {}
    for side, k in (("faster", 1 - SPEED_BAND), ("slower", 1 + SPEED_BAND)):
        for m in compare(predicted, simulate_at(k))["metrics"]:
            out.setdefault(m["metric"], {})[side] = m["rel_error"]
    return out


def print_speed_bands(points: list[dict]) -> None:
    """One line a point: how far its prediction moves with a host SPEED_BAND faster or slower (speed_band)."""
    print(f"with every step {SPEED_BAND:.0%} faster / slower than the profile, the simulation moves:")
    for p in points:
        band = p["speed_band"]
        cells = ", ".join(f"{m} {_pct(band[m]['faster'])} / {_pct(band[m]['slower'])}" for m in SPEED_METRICS)
        print(f"  {p['rate']:g} req/s: {cells}")


def print_ttft_split(points: list[dict]) -> None:
    """One line a point: where the server's requests spent their time to first token (lab/ttft_split.py). The way
    in and out of the server and the tokenizing are what the profile's request overhead stands for; under load a
    request also waits for the step in progress before the engine takes it, which the simulation charges to the
    scheduler."""
    for p in points:
        if not (s := p.get("ttft_split")):
            continue
        print(f"{p['rate']:g} req/s: time to first token, medians of {s['requests']} requests: "
              f"{format_ms(s['http'])} to the server, {format_ms(s['taken'])} to the engine (tokenizing, and the "
              f"step in progress if any), {format_ms(s['engine'])} in it, {format_ms(s['out'])} back (the "
              f"profile's request overhead: {format_ms(s['request_overhead'])}"
              f"{'' if 'delivery_p50' not in s else ', delivery p50 ' + format_ms(s['delivery_p50'])})")


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:+.0%}"


def print_step_drift(points: list[dict]) -> None:
    """One line a point: how the server's steps ran against the step cost that predicted it, with a warning where
    something ran more than STALE off, and the point simulated again at that speed where it was SPEED_NOTE off."""
    for p in points:
        r = p.get("steps_vs_profile") or {}
        if not r.get("ratio"):
            continue
        kinds = ", ".join(f"{k} x{v['ratio']:.2f} ({v['steps']})" for k, v in r["by_kind"].items())
        warning = step_drift_warning(r)
        total = f", all together x{r['time_ratio']:.3f}" if r.get("time_ratio") else ""
        if r.get("memory_ratio"):
            total += f"; by least squares memory terms x{r['memory_ratio']:.3f}, compute x{r['compute_ratio']:.3f}"
        print(f"{p['rate']:g} req/s: the server's steps ran x{r['ratio']:.2f} the profile's time (median of "
              f"{r['steps']}; {kinds}{total})" + (f" - {warning}" if warning else ""))
        if again := p.get("at_measured_speed"):
            errors = ", ".join(f"{m['metric']} {m['rel_error']:+.0%}" for m in again["metrics"]
                               if m["metric"] in SPEED_METRICS and m["rel_error"] is not None)
            yes = {True: "yes", False: "no"}
            print(f"    at that speed the simulation gives {errors}; meets the card: "
                  f"{yes[again['meets_predicted']]} (measured: {yes[p['meets_measured']]})")


def _margin(check) -> float | None:
    """How far past its limit a check's value lies, as a fraction of the limit (negative: inside it)."""
    v, limit = check.measured, check.limit
    if v is None or not limit > 0:
        return None
    return 1 - v / limit if check.kind in ("goodput", "throughput") else v / limit - 1  # at least / at most


def nearest_objective(card, predicted: dict, measured: dict) -> dict | None:
    """The card's objective the simulation puts nearest its limit (or furthest past it), with how far inside or
    past it the prediction and the measurement lie. At a bracket rate this says how accurate the model had to be:
    the long card's TTFT p50 rises 7% from 0.85x to 1.15x its SLO-max, so a bracket there asks for ~1%."""
    from inferlab.lab.capacity import checks

    pred = [(m, c) for c in checks(card, predicted) if (m := _margin(c)) is not None]
    if not pred:
        return None
    m, c = max(pred, key=lambda mc: mc[0])
    meas = next((_margin(x) for x in checks(card, measured) if x.objective == c.objective), None)
    return {"objective": c.objective, "predicted": m, "measured": meas}


def _margin_words(m: float | None) -> str:
    return "–" if m is None else f"{abs(m):.1%} {'over' if m > 0 else 'under'} it"


def max_rate_verdict(bracket: tuple[float, float, float], within: float, points: list[dict]) -> dict:
    """The measured SLO-max rate of a draw lies within `within` of the predicted one when the real server meets the
    card on that draw at the lower bracket rate and misses it at the upper."""
    predicted, lo, hi = bracket
    meets = {p["rate"]: p["meets_measured"] for p in points}
    at_lo, at_hi = meets.get(round(lo, 4)), meets.get(round(hi, 4))
    ok = at_lo is True and at_hi is False
    how = {True: "meets the card", False: "misses it", None: "not measured"}
    verdict = (f"predicted SLO-max rate of the measured draw {predicted:.3g} req/s; on that draw the real server "
               f"{how[at_lo]} at {lo:.3g} and {how[at_hi]} at {hi:.3g}: the measured maximum is "
               + (f"within {within:.0%} of the prediction" if ok else
                  "below the lower bound" if at_lo is False else
                  "above the upper bound" if at_hi is True else "undetermined"))
    return {"predicted": predicted, "lower": lo, "upper": hi, "meets_at_lower": at_lo, "meets_at_upper": at_hi,
            "within": ok, "verdict": verdict}


def compare(measured: dict, predicted: dict) -> dict:
    """Predicted against measured for every metric, with the relative error (predicted / measured - 1)."""
    import numpy as np

    rows = []
    draws = (predicted.get("noise_draws") or {}).get("latency", {})
    for m, p in VALIDATED:
        runs = [v for v in draws.get(m, {}).get(p, []) if v is not None]
        band = [float(np.percentile(runs, 10)), float(np.percentile(runs, 90))] if len(runs) > 1 else None
        rows.append((f"{m} {p}", measured["latency"][m].get(p), predicted["latency"][m].get(p), band))
    for key in ("requests_per_s", "output_tokens_per_s"):
        rows.append((key, measured["throughput"][key], predicted["throughput"][key], None))
    g_m, g_p = measured.get("goodput") or {}, predicted.get("goodput") or {}
    rows.append(("goodput share", g_m.get("share"), g_p.get("share"), None))
    return {"metrics": [{"metric": k, "measured": a, "predicted": b,
                         "rel_error": None if a in (None, 0) or b is None else b / a - 1,
                         **({"noise_band": band} if band else {})} for k, a, b, band in rows]}


def print_validation(points: list[dict]) -> None:
    from rich.table import Table

    t = Table(title="predicted vs measured")
    t.add_column("rate")
    t.add_column("metric")
    for col in ("measured", "predicted", "error", "noise p10-p90"):
        t.add_column(col, justify="right")
    for p in points:
        for r in p["metrics"]:
            fmt = (lambda v: format_ms(v)) if r["metric"].split()[0] in ("ttft", "itl", "tpot", "e2e") else \
                (lambda v: "–" if v is None else f"{v:.3g}")
            err = "–" if r["rel_error"] is None or math.isnan(r["rel_error"]) else f"{r['rel_error']:+.0%}"
            band = r.get("noise_band")
            t.add_row(f"{p['rate']:g}", r["metric"], fmt(r["measured"]), fmt(r["predicted"]), err,
                      "" if band is None else f"{fmt(band[0])} - {fmt(band[1])}")
        if "meets_measured" in p:
            yes = {True: "yes", False: "no"}
            t.add_row(f"{p['rate']:g}", "meets the card", yes[p["meets_measured"]], yes[p["meets_predicted"]], "", "",
                      end_section=True)
    _console().print(t)
