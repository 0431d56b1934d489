"""Where a CUDA GPU is available: run the engine on it with the bundled model, record its throughput and its greedy
agreement with the CPU run. A check, never a requirement of the test suite.

    python benchmarks/gpu_check.py [--dtype bfloat16] [--num-requests 64] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def greedy(llm, prompts, max_tokens):
    from inferlab import SamplingParams

    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    wall = time.perf_counter() - t
    return [o.token_ids for o in outs], sum(len(o.token_ids) for o in outs) / wall


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", help="float32 makes CPU/GPU agreement meaningful")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    from inferlab import LLM

    prompts = [[{"role": "user", "content": f"Tell me fact number {i} about the ocean."}] for i in range(args.num_requests)]
    gpu = LLM(device="cuda", dtype=args.dtype)
    greedy(gpu, prompts[:2], 4)  # warm-up
    gpu_tokens, gpu_tps = greedy(gpu, prompts, args.max_tokens)
    del gpu
    cpu = LLM(device="cpu", dtype=args.dtype)
    cpu_tokens, cpu_tps = greedy(cpu, prompts, args.max_tokens)
    identical = sum(a == b for a, b in zip(gpu_tokens, cpu_tokens))
    first_div = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(gpu_tokens, cpu_tokens)]
    res = {"device": torch.cuda.get_device_name(0), "dtype": args.dtype, "gpu_output_tokens_per_s": gpu_tps,
           "cpu_output_tokens_per_s": cpu_tps, "identical_share": identical / len(prompts),
           "mean_first_divergence": sum(first_div) / len(first_div)}
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
