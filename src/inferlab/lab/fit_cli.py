"""`inferlab fit`: will the model fit, and how fast can it possibly go? Arithmetic only; no model is loaded."""

from __future__ import annotations

import argparse
import json
import sys

from inferlab.lab.fit import FLOAT_DTYPES, QUANTIZATIONS, DTYPE_BYTES, FitReport, FitRequest, fit
from inferlab.lab.hardware import HARDWARE_PRESETS, THIS_MACHINE, resolve_hardware
from inferlab.lab.model_presets import MODEL_PRESETS, resolve_model
from inferlab.common.units import UnitError, format_bytes, format_ms, parse_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help=f"a preset ({', '.join(MODEL_PRESETS)}), a GGUF file or a Hugging Face folder "
                        f"(default: the bundled model)")
    p.add_argument("--hardware", default=THIS_MACHINE,
                   help=f"{', '.join(HARDWARE_PRESETS)} or '{THIS_MACHINE}' (measured by a short probe; the default)")
    p.add_argument("--context", type=int, default=4096, help="tokens per sequence the KV cache must hold")
    p.add_argument("--concurrency", type=int, default=1, help="sequences resident at once")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens for the prefill bound (default: context)")
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS)
    p.add_argument("--quant-group-size", type=int, default=32, help="int4: weights per scale")
    p.add_argument("--dtype", default="bf16", choices=FLOAT_DTYPES, help="float weights, activations and compute")
    p.add_argument("--kv-dtype", default=None, choices=list(DTYPE_BYTES), help="default: --dtype")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--reserve", type=float, default=0.10,
                   help="share of device memory kept for the runtime and fragmentation (default 0.10)")
    p.add_argument("--memory-budget", default=None, help="cap on what the model may use, e.g. 20GiB")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.add_argument("--list", action="store_true", help="list model and hardware presets with their sources")


def run(args: argparse.Namespace) -> int:
    if args.list:
        return _list()
    try:
        req = FitRequest(
            context=args.context, concurrency=args.concurrency, prompt_len=args.prompt_len,
            quantization=args.quantization, quant_group_size=args.quant_group_size, dtype=args.dtype,
            kv_dtype=args.kv_dtype, block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
            reserve_frac=args.reserve,
            memory_budget=parse_bytes(args.memory_budget, "--memory-budget") if args.memory_budget else None,
        )
        req.validate()
        spec = resolve_model(args.model)
        hw = resolve_hardware(args.hardware)
        report = fit(spec, hw, req)
    except (ValueError, UnitError, FileNotFoundError, RuntimeError) as e:
        print(f"inferlab fit: {e}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(report.to_dict(), sys.stdout, indent=2)
        print()
    else:
        print_report(report)
    return 0


def _list() -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title="model presets", title_justify="left")
    for c in ("name", "params", "active", "layers", "heads/kv", "vocab"):
        t.add_column(c)
    for s in MODEL_PRESETS.values():
        t.add_row(s.name, f"{s.num_params / 1e9:.2f} B", f"{s.active_params / 1e9:.2f} B", str(s.num_layers),
                  f"{s.num_heads}/{s.num_kv_heads}", str(s.vocab_size))
    console.print(t)
    for s in MODEL_PRESETS.values():
        console.print(f"  [dim]{s.name}: {s.source}[/]")
    h = Table(title="hardware presets (dense peaks)", title_justify="left")
    for c in ("name", "memory", "bandwidth", "bf16", "fp32"):
        h.add_column(c)
    for hw in HARDWARE_PRESETS.values():
        h.add_row(hw.name, f"{hw.memory_bytes / 2**30:.0f} GiB", f"{hw.bandwidth / 1e12:.2f} TB/s",
                  f"{hw.flops['bf16'] / 1e12:.0f} TFLOP/s", f"{hw.flops['fp32'] / 1e12:.1f} TFLOP/s")
    h.add_row(THIS_MACHINE, "measured", "measured", "measured", "measured")
    console.print(h)
    for hw in HARDWARE_PRESETS.values():
        console.print(f"  [dim]{hw.name}: {hw.source}[/]")
    console.print(f"  [dim]{THIS_MACHINE}: a short probe (read bandwidth, bf16/fp32 matmul) run by `inferlab fit`[/]")
    return 0


def _rate(flops: float) -> str:
    return f"{flops / 1e12:.1f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.1f} GFLOP/s"


def print_report(r: FitReport) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    req = r.request
    console.print(f"[bold]{r.model}[/] on [bold]{r.hardware}[/]  "
                  f"({r.num_params / 1e9:.3g} B params" + (f", {r.active_params / 1e9:.3g} B active" if
                                                            r.active_params != r.num_params else "") + ")")
    w = Table(title="weights (GB = 10^9 bytes)", title_justify="left")
    for c in ("quantization", "linear layers", "scales, zeros", "16-bit rest", "total"):
        w.add_column(c, justify="left" if c == "quantization" else "right")
    for name, wm in r.weights.items():
        w.add_row(f"{name} ◀" if name == r.selected else name, format_bytes(wm.quantized_bytes),
                  format_bytes(wm.scale_bytes), format_bytes(wm.unquantized_bytes), format_bytes(wm.total))
    console.print(w)
    for name, wm in r.weights.items():
        console.print(f"  [dim]{name}: {wm.description}[/]")
    console.print("  [dim]16-bit rest: untied embedding table, norms, biases, router (never quantized)[/]")

    m = Table(title=f"memory: context {req.context} × concurrency {req.concurrency}", title_justify="left")
    m.add_column("item")
    m.add_column("bytes", justify="right")
    m.add_column("how", justify="left")
    kv_dt = req.kv_dtype or req.dtype
    m.add_row("weights", format_bytes(r.weights[r.selected].total), r.selected)
    m.add_row("KV cache per token", format_bytes(r.kv_bytes_per_token), f"2 × layers × kv_heads × head_dim × {kv_dt}")
    m.add_row("KV cache", format_bytes(r.kv_bytes),
              f"{r.kv_tokens_per_seq} tokens ({req.block_size}-token blocks) × {req.concurrency}")
    m.add_row("activations (estimate)", format_bytes(r.activation_bytes),
              f"step of {req.max_num_batched_tokens} tokens + fp32 logits per sequence")
    m.add_row("needed", format_bytes(r.needed_bytes), "")
    m.add_row("budget", format_bytes(r.budget_bytes),
              f"{format_bytes(r.memory_bytes)} less {req.reserve_frac:.0%} reserve"
              + (f", capped at {format_bytes(req.memory_budget)}" if req.memory_budget else ""))
    verdict = "[green]fits[/]" if r.fits else "[red]does not fit[/]"
    m.add_row("verdict", verdict, f"max concurrency at this context: {r.max_concurrency}; "
                                  f"max context at this concurrency: {r.max_context}")
    console.print(m)

    d = Table(title=f"roofline lower bounds: {_rate(r.peak_flops)} {req.dtype}, {r.bandwidth / 1e9:.4g} GB/s, "
                    f"balance {r.machine_balance:.0f} FLOP/byte", title_justify="left")
    d.add_column("")
    pf = r.prefill
    for p in r.decode:
        d.add_column(f"decode, batch {p.batch}", justify="right")
    d.add_column(f"prefill {pf.tokens} tok", justify="right")
    rows = [
        ("bytes read", [format_bytes(p.weight_bytes_read + p.kv_bytes_read) for p in r.decode], format_bytes(pf.bytes_read)),
        ("FLOPs", [f"{p.flops:.3g}" for p in r.decode], f"{pf.flops:.3g}"),
        ("memory time", [format_ms(p.memory_ms / 1e3) for p in r.decode], format_ms(pf.memory_ms / 1e3)),
        ("compute time", [format_ms(p.compute_ms / 1e3) for p in r.decode], format_ms(pf.compute_ms / 1e3)),
        ("lower bound", [f"[bold]{format_ms(p.step_ms / 1e3)}[/]" for p in r.decode], f"[bold]{format_ms(pf.time_ms / 1e3)}[/]"),
        ("bound by", [p.bound for p in r.decode], pf.bound),
        ("tok/s per user", [f"{p.tokens_per_s_per_user:.4g}" for p in r.decode], ""),
        ("tok/s total", [f"{p.tokens_per_s:.4g}" for p in r.decode], f"{pf.tokens / pf.time_ms * 1e3:.4g}"),
    ]
    for label, dec, pre in rows:
        d.add_row(label, *dec, pre)
    console.print(d)
    console.print(f"  [dim]decode at context {req.context}: each step reads the weights once and the KV cache of "
                  f"every sequence; prefill: one prompt, weights read once[/]")
    cb = r.compute_bound_batch
    console.print(
        f"decode turns compute-bound at batch ≥ {r.compute_bound_batch_short} for short contexts; at context "
        f"{req.context}: " + (f"batch ≥ {cb}" if cb else "never (KV reads grow with the batch as fast as FLOPs)")
    )
    for n in r.notes:
        console.print(f"[yellow]note:[/] {n}")
    console.print(f"[dim]hardware: {r.hardware_source}\nmodel: {r.model_source}[/]")
