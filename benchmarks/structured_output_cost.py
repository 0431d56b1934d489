"""What structured output and logprobs cost the engine: output tok/s at 16 concurrent streams, plain vs every request
under a JSON schema (xgrammar masks) vs every request asking logprobs=5, in one process, alternating the modes.

    PYTHONPATH=src python benchmarks/structured_output_cost.py [--streams 16] [--tokens 128] [--rounds 3]

Each request decodes exactly --tokens tokens: the plain and logprobs ones with ignore_eos, the guided ones under a
schema (an object holding an unbounded array of strings) that greedy decoding of this model keeps extending. Prints
one JSON line per mode with the median tok/s over rounds and the slowdown against plain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from inferlab import LLM, SamplingParams
from inferlab.engine.structured_output import Guide

SCHEMA = json.dumps({"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
                     "required": ["notes"]})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, max_num_seqs=args.streams)
    prompts = [[{"role": "user", "content": f"List notes about topic number {i} as JSON."}]
               for i in range(args.streams)]
    modes = {
        "plain": SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True),
        "json_schema": SamplingParams(temperature=0, max_tokens=args.tokens, guide=Guide("json_schema", SCHEMA)),
        "logprobs5": SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, logprobs=5),
    }
    llm.generate(prompts[:2], modes["json_schema"])  # warm-up: kernels, the grammar compiler
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode, params in modes.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t0
            rates[mode].append(sum(len(o.token_ids) for o in outs) / dt)
    base = statistics.median(rates["plain"])
    for mode, r in rates.items():
        med = statistics.median(r)
        print(json.dumps({"mode": mode, "streams": args.streams, "tokens": args.tokens, "tok_s_median": round(med, 1),
                          "tok_s_all": [round(x, 1) for x in r], "slowdown_vs_plain": round(1 - med / base, 3)}))


if __name__ == "__main__":
    main()
