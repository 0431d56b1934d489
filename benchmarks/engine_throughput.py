"""Engine throughput on a mixed workload, against transformers' static-batched `generate`, in one run.

    python benchmarks/engine_throughput.py [--num-requests 256] [--dtype auto] [--skip-hf]

Workload: prompt lengths uniform in [32, 512], output lengths uniform in [16, 512] (fixed seed), ignore_eos so every
request produces exactly its length. inferlab receives all requests at once and batches continuously; transformers
runs batches of 64 (left-padded), each until its longest request is done — the static batching baseline.
Also prints batch-1 ms/token beside the memory-bandwidth bound (weight bytes / measured read bandwidth), and peak
aggregate tokens/s beside the compute bound (measured matmul FLOP/s / (2 x parameters)).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch


def measure_bandwidth(nbytes: int = 2**30, repeats: int = 5) -> float:
    """Bytes/s for a large read (a sum over a tensor far bigger than the caches)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def measure_matmul(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def workload(n: int, tokenizer, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(32, 513, n)
    out_lens = rng.integers(16, 513, n)
    vocab = np.array([t for t in range(tokenizer.vocab_size) if t not in tokenizer.all_special_ids][:20000])
    prompts = [rng.choice(vocab, int(k)).tolist() for k in in_lens]
    return prompts, out_lens.tolist()


def run_inferlab(llm, prompts, out_lens) -> tuple[float, int]:
    from inferlab import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True) for m in out_lens]
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    wall = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    assert n == sum(out_lens), "ignore_eos must give exactly the requested lengths"
    return wall, n


def run_hf(model, prompts, out_lens, batch: int = 64, pad_id: int = 0) -> tuple[float, int]:
    from transformers import GenerationConfig

    t = time.perf_counter()
    useful = 0
    for i in range(0, len(prompts), batch):
        ps, os_ = prompts[i:i + batch], out_lens[i:i + batch]
        width = max(len(p) for p in ps)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        cfg = GenerationConfig(max_new_tokens=max(os_), do_sample=False, eos_token_id=None, pad_token_id=pad_id)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, generation_config=cfg)
        useful += sum(os_)  # tokens past a request's own length are wasted work, not throughput
    return time.perf_counter() - t, useful


def batch1_ms_per_token(llm, n_tokens: int = 128) -> float:
    from inferlab import SamplingParams

    out = llm.generate("The history of computing", SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True))[0]
    itl = out.metrics.inter_token_latencies
    return 1000 * float(np.median(itl))


def peak_decode_tps(llm, batch: int = 64, n_tokens: int = 64) -> float:
    from inferlab import SamplingParams

    prompts = [{"prompt_token_ids": [100 + i, 200, 300, 400]} for i in range(batch)]
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


def show(res: dict, *keys: str) -> None:
    """Print figures as they are measured, so an interrupted run still leaves them."""
    for k in keys or list(res):
        v = res[k]
        print(f"{k:40s} {v:.3f}" if isinstance(v, float) else f"{k:40s} {v}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    from inferlab import LLM

    llm = LLM(dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    eng = llm.engine
    dtype = eng.dtype
    res: dict = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                 "dtype": str(dtype).removeprefix("torch."), "num_requests": args.num_requests,
                 "torch": torch.__version__}
    bw = measure_bandwidth()
    flops = measure_matmul(dtype)
    params = eng.model_config.num_params
    res["read_bandwidth_GBps"] = bw / 1e9
    res["matmul_GFLOPs"] = flops / 1e9
    res["weight_bytes"] = eng.weight_bytes
    res["bandwidth_bound_ms_per_token"] = 1000 * eng.weight_bytes / bw
    res["compute_bound_tokens_per_s"] = flops / (2 * params)

    show(res)
    res["batch1_ms_per_token"] = batch1_ms_per_token(llm)
    show(res, "batch1_ms_per_token")
    res["peak_decode_tokens_per_s_batch64"] = peak_decode_tps(llm)
    show(res, "peak_decode_tokens_per_s_batch64")
    prompts, out_lens = workload(args.num_requests, llm.tokenizer)
    wall, n = run_inferlab(llm, prompts, out_lens)
    res["inferlab_output_tokens_per_s"] = n / wall
    res["inferlab_wall_s"] = wall
    show(res, "inferlab_output_tokens_per_s", "inferlab_wall_s")
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        p = eng.model_path
        hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dtype).eval()
        wall_hf, n_hf = run_hf(hf, prompts, out_lens)
        res["hf_static_output_tokens_per_s"] = n_hf / wall_hf
        res["hf_wall_s"] = wall_hf
        res["ratio_inferlab_over_hf"] = res["inferlab_output_tokens_per_s"] / res["hf_static_output_tokens_per_s"]
        show(res, "hf_static_output_tokens_per_s", "hf_wall_s", "ratio_inferlab_over_hf")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
