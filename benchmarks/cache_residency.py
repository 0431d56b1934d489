"""How much of a decode step's weight stream this host's caches keep, and what the LM head reads from memory.

    python benchmarks/cache_residency.py [--evict 64 128 256 512 1024] [--repeats 30]

Times, at one token, the int8 LM head the int4 mode keeps (49152 x 576, inferlab's kernel, on huge pages as the
engine places it) and a plain fp32 sum over the same 28 MB: hot (called again at once) and after reading N MB of
other memory, which leaves in the caches only what N MB did not push out. Then the read-bandwidth probe that
benchmarks/peers.py divides a token's bytes by (lab/hardware.py: a sum over 256 MiB) against the same sum over
2 GiB: whether the probe the one-stream bound is drawn from reads partly from the caches. A step streams 90 MB
(int4) to 270 MB (bf16); what the caches keep of it between steps, the engine reads faster.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from inferlab.common.host_memory import advise_huge_pages, huge_page_copies, zeroed_host_tensor
from inferlab.kernels import cpu_kernels

N, K = 49152, 576  # SmolLM2-135M's LM head


def filled(nbytes: int) -> torch.Tensor:
    x = zeroed_host_tensor((nbytes // 4,), torch.float32)
    advise_huge_pages(x)
    return x.fill_(1.0)


def median_ms(fn, before, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        before()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--evict", type=int, nargs="+", default=[64, 128, 256, 512, 1024], help="MB read in between")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    k = cpu_kernels()
    if k is None:
        raise SystemExit("inferlab's CPU kernels are not built on this machine")
    torch.manual_seed(0)
    w, s = huge_page_copies([torch.randint(-127, 128, (N, K), dtype=torch.int8), torch.rand(N, dtype=torch.bfloat16)])
    x = torch.randn(1, K, dtype=torch.bfloat16)
    same = filled(N * K)
    head, plain = (lambda: k.int8_linear(x, w, s)), (lambda: same.sum())
    gbs = lambda ms: N * K / ms / 1e6  # noqa: E731
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {N * K / 1e6:.1f} MB read a call")
    print("| read between calls | int8 LM head ms (GB/s) | fp32 sum of the same bytes ms (GB/s) |")
    print("|---|---|---|")
    hot = [median_ms(f, lambda: None, args.repeats) for f in (head, plain)]
    print(f"| nothing (hot) | {hot[0]:.3f} ({gbs(hot[0]):.1f}) | {hot[1]:.3f} ({gbs(hot[1]):.1f}) |")
    for mb in args.evict:
        junk = filled(mb * 2**20)
        evict = lambda: junk.sum()  # noqa: E731
        cold = [median_ms(f, evict, args.repeats) for f in (head, plain)]
        print(f"| {mb} MB | {cold[0]:.3f} ({gbs(cold[0]):.1f}) | {cold[1]:.3f} ({gbs(cold[1]):.1f}) |")
        del junk
    for size in (256 * 2**20, 2 * 2**30):  # the probe's best time over repeated sums, as lab/hardware.py takes it
        big = filled(size)
        best = min(median_ms(lambda: big.sum(), lambda: None, 1) for _ in range(10))
        print(f"probe over {size / 2**20:.0f} MiB: {size / best / 1e6:.1f} GB/s")
        del big


if __name__ == "__main__":
    main()
