"""The C++ decode plan against the Python layers, in one process: the plan switched off and on in turn, so both
sides see the same machine moment to moment.

    python benchmarks/decode_plan_ab.py --model gemma3 --quantization int4 [--rounds 3] [--tokens 96]

Each round generates --tokens greedy tokens after a 128-token prompt with the plan and then without it, and prints
each side's median inter-token latency.
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a GGUF or HF folder, or gemma3; default: the bundled SmolLM2")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()

    from inferlab import LLM, SamplingParams
    from inferlab.common.bundled import gemma3_model_path

    model = str(gemma3_model_path()) if args.model == "gemma3" else args.model
    llm = LLM(model=model, dtype="bfloat16", quantization=args.quantization, kv_cache_memory=256 * 2**20)
    net = llm.engine.runner.model.model
    plan = net.decode_plan
    if plan is None:
        raise SystemExit("this model and setting have no decode plan (see models/llama.py build_decode_plan)")
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(1000, 1128))}
    llm.generate([prompt], sp)  # warm-up
    for r in range(args.rounds):
        for on in (True, False):
            net.decode_plan = plan if on else None
            out = llm.generate([prompt], sp)[0]
            print(f"round {r + 1}: {'plan' if on else 'layers'} ITL p50 "
                  f"{1000 * np.median(out.metrics.inter_token_latencies):.2f} ms", flush=True)
    net.decode_plan = plan


if __name__ == "__main__":
    main()
