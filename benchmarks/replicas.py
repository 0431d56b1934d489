"""What replicas buy on this machine, in one command: inferlab on Ray Serve (`inferlab serve --replicas`).

1. Throughput and latency at 16 and 64 concurrent streams: one process with 2 threads (plain `inferlab serve`),
   the same on Ray Serve (1 replica x 2 threads: what the Ray path itself costs), and 2 replicas x 1 thread.
2. Routing on a shared-prefix workload (8 groups sharing a 384-token prefix) over 2 replicas x 1 thread:
   prefix-affinity against round-robin (and Ray's default, power of two choices): the prefix-cache hit rate the
   replicas report on /metrics (summed over replicas) and TTFT p50/p99.

    python benchmarks/replicas.py [--out-dir bench-results/replicas] [--simulate] [--smoke]

Writes replicas.json (every run's bench summary, the commands, and the simulator hook) and replicas.md (the
tables, a view of the JSON). `--smoke` runs a tiny version (4 streams, few requests) to check the plumbing; its
figures mean nothing. At the end it prints the `inferlab simulate` commands that predict the 2-replica rows from
a 1-replica calibration, with the workload cards it wrote for them; `--simulate` runs them too and adds the
predictions and their relative errors to the JSON and the table.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import ROOT, free_port, summarize, wait_ready  # noqa: E402

KV = "256MiB"  # per replica: two pools fit a small machine's memory with room for the prefixes
THROUGHPUT_WL = ["--input-len", "128", "--output-len", "64"]
PREFIX_WL = ["--input-len", "448", "--output-len", "32", "--prefix-groups", "8", "--prefix-len", "384"]
# name -> `inferlab serve` flags
SERVERS = {
    "1 process x 2 threads": ["--num-threads", "2"],
    "Ray: 1 replica x 2 threads": ["--replicas", "1", "--num-threads", "2"],
    "Ray: 2 replicas x 1 thread": ["--replicas", "2", "--num-threads", "1"],
}
ROUTERS = ("prefix-affinity", "round-robin", "power-of-two")


def serve(flags: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "inferlab", "serve", "--port", str(port), "--kv-cache-memory", KV, *flags]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, proc, 1200)
    return proc, base


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)  # the Ray path stops Serve and its local cluster on SIGINT
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        import os

        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def bench(base: str, workload: list[str], conc: int, rounds: int, out: Path) -> dict:
    """Closed loop at `conc` streams, `rounds` requests per stream after one warm-up round."""
    cmd = [sys.executable, "-m", "inferlab", "bench", "--base-url", base, "--concurrency", str(conc),
           "--num-requests", str(conc * rounds), "--warmup", str(conc), "--ignore-eos", "--scrape-metrics",
           "--output-dir", str(out), "--quiet", "--no-html", *workload]
    subprocess.run(cmd, cwd=ROOT, check=True)
    res = json.loads((out / "results.json").read_text())
    row = summarize(res)
    sm = res["runs"][0].get("server_metrics") or {}
    row["prefix_cache_hit_rate"] = sm.get("prefix_cache_hit_rate")
    row["bench_command"] = " ".join(cmd)
    return row


def write_cards(out: Path, concurrencies: list[int], prefix_streams: int, rounds: int) -> dict[str, Path]:
    """Workload cards for `inferlab simulate predict` matching the bench runs above."""
    base = yaml.safe_load((ROOT / "examples" / "card-cpu.yaml").read_text())
    cards = {}
    for name, conc, inp, outp, prefix in [*((f"c{c}", c, 128, 64, None) for c in concurrencies),
                                         ("prefix", prefix_streams, 448, 32, {"share": round(384 / 448, 4), "groups": 8})]:
        card = dict(base, name=f"replicas-{name}", description=f"benchmarks/replicas.py: the {name} workload")
        card["traffic"] = {"arrival": "closed", "concurrency": conc, "requests": conc * rounds,
                           "warmup": conc, "seed": 0, "input_len": inp, "output_len": outp}
        if prefix:
            card["traffic"]["prefix"] = prefix
        card["server"] = {"kind": "inferlab", "config": {"kv_cache_memory": KV}, "ready_timeout": "20min"}
        path = out / f"card-{name}.yaml"
        path.write_text(yaml.safe_dump(card, sort_keys=False))
        cards[name] = path
    return cards


def simulate_commands(out: Path, cards: dict[str, Path], prefix_streams: int) -> list[str]:
    """Calibrate one replica's engine (1 thread), then simulate the 2-replica runs as bench ran them: a closed loop
    of the same streams. The simulator's least-loaded router stands for Ray's power of two choices."""
    profile = out / "profile-1x1.json"
    cmds = [f"inferlab simulate calibrate engine --num-threads 1 --kv-cache-memory {KV} -o {profile}"]
    for name, card in cards.items():
        users = prefix_streams if name == "prefix" else int(name[1:])
        routers = ROUTERS[:2] if name == "prefix" else ("least-loaded",)
        for router in routers:
            cmds.append(f"inferlab simulate predict {card} --profile {profile} --replicas 2 --router {router} "
                        f"--users {users} --no-search --json {out / f'predict-{name}-{router}.json'}")
    return cmds


def simulate(results: dict, out: Path) -> list[dict]:
    """Run the simulate commands and set each prediction beside the measured 2-replica row: relative error
    (predicted - measured) / measured of output tok/s and TTFT p50/p99."""
    rows = []
    for cmd in results["simulate"]:
        subprocess.run([sys.executable, "-m", "inferlab", *cmd.split()[1:]], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
        if " predict " not in cmd:
            continue
        pred_path = Path(cmd.split("--json ")[1].split()[0])
        name, router = pred_path.stem.removeprefix("predict-").split("-", 1)
        (point,) = json.loads(pred_path.read_text())["points"]
        if name == "prefix":
            measured = next(r for r in results["routing"] if r["router"] == router)
        else:
            measured = next(r for r in results["throughput"]
                            if r["server"] == "Ray: 2 replicas x 1 thread" and r["streams"] == int(name[1:]))
        row = {"workload": name, "router": router, "streams": measured["streams"]}
        for key, pred in (("output_tokens_per_s", point["output_tokens_per_s"]),
                          ("ttft_p50_ms", 1000 * point["ttft_p50"]), ("ttft_p99_ms", 1000 * point["ttft_p99"])):
            row[f"{key}_predicted"], row[f"{key}_measured"] = pred, measured[key]
            row[f"{key}_rel_error"] = (pred - measured[key]) / measured[key] if measured[key] else None
        rows.append(row)
    return rows


def table(results: dict) -> str:
    lines = ["| server | streams | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | errors |",
             "|---|---|---|---|---|---|---|"]
    for r in results["throughput"]:
        lines.append(f"| {r['server']} | {r['streams']} | {r['output_tokens_per_s']:.1f} | {r['ttft_p50_ms']:.0f} | "
                     f"{r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} | {r['errors']} |")
    lines += ["", "| router (2 replicas x 1 thread) | streams | prefix-cache hit rate | TTFT p50 (ms) | "
                  "TTFT p99 (ms) | output tok/s |", "|---|---|---|---|---|---|"]
    for r in results["routing"]:
        hit = "n/a" if r["prefix_cache_hit_rate"] is None else f"{r['prefix_cache_hit_rate']:.1%}"
        lines.append(f"| {r['router']} | {r['streams']} | {hit} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                     f"{r['output_tokens_per_s']:.1f} |")
    if results.get("prediction"):
        lines += ["", "| simulator, 2 replicas (calibrated on 1 x 1 thread) | streams | output tok/s pred / meas "
                      "(error) | TTFT p50 ms pred / meas (error) | TTFT p99 ms pred / meas (error) |",
                  "|---|---|---|---|---|"]
        for r in results["prediction"]:
            cells = [f"{r[k + '_predicted']:.0f} / {r[k + '_measured']:.0f} ({_pct(r[k + '_rel_error'])})"
                     for k in ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms")]
            lines.append(f"| {r['workload']}, {r['router']} | {r['streams']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.0%}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench-results" / "replicas")
    ap.add_argument("--rounds", type=int, default=3, help="measured requests per stream (after one warm-up round)")
    ap.add_argument("--smoke", action="store_true", help="4 streams, 1 round, one server of each kind: plumbing only")
    ap.add_argument("--simulate", action="store_true",
                    help="also calibrate the simulator on one replica and state its error on the 2-replica rows")
    args = ap.parse_args()
    out: Path = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    streams, prefix_streams, rounds = ([4], 4, 1) if args.smoke else ([16, 64], 16, args.rounds)
    results: dict = {"smoke": args.smoke, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "kv_cache_memory_per_replica": KV, "throughput": [], "routing": []}
    for name, flags in SERVERS.items():
        proc, base = serve(flags + ["--max-num-seqs", "64"], out / f"serve-{len(results['throughput'])}.log")
        try:
            for conc in streams:
                row = bench(base, THROUGHPUT_WL, conc, rounds, out / f"{_slug(name)}-c{conc}")
                results["throughput"].append({"server": name, "serve_flags": flags, "streams": conc, **row})
        finally:
            stop(proc)
    for router in ROUTERS:
        flags = SERVERS["Ray: 2 replicas x 1 thread"] + ["--router", router]
        proc, base = serve(flags, out / f"serve-{router}.log")
        try:
            row = bench(base, PREFIX_WL, prefix_streams, rounds, out / f"prefix-{router}")
            results["routing"].append({"router": router, "serve_flags": flags, "streams": prefix_streams, **row})
        finally:
            stop(proc)
    cards = write_cards(out, streams, prefix_streams, rounds)
    results["simulate"] = simulate_commands(out, cards, prefix_streams)
    if args.simulate:
        results["prediction"] = simulate(results, out)
    (out / "replicas.json").write_text(json.dumps(results, indent=2))
    md = table(results)
    (out / "replicas.md").write_text(md)
    print(md)
    print("The simulator's prediction of the 2-replica rows from a 1-replica x 1-thread calibration:")
    print("\n".join("  " + c for c in results["simulate"]))
    print(f"\nresults: {out / 'replicas.json'}")
    return 0


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()


if __name__ == "__main__":
    sys.exit(main())
