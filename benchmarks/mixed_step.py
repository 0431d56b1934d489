"""A step that prefills a chunk beside running decodes: as rows of the decode plan against on the layers.

    python benchmarks/mixed_step.py [--decodes 7] [--prompt-len 1000] [--chunks 64 128 256 500] [--rounds 3]

--decodes sequences (128-token prompts) decode throughout while prompts of --prompt-len random tokens are prefilled
one after another in chunks of each size. For each chunk size the two paths alternate prompt by prompt in one
engine (engine/model_runner.py: ROW_ATTENTION_MAX_KEYS set past any chunk, or to 0), --rounds prompts each, and
the median step time of each path is reported with their ratio. Offline (no server), bundled model, bf16.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decodes", type=int, default=7)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256, 500])
    ap.add_argument("--rounds", type=int, default=3, help="prompts prefilled per chunk size and path")
    args = ap.parse_args()

    import inferlab.engine.model_runner as model_runner
    from inferlab import LLM, SamplingParams

    llm = LLM(dtype="bfloat16", kv_cache_memory=1024 * 2**20, enable_prefix_caching=False, decode_stall_ratio=None)
    eng = llm.engine
    rng = np.random.default_rng(0)
    for i in range(args.decodes):
        eng.add_request(f"d{i}", {"prompt_token_ids": rng.integers(100, 20000, 128).tolist()},
                        SamplingParams(max_tokens=4096, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.requests.values()):
        eng.step()
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    print(f"{eng.model_name}: {args.decodes} decodes beside chunks of a {args.prompt_len}-token prompt "
          f"(median step, ms)")
    for chunk in args.chunks:
        eng.scheduler.max_prefill_tokens_with_decodes = chunk
        times: dict[str, list[float]] = {"rows": [], "layers": []}
        for r in range(2 * args.rounds):
            path = "rows" if r % 2 == 0 else "layers"
            model_runner.ROW_ATTENTION_MAX_KEYS = 1 << 40 if path == "rows" else 0
            model_runner.ROW_ATTENTION_MAX_TOKENS = 1 << 40
            eng.add_request(f"p{chunk}-{r}", {"prompt_token_ids": rng.integers(100, 20000, args.prompt_len).tolist()},
                            one)
            while f"p{chunk}-{r}" in eng.requests:
                t = time.perf_counter()
                eng.step()
                times[path].append(time.perf_counter() - t)
        rows, layers = (1e3 * float(np.median(times[p])) for p in ("rows", "layers"))
        print(f"  chunk {chunk:4d}: rows {rows:6.1f}  layers {layers:6.1f}  layers / rows {layers / rows:.2f}x")


if __name__ == "__main__":
    main()
