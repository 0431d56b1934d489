"""What oneDNN's GEMM costs at a row count it has not met yet, with rows exact and padded to ONEDNN_ROW_QUANTUM.

    python benchmarks/onednn_rows.py [--lengths 64] [--rounds 2]

oneDNN builds (JITs) a primitive for each row count a GEMM meets and caches it (1,024 primitives, LRU); the engine
takes oneDNN's GEMM for steps of onednn_min_rows() rows or more where the CPU has AMX (layers/packed_linear.py).
Each path runs in a fresh process, since the cache is the process's, the two alternating (ABAB...) --rounds times:
  - gemm: SmolLM2-135M's four layer shapes and its LM head, pre-packed as the engine packs them: the first call at
    each of 24 new row counts (5-500) against the next calls at the same count, and the resident memory each row
    count adds (all counts 16-528);
  - engine: the offline engine (bundled model, bf16): decode-only steps of 4-33 sequences; then prefills
    (max_tokens=1, nothing cached) of --lengths prompts of distinct lengths (64-256 tokens, like
    examples/card-cpu.yaml), as many new prompts at the same lengths, and three times as many of lengths drawn
    from 64-512 (repeats as a server meets them): each pass's median and mean step time, and the process's
    resident memory after it.
Only meaningful where oneDNN's GEMM runs (a CPU with AMX, or INFERLAB_ONEDNN_MIN_ROWS set): elsewhere it says so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def gemm_case(quantum: int) -> dict:
    import torch

    import inferlab.layers.packed_linear as pl
    pl.ONEDNN_ROW_QUANTUM = quantum
    torch.manual_seed(0)
    ws = {k: pl.pack_onednn(torch.randn(n, kk, dtype=torch.bfloat16) * 0.02) for k, (n, kk) in SHAPES.items()}
    x = {k: torch.randn(600, kk, dtype=torch.bfloat16) for k, (_, kk) in SHAPES.items()}

    def layer(m: int, head: bool = False) -> float:
        t = time.perf_counter()
        for k, w in ws.items():
            if (k == "lm_head") == head:
                pl.packed_mm(x[k][:m], w, SHAPES[k][0])
        return time.perf_counter() - t

    layer(100), layer(100)  # oneDNN itself up
    rows = [5, 7, 12, 33, 47, 70, 97, 111, 129, 150, 151, 158, 163, 177, 190, 203, 219, 244, 255, 301, 333, 390,
            457, 500]
    first, again = [], []
    for m in rows:
        first.append(layer(m))
        again.append(float(np.median([layer(m) for _ in range(5)])))
    head_first = [layer(m, head=True) for m in (5, 9, 13)]
    head_again = [float(np.median([layer(m, head=True) for _ in range(5)])) for m in (5, 9, 13)]
    r0, t0 = rss_mb(), time.perf_counter()
    for m in range(16, 529):
        layer(m)
    reach = {m if m <= pl.ONEDNN_EXACT_ROWS else -(-m // quantum) * quantum for m in rows}
    return {"rows": rows, "counts_reaching_onednn": len(reach), "first_ms": [1e3 * v for v in first],
            "again_ms": [1e3 * v for v in again],
            "head_first_ms": [1e3 * v for v in head_first], "head_again_ms": [1e3 * v for v in head_again],
            "sweep_s": time.perf_counter() - t0, "sweep_rss_mb": rss_mb() - r0}


def engine_case(quantum: int, lengths: int) -> dict:
    import inferlab.layers.packed_linear as pl
    from inferlab import LLM, SamplingParams

    pl.ONEDNN_ROW_QUANTUM = quantum  # the layers' path
    llm = LLM(dtype="bfloat16", kv_cache_memory=256 * 2**20, enable_prefix_caching=False)
    eng = llm.engine
    eng.runner.model.model.decode_plan.onednn_row_quantum = quantum  # the decode plan's (most steps)
    assert eng.runner.model.model.decode_plan.onednn_exact_rows == pl.ONEDNN_EXACT_ROWS
    rng = np.random.default_rng(0)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    sizes = rng.choice(np.arange(64, 257), lengths, replace=False).tolist()
    counter = iter(range(1 << 30))

    def step_time(n: int) -> float:
        rid = f"r{next(counter)}"
        eng.add_request(rid, {"prompt_token_ids": rng.integers(100, 20000, n).tolist()}, one)
        t = time.perf_counter()
        while rid in eng.requests:
            eng.step()
        return time.perf_counter() - t

    def decode_steps(batch: int) -> float:
        """Median decode-only step of `batch` sequences (64-token prompts, 24 tokens each)."""
        ids = [f"r{next(counter)}" for _ in range(batch)]
        for rid in ids:
            eng.add_request(rid, {"prompt_token_ids": rng.integers(100, 20000, 64).tolist()},
                            SamplingParams(max_tokens=24, ignore_eos=True))
        eng.step()  # the prefills
        times = []
        while any(rid in eng.requests for rid in ids):
            eng.step()
            times.append(eng.last_step_time)
        return float(np.median(times[:-1]))

    step_time(300), step_time(300)  # warm-up at a length outside the sizes
    out = {"decode_ms": {b: 1e3 * decode_steps(b) for b in (4, 5, 9, 13, 16, 33)}}
    passes = {"new lengths": sizes, "same lengths again": sizes,
              "uniform 64-512, repeats": rng.integers(64, 513, 3 * lengths).tolist()}
    for name, lens in passes.items():
        times = [step_time(n) for n in lens]
        out[name] = {"median_ms": 1e3 * float(np.median(times)), "mean_ms": 1e3 * float(np.mean(times)),
                     "rss_mb": rss_mb()}
    return out


def child(args) -> None:
    q = args.child_quantum
    print(json.dumps({"gemm": gemm_case(q)} if args.child == "gemm" else {"engine": engine_case(q, args.lengths)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, default=64, help="distinct prompt lengths the engine prefills")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", choices=("gemm", "engine"), help=argparse.SUPPRESS)
    ap.add_argument("--child-quantum", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from inferlab.layers.packed_linear import ONEDNN_ROW_QUANTUM, onednn_min_rows
    if not onednn_min_rows():
        print("oneDNN's GEMM does not run on this machine (no AMX; INFERLAB_ONEDNN_MIN_ROWS unset): nothing to measure")
        return
    from inferlab.bench.machine import MachineSampler
    machine = MachineSampler()  # the children are reaped, so their CPU counts as this benchmark's
    machine.start()
    paths = {"exact rows": 1, f"padded to {ONEDNN_ROW_QUANTUM}": ONEDNN_ROW_QUANTUM}
    runs: dict[str, list[dict]] = {p: [] for p in paths}
    for r in range(args.rounds):
        for case in ("gemm", "engine"):
            for p, q in (paths.items() if r % 2 == 0 else reversed(paths.items())):
                cmd = [sys.executable, __file__, "--child", case, "--child-quantum", str(q), "--lengths",
                       str(args.lengths)]
                runs[p].append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True
                                                         ).stdout.strip().splitlines()[-1]))
                print(f"round {r + 1} {case} {p}: done", file=sys.stderr)
    share = machine.stop()["foreign_cpu_share"]
    print(f"{args.rounds} rounds, each path in a fresh process; figures: the median over rounds; other processes' "
          f"CPU over the run: {'unknown' if share is None else f'{100 * share:.1f}%'}")
    for p in paths:
        g = [x["gemm"] for x in runs[p] if "gemm" in x]
        e = [x["engine"] for x in runs[p] if "engine" in x]
        med = lambda key: float(np.median([x[key] for x in g]))  # noqa: E731
        first = np.median([x["first_ms"] for x in g], axis=0)
        again = np.median([x["again_ms"] for x in g], axis=0)
        print(f"\n{p}")
        print(f"  gemm, 4 layer shapes at 24 new row counts 5-500 ({g[0]['counts_reaching_onednn']} counts reach "
              f"oneDNN): first call median {np.median(first):.2f} ms, the next calls {np.median(again):.2f} ms "
              f"(first - next: {np.median(first - again):.2f} ms)")
        print(f"  gemm, LM head at 5/9/13 rows: first {np.round(np.median([x['head_first_ms'] for x in g], 0), 2)} "
              f"ms, next {np.round(np.median([x['head_again_ms'] for x in g], 0), 2)} ms")
        print(f"  gemm, every row count 16-528 once: {med('sweep_s'):.2f} s, "
              f"resident memory +{med('sweep_rss_mb'):.0f} MB")
        by_row = " ".join(f"{m}:{a:.2f}" for m, a in zip(g[0]["rows"], again))
        print(f"  gemm, cached, per row count (ms): {by_row}")
        dec = {b: np.median([x["decode_ms"][b] for x in e]) for b in e[0]["decode_ms"]}
        print("  engine, decode-only step median by batch (ms): " + " ".join(f"{b}:{v:.2f}" for b, v in dec.items()))
        for name, k in (("new lengths", 1), ("same lengths again", 1), ("uniform 64-512, repeats", 3)):
            print(f"  engine, {k * args.lengths} prompts of {name}: step median "
                  f"{np.median([x[name]['median_ms'] for x in e]):.1f} ms, mean "
                  f"{np.median([x[name]['mean_ms'] for x in e]):.1f} ms, resident "
                  f"{np.median([x[name]['rss_mb'] for x in e]):.0f} MB")


if __name__ == "__main__":
    main()
