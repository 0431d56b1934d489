"""inferlab's own CPU kernels, compiled on first use with torch's extension builder (cached under
$TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions, rebuilt when the source changes).

Where the build cannot run (no C++ compiler, a torch without headers) the engine logs why once and uses its
pure-torch path, which computes the same thing more slowly. INFERLAB_KERNELS=0 forces that path (for A/B runs).
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import sys
from pathlib import Path

import torch

from inferlab.common.cpu_info import cpuinfo_field

log = logging.getLogger("inferlab.engine")

# -fopenmp: at::parallel_for is inline and runs on one thread without it (it joins torch's own libgomp, same
# soname). -fassociative-math and friends let the compiler vectorise the fp32 dot products and sums (a fixed
# order per build: results stay deterministic); no -ffast-math, so exp and infinities keep their IEEE meaning.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
           "-fno-trapping-math"]


@functools.cache
def cpu_kernels():
    """The compiled module, or None where it cannot be built or is switched off."""
    if os.environ.get("INFERLAB_KERNELS", "1") == "0":
        return None
    try:
        kernels = build_kernels(Path(__file__).parent, "inferlab_cpu_kernels")
    except Exception as e:  # a missing compiler or header shows up as one of several exception types
        log.warning("inferlab's CPU kernels could not be built (%s: %s); using the torch path",
                    type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None
    kernels.set_packed_prefetch_tokens(packed_prefetch_tokens())
    return kernels


def packed_prefetch_tokens() -> int:
    """Up to how many tokens a tile of the packed bf16 GEMM asks for its weights ahead (kernels/packed_gemm.cpp):
    measured, on the EPYC (AMD) one (more cost 3-13%), on the Xeon with AMX every tile size (8: 1.05-1.36x from 2
    to 64 tokens). A host's vendor is what tells them apart here; INFERLAB_PACKED_PREFETCH_TOKENS sets it."""
    env = os.environ.get("INFERLAB_PACKED_PREFETCH_TOKENS")
    if env is not None:
        try:
            return max(0, int(env))
        except ValueError:
            raise ValueError(f"INFERLAB_PACKED_PREFETCH_TOKENS must be a whole number of tokens, got {env!r}") from None
    return 8 if cpuinfo_field("vendor_id") == "GenuineIntel" else 1


def build_kernels(source_dir: Path, name: str):
    """The module compiled from every .cpp in source_dir, loaded as `name` (benchmarks build an earlier revision's
    beside this one's, to time both in one process: its own files, not this tree's list).

    torch marks a build in progress with a file (`lock` in the build directory) that only the builder removes: a
    process killed mid-build leaves it, and every later process then waits on it forever. So our processes first
    take an flock, which the kernel drops when its holder dies; whoever holds it knows no one of ours is building,
    and a `lock` found then is stale."""
    from torch.utils.cpp_extension import get_default_build_root, load

    # torch's own layout under its default root: one folder per Python and accelerator, so venvs sharing
    # ~/.cache do not load each other's builds.
    accelerator = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    variant = f"py{sys.version_info.major}{sys.version_info.minor}_{accelerator}"
    chosen = os.environ.get("TORCH_EXTENSIONS_DIR")
    build_dir = (Path(chosen) if chosen else Path(get_default_build_root()) / variant) / name
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "inferlab.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing %s, left by a kernel build that was killed", stale)
            stale.unlink()
        return load(name=name, sources=sorted(str(f) for f in source_dir.glob("*.cpp")), extra_cflags=_CFLAGS,
                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)


def kernels_for(*tensors: torch.Tensor):
    """The kernels if they can take these tensors (CPU, one dtype of fp32/bf16), else None. The first is the
    activation: it must not need gradients (the kernels have no backward); the rest are weights or caches."""
    t = tensors[0]
    if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.bfloat16) or t.requires_grad:
        return None
    if any(x.dtype != t.dtype or x.device != t.device for x in tensors):
        return None
    return cpu_kernels()


def kernels_for_pool(x: torch.Tensor, pool: torch.Tensor, *others: torch.Tensor):
    """kernels_for(x, *others) where the KV pool is x's dtype or int8 (layers/kv_int8.py), which the attention
    kernels take with either activation dtype, or bf16 under fp32 activations (`--kv-cache-dtype bfloat16`)."""
    bf16_under_fp32 = pool.dtype == torch.bfloat16 and x.dtype == torch.float32
    if pool.device != x.device or (pool.dtype not in (x.dtype, torch.int8) and not bf16_under_fp32):
        return None
    return kernels_for(x, *others)


def gemv_kernels():
    """The kernels if their matrix-vector products (gemv.cpp: bf16, int8, int4) were built vectorised (AVX-512 with
    BF16), else None: the scalar build computes the same values, but slower than torch's own paths."""
    k = cpu_kernels()
    return k if k is not None and k.gemv_simd() else None


def int_gemv_kernels():
    """The kernels if their products for fp32 or bf16 activations on quantized weights (gemv.cpp: int8, and int4 at
    group size 32 with int8 activations; packed_gemm.cpp: bf16 weights under fp32 activations) were built
    vectorised: with AVX-512 BF16 as gemv_kernels(), or with AVX2 (an EPYC before Zen 4), else None."""
    k = cpu_kernels()
    return k if k is not None and k.int_gemv_simd() else None
