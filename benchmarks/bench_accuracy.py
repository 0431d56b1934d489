"""Bench's own error against the fake server's recorded write times, and the same for other load generators.

The fake server runs in its own process and records when it actually wrote every chunk (GET /stats), on the
machine's monotonic clock. For each load level and each tool:

  TTFT error pX = the tool's reported TTFT pX - the server's TTFT pX (first write - request arrival), same run
  ITL error pX  = the tool's per-token ITL pX - the server's write-gap pX (one token per chunk, so per-chunk and
                  per-token gaps coincide and every tool's per-chunk ITL is comparable)

For inferlab, whose records carry request ids, it also reports the matched per-request error (each request's
time from send to first chunk minus the server's first write minus its arrival, for the same request) and the
receive lag of every chunk (arrival - write). In open loop inferlab's reported TTFT starts at the scheduled
time, so its distribution-level TTFT error includes the client delay, by design; GuideLLM's starts at its send.

    .venv/bin/python benchmarks/bench_accuracy.py                      # inferlab only
    .venv/bin/python benchmarks/bench_accuracy.py --guidellm /tmp/venv-guidellm/bin/guidellm \
        --aiperf /tmp/venv-aiperf/bin/aiperf --tokenizer-dir /tmp/smollm2-tokenizer

The tokenizer folder for the other tools is saved from the bundled GGUF with transformers:
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained("/tmp/smollm2-tokenizer")

Other tools are run from throwaway virtualenvs, never installed into the project's. Numbers depend on the
machine and its load; run it on a quiet machine and keep the command with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def start_fake(ttft: float, itl: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "inferlab", "fake-server", "--port", "0", "--ttft", f"{ttft}s",
                             "--itl", f"{itl}s"], stdout=subprocess.PIPE, text=True, env=ENV)
    line = proc.stdout.readline()
    return proc, line.split()[4]


def server_stats(url: str) -> list[dict]:
    with urllib.request.urlopen(url + "/stats", timeout=60) as r:
        return [s for s in json.loads(r.read())["requests"] if s["status"] == "done"]


def clear(url: str) -> None:
    urllib.request.urlopen(urllib.request.Request(url + "/stats", method="DELETE"), timeout=30).read()


def server_truth(stats: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    ttft = np.array([s["writes"][0] - s["arrival"] for s in stats])
    gaps = np.concatenate([np.diff(s["writes"]) for s in stats])
    return ttft, gaps


def pct(a, p) -> float:
    return float(np.percentile(a, p)) if len(a) else float("nan")


def run_inferlab(url: str, load: list[str], n: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "inferlab", "bench", "--base-url", url, *load, "--num-requests", str(n),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--quiet", "--no-html",
               "--output-dir", tmp, "--timeout", "300s"]
        subprocess.run(cmd, env=ENV, check=True, capture_output=True)
        res = json.loads(Path(tmp, "results.json").read_text())
        sys.path.insert(0, str(ROOT / "src"))
        from inferlab.bench.records import read_records

        recs = [r for r in read_records(Path(tmp, "records.jsonl")) if r.ok]
    run = res["runs"][0]
    stats = server_stats(url)
    by_id = {s["id"]: s for s in stats}
    origin = run["clock_origin"]
    matched, lag = [], []
    for r in recs:
        s = by_id.get(r.request_id)
        if s is None:
            continue
        times = [origin + t for t, k in zip(r.chunk_times, r.chunk_tokens) if k]
        # from the send, not the schedule: the measurement's own error, without the open-loop client delay
        matched.append((times[0] - (origin + r.sent)) - (s["writes"][0] - s["arrival"]))
        lag += [a - w for a, w in zip(times, s["writes"])]
    ttft_true, gaps_true = server_truth(stats)
    lat = run["latency"]
    out = {
        "ttft_err_p50": lat["ttft"]["p50"] - pct(ttft_true, 50), "ttft_err_p99": lat["ttft"]["p99"] - pct(ttft_true, 99),
        "itl_err_p50": lat["itl"]["p50"] - pct(gaps_true, 50), "itl_err_p99": lat["itl"]["p99"] - pct(gaps_true, 99),
        "tpot_err_p50": lat["tpot"]["p50"] - pct(per_request_tpot(stats), 50),
        "tpot_err_p99": lat["tpot"]["p99"] - pct(per_request_tpot(stats), 99),
        "matched_ttft_err_p50": pct(matched, 50), "matched_ttft_err_p99": pct(matched, 99),
        "chunk_lag_p50": pct(lag, 50), "chunk_lag_p99": pct(lag, 99),
        "client_delay_p99": lat["client_delay"]["p99"], "completed": run["counts"]["completed"],
        "failed": run["counts"]["failed"], "requests_per_s": run["throughput"]["requests_per_s"],
        "server_ttft_p50": pct(ttft_true, 50), "server_ttft_p99": pct(ttft_true, 99),
    }
    return out


def run_guidellm(url: str, kind: str, value: float, n: int, args) -> dict:
    """GuideLLM 0.8 (a throwaway venv): TTFT and its ITL (decode time per token per request) from its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "guidellm.json")
        profile = f"kind=concurrent,streams={int(value)}" if kind == "concurrency" else f"kind=poisson,rate={value}"
        cmd = [args.guidellm, "run", "--backend", f"kind=openai_http,target={url},model=fake-model",
               "--profile", profile, "--constraint", f"kind=max_requests,count={n}",
               "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},output_tokens={args.output_len}",
               "--tokenizer", f"kind=hf_auto,model={args.tokenizer_dir}", "--output", f"kind=json,path={out}",
               "--disable-console"]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
        if proc.returncode != 0 or not out.exists():
            return {"error": (proc.stderr or proc.stdout)[-400:]}
        report = json.loads(out.read_text())
    m = report["benchmarks"][0]["metrics"]
    stats = server_stats(url)
    ttft_true, _ = server_truth(stats)
    tpot_true = per_request_tpot(stats)

    def pick(name, p):
        return m[name]["successful"]["percentiles"][f"p{p}"] / 1000.0  # reported in milliseconds

    return {
        "ttft_err_p50": pick("time_to_first_token_ms", 50) - pct(ttft_true, 50),
        "ttft_err_p99": pick("time_to_first_token_ms", 99) - pct(ttft_true, 99),
        # GuideLLM's "ITL" is our TPOT (per-request decode time per token); it has no per-token ITL
        "tpot_err_p50": pick("inter_token_latency_ms", 50) - pct(tpot_true, 50),
        "tpot_err_p99": pick("inter_token_latency_ms", 99) - pct(tpot_true, 99),
        "completed": m["request_totals"]["successful"] if isinstance(m["request_totals"], dict) else len(stats),
        "server_ttft_p50": pct(ttft_true, 50), "server_ttft_p99": pct(ttft_true, 99),
    }


def run_aiperf(url: str, kind: str, value: float, n: int, args) -> dict:
    """NVIDIA AIPerf (a throwaway venv): TTFT, its ITL (our TPOT) and its inter-chunk latency (one token per
    chunk here, so our per-token ITL) from profile_export_aiperf.json."""
    with tempfile.TemporaryDirectory() as tmp:
        load = (["--concurrency", str(int(value))] if kind == "concurrency"
                else ["--request-rate", str(value), "--arrival-pattern", "poisson"])
        cmd = [args.aiperf, "profile", "--model", "fake-model", "--url", url, "--endpoint-type", "completions",
               "--streaming", *load, "--request-count", str(n), "--prompt-input-tokens-mean", str(args.input_len),
               "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(args.output_len),
               "--prompt-output-tokens-stddev", "0", "--tokenizer", args.tokenizer_dir,
               "--output-artifact-dir", tmp, "--ui-type", "none"]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
        out = Path(tmp, "profile_export_aiperf.json")
        if proc.returncode != 0 or not out.exists():
            return {"error": (proc.stderr or proc.stdout)[-400:]}
        m = json.loads(out.read_text())
    stats = server_stats(url)
    ttft_true, gaps_true = server_truth(stats)
    tpot_true = per_request_tpot(stats)

    def pick(name, p):
        return m[name][f"p{p}"] / 1000.0  # milliseconds

    return {
        "ttft_err_p50": pick("time_to_first_token", 50) - pct(ttft_true, 50),
        "ttft_err_p99": pick("time_to_first_token", 99) - pct(ttft_true, 99),
        "tpot_err_p50": pick("inter_token_latency", 50) - pct(tpot_true, 50),
        "tpot_err_p99": pick("inter_token_latency", 99) - pct(tpot_true, 99),
        "itl_err_p50": pick("inter_chunk_latency", 50) - pct(gaps_true, 50),
        "itl_err_p99": pick("inter_chunk_latency", 99) - pct(gaps_true, 99),
        "completed": int(m.get("completed_request_count", m["request_count"]).get("avg", 0)),
        "server_ttft_p50": pct(ttft_true, 50), "server_ttft_p99": pct(ttft_true, 99),
    }


def per_request_tpot(stats: list[dict]) -> np.ndarray:
    return np.array([(s["writes"][-1] - s["writes"][0]) / (len(s["writes"]) - 1) for s in stats if len(s["writes"]) > 1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="8,64,256,512")
    p.add_argument("--rates", default="25,50,100,200,400", help="Poisson rates, req/s")
    p.add_argument("--ttft", type=float, default=0.05)
    p.add_argument("--itl", type=float, default=0.01)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="requests per user at each concurrency (at least 64)")
    p.add_argument("--rate-seconds", type=float, default=8.0, help="requests = rate x this")
    p.add_argument("--guidellm", default=None, help="path to a guidellm executable in a throwaway venv")
    p.add_argument("--aiperf", default=None, help="path to an aiperf executable in a throwaway venv")
    p.add_argument("--inferlab-workers", type=int, default=1,
                   help="inferlab bench --workers for loads with at least --workers-from requests in flight")
    p.add_argument("--workers-from", type=float, default=256)
    p.add_argument("--only-inferlab", action="store_true")
    p.add_argument("--tokenizer-dir", default=None, help="a Hugging Face tokenizer folder for the other tools")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()

    proc, url = start_fake(args.ttft, args.itl)
    rows = []
    print(f"fake server: ttft {args.ttft * 1e3:g} ms, itl {args.itl * 1e3:g} ms, 1 token per chunk; "
          f"prompts {args.input_len} tokens, outputs {args.output_len} tokens; all figures in ms")
    print(HEADER)
    try:
        levels = [("concurrency", int(c)) for c in args.concurrency.split(",") if c]
        levels += [("rate", float(r)) for r in args.rates.split(",") if r]
        for kind, value in levels:
            n = max(64, args.rounds * int(value)) if kind == "concurrency" else int(value * args.rate_seconds)
            in_flight = value if kind == "concurrency" else value * (args.ttft + args.output_len * args.itl)
            workers = args.inferlab_workers if in_flight >= args.workers_from else 1
            load = [f"--{kind}", str(value), "--workers", str(workers)]
            tools = [("inferlab" + (f" ({workers} workers)" if workers > 1 else ""),
                      lambda: run_inferlab(url, load, n, args))]
            if args.only_inferlab:
                tools = tools[:1]
            if args.guidellm:
                tools.append(("guidellm", lambda: run_guidellm(url, kind, value, n, args)))
            if args.aiperf:
                tools.append(("aiperf", lambda: run_aiperf(url, kind, value, n, args)))
            for name, fn in tools:
                clear(url)
                t = time.perf_counter()
                r = fn()
                r.update(tool=name, load=f"{kind} {value:g}", requests=n, wall_s=time.perf_counter() - t)
                rows.append(r)
                print(fmt(r), flush=True)
    finally:
        proc.terminate()
        proc.wait()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


def fmt(r: dict) -> str:
    if "error" in r:
        return f"{r['tool']:9s} {r['load']:18s} error: {r['error']}"
    ms = lambda k: f"{r[k] * 1e3:8.2f}" if r.get(k) is not None and r[k] == r[k] else "       -"
    return (f"| {r['tool']} | {r['load']} | {ms('ttft_err_p50')} | {ms('ttft_err_p99')} | {ms('tpot_err_p50')} | "
            f"{ms('tpot_err_p99')} | {ms('itl_err_p50')} | {ms('itl_err_p99')} | {ms('matched_ttft_err_p50')} | "
            f"{ms('matched_ttft_err_p99')} | {ms('chunk_lag_p50')} | {ms('chunk_lag_p99')} | {ms('client_delay_p99')} | "
            f"{r.get('completed')}/{r['requests']} |")


HEADER = ("| tool | load | TTFT err p50 | TTFT err p99 | TPOT err p50 | TPOT err p99 | ITL err p50 | ITL err p99 | "
          "matched TTFT err p50 | matched TTFT err p99 | chunk lag p50 | chunk lag p99 | client delay p99 | ok |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


if __name__ == "__main__":
    main()
