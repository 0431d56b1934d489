"""Speculative decoding benchmark (not a test: it measures, it never asserts speed).

  python benchmarks/speculative.py [--max-tokens 96] [--k 4] [--draft-layers 28] [--threads 1] [--json out.json]

TPOT (time per output token after the first, per request, averaged over requests) with and without each method, on
(a) input-grounded tasks (rewrite or summarise a passage, edit code: the output copies from the prompt) and
(b) open-ended chat, at batch 1 (requests one at a time) and at 16 concurrent requests. Greedy, so every method
must produce the baseline's tokens; the table says whether it did. Each method runs twice: speculating every step
("always"), and under the engine's default SpecPolicy ("policy": skipped when its cost model says the step or
the sequence would not pay). `--sweep` adds n-gram vs baseline at 1..16 concurrent requests on the
grounded task; `--only steptime` times decode steps against the number of tokens in them and the context
they attend to: the data behind SpecPolicy.token_cost and context_cost.
Configurations alternate request by request (batch 1) or run by run (concurrent), so the machine's drifting load
falls on all of them alike; the load average is recorded with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from inferlab import LLM, SamplingParams  # noqa: E402
from inferlab.spec import SpecPolicy, make_proposer  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "src" / "inferlab" / "data" / "corpus"
ALWAYS = SpecPolicy(always=True)


def paragraphs(name: str, first: int, count: int) -> str:
    parts = [p for p in (CORPUS / name).read_text().split("\n\n") if p.strip()]
    return "\n\n".join(parts[first:first + count])


def code_lines(name: str, start: int, stop: int) -> str:
    return "\n".join((CORPUS / name).read_text().splitlines()[start:stop])


def workloads() -> dict[str, list[list[dict]]]:
    def user(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    grounded = [
        user("Rewrite the following passage, keeping every sentence but replacing the word 'bread' with 'loaf' "
             "wherever it appears:\n\n" + paragraphs("prose_bread.txt", 1, 2)),
        user("Add a one-line docstring to every method that lacks one, and return the complete code:\n\n```python\n"
             + code_lines("code_inventory.py", 8, 40) + "\n```"),
        user("Summarise this story in a few sentences, reusing its own wording where you can:\n\n"
             + paragraphs("prose_lighthouse.txt", 1, 2)),
        user("Rename the function `binary_search` to `bisect_find` and return the complete code:\n\n```python\n"
             + code_lines("code_algorithms.py", 0, 30) + "\n```"),
    ]
    chat = [
        user("Write a short story about a robot who learns to paint."),
        user("What are some tips for staying productive when working from home?"),
        user("Describe your ideal weekend in a small seaside town."),
        user("Why do people enjoy music? Give a few reasons."),
    ]
    return {"grounded": grounded, "chat": chat}


def configs(k: int, draft_layers: int) -> dict[str, tuple[dict | None, SpecPolicy | None]]:
    ngram = dict(speculative="ngram", num_speculative_tokens=k)
    draft = dict(speculative="draft", num_speculative_tokens=k, draft_layers=draft_layers)
    return {
        "none": (None, None),
        f"ngram k={k} always": (ngram, ALWAYS),
        f"ngram k={k} policy": (ngram, SpecPolicy()),
        f"draft L={draft_layers} k={k} always": (draft, ALWAYS),
        f"draft L={draft_layers} k={k} policy": (draft, SpecPolicy()),
    }


def use(llm: LLM, options: dict | None, policy: SpecPolicy | None) -> None:
    eng = llm.engine
    eng.proposer = None if options is None else make_proposer(replace(eng.config, **options), eng.runner, eng.tokenizer, policy)


def run(llm: LLM, prompts: list[list[dict]], params: SamplingParams) -> dict:
    """Generate all prompts concurrently; per-request TPOT, tokens, and the speculation counters' deltas."""
    eng = llm.engine
    before = eng.stats()
    skipped0 = getattr(eng.proposer, "num_steps_skipped", 0)
    cooling0 = getattr(eng.proposer, "num_seq_steps_cooling", 0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    after = eng.stats()
    tpots = [(o.metrics.token_times[-1] - o.metrics.first_token_time) / (len(o.token_ids) - 1)
             for o in outs if len(o.token_ids) > 1]
    return {
        "tpot_s": tpots,
        "tokens": [o.token_ids for o in outs],
        "wall_s": wall,
        "output_tokens": sum(len(o.token_ids) for o in outs),
        "drafts": after.spec_num_drafts_total - before.spec_num_drafts_total,
        "draft_tokens": after.spec_num_draft_tokens_total - before.spec_num_draft_tokens_total,
        "accepted": after.spec_num_accepted_tokens_total - before.spec_num_accepted_tokens_total,
        "steps": after.num_steps_total - before.num_steps_total,
        "steps_skipped": getattr(eng.proposer, "num_steps_skipped", 0) - skipped0,
        "seq_steps_cooling": getattr(eng.proposer, "num_seq_steps_cooling", 0) - cooling0,
    }


def merge(runs: list[dict]) -> dict:
    out = {key: sum(r[key] for r in runs) for key in ("wall_s", "output_tokens", "drafts", "draft_tokens",
                                                      "accepted", "steps", "steps_skipped", "seq_steps_cooling")}
    out["tpot_s"] = [t for r in runs for t in r["tpot_s"]]
    out["tokens"] = [t for r in runs for t in r["tokens"]]
    return out


def summarise(r: dict, base: dict) -> dict:
    tpot = statistics.mean(r["tpot_s"])
    same = sum(a == b for a, b in zip(r["tokens"], base["tokens"]))
    return {
        "tpot_ms": tpot * 1e3,
        "speedup": statistics.mean(base["tpot_s"]) / tpot,
        "output_tok_s": r["output_tokens"] / r["wall_s"],
        "acceptance": r["accepted"] / r["draft_tokens"] if r["draft_tokens"] else None,
        "tokens_per_verify": 1 + r["accepted"] / r["drafts"] if r["drafts"] else None,
        "drafts": r["drafts"],
        "steps_skipped": r["steps_skipped"],
        "seq_steps_cooling": r["seq_steps_cooling"],
        "identical": f"{same}/{len(base['tokens'])}",
    }


def bench(llm: LLM, cfgs: dict, prompts: list[list[dict]], params: SamplingParams, concurrency: int,
          repeats: int) -> dict:
    raw: dict[str, list[dict]] = {name: [] for name in cfgs}
    names = list(cfgs)
    if concurrency == 1:
        for i, p in enumerate(prompts * repeats):
            for name in names[i % len(names):] + names[: i % len(names)]:  # rotate the order per request
                use(llm, *cfgs[name])
                raw[name].append(run(llm, [p], params))
    else:
        batch = [prompts[i % len(prompts)] for i in range(concurrency)]
        for rep in range(repeats):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                use(llm, *cfgs[name])
                raw[name].append(run(llm, batch, params))
    use(llm, None, None)
    merged = {name: merge(runs) for name, runs in raw.items()}
    rows = {name: summarise(r, merged["none"]) for name, r in merged.items()}
    rows["none"]["baseline_tokens"] = merged["none"]["tokens"]
    return rows


def time_decode_steps(llm: LLM, prompts: list[list[int]], steps: int = 12) -> float:
    """Fastest of `steps` pure decode steps over these prompts (the minimum: other processes on a shared machine
    only ever add time)."""
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)  # nobody finishes while timed
    ids = [f"steptime-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, sp)
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in eng.requests.values()) or eng.scheduler.waiting:
        eng.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    for rid in ids:
        eng.abort(rid)
    return min(times)


def steptime(llm: LLM, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)) -> dict:
    """Decode-step time against tokens per step (short contexts) and against context length (16 sequences):
    the data behind SpecPolicy.token_cost (b / a of the line a + b * tokens) and context_cost."""
    # Distinct first tokens: no prefix-cache hits between the sequences.
    best = {n: time_decode_steps(llm, [[100 + i, *range(200, 215)] for i in range(n)]) for n in sizes}
    xs, ys = list(best), list(best.values())
    b = statistics.covariance(xs, ys) / statistics.variance(xs)
    a = statistics.mean(ys) - b * statistics.mean(xs)
    short = best.get(16) or time_decode_steps(llm, [[100 + i, *range(200, 215)] for i in range(16)])
    # Unequal lengths (100..700, mean 400), as in any real batch: attention pads to the longest and masks.
    long = time_decode_steps(llm, [[100 + i, *range(200, 299 + 40 * i)] for i in range(16)])
    d = (long - short) / (16 * (400 - 16))
    print("\ndecode step time: " + ", ".join(f"{n} tok {t * 1e3:.1f} ms" for n, t in best.items())
          + f"; 16 tok at 400-token contexts {long * 1e3:.1f} ms")
    print(f"fit: {a * 1e3:.1f} ms + {b * 1e3:.2f} ms/token + {d * 1e3:.4f} ms/context token -> token_cost = "
          f"{b / a:.3f}, context_cost = {d / a:.5f}")
    return {"best_s": best, "long_context_s": long, "a_s": a, "b_s": b, "d_s": d, "token_cost": b / a,
            "context_cost": d / a}


def print_table(title: str, rows: dict) -> None:
    print(f"\n{title}")
    print("| config | TPOT ms | speedup | out tok/s | acceptance | tokens/verify | steps skipped | seq-steps cooling "
          "| identical |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        tpv = "-" if r["tokens_per_verify"] is None else f"{r['tokens_per_verify']:.2f}"
        print(f"| {name} | {r['tpot_ms']:.1f} | {r['speedup']:.2f}x | {r['output_tok_s']:.1f} | {acc} | {tpv} | "
              f"{r['steps_skipped']} | {r['seq_steps_cooling']} | {r['identical']} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="proposals per step")
    ap.add_argument("--draft-layers", type=int, default=28, help="the draft: the target's first L layers")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is steadiest on a shared box)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--sweep", action="store_true", help="also n-gram vs none at 1, 2, 4, 8, 16 concurrent")
    ap.add_argument("--only", choices=["grounded", "chat", "sweep", "steptime"], default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    llm = LLM(dtype=args.dtype, num_threads=args.threads, kv_cache_memory=256 * 2**20)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    cfgs = configs(args.k, args.draft_layers)
    results: dict = {
        "command": " ".join(sys.argv),
        "model": llm.engine.model_name, "dtype": str(llm.engine.dtype), "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(), "load_avg_start": os.getloadavg(), "runs": {},
    }
    llm.generate("warm up", SamplingParams(max_tokens=4))
    if args.only in (None, "steptime"):
        results["steptime"] = steptime(llm)
    for wname, prompts in workloads().items():
        if args.only and wname != args.only:
            continue
        for conc in (1, args.concurrency):
            rows = bench(llm, cfgs, prompts, params, conc, args.repeats)
            results["runs"][f"{wname} x{conc}"] = rows
            print_table(f"{wname}, {'batch 1' if conc == 1 else f'{conc} concurrent'}", rows)
        # Greedy ties: bf16 logits are coarse, so batch composition alone can flip a tie. How often does the
        # baseline itself change between batch 1 and concurrent? (The tests check exact identity in float32.)
        alone = results["runs"][f"{wname} x1"]["none"]["baseline_tokens"]
        batched = results["runs"][f"{wname} x{args.concurrency}"]["none"]["baseline_tokens"]
        same = sum(batched[i] == alone[i % len(alone)] for i in range(len(batched)))
        results["runs"][f"{wname} baseline batch-1 vs concurrent identical"] = f"{same}/{len(batched)}"
        print(f"{wname}: the baseline's own outputs at batch 1 and {args.concurrency} concurrent agree on "
              f"{same}/{len(batched)} requests")
    if args.sweep or args.only == "sweep":
        sweep_cfgs = {k: v for k, v in cfgs.items() if k == "none" or "ngram" in k}
        for conc in (1, 2, 4, 8, 16):
            rows = bench(llm, sweep_cfgs, workloads()["grounded"], params, conc, args.repeats)
            results["runs"][f"sweep grounded x{conc}"] = rows
            print_table(f"sweep: grounded, {conc} concurrent", rows)
    results["load_avg_end"] = os.getloadavg()
    print(f"\nload average: start {results['load_avg_start']}, end {results['load_avg_end']} "
          f"({results['cpus']} CPUs, {results['threads']} torch thread(s), {results['dtype']})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
