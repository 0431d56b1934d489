"""What a one-token step pays for calling the layer matmuls one at a time (issue 19's 1-stream target).

    python benchmarks/call_overhead.py [--layers 30] [--repeats 40] [--slices 30 120 480]

Ways over inferlab's packed bf16 matrix-vector kernel at one token, with SmolLM2-135M's layer shapes, every weight
on huge pages as the engine places them (layers/packed_linear.py: place_streamed_weights):
  per-layer  every layer's four matmuls (qkv, o, gate+up, down) as separate calls, as a decode step makes them;
  stacked    the same bytes in four calls (each shape's weights of every layer stacked): the read rate without
             the per-call cost;
  one call   the same bytes as one matrix (K = 576) in one call, and in N equal calls (--slices): whether a loss
             comes with the number of calls or with the layer shapes;
  tiny       the same number of calls on 32-row weights: what a call costs when there is almost nothing to read,
             with the machine's threads and on one (no fork/join).
The gap between per-layer and stacked is what fusing a layer's calls into one parallel region could win.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from inferlab.common.host_memory import huge_page_copies
from inferlab.kernels import gemv_kernels
from inferlab.layers.packed_linear import pack_bf16

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate+up, down
TILE = 32  # outputs per packed tile (kernels/packed_gemm.cpp)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--slices", type=int, nargs="*", default=[30, 120, 480], help="the one matrix in N equal calls")
    args = ap.parse_args()
    k = gemv_kernels()
    if k is None:
        raise SystemExit("the packed kernels need AVX-512 with BF16 on this machine")
    g = torch.Generator().manual_seed(0)
    weights = [[torch.randn(o, i, generator=g).bfloat16() for o, i in SHAPES] for _ in range(args.layers)]
    nbytes = sum(w.numel() * 2 for layer in weights for w in layer)
    calls = len(SHAPES) * args.layers

    def placed(mats):  # (weight, out, in) -> the same with the packed weights on one huge-page mapping
        return [(p, n, i) for p, (_, n, i) in zip(huge_page_copies([p for p, _, _ in mats]), mats)]

    per_layer = placed([(pack_bf16(w), w.shape[0], w.shape[1]) for layer in weights for w in layer])
    stacked = placed([(pack_bf16(torch.cat([layer[s] for layer in weights])), SHAPES[s][0] * args.layers,
                       SHAPES[s][1]) for s in range(len(SHAPES))])
    one = huge_page_copies([pack_bf16(torch.randn(nbytes // (576 * 2 * TILE) * TILE, 576, generator=g).bfloat16())])[0]

    def sliced(n: int):  # equal slices of the one matrix along its tiles
        per = one.shape[0] // n
        return [(one[j * per:(j + 1) * per], per * TILE, 576) for j in range(n)]

    tiny = [(pack_bf16(torch.randn(32, i, generator=g).bfloat16()), 32, i) for _, i in SHAPES] * args.layers
    x = {i: torch.randn(1, i, generator=g).bfloat16() for _, i in SHAPES}

    def run(mats):
        for p, n, i in mats:
            k.packed_linear(x[i], p, n, False)

    threads = torch.get_num_threads()
    cases = {"per-layer": (per_layer, threads), "stacked": (stacked, threads), "one call": (sliced(1), threads),
             **{f"{n} equal calls": (sliced(n), threads) for n in args.slices},
             "tiny": (tiny, threads), "tiny, 1 thread": (tiny, 1)}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):  # interleaved, so a slow stretch of the host touches every case alike
        for name, (mats, n) in cases.items():
            torch.set_num_threads(n)
            t = time.perf_counter()
            run(mats)
            times[name].append(time.perf_counter() - t)
    torch.set_num_threads(threads)
    print(f"{threads} threads, {args.layers} layers, {nbytes / 1e6:.0f} MB of bf16 weights, {calls} calls a step")
    for name, v in times.items():
        med = statistics.median(v[5:])  # the first rounds warm the caches and the thread pool
        what = f"{med / calls * 1e6:.2f} us a call" if name.startswith("tiny") else \
            f"{nbytes / med / 1e9:.1f} GB/s"
        print(f"{name:>15}: median {med * 1e3:.3f} ms  ({what})")


if __name__ == "__main__":
    main()
