"""Where a decode step's time goes, by engine phase, at a few batch sizes.

    python benchmarks/step_profile.py [--batches 16 64] [--context 192] [--temperature 1.0] [--steps 20]
    python benchmarks/step_profile.py --model gemma3 --batches 1 --engine-arg quantization=int4

B sequences with --context random prompt tokens are prefilled, then --steps decode steps are timed with a timer
around each phase the engine runs: scheduling, input preparation, the decoder layers (`model`: one C++ call for
decode-only steps on the CPU), the LM head (`logits`), sampling, and appending the tokens (detokenization, stop
checks), and the scheduler's `observe` (the prefill budget's fit, with `--engine-arg decode_stall_ratio=1.5`, the
served default; off here unless given). `other` is the rest of `LLMEngine.step`. The timers cost a few microseconds
per call.

`--warm N` then repeats the input preparation, the decoder layers, the LM head and the sampler N times each, back to
back, on one step's inputs: what each costs with its code and data in the caches, where in the step loop the weights
it streams between them have pushed both out.
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--temperature", type=float, default=1.0, help="1.0: what `inferlab bench` asks for by default")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", default=None, help="a GGUF or HF folder, or gemma3 (the Gemma 3 270M package's "
                                                  "file); default: the bundled SmolLM2")
    ap.add_argument("--engine-arg", action="append", default=[], help="EngineConfig field=value, repeatable")
    ap.add_argument("--warm", type=int, default=0, metavar="N", help="then each phase N times back to back")
    args = ap.parse_args()

    from inferlab import LLM, SamplingParams

    from inferlab.common.bundled import gemma3_model_path

    extra = {k: _value(v) for k, v in (kv.split("=", 1) for kv in args.engine_arg)}
    if args.model:
        extra["model"] = str(gemma3_model_path()) if args.model == "gemma3" else args.model
    # No decode-stall bound: the batch's prompts are prefilled before its decode steps are timed (with the bound,
    # the first sequences would decode, and finish, while the last ones still prefill).
    llm = LLM(**{"dtype": "bfloat16", "kv_cache_memory": 1024 * 2**20, "decode_stall_ratio": None, **extra})
    eng = llm.engine
    times: dict[str, float] = collections.defaultdict(float)

    def timed(obj, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times[key] += time.perf_counter() - t

        setattr(obj, name, wrapper)

    timed(eng.scheduler, "schedule", "schedule")
    timed(eng.scheduler, "observe", "observe")  # the prefill budget's fit (decode_stall_ratio; off by default here)
    timed(eng.runner, "prepare", "prepare")
    timed(eng.runner.model.model, "forward", "model")
    timed(eng.runner.model, "compute_logits", "logits")
    timed(eng, "sampler", "sampler")
    timed(eng, "_append_tokens", "append")
    print(f"{eng.model_name}: {torch.get_num_threads()} threads, {str(eng.dtype).removeprefix('torch.')}, context "
          f"{args.context}, temperature {args.temperature}, quantization {eng.quant_path}")
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.steps + 16, ignore_eos=True)
    for b in args.batches:
        for i in range(b):
            eng.add_request(f"b{b}-{i}", {"prompt_token_ids": rng.integers(100, 20000, args.context).tolist()},
                            params)
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.requests.values()):
            eng.step()
        for _ in range(3):
            eng.step()
        times.clear()
        t = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        total = (time.perf_counter() - t) / args.steps * 1e3
        parts = {k: v / args.steps * 1e3 for k, v in times.items()}
        parts["other"] = total - sum(parts.values())
        print(f"batch {b:3d}: {total:6.2f} ms a step | " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
        if args.warm:
            print(f"           warm, each {args.warm} times back to back: " + ", ".join(
                f"{k} {v:.3f}" for k, v in warm_phases(eng, args.warm).items()))
        for rid in list(eng.requests):
            eng.abort(rid)


def _value(text: str):
    """An --engine-arg value as the EngineConfig field takes it: a number or None where it reads as one."""
    if text == "None":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def warm_phases(eng, repeats: int) -> dict[str, float]:
    """ms a call of each phase repeated back to back on the next step's inputs (the step itself is not run: the
    caller aborts its requests after)."""
    batch = eng.scheduler.schedule()
    tables = [eng.block_manager.table(s.request_id) for s in batch.seqs]
    runner, model = eng.runner, eng.runner.model
    inputs = runner.prepare(batch, tables)
    with torch.inference_mode():
        hidden = model(inputs.input_ids, inputs.positions, inputs.meta)
        logits = model.compute_logits(hidden[inputs.logits_index])
        phases = {
            "prepare": lambda: runner.prepare(batch, tables),
            "model": lambda: model(inputs.input_ids, inputs.positions, inputs.meta),
            "logits": lambda: model.compute_logits(hidden[inputs.logits_index]),
            "sampler": lambda: eng._sample_batch(logits, inputs.sample_seqs, inputs.logits_per_seq),
        }
        out = {}
        for name, fn in phases.items():
            fn()
            t = time.perf_counter()
            for _ in range(repeats):
                fn()
            out[name] = (time.perf_counter() - t) / repeats * 1e3
    return out


if __name__ == "__main__":
    main()
