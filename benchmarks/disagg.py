"""Colocated against disaggregated serving on the same two cores, with the simulator's predictions beside each
measurement.

    python benchmarks/disagg.py                         # everything: ~30 minutes on a quiet 2-core machine
    python benchmarks/disagg.py --smoke                 # one tiny point per topology, to check the plumbing

Topologies (all on the cores this process may use, normally 2; the server is started under that affinity):
  colocated      `inferlab serve` (default scheduling: prefill chunks share steps with decodes)
  colocated-cap  `inferlab serve --max-prefill-tokens-with-decodes CAP`
  disaggregated  `inferlab serve --disaggregate` (prefill worker on one core, decode worker on the other)
Mixes (`inferlab bench` synthetic prompts, ignore_eos so output lengths are exact):
  prefill-heavy  prompts of ~1000 tokens, 32 output tokens
  chat           prompts uniform 64..512 tokens, 128 output tokens
At each rate: an open-loop Poisson run with --scrape-metrics and an ITL objective (--slo tpot=..., the per-request
mean inter-token latency: the goodput column is the share of requests meeting it, as vLLM's goodput counts TPOT).
Reported: ITL p50/p99 (every gap between tokens), TTFT p50/p99, output tokens/s, requests/s, goodput.

Predictions: every server runs with `--step-trace` (a disaggregated one writes a trace per worker), and each point
is predicted from a step-cost profile fitted to that topology's served steps at the *other* rates of the same mix
(leave one rate out: the calibration never saw the point it predicts; a mix run at one rate only is predicted from
the other mix's steps). `inferlab simulate predict` then runs a card of the point (its mix, rate and bench seed):
colocated, colocated with the cap (the card's server config), and --prefill 1 --decode 1 with the KV link's
bandwidth set to the copy bandwidth the server reported (kv_transfer bytes / seconds).
Each bench run has its own seed: the same seed draws the same prompts, which a later run would find in the
server's prefix cache.

Writes OUT/disagg.json (the single source: every bench summary and prediction) and OUT/disagg.md (the table).
Figures from a machine shared with other work are contaminated: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from inferlab.bench.launcher import free_port, launch  # noqa: E402

MIXES = {
    "prefill-heavy": {"input_len": "normal:1000,50", "output_len": "32", "card_input": {"dist": "normal", "mean": 1000,
                                                                                       "std": 50}, "card_output": 32},
    "chat": {"input_len": "uniform:64,512", "output_len": "128",
             "card_input": {"dist": "uniform", "min": 64, "max": 512}, "card_output": 128},
}
RATES = {"prefill-heavy": [0.3, 0.4], "chat": [0.5, 1.0]}


def inferlab(*args: str) -> list[str]:
    return [sys.executable, "-m", "inferlab.cli", *args]


def topologies(cap: int) -> dict[str, list[str]]:
    return {"colocated": [], "colocated-cap": ["--max-prefill-tokens-with-decodes", str(cap)],
            "disaggregated": ["--disaggregate"]}


def bench(base: str, mix: dict, rate: float, n: int, slo_ms: float, out: Path, seed: int) -> dict:
    cmd = inferlab("bench", "--base-url", base, "--rate", str(rate), "--num-requests", str(n), "--warmup", "2",
                   "--input-len", mix["input_len"], "--output-len", mix["output_len"], "--ignore-eos",
                   "--slo", f"tpot={slo_ms}ms", "--scrape-metrics", "--output-dir", str(out), "--quiet", "--no-html",
                   "--seed", str(seed))
    t0 = time.perf_counter()  # CLOCK_MONOTONIC, the clock the server's step trace stamps its steps with
    subprocess.run(cmd, check=False, env=_env())  # exit 1 = an SLO missed: still a result
    window = (t0, time.perf_counter())
    results = json.loads((out / "results.json").read_text())
    run = results["runs"][0]
    lat = run["latency"]
    sm = run.get("server_metrics") or {}
    return {"ttft_p50": lat["ttft"]["p50"], "ttft_p99": lat["ttft"]["p99"], "itl_p50": lat["itl"]["p50"],
            "itl_p99": lat["itl"]["p99"], "tpot_p99": lat["tpot"]["p99"],
            "requests_per_s": run["throughput"]["requests_per_s"],
            "output_tokens_per_s": run["throughput"]["output_tokens_per_s"],
            "goodput_share": (run["goodput"] or {}).get("share"), "failed": run["counts"]["failed"],
            "kv_transfer_bytes": sm.get("kv_transfer_bytes"), "kv_transfer_seconds": sm.get("kv_transfer_seconds"),
            "by_role": sm.get("by_role"), "results": str(out / "results.json"), "seed": seed, "window": window}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def write_card(path: Path, mix: dict, name: str, slo_ms: float, server: dict, seed: int) -> Path:
    import yaml

    card = {"version": 1, "name": name, "description": f"benchmarks/disagg.py: {name}",
            "contract": {"endpoint": "completions", "streaming": True,
                         "context": {"max_input_tokens": 1200, "max_output_tokens": 128}},
            "traffic": {"arrival": "poisson", "rate": "1/s", "requests": 40, "seed": seed, "warmup": 2,
                        "input_len": mix["card_input"], "output_len": mix["card_output"]},
            "objectives": {"tpot": {"p99": f"{slo_ms}ms"}},
            "constraints": {"hardware": "this machine"},
            "server": {"kind": "inferlab", "config": server}}
    path.write_text(yaml.safe_dump(card, sort_keys=False))
    return path


def traces(out: Path, topo: str) -> list[Path]:
    base = out / f"steps-{topo}.jsonl"
    return [base.with_name(base.name + ".prefill0"), base.with_name(base.name + ".decode0")] \
        if topo == "disaggregated" else [base]


def calibrate(out: Path, report: dict, key: str) -> Path:
    """The profile that predicts `key`: the topology's served steps at the mix's other rates (else the other mix's)."""
    from inferlab.lab.calibrate import calibrate_served

    topo, mix, _ = key.split("/")
    same_topo = [k for k in report["measured"] if k.startswith(topo + "/") and k != key]
    others = [k for k in same_topo if k.split("/")[1] == mix] or same_topo
    windows = [tuple(report["measured"][k]["window"]) for k in others]
    cost = calibrate_served(traces(out, topo), {}, windows=windows)
    cost.notes.append(f"fitted on {', '.join(others)}")
    return cost.save(out / f"profile-{key.replace('/', '_')}.json")


def predict(card: Path, profile: Path, rates: list[float], extra: list[str], out: Path, n: int) -> list[dict]:
    cmd = inferlab("simulate", "predict", str(card), "--profile", str(profile), "--rates",
                   ",".join(map(str, rates)), "--requests", str(n), "--no-search", "--json", str(out),
                   *extra)
    subprocess.run(cmd, check=True, env=_env(), stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["points"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="disagg-results")
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--topologies", default="colocated,colocated-cap,disaggregated")
    ap.add_argument("--rates", default=None, help="override every mix's rates, comma-separated req/s")
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--cap", type=int, default=64, help="--max-prefill-tokens-with-decodes of colocated-cap")
    ap.add_argument("--itl-slo-ms", type=float, default=100.0)
    ap.add_argument("--no-predict", action="store_true")
    ap.add_argument("--predict-only", action="store_true", help="redo the predictions from OUT/disagg.json and the "
                                                                 "step traces beside it (no server, no bench)")
    ap.add_argument("--smoke", action="store_true", help="one tiny point per topology and mix")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cores = sorted(os.sched_getaffinity(0))[:2]
    mixes = {m: MIXES[m] for m in args.mixes.split(",")}
    rates = {m: ([float(r) for r in args.rates.split(",")] if args.rates else RATES[m]) for m in mixes}
    n = args.num_requests
    if args.smoke:
        rates, n = {m: [rates[m][0]] for m in mixes}, 4
    topos = {t: f for t, f in topologies(args.cap).items() if t in args.topologies.split(",")}
    report: dict = {"cores": cores, "itl_slo_ms": args.itl_slo_ms, "cap": args.cap, "num_requests": n,
                    "rates": rates, "measured": {}, "predicted": {}, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}

    if args.predict_only:
        report = {**json.loads((out / "disagg.json").read_text()), "predicted": {}}
        mixes = {m: MIXES[m] for m in {k.split("/")[1] for k in report["measured"]}}
        args.itl_slo_ms, args.cap, n = report["itl_slo_ms"], report["cap"], report["num_requests"]
        topos = {}
    for topo, flags in topos.items():
        port = free_port()
        # colocated: one engine with a thread per core; disaggregated: one thread per worker, each worker pinned
        # by the server to its own core
        threads = [] if topo == "disaggregated" else ["--num-threads", str(len(cores))]
        argv = ["taskset", "-c", ",".join(map(str, cores)),
                *inferlab("serve", "--port", str(port), *threads, *flags, "--step-trace",
                          str(out / f"steps-{topo}.jsonl"))]
        print(f"== {topo}: {' '.join(argv)}", flush=True)
        with launch(argv, port, ready_timeout=1800, log_path=out / f"server-{topo}.log", env=_env()) as server:
            seed = 0
            for mix_name, mix in mixes.items():
                for rate in rates[mix_name]:
                    key = f"{topo}/{mix_name}/{rate:g}"
                    seed += 1
                    r = bench(server.base_url, mix, rate, n, args.itl_slo_ms, out / key.replace("/", "_"), seed)
                    report["measured"][key] = r
                    print(f"   {key}: ITL p50 {r['itl_p50'] * 1e3:.0f} p99 {r['itl_p99'] * 1e3:.0f} ms, TTFT p50 "
                          f"{r['ttft_p50'] * 1e3:.0f} p99 {r['ttft_p99'] * 1e3:.0f} ms, "
                          f"{r['output_tokens_per_s']:.1f} tok/s, goodput {r['goodput_share']}", flush=True)
        (out / "disagg.json").write_text(json.dumps(report, indent=1))

    if not args.no_predict:
        link = _copy_bandwidth(report)
        for key, m in report["measured"].items():
            topo, mix_name, rate = key.split("/")
            name = key.replace("/", "_")
            server = {"max_prefill_tokens_with_decodes": args.cap} if topo == "colocated-cap" else {}
            card = write_card(out / f"card-{name}.yaml", mixes[mix_name], name, args.itl_slo_ms, server, m["seed"])
            extra = ["--prefill", "1", "--decode", "1", "--link-bandwidth", f"{link:.0f}B"] \
                if topo == "disaggregated" else []
            p = predict(card, calibrate(out, report, key), [float(rate)], extra, out / f"predict-{name}.json",
                        n)[0]
            report["predicted"][key] = {k: p.get(k) for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99",
                                                              "output_tokens_per_s", "requests_per_s",
                                                              "goodput_share")}
        report["link_bandwidth_bytes_per_s"] = link
    (out / "disagg.json").write_text(json.dumps(report, indent=1))
    (out / "disagg.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def _copy_bandwidth(report: dict) -> float:
    """The KV hand-off's measured copy bandwidth (pool -> buffer -> pool, both copies), for the simulator's link."""
    b = sum(r["kv_transfer_bytes"] or 0 for k, r in report["measured"].items() if k.startswith("disaggregated"))
    s = sum(r["kv_transfer_seconds"] or 0 for k, r in report["measured"].items() if k.startswith("disaggregated"))
    return b / s if b and s else 5e9


def markdown(report: dict) -> str:
    def ms(v) -> str:
        return "–" if v is None else f"{v * 1e3:.0f}"

    lines = [f"ITL objective (per-request mean, TPOT) {report['itl_slo_ms']:g} ms; {report['num_requests']} requests "
             f"per point; cores {report['cores']}. Measured / predicted by `inferlab simulate`.", "",
             "| topology | mix | rate | ITL p50 | ITL p99 | TTFT p50 | TTFT p99 | out tok/s | goodput |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for key, m in report["measured"].items():
        topo, mix, rate = key.split("/")
        p = report["predicted"].get(key, {})

        def pair(name: str, fmt=ms) -> str:
            return f"{fmt(m.get(name))} / {fmt(p.get(name))}"

        lines.append(f"| {topo} | {mix} | {rate} | {pair('itl_p50')} | {pair('itl_p99')} | {pair('ttft_p50')} | "
                     f"{pair('ttft_p99')} | {pair('output_tokens_per_s', lambda v: '–' if v is None else f'{v:.1f}')}"
                     f" | {pair('goodput_share', lambda v: '–' if v is None else f'{v:.0%}')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
