"""Decode speed at a few batch sizes, for A/B runs of one engine change at a time.

    python benchmarks/decode_speed.py [--dtype bfloat16] [--batches 1 8 16 64] [--context 256] [--engine-arg ...]
    INFERLAB_KERNELS=0 python benchmarks/decode_speed.py          # the pure-torch path instead of inferlab's kernels
    python benchmarks/decode_speed.py --engine-arg pack_weights=false

Batch 1: median inter-token latency of one 128-token greedy generation. Batch B: B prompts of --context random
tokens arrive together and each generates 128 tokens (ignore_eos): output tokens/s over the whole run (prefill
included) and the median inter-token latency (decode steps at that batch size).
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
    args = ap.parse_args()

    from inferlab import LLM, SamplingParams

    extra = {}
    for kv in args.engine_arg:
        k, v = kv.split("=", 1)
        extra[k] = {"true": True, "false": False}.get(v.lower(), v)
    llm = LLM(dtype=args.dtype, kv_cache_memory=1024 * 2**20, **extra)
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"INFERLAB_KERNELS={os.environ.get('INFERLAB_KERNELS', '1')}, {extra or 'defaults'}")
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 2, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for b in args.batches:
        prompts = [{"prompt_token_ids": rng.integers(100, 20000, args.context).tolist()} for _ in range(b)]
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t
        itl = np.concatenate([o.metrics.inter_token_latencies for o in outs])
        n = sum(len(o.token_ids) for o in outs)
        print(f"batch {b:3d}: {n / wall:7.1f} output tok/s, ITL p50 {1000 * np.median(itl):7.2f} ms", flush=True)


if __name__ == "__main__":
    main()
