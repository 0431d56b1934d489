"""What splitting a one-row decode's weight stream into many kernel calls costs: the same packed bf16 bytes read by
one call, by N calls of equal slices, and by the 120 calls of SmolLM2-135M's 30 layers (fused QKV, O, gate/up,
down), all on huge pages as the engine places them, best of 9 passes a case, cases alternated over --rounds.

    python benchmarks/packed_call_split.py [--calls 30 120 480] [--rows 1] [--rounds 5]

It showed where batch-1 bf16 decode loses to the bandwidth bound (docs/benchmarks.md, round 19): the 120 calls
read ~20% slower than one call over the same bytes, and equal slices of one matrix lose most of it too, so the
loss comes with the calls, not with the layer shapes. The lab's bandwidth probe (an fp32 sum over 256 MiB, what
`benchmarks/peers.py` divides by) runs first and last.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from inferlab.common.host_memory import huge_page_copies
from inferlab.kernels import gemv_kernels
from inferlab.lab.hardware import probe_this_machine
from inferlab.layers.packed_linear import pack_bf16

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one layer's four matmuls
TILE = 32  # outputs per packed tile (kernels/packed_gemm.cpp)


def best_of(fn, passes: int = 9) -> float:
    fn()
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, nargs="+", default=[30, 120, 480])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    k = gemv_kernels()
    if k is None:
        raise SystemExit("inferlab's CPU kernels are not built here")
    g = torch.Generator().manual_seed(0)
    layers = huge_page_copies([pack_bf16(torch.randn(o, i, generator=g, dtype=torch.bfloat16))
                               for _ in range(30) for o, i in SHAPES])
    nbytes = sum(w.numel() * w.element_size() for w in layers)
    # One matrix of the same bytes (K = 576), and equal slices of it along its tiles.
    one = huge_page_copies([pack_bf16(torch.randn(nbytes // (576 * 2 * TILE) * TILE, 576, generator=g,
                                                  dtype=torch.bfloat16))])[0]
    x = {i: torch.randn(args.rows, i, generator=g, dtype=torch.bfloat16) for i in (576, 1536)}

    def split(n: int):
        per = one.shape[0] // n
        parts = [one[j * per:(j + 1) * per] for j in range(n)]
        return lambda: [k.packed_linear(x[576], p, p.shape[0] * TILE, False) for p in parts]

    def model_layers():
        for w, (o, i) in zip(layers, SHAPES * 30):
            k.packed_linear(x[i], w, o, False)

    cases = {"1 call": split(1), **{f"{n} equal calls": split(n) for n in args.calls},
             "the 120 layer calls": model_layers}
    probes = [probe_this_machine("cpu", seconds=1.0).bandwidth]
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            times[name].append(best_of(fn))
    probes.append(probe_this_machine("cpu", seconds=1.0).bandwidth)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rows} row(s), {nbytes / 1e6:.0f} MB "
          f"of packed bf16 weights; probe {probes[0] / 1e9:.1f} / {probes[1] / 1e9:.1f} GB/s (first / last)")
    base = statistics.median(times["1 call"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:22s} median {med * 1e3:6.2f} ms ({nbytes / med / 1e9:5.1f} GB/s, x{med / base:.2f} of one "
              f"call)  rounds: " + " ".join(f"{t * 1e3:.2f}" for t in ts))


if __name__ == "__main__":
    main()
