"""CPU bf16 matmul paths for a decoder's weights, out of cache: which kernel to use at which batch size.

    python benchmarks/linear_kernels.py [--rows 1 2 4 8 16 64 256]

Multiplies a batch of `rows` activations by every weight of SmolLM2-135M's 30 layers (fused QKV, O, gate/up,
down; random values, real shapes: 212 MB in bf16, far more than the caches) with four paths:
  F.linear           what nn.Linear does: oneDNN's bf16 GEMM
  gemv (no oneDNN)   F.linear with oneDNN switched off: torch's own kernel, a matrix-vector product per row
  oneDNN packed      oneDNN with the weight reordered ahead of time (layers/packed_linear.py's fallback)
  inferlab packed    inferlab's layout and kernel (kernels/packed_gemm.cpp; what the layers use where it is built)
and prints milliseconds per pass and the weight bytes read per second. A last column runs inferlab's int4 kernel
(kernels/gemv.cpp: Q4_1 nibbles, group 32, int8 activations) on random nibbles of the same shapes; its GB/s count
the int4 bytes it reads (nibbles and fp16 scales and minimums: 20 bytes a group of 32); the next, `--quantization
w8a8`'s kernel (kernels/w8a8_gemm.cpp: int8 weights, activations rounded to int8 per 32) on the same shapes, and
the weight-only int8 kernel the int8 mode uses for small steps (up to 64 rows); their GB/s count the int8 bytes. A
last line times the int8 LM head the int4 mode keeps (49152 x 576, inferlab's int8 kernel) at one token.

`--against REV` times instead this tree's packed kernels (bf16 and w8a8), int4 and int8 kernels against git revision
REV's (built beside them from `git archive`), pass by pass alternately, for every --rows, then the bf16 LM head
(49152 x 576, fp32 logits) at one row; where the two do not give the same bits (a change that reorders a kernel's
sums), the row says by how much they differ, and more than 1% of the largest output stops it. On a CPU without
AVX-512 BF16 it times the kernels the engine runs there instead: bf16 weights under fp32 activations (layers and
LM head), int4 and int8 on fp32 activations.

    python benchmarks/linear_kernels.py --against 7e1d74a --rows 1 2 4 8 16 64

`--fp32` times the paths of a CPU without AVX-512 BF16 (an AVX2-only EPYC), where the engine runs in fp32: F.linear
(MKL's sgemm), oneDNN's packed fp32 GEMM (layers/packed_linear.py: onednn_fp32_packing), inferlab's int4 and int8
kernels (their AVX2 builds there), inferlab's kernel for bf16 weights and fp32 activations (`--quantization bf16`)
and those weights widened to fp32 then F.linear, torch's int8 kernel (_weight_int8pack_mm, bf16 activations: the
int8 mode's stand-in where ours is not vectorised), and int4 and int8 dequantized then F.linear (the path past a
kernel's step size where no packed copy is kept, and everywhere without a kernel). The last columns say whether a
row's result is the same bits at `rows` rows as alone, for F.linear and oneDNN (what models/llama.py's row padding
depends on).

    python benchmarks/linear_kernels.py --fp32 --rows 1 2 4 16 64 256

`--placement` times the same kernels (packed bf16, int4, w8a8) on the same weights in two placements, pass by pass
alternately: each matrix a tensor of its own, as loading leaves them, and all of them copied end to end onto one
huge-page mapping in the order a step reads them (layers/packed_linear.py: place_streamed_weights).

    python benchmarks/linear_kernels.py --placement --rows 1 4 16 64

`--per-shape` times the packed bf16 kernel at one row on each of a layer's four shapes alone and on the LM head,
each as enough copies end to end on one huge-page mapping to pass 128 MB (out of the caches), beside a sum over a
buffer of the same bytes (the lab's bandwidth probe), pass by pass alternately: what a call's size costs the
kernel against a plain stream. "us over the stream" is a call's time less its bytes at the sum's rate.

    python benchmarks/linear_kernels.py --per-shape
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from inferlab.kernels import gemv_kernels
from inferlab.layers.packed_linear import pack_bf16
from inferlab.quant.int8 import quantize_int8
from inferlab.quant.w8a8 import pack_w8a8

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one layer's four matmuls


def best_of(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256, 512])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--against", metavar="REV", help="time this tree's packed kernels against git revision REV's")
    ap.add_argument("--passes", type=int, default=30, help="with --against or --placement: passes a side")
    ap.add_argument("--only", metavar="PREFIX", help="with --against: only the kernels whose name starts so (bf16, "
                                                      "int4, int8, w8a8); the LM head is bf16")
    ap.add_argument("--placement", action="store_true", help="each weight its own tensor against one huge-page "
                                                             "mapping for all")
    ap.add_argument("--fp32", action="store_true", help="the fp32 paths of a CPU without AVX-512 BF16")
    ap.add_argument("--per-shape", action="store_true", help="the packed bf16 kernel at one row, shape by shape, "
                                                             "against a sum over the same bytes")
    args = ap.parse_args()
    if args.per_shape:
        per_shape()
        return
    if args.fp32:
        fp32_paths(args.rows, args.layers)
        return
    if args.placement:
        placement(args.rows, args.layers, args.passes)
        return
    if args.against:
        against(args.against, args.rows, args.layers, args.passes, args.only)
        return
    g = torch.Generator().manual_seed(0)
    weights = [[torch.randn(o, i, generator=g).bfloat16() for o, i in SHAPES] for _ in range(args.layers)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in layer] for layer in weights]
    kernels = gemv_kernels()
    ours = [[pack_bf16(w) for w in layer] for layer in weights] if kernels is not None else None
    nbytes = sum(w.numel() * w.element_size() for layer in weights for w in layer)
    q4 = [random_q4_1(g, o, i) for _ in range(args.layers) for o, i in SHAPES]
    q4_bytes = sum(q.numel() + 2 * d.numel() * 2 for q, d, _ in q4)
    q8 = [quantize_int8(w) for layer in weights for w in layer]
    w8 = [(pack_w8a8(q), s, q.shape[0]) for q, s in q8]
    q8_bytes = sum(q.numel() for q, _ in q8)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {nbytes / 1e6:.0f} MB of bf16 weights")
    print(f"{'rows':>5} {'F.linear ms':>12} {'gemv ms':>9} {'oneDNN packed':>14} {'inferlab packed':>16} "
          f"{'int4 ms':>8} {'w8a8 ms':>8} {'int8 ms':>8}   GB/s: linear / gemv / oneDNN / inferlab / int4 / w8a8")
    for m in args.rows:
        xs = {i: torch.randn(m, i, generator=g).bfloat16() for _, i in SHAPES}

        def linear():
            for layer in weights:
                for w in layer:
                    F.linear(xs[w.shape[1]], w)

        def gemv():
            torch._C._set_mkldnn_enabled(False)
            try:
                linear()
            finally:
                torch._C._set_mkldnn_enabled(True)

        def pack():
            for layer, players in zip(weights, packed):
                for w, p in zip(layer, players):
                    torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

        def inferlab():
            for layer, players in zip(weights, ours):
                for w, p in zip(layer, players):
                    kernels.packed_linear(xs[w.shape[1]], p, w.shape[0])

        def int4():
            for q, d, mn in q4:
                kernels.int4_linear(xs[q.shape[1] * 2], q, d, mn, 32)

        def w8a8():
            for p, s, n in w8:
                kernels.w8a8_linear(xs[p.shape[1] * 4], p, s, n)

        def int8():
            for q, s in q8:
                kernels.int8_linear(xs[q.shape[1]], q, s)

        nan = float("nan")
        t = [best_of(f) for f in (linear, gemv, pack)] + ([best_of(inferlab)] if ours is not None else [nan])
        t4, t8 = (best_of(int4), best_of(w8a8)) if kernels is not None else (nan, nan)
        ti8 = best_of(int8) if kernels is not None and m <= 64 else nan
        print(f"{m:>5} {t[0] * 1e3:>12.2f} {t[1] * 1e3:>9.2f} {t[2] * 1e3:>14.2f} {t[3] * 1e3:>16.2f} "
              f"{t4 * 1e3:>8.2f} {t8 * 1e3:>8.2f} {ti8 * 1e3:>8.2f}   "
              + " / ".join(f"{nbytes / x / 1e9:.1f}" for x in t)
              + f" / {q4_bytes / t4 / 1e9:.1f} / {q8_bytes / t8 / 1e9:.1f}", flush=True)
    if kernels is not None:
        head = torch.randint(-127, 128, (49152, 576), dtype=torch.int8, generator=g)
        scale = torch.rand(49152, generator=g)
        x = torch.randn(1, 576, generator=g).bfloat16()
        t = best_of(lambda: kernels.int8_linear(x, head, scale))
        print(f"int8 LM head 49152 x 576, 1 token: {t * 1e3:.3f} ms, {head.numel() / t / 1e9:.1f} GB/s", flush=True)


def fp32_paths(rows: list[int], layers: int) -> None:
    from inferlab.bench.machine import MachineSampler
    from inferlab.kernels import int_gemv_kernels
    from inferlab.layers.packed_linear import pack_onednn
    from inferlab.quant.int4 import Int4Linear
    from inferlab.quant.int8 import Int8Linear

    kernels = int_gemv_kernels()
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=g) for _ in range(layers) for o, i in SHAPES]
    onednn = [pack_onednn(w, torch.float32) for w in weights]
    q4 = [random_q4_1(g, *w.shape) for w in weights]
    q4_layers = [Int4Linear(q, d.view(torch.float16), mn.view(torch.float16), 32) for q, d, mn in q4]
    q8 = [quantize_int8(w) for w in weights]
    nbytes, q4_bytes = sum(w.numel() * 4 for w in weights), sum(q.numel() + 2 * d.numel() * 2 for q, d, _ in q4)
    q8_bytes = sum(q.numel() for q, _ in q8)
    q8_layers = [Int8Linear(q, s) for q, s in q8]
    bf16 = [w.bfloat16() for w in weights]
    bf16_packed = [pack_bf16(w) for w in bf16]
    cases = {
        "F.linear": lambda xs: [F.linear(xs[w.shape[1]], w) for w in weights],
        "oneDNN packed": lambda xs: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                     for w, p in zip(weights, onednn)],
        "bf16 ours": lambda xs: [kernels.packed_linear_fp32(xs[w.shape[1]], p, w.shape[0])
                                 for w, p in zip(bf16, bf16_packed)],
        "bf16 widened": lambda xs: [F.linear(xs[w.shape[1]], w.float()) for w in bf16],
        "int4 ours": lambda xs: [kernels.int4_linear(xs[q.shape[1] * 2], q, d, mn, 32) for q, d, mn in q4],
        "int4 dequantized": lambda xs: [F.linear(xs[lin.in_features], lin.dequantize()) for lin in q4_layers],
        "int8 ours": lambda xs: [kernels.int8_linear(xs[q.shape[1]], q, s) for q, s in q8],
        "int8 torch": lambda xs: [torch.ops.aten._weight_int8pack_mm(xs[q.shape[1]].bfloat16(), q, s) for q, s in q8],
        "int8 dequantized": lambda xs: [F.linear(xs[lin.in_features], lin.dequantize()) for lin in q8_layers],
    }
    if kernels is None:
        for name in ("int4 ours", "int8 ours", "bf16 ours"):
            del cases[name]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {layers} layers' matmuls a pass "
          f"(SmolLM2-135M's shapes), fp32 activations; best of 5 passes; inferlab's integer kernels: "
          f"{'vectorised' if kernels is not None else 'not vectorised here (left out)'}")
    bytes_of = {"F.linear": nbytes, "oneDNN packed": nbytes, "bf16 ours": nbytes // 2, "bf16 widened": nbytes // 2,
                "int4 ours": q4_bytes, "int4 dequantized": q4_bytes,
                "int8 ours": q8_bytes, "int8 torch": q8_bytes, "int8 dequantized": q8_bytes}
    print("| rows | " + " | ".join(f"{name} ms (GB/s)" for name in cases)
          + " | row alone = in step: F.linear, oneDNN |")
    print("|---" * (len(cases) + 2) + "|")
    machine = MachineSampler()
    machine.start()
    for m in rows:
        xs = {i: torch.randn(m, i, generator=g) for _, i in SHAPES}
        cells = []
        for name, run in cases.items():
            t = best_of(lambda: run(xs))
            cells.append(f"{t * 1e3:.2f} ({bytes_of[name] / t / 1e9:.1f})")
        alone = {i: x[:1] for i, x in xs.items()}
        same = [all(torch.equal(a[:1], b) for a, b in zip(cases[name](xs), cases[name](alone)))
                for name in ("F.linear", "oneDNN packed")]
        print(f"| {m} | " + " | ".join(cells) + " | " + ", ".join("yes" if x else "no" for x in same) + " |",
              flush=True)
    share = machine.stop()["foreign_cpu_share"]
    print(f"other processes' CPU over the run: {'unknown' if share is None else f'{100 * share:.1f}%'}")


def random_q4_1(g: torch.Generator, out_features: int, in_features: int) -> tuple[torch.Tensor, ...]:
    """Random Q4_1 nibbles, scales and minimums (fp16 bits) of a weight's shape, group 32."""
    return (torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8, generator=g),
            (torch.rand(out_features, in_features // 32, generator=g) * 0.01).half().view(torch.int16),
            (torch.rand(out_features, in_features // 32, generator=g) * -0.1).half().view(torch.int16))


def bf16_layout_for(kernels, w: torch.Tensor) -> torch.Tensor:
    """w packed as `kernels`' packed_linear takes it: this tree's pack_bf16, or the layout before round 12 (blocks
    of 16 outputs, each block's lines in a run of their own) where that kernel's shape check rejects the new one."""
    packed = pack_bf16(w)
    try:
        kernels.packed_linear(torch.zeros(1, w.shape[1], dtype=torch.bfloat16), packed, w.shape[0])
        return packed
    except RuntimeError:
        padded = F.pad(w, (0, 0, 0, -w.shape[0] % 16))
        return padded.view(-1, 16, w.shape[1] // 2, 2).transpose(1, 2).contiguous()


def against(rev: str, rows: list[int], layers: int, passes: int, only: str | None) -> None:
    from decode_attention import kernels_at

    from inferlab.bench.machine import MachineSampler

    from inferlab.common.host_memory import huge_page_copies

    from inferlab.kernels import int_gemv_kernels

    # Without AVX-512 BF16 (an AVX2 EPYC) the engine computes in fp32: the bf16 weights go through
    # packed_linear_fp32, and the integer kernels take fp32 activations.
    fp32 = gemv_kernels() is None
    kernels = int_gemv_kernels()
    if kernels is None:
        raise SystemExit("inferlab's kernels are not vectorised on this machine (neither AVX-512 BF16 nor AVX2)")
    base = kernels_at(rev)
    act = torch.float32 if fp32 else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=g).bfloat16() for _ in range(layers) for o, i in SHAPES]
    head = torch.randn(49152, 576, generator=g).bfloat16()
    # Each side's bf16 weights in the layout its kernel takes, all on one huge-page mapping as the engine keeps them.
    packs = {m: huge_page_copies([pack_bf16(w) if fp32 else bf16_layout_for(m, w) for w in weights + [head]])
             for m in (kernels, base)}
    outs = [w.shape[0] for w in weights]
    w8 = huge_page_copies([t for q, s in map(quantize_int8, weights) for t in (pack_w8a8(q), s)])
    w8 = [(w8[2 * i], w8[2 * i + 1], n) for i, n in enumerate(outs)]
    q4 = huge_page_copies([t for w in weights for t in random_q4_1(g, *w.shape)])
    q4 = [tuple(q4[3 * i:3 * i + 3]) for i in range(len(weights))]
    i8 = huge_page_copies([t for w in weights for t in quantize_int8(w)])
    i8 = [(i8[2 * i], i8[2 * i + 1]) for i in range(len(weights))]
    cases = {
        "bf16": lambda m, xs: [m.packed_linear(xs[p.shape[1] * 2], p, n, False) for p, n in zip(packs[m], outs)],
        "bf16 weights, fp32 activations": lambda m, xs: [m.packed_linear_fp32(xs[p.shape[1] * 2], p, n)
                                                         for p, n in zip(packs[m], outs)],
        "w8a8": lambda m, xs: [m.w8a8_linear(xs[p.shape[1] * 4], p, s, n) for p, s, n in w8],
        "int4": lambda m, xs: [m.int4_linear(xs[q.shape[1] * 2], q, d, mn, 32) for q, d, mn in q4],
        "int8": lambda m, xs: [m.int8_linear(xs[q.shape[1]], q, s) for q, s in i8],
    }
    # The kernels the engine runs on this CPU: with AVX-512 BF16 the bf16 and w8a8 ones (bf16 activations), without
    # it bf16 weights under fp32 activations (bf16 and w8a8 are not built there).
    for name in ("bf16 weights, fp32 activations",) if not fp32 else ("bf16", "w8a8"):
        del cases[name]
    if only:
        cases = {name: call for name, call in cases.items() if name.startswith(only)}
    print(f"{torch.get_num_threads()} threads; {layers} layers' matmuls a pass (SmolLM2-135M's shapes); median of "
          f"{passes} passes; this tree against {rev}; {'fp32' if fp32 else 'bf16'} activations")
    print(f"| kernel | rows | this tree ms | {rev} ms | {rev} / this tree |")
    print("|---|---|---|---|---|")
    machine = MachineSampler()
    machine.start()

    def compare(kernel: str, m: int, run) -> None:
        ours, theirs = run(kernels), run(base)
        # A change may reorder a kernel's sums (bits differ, values agree to rounding); more than that is a bug.
        differ = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                     for a, b in zip(ours, theirs))
        assert differ < 1e-2, f"{kernel} at {m} rows: outputs differ from {rev}'s by {differ:.2g} of their largest"
        times: dict[str, list[float]] = {"this": [], "base": []}
        for i in range(passes):
            for name, mod in (("this", kernels), ("base", base))[::1 if i % 2 else -1]:
                t = time.perf_counter()
                run(mod)
                times[name].append(time.perf_counter() - t)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        note = "" if differ == 0 else f" (outputs differ by up to {differ:.1g} of the largest)"
        print(f"| {kernel} | {m} | {ms['this']:.2f} | {ms['base']:.2f} | {ms['base'] / ms['this']:.2f}x{note} |",
              flush=True)

    for m in rows:
        xs = {i: torch.randn(m, i, generator=g).to(act) for _, i in SHAPES}
        for kernel, call in cases.items():
            compare(kernel, m, lambda mod: call(mod, xs))
    x = torch.randn(1, 576, generator=g).to(act)
    if fp32:
        compare("bf16 LM head", 1, lambda mod: [mod.packed_linear_fp32(x, packs[mod][-1], 49152)])
    else:
        compare("bf16 LM head, fp32 out", 1, lambda mod: [mod.packed_linear(x, packs[mod][-1], 49152, True)])
    share = machine.stop()["foreign_cpu_share"]
    print(f"other processes' CPU over the run: {'unknown' if share is None else f'{100 * share:.1f}%'}")


def per_shape(min_bytes: int = 128 * 10**6) -> None:
    import math

    from inferlab.bench.machine import MachineSampler
    from inferlab.common.host_memory import huge_page_copies

    kernels = gemv_kernels()
    if kernels is None:
        raise SystemExit("the packed kernels need AVX-512 with BF16 on this machine")
    g = torch.Generator().manual_seed(0)
    print(f"{torch.get_num_threads()} threads; one row; best of 21 passes over the copies, each followed by a sum")
    print("| shape (out x in) | copies | MB a call | us a call | GB/s | fp32 sum of the same bytes, GB/s "
          "| us over the stream |")
    print("|---|---|---|---|---|---|---|")
    machine = MachineSampler()
    machine.start()
    for o, i in [*SHAPES, (49152, 576)]:
        size = o * i * 2
        n = math.ceil(min_bytes / size)
        packs = huge_page_copies([pack_bf16(torch.randn(o, i, generator=g).bfloat16()) for _ in range(n)])
        x = torch.randn(1, i, generator=g).bfloat16()
        flat = huge_page_copies([torch.ones(n * size // 4)])[0]
        t = ts = float("inf")
        for _ in range(21):  # alternately: the host's bandwidth moves within seconds
            t0 = time.perf_counter()
            for p in packs:
                kernels.packed_linear(x, p, o, False)
            t1 = time.perf_counter()
            flat.sum()
            t, ts = min(t, t1 - t0), min(ts, time.perf_counter() - t1)
        sum_rate = n * size / ts
        print(f"| {o} x {i} | {n} | {size / 1e6:.2f} | {t / n * 1e6:.1f} | {n * size / t / 1e9:.1f} | "
              f"{sum_rate / 1e9:.1f} | {(t / n - size / sum_rate) * 1e6:.1f} |", flush=True)
    share = machine.stop()["foreign_cpu_share"]
    print(f"other processes' CPU over the run: {'unknown' if share is None else f'{100 * share:.1f}%'}")


def placement(rows: list[int], layers: int, passes: int) -> None:
    from inferlab.bench.machine import MachineSampler
    from inferlab.common.host_memory import huge_page_copies

    kernels = gemv_kernels()
    if kernels is None:
        raise SystemExit("the packed kernels need AVX-512 with BF16 on this machine")
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=g).bfloat16() for _ in range(layers) for o, i in SHAPES]
    head = torch.randn(49152, 576, generator=g).bfloat16()
    bf16 = [pack_bf16(w) for w in weights]
    q4 = [t for o, i in SHAPES * layers
          for t in (torch.randint(0, 256, (o, i // 2), dtype=torch.uint8, generator=g),
                    (torch.rand(o, i // 32, generator=g) * 0.01).half().view(torch.int16),
                    (torch.rand(o, i // 32, generator=g) * -0.1).half().view(torch.int16))]
    w8 = [t for q, s in map(quantize_int8, weights) for t in (pack_w8a8(q), s)]
    lm_head = [pack_bf16(head)]
    outs = [w.shape[0] for w in weights]

    def cases(bf16, q4, w8, lm_head):
        return {
            "bf16": lambda xs: [kernels.packed_linear(xs[p.shape[1] * 2], p, n, False) for p, n in zip(bf16, outs)],
            "int4": lambda xs: [kernels.int4_linear(xs[q.shape[1] * 2], q, d, mn, 32)
                                for q, d, mn in zip(q4[::3], q4[1::3], q4[2::3])],
            "w8a8": lambda xs: [kernels.w8a8_linear(xs[p.shape[1] * 4], p, s, n)
                                for p, s, n in zip(w8[::2], w8[1::2], outs)],
            "bf16 LM head, fp32 out": lambda xs: [kernels.packed_linear(xs[576], lm_head[0], 49152, True)],
        }

    own = cases(bf16, q4, w8, lm_head)
    mapped = cases(*(huge_page_copies(ts) for ts in (bf16, q4, w8, lm_head)))
    print(f"{torch.get_num_threads()} threads; {layers} layers' matmuls a pass (SmolLM2-135M's shapes); median of "
          f"{passes} passes; each weight its own tensor against all on one huge-page mapping")
    print("| kernel | rows | own tensors ms | one mapping ms | own / mapping |")
    print("|---|---|---|---|---|")
    machine = MachineSampler()
    machine.start()
    for m in rows:
        xs = {i: torch.randn(m, i, generator=g).bfloat16() for _, i in SHAPES}
        for kernel in own:
            if kernel.startswith("bf16 LM") and m != 1:
                continue
            a, b = own[kernel](xs), mapped[kernel](xs)
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{kernel} at {m} rows: the placements differ"
            times: dict[str, list[float]] = {"own": [], "mapped": []}
            for i in range(passes):
                for name, run in (("own", own[kernel]), ("mapped", mapped[kernel]))[::1 if i % 2 else -1]:
                    t = time.perf_counter()
                    run(xs)
                    times[name].append(time.perf_counter() - t)
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            print(f"| {kernel} | {m} | {ms['own']:.2f} | {ms['mapped']:.2f} | {ms['own'] / ms['mapped']:.2f}x |",
                  flush=True)
    share = machine.stop()["foreign_cpu_share"]
    print(f"other processes' CPU over the run: {'unknown' if share is None else f'{100 * share:.1f}%'}")


if __name__ == "__main__":
    main()
