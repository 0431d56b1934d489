"""Decode speed at a few batch sizes, for A/B runs of one engine change at a time.

    python benchmarks/decode_speed.py [--dtype bfloat16] [--batches 1 8 16 64] [--context 256] [--engine-arg ...]
    INFERLAB_KERNELS=0 python benchmarks/decode_speed.py          # the pure-torch path instead of inferlab's kernels
    python benchmarks/decode_speed.py --engine-arg pack_weights=false

Batch 1: median inter-token latency of one 128-token greedy generation. Batch B: B prompts of --context random
tokens arrive together and each generates 128 tokens (ignore_eos): output tokens/s over the whole run (prefill
included) and the median inter-token latency (decode steps at that batch size).

`--against REV` runs instead two engines in one process, one on this tree's kernels and one on git revision REV's
(built beside them from `git archive`), and alternates their generations `--rounds` times per batch size (the
order flipping each round): a kernel change measured on the engine where the host's speed drifts between processes.
Prints each side's median over the rounds and REV's over this tree's.

    python benchmarks/decode_speed.py --against 20031af --batches 1 4 16 --rounds 6
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 64])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--engine-arg", action="append", default=[], help="EngineConfig field=value, repeatable")
    ap.add_argument("--against", metavar="REV", help="this tree's kernels against git revision REV's, alternately")
    ap.add_argument("--rounds", type=int, default=6, help="with --against: generations per side and batch size")
    args = ap.parse_args()

    from inferlab import LLM, SamplingParams

    extra = {}
    for kv in args.engine_arg:
        k, v = kv.split("=", 1)
        extra[k] = {"true": True, "false": False}.get(v.lower(), v)
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"INFERLAB_KERNELS={os.environ.get('INFERLAB_KERNELS', '1')}, {extra or 'defaults'}")
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    if args.against:
        against(args, extra, rng, params)
        return
    llm = LLM(dtype=args.dtype, kv_cache_memory=1024 * 2**20, **extra)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 2, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for b in args.batches:
        prompts = [{"prompt_token_ids": rng.integers(100, 20000, args.context).tolist()} for _ in range(b)]
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t
        itl = np.concatenate([o.metrics.inter_token_latencies for o in outs])
        n = sum(len(o.token_ids) for o in outs)
        print(f"batch {b:3d}: {n / wall:7.1f} output tok/s, ITL p50 {1000 * np.median(itl):7.2f} ms", flush=True)


def against(args, extra: dict, rng, params) -> None:
    import inferlab.kernels as kernels
    from decode_attention import kernels_at

    from inferlab import LLM, SamplingParams
    from inferlab.bench.machine import MachineSampler

    # Every engine call reaches the kernels through cpu_kernels() -> build_kernels(); routing that to the selected
    # side's module while the side is built and while it generates keeps each engine on its own kernels.
    build = kernels.build_kernels
    sides = {"this": kernels.cpu_kernels(), args.against: kernels_at(args.against)}
    selected = {"module": None}
    kernels.build_kernels = lambda d, name: (selected["module"] if name == "inferlab_cpu_kernels"
                                             else build(d, name))
    # Each engine's thread adapter would set torch's one global thread count from its own steps; a fixed count
    # keeps both sides on the same.
    extra = {"num_threads": torch.get_num_threads(), **extra}
    llms = {}
    for name, module in sides.items():
        selected["module"] = module
        llms[name] = LLM(dtype=args.dtype, kv_cache_memory=1024 * 2**20, **extra)
        llms[name].generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=4))
    print(f"this tree against {args.against}, {args.rounds} alternating rounds; ITL p50 in ms, each round's and the "
          "median")
    print(f"| batch | this tree | {args.against} | {args.against} / this tree |")
    print("|---|---|---|---|")
    machine = MachineSampler()
    machine.start()
    for b in args.batches:
        prompts = [{"prompt_token_ids": rng.integers(100, 20000, args.context).tolist()} for _ in range(b)]
        itl = {name: [] for name in sides}
        for r in range(args.rounds):
            for name in list(sides)[::1 if r % 2 == 0 else -1]:
                selected["module"] = sides[name]
                outs = llms[name].generate(prompts, params)
                itl[name].append(1000 * float(np.median(np.concatenate([o.metrics.inter_token_latencies
                                                                         for o in outs]))))
        med = {name: float(np.median(v)) for name, v in itl.items()}
        cells = [f"{med[n]:.2f} ({' '.join(f'{x:.2f}' for x in itl[n])})" for n in sides]
        print(f"| {b} | {cells[0]} | {cells[1]} | {med[args.against] / med['this']:.2f}x |", flush=True)
    share = machine.stop()["foreign_cpu_share"]
    print(f"other processes' CPU over the run: {'unknown' if share is None else f'{100 * share:.1f}%'}")


if __name__ == "__main__":
    main()
