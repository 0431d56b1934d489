"""Steps with no decodes beside their multi-token queries: as rows of the decode plan against on the layers.

    python benchmarks/extend_step.py [--rounds 5]

Each case is one kind of step, prompts chosen so that the step is the only one of its request (max_tokens=1), and
the two paths alternate request by request in one engine (engine/model_runner.py: ROW_ATTENTION_MAX_KEYS set past
any step, or to 0, which is the layers' path: a batched SDPA over keys gathered from the pool, or for a lone
prompt from position 0 the causal SDPA over its own fresh K/V):
  - fresh N: one prompt of N random tokens, nothing cached;
  - 4 x N together: four such prompts arriving at once (one step of 4N tokens);
  - hit P+S: a prompt whose first P tokens are in the prefix cache (a previous request had them), S new ones;
  - verify: n-gram speculative decoding on a prompt that repeats itself (steps of 1 + 4 tokens a sequence), the
    mean time per output token of 64-token greedy generations, and whether each path's tokens are plain greedy's
    (the same engine without speculation, on the same path).
Reported: the median step time (ms) of each path and their ratio. Offline (no server), bundled model, bf16.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5, help="requests per case and path")
    args = ap.parse_args()

    import inferlab.engine.model_runner as model_runner
    from inferlab import LLM, SamplingParams

    llm = LLM(dtype="bfloat16", kv_cache_memory=1024 * 2**20)
    eng = llm.engine
    rng = np.random.default_rng(0)
    one = SamplingParams(max_tokens=1, ignore_eos=True)

    def use(path: str) -> None:
        model_runner.ROW_ATTENTION_MAX_KEYS = 1 << 24 if path == "rows" else 0

    def timed_steps(prompts: list[list[int]]) -> float:
        ids = [f"r{next(counter)}" for _ in prompts]
        for rid, p in zip(ids, prompts):
            eng.add_request(rid, {"prompt_token_ids": p}, one)
        t = time.perf_counter()
        while any(rid in eng.requests for rid in ids):
            eng.step()
        return time.perf_counter() - t

    counter = iter(range(1 << 30))
    tokens = lambda n: rng.integers(100, 20000, n).tolist()  # noqa: E731
    cases = {f"fresh {n}": (lambda n=n: [tokens(n)]) for n in (32, 104, 256, 512)}
    cases |= {f"4 x {n} together": (lambda n=n: [tokens(n) for _ in range(4)]) for n in (32, 104)}
    prefixes = {p: tokens(p) for p in (1000, 3000)}
    for p, prefix in prefixes.items():
        use("layers")
        timed_steps([prefix])  # now cached
        cases |= {f"hit {p}+{s}": (lambda prefix=prefix, s=s: [prefix + tokens(s)]) for s in (16, 128)}
    timed_steps([tokens(64)] * 2)  # warm-up
    print(f"{eng.model_name}, bf16: median step ms (one step a request), {args.rounds} requests a path")
    for name, make in cases.items():
        times: dict[str, list[float]] = {"rows": [], "layers": []}
        for r in range(2 * args.rounds):
            path = ("rows", "layers")[r % 2]
            use(path)
            times[path].append(timed_steps(make()))
        rows, layers = (1e3 * float(np.median(times[p])) for p in ("rows", "layers"))
        print(f"  {name:18s}: rows {rows:7.2f}  layers {layers:7.2f}  layers / rows {layers / rows:.2f}x", flush=True)

    # No prefix cache: each generation prefills its prompt on the path measured.
    spec = LLM(dtype="bfloat16", kv_cache_memory=512 * 2**20, speculative="ngram", enable_prefix_caching=False)
    no_spec = LLM(dtype="bfloat16", kv_cache_memory=512 * 2**20, enable_prefix_caching=False)
    base = tokens(24)
    prompt = [{"prompt_token_ids": base * 6}]  # the n-gram proposer finds the continuation in the prompt
    greedy = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
    plain: dict[str, list[int]] = {}
    for path in ("rows", "layers"):
        use(path)
        plain[path] = no_spec.generate(prompt, greedy)[0].token_ids
    tpot: dict[str, list[float]] = {"rows": [], "layers": []}
    exact: dict[str, bool] = {}
    for r in range(2 * args.rounds):
        path = ("rows", "layers")[r % 2]
        use(path)
        o = spec.generate(prompt, greedy)[0]
        m = o.metrics
        tpot[path].append((m.finished_time - m.first_token_time) / (len(o.token_ids) - 1))
        exact[path] = o.token_ids == plain[path]
    rows, layers = (1e3 * float(np.median(tpot[p])) for p in ("rows", "layers"))
    print(f"  {'verify (TPOT)':18s}: rows {rows:7.2f}  layers {layers:7.2f}  layers / rows {layers / rows:.2f}x"
          f"  plain greedy's tokens: rows {exact['rows']}, layers {exact['layers']}")


if __name__ == "__main__":
    main()
