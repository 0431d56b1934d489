"""Decode attention over the paged pool: the bf16 pool against the int8 one (`--kv-cache-dtype int8`), and with
`--dtype float32` (fp32 queries, as on a CPU without AVX-512 BF16) the fp32 pool against a bf16 one
(`--kv-cache-dtype bfloat16`) and the int8 one.

SmolLM2-135M's shapes (9 query heads, 3 KV heads of 64, 30 layers, blocks of 16 tokens), each layer its own slice
of one pool the engine's default size (46,600 tokens: 1 GiB in bf16) with every sequence's blocks scattered over
it, as after a while of serving. One pass = the 30 layers' paged_decode_attention calls of one decode step; the
two pools alternate pass by pass, so a shift in the host's speed meets both. Prints ms a pass (median of the
passes) and the pool bytes read a second.

    python benchmarks/decode_attention.py [--batches 1 16 64] [--context 192] [--passes 30] [--tables scattered]
    python benchmarks/decode_attention.py --dtype float32 --batches 1 16 64

`--tables` places each sequence's blocks: `scattered` over the pool (the default, as after a while of serving),
`ordered` (each sequence's blocks one after another, as for prompts that arrive together), or `shared` (every
sequence reads the same blocks: the pool stays in cache, so what is left is the kernel's arithmetic).

`--extend 0+512 1000+128 3000+128` times instead the rows of one sequence's new tokens (P cached keys, then S rows,
row i attending to keys 0..P+i, as engine/model_runner.py runs a prefill chunk, prefix-cache extend or verification)
on each pool: in order, which the kernel reads as runs of rows sharing each key tile, against the same rows in
reverse order, which it reads one row at a time (the outputs are the same bits; the script checks).

`--against REV` times instead this tree's kernel against the kernel as it was at git revision REV (built beside it
from `git archive`), pass by pass alternately on each pool, for every batch and for each `--contexts` length (one
sequence length for the whole batch); it checks the two agree within bf16 rounding. `--dtype float32` makes the
queries and the plain pool fp32, as the engine keeps them on a CPU without AVX-512 BF16.

    python benchmarks/decode_attention.py --against 620ed29 --batches 1 2 3 4 16 --contexts 256 768 2048
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from inferlab.bench.machine import MachineSampler
from inferlab.kernels import build_kernels, cpu_kernels
from inferlab.layers import kv_int8

LAYERS, HEADS, KV_HEADS, DIM, BLOCK = 30, 9, 3, 64, 16
POOL_TOKENS = 46_600


NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int8: "int8"}


def pools(num_blocks: int, dtype: torch.dtype = torch.bfloat16,
          also: tuple[torch.dtype, ...] = ()) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each layer's pool in `dtype`, in int8 and in each of `also`, named as NAMES says."""
    g = torch.Generator().manual_seed(0)
    out: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {NAMES[t]: [] for t in (dtype, *also, torch.int8)}
    for _ in range(LAYERS):
        k, v = (torch.randn(KV_HEADS, num_blocks, BLOCK, DIM, generator=g).to(dtype) for _ in range(2))
        out[NAMES[dtype]].append((k, v))
        for t in also:
            out[NAMES[t]].append((k.to(t), v.to(t)))
        slots = torch.arange(num_blocks * BLOCK)
        k8, v8 = (torch.empty(KV_HEADS, num_blocks, BLOCK * kv_int8.row_bytes(DIM), dtype=torch.int8)
                  for _ in range(2))
        kv_int8.write(k8, slots, k.view(KV_HEADS, -1, DIM).transpose(0, 1))
        kv_int8.write(v8, slots, v.view(KV_HEADS, -1, DIM).transpose(0, 1))
        out["int8"].append((k8, v8))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--passes", type=int, default=30)
    ap.add_argument("--tables", choices=["scattered", "ordered", "shared"], default="scattered",
                    help="where each sequence's blocks lie (default mode only)")
    ap.add_argument("--extend", nargs="+", metavar="P+S", help="cached keys + new rows of one sequence")
    ap.add_argument("--against", metavar="REV", help="time this tree's kernel against git revision REV's")
    ap.add_argument("--contexts", type=int, nargs="+", help="with --against: the context lengths (default --context)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="the queries' and the plain pool's dtype (float32: the engine on a CPU without AVX-512 "
                         "BF16; in the default mode it adds the bf16 pool under fp32 queries, --kv-cache-dtype "
                         "bfloat16); --extend: bfloat16 only")
    args = ap.parse_args()
    kernels = cpu_kernels()
    num_blocks = POOL_TOKENS // BLOCK
    dtype = getattr(torch, args.dtype)
    plain_fp32 = dtype == torch.float32 and not args.against and not args.extend
    layers = pools(num_blocks, dtype if not args.extend else torch.bfloat16,
                   also=(torch.bfloat16,) if plain_fp32 else ())
    if args.extend:
        extend(kernels, layers, num_blocks, args.extend, args.passes)
        return
    if args.against:
        against(kernels, kernels_at(args.against), args.against, layers, num_blocks, args.batches,
                args.contexts or [args.context], args.passes, dtype)
        return
    print(f"{torch.get_num_threads()} threads; {LAYERS} layers x {KV_HEADS} KV heads x {DIM}, context {args.context}, "
          f"pool {num_blocks} blocks of {BLOCK}, {args.tables}; {args.dtype} queries; median of {args.passes} passes")
    names = list(layers)
    print("| batch | " + " | ".join(f"{n} ms" for n in names) + " | " + " | ".join(f"{n} GB/s" for n in names)
          + " | " + " | ".join(f"{names[0]} / {n}" for n in names[1:]) + " |")
    print("|---" * (3 * len(names)) + "|")
    for B in args.batches:
        nblk = -(-args.context // BLOCK)
        tables = {"scattered": torch.randperm(num_blocks)[:B * nblk].view(B, nblk),
                  "ordered": torch.arange(B * nblk).view(B, nblk),
                  "shared": torch.arange(nblk).expand(B, nblk).contiguous()}[args.tables]
        lens = torch.full((B,), args.context, dtype=torch.long)
        q = torch.randn(B, HEADS, DIM).to(dtype)
        times = {name: [] for name in layers}
        for _ in range(args.passes + 2):
            for name, kv in layers.items():
                t0 = time.perf_counter()
                for k, v in kv:
                    kernels.paged_decode_attention(q, k, v, tables, lens, DIM**-0.5)
                times[name].append(time.perf_counter() - t0)
        ms = {name: statistics.median(t[2:]) * 1e3 for name, t in times.items()}
        row_bytes = {"fp32": DIM * 4, "bf16": DIM * 2, "int8": kv_int8.row_bytes(DIM)}
        gbs = {n: 2 * LAYERS * KV_HEADS * B * args.context * row_bytes[n] / ms[n] / 1e6 for n in names}
        print(f"| {B} | " + " | ".join(f"{ms[n]:.2f}" for n in names) + " | " + " | ".join(f"{gbs[n]:.1f}"
              for n in names) + " | " + " | ".join(f"{ms[names[0]] / ms[n]:.2f}x" for n in names[1:]) + " |")


def extend(kernels, pools_by_dtype: dict[str, list[tuple[torch.Tensor, torch.Tensor]]], num_blocks: int,
           shapes: list[str], passes: int) -> None:
    print(f"{torch.get_num_threads()} threads; {LAYERS} layers x {KV_HEADS} KV heads x {DIM}, pools of {num_blocks} "
          f"blocks of {BLOCK}, scattered; median of {passes} passes")
    print("| cached + new rows | pool | runs ms | row by row ms | row by row / runs |")
    print("|---|---|---|---|---|")
    for shape in shapes:
        P, S = (int(x) for x in shape.split("+"))
        nblk = -(-(P + S) // BLOCK)
        tables = torch.randperm(num_blocks)[:nblk].expand(S, nblk).contiguous()
        lens = torch.arange(P + 1, P + S + 1)
        q = torch.randn(S, HEADS, DIM).to(torch.bfloat16)
        rev = torch.arange(S - 1, -1, -1)
        orders = {"runs": (q, tables, lens), "rows": (q[rev].contiguous(), tables[rev].contiguous(), lens[rev])}
        for pool, layers in pools_by_dtype.items():
            k, v = layers[0]
            qr, tr, lr = orders["rows"]
            same = kernels.paged_decode_attention(qr, k, v, tr, lr, DIM**-0.5)[rev]
            assert torch.equal(same, kernels.paged_decode_attention(q, k, v, tables, lens, DIM**-0.5))
            times = {name: [] for name in orders}
            for _ in range(passes + 2):
                for name, (qq, tt, ll) in orders.items():
                    t0 = time.perf_counter()
                    for k, v in layers:
                        kernels.paged_decode_attention(qq, k, v, tt, ll, DIM**-0.5)
                    times[name].append(time.perf_counter() - t0)
            ms = {name: statistics.median(t[2:]) * 1e3 for name, t in times.items()}
            print(f"| {P} + {S} | {pool} | {ms['runs']:.1f} | {ms['rows']:.1f} | {ms['rows'] / ms['runs']:.2f}x |",
                  flush=True)


def kernels_at(rev: str):
    """The kernels as built from git revision `rev`'s sources."""
    root = Path(__file__).resolve().parents[1]
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=root, check=True, capture_output=True,
                         text=True).stdout.strip()
    src = Path(tempfile.mkdtemp(prefix=f"inferlab-kernels-{sha}-"))
    archive = subprocess.run(["git", "archive", sha, "src/inferlab/kernels"], cwd=root, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    return build_kernels(src / "src/inferlab/kernels", f"inferlab_cpu_kernels_{sha}")


def against(kernels, base, rev: str, pools_by_dtype: dict[str, list[tuple[torch.Tensor, torch.Tensor]]],
            num_blocks: int, batches: list[int], contexts: list[int], passes: int, dtype: torch.dtype) -> None:
    print(f"{torch.get_num_threads()} threads; {LAYERS} layers x {KV_HEADS} KV heads x {DIM}, pools of {num_blocks} "
          f"blocks of {BLOCK}, scattered; median of {passes} passes; this tree against {rev}")
    print(f"| context | batch | pool | this tree ms | {rev} ms | µs a key, this tree | {rev} / this tree |")
    print("|---|---|---|---|---|---|---|")
    machine = MachineSampler()
    machine.start()
    for context in contexts:
        for B in batches:
            nblk = -(-context // BLOCK)
            tables = torch.randperm(num_blocks)[:B * nblk].view(B, nblk)
            lens = torch.full((B,), context, dtype=torch.long)
            q = torch.randn(B, HEADS, DIM).to(dtype)
            for pool, layers in pools_by_dtype.items():
                k, v = layers[0]
                ours, theirs = (m.paged_decode_attention(q, k, v, tables, lens, DIM**-0.5) for m in (kernels, base))
                assert torch.allclose(ours.float(), theirs.float(), atol=2e-2, rtol=2e-2), (context, B, pool)
                times = {"this": [], "base": []}
                for i in range(passes + 2):
                    # Each order every other pass: a small batch's keys stay in the cache for whichever runs second.
                    for name, m in (("this", kernels), ("base", base))[::1 if i % 2 else -1]:
                        t0 = time.perf_counter()
                        for k, v in layers:
                            m.paged_decode_attention(q, k, v, tables, lens, DIM**-0.5)
                        times[name].append(time.perf_counter() - t0)
                ms = {name: statistics.median(t[2:]) * 1e3 for name, t in times.items()}
                print(f"| {context} | {B} | {pool} | {ms['this']:.2f} | {ms['base']:.2f} | "
                      f"{ms['this'] * 1e3 / (B * context):.2f} | {ms['base'] / ms['this']:.2f}x |", flush=True)
    share = machine.stop()["foreign_cpu_share"]
    print(f"other processes' CPU over the run: {'unknown' if share is None else f'{100 * share:.1f}%'}")


if __name__ == "__main__":
    main()
