"""`inferlab demo`: the offline engine answering a few chat prompts in the terminal, then a throughput line."""

from __future__ import annotations

import argparse
import time

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about a cat watching the rain.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for writing readable Python code.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from inferlab.engine.config import EngineConfig

    parser.add_argument("--prompt", action="append", help="a chat prompt (repeat for several); default: four examples")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    EngineConfig.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from inferlab.engine.config import EngineConfig
    from inferlab.common.errors import InvalidRequestError, ModelLoadError
    from inferlab.engine.llm import LLM
    from inferlab.engine.sampling_params import SamplingParams

    console = Console()
    cfg = EngineConfig.from_cli_args(args)
    t0 = time.perf_counter()
    try:
        llm = LLM(**{k: v for k, v in cfg.to_dict().items()})
    except ModelLoadError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    eng = llm.engine
    console.print(f"[bold]{eng.model_name}[/bold] on {eng.device} ({str(eng.dtype).removeprefix('torch.')}), "
                  f"weights {eng.weight_bytes / 2**20:.0f} MiB, KV pool {eng.runner.kv_cache_bytes / 2**20:.0f} MiB, "
                  f"quantization {eng.quant_path}; loaded in {time.perf_counter() - t0:.1f}s")
    prompts = args.prompt or DEFAULT_PROMPTS
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    t1 = time.perf_counter()
    try:
        outs = llm.generate([[{"role": "user", "content": p}] for p in prompts], params)
    except InvalidRequestError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    wall = time.perf_counter() - t1
    for p, o in zip(prompts, outs):
        console.print(f"\n[bold cyan]> {p}[/bold cyan]")
        console.print(o.text.strip())
        m = o.metrics
        itl = m.inter_token_latencies
        console.print(f"[dim]{len(o.token_ids)} tokens, {o.finish_reason}; TTFT {m.ttft * 1000:.0f} ms, "
                      f"ITL mean {1000 * sum(itl) / max(1, len(itl)):.1f} ms[/dim]")
    n_out = sum(len(o.token_ids) for o in outs)
    console.print(f"\n[bold]throughput:[/bold] {len(outs)} requests batched together, {n_out} output tokens in "
                  f"{wall:.2f}s = {n_out / wall:.1f} output tokens/s")
    return 0
