"""Prefix caching on and off, in one run: TTFT and throughput on a shared-prefix workload (8 groups sharing a
1,024-token prefix, 64-token unique suffixes), and the cost on a workload with no reuse.

    python benchmarks/prefix_caching.py [--num-requests 48] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import ROOT, free_port, summarize, wait_ready  # noqa: E402


def bench(base: str, extra: list[str], n: int, conc: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="prefix-bench-"))
    cmd = [sys.executable, "-m", "inferlab", "bench", "--base-url", base, "--concurrency", str(conc),
           "--num-requests", str(n), "--output-len", "32", "--ignore-eos", "--output-dir", str(out), "--quiet",
           "--no-html", *extra]
    subprocess.run(cmd, cwd=ROOT, check=True)
    return summarize(json.loads((out / "results.json").read_text()))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    shared = ["--input-len", "1088", "--prefix-groups", "8", "--prefix-len", "1024"]
    unique = ["--input-len", "512", "--seed", "1"]
    rows = {}
    for caching in ("on", "off"):
        port = free_port()
        flag = "--enable-prefix-caching" if caching == "on" else "--no-enable-prefix-caching"
        proc = subprocess.Popen([sys.executable, "-m", "inferlab", "serve", "--port", str(port), flag,
                                 "--max-num-batched-tokens", "1024"], cwd=ROOT, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base, proc, 600)
            rows[f"shared-prefix, caching {caching}"] = bench(base, shared, args.num_requests, args.concurrency)
            rows[f"no reuse, caching {caching}"] = bench(base, unique, args.num_requests, args.concurrency)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    print("| workload | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) |")
    print("|---|---|---|---|---|")
    for k, r in rows.items():
        print(f"| {k} | {r['output_tokens_per_s']:.1f} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | "
              f"{r['itl_p50_ms']:.1f} |")
    on, off = rows["shared-prefix, caching on"], rows["shared-prefix, caching off"]
    print(f"\nshared prefix: TTFT p50 {off['ttft_p50_ms'] / on['ttft_p50_ms']:.1f}x lower with caching")
    u_on, u_off = rows["no reuse, caching on"], rows["no reuse, caching off"]
    print(f"no reuse: throughput with caching = {u_on['output_tokens_per_s'] / u_off['output_tokens_per_s']:.3f}x "
          f"of without")
    return 0


if __name__ == "__main__":
    sys.exit(main())
