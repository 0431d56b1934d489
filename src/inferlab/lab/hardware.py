"""Accelerator presets (from vendor datasheets) and a short probe that measures this machine.

Peak FLOP/s are dense figures: NVIDIA's datasheets print Tensor Core rates "with sparsity" (2:4 structured), which
plain inference never reaches, so the presets hold half the printed number. Memory sizes marketed as "GB" are GiB in
practice (an H100 80GB reports 80 GiB less a few hundred MiB to the driver), so the presets store GiB.
"""

from __future__ import annotations

import os
import platform
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from inferlab.common.cpu_info import cpuinfo_field

GiB = 2**30
TB = 10**12
TFLOP = 10**12


@dataclass(slots=True, frozen=True)
class Hardware:
    name: str
    memory_bytes: int
    bandwidth: float  # bytes/s, peak memory read bandwidth
    flops: dict[str, float] = field(default_factory=dict)  # compute dtype -> dense FLOP/s (or OP/s for int8)
    source: str = ""
    measured: bool = False  # True for the probe: figures are achieved rates, not datasheet peaks

    def peak_flops(self, dtype: str) -> float:
        if dtype in self.flops:
            return self.flops[dtype]
        if dtype == "fp16" and "bf16" in self.flops:  # same tensor-core rate on every preset
            return self.flops["bf16"]
        raise ValueError(f"{self.name}: no {dtype} FLOP/s figure (known: {', '.join(self.flops)})")


_H100_SRC = "NVIDIA H100 Tensor Core GPU datasheet, SXM5 column (https://www.nvidia.com/en-us/data-center/h100/)"
_H200_SRC = "NVIDIA H200 Tensor Core GPU datasheet, SXM column (https://www.nvidia.com/en-us/data-center/h200/)"
_A100_SRC = "NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column (https://www.nvidia.com/en-us/data-center/a100/)"
_L4_SRC = "NVIDIA L4 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/l4/)"

HARDWARE_PRESETS: dict[str, Hardware] = {
    h.name: h
    for h in [
        # Datasheet: 80GB HBM3, 3.35 TB/s; BF16/FP16 1,979 TFLOPS*, INT8 3,958 TOPS*, FP32 67 TFLOPS (* sparsity).
        Hardware("H100 SXM", 80 * GiB, 3.35 * TB,
                 {"bf16": 989.5 * TFLOP, "fp8": 1979 * TFLOP, "int8": 1979 * TFLOP, "fp32": 67 * TFLOP}, _H100_SRC),
        # Datasheet: 141GB HBM3e, 4.8 TB/s; the same Hopper compute as H100 SXM.
        Hardware("H200", 141 * GiB, 4.8 * TB,
                 {"bf16": 989.5 * TFLOP, "fp8": 1979 * TFLOP, "int8": 1979 * TFLOP, "fp32": 67 * TFLOP}, _H200_SRC),
        # Datasheet: 80GB HBM2e, 2,039 GB/s; BF16 312 TFLOPS (624*), INT8 624 TOPS (1,248*), FP32 19.5 TFLOPS.
        Hardware("A100 80GB", 80 * GiB, 2.039 * TB,
                 {"bf16": 312 * TFLOP, "int8": 624 * TFLOP, "fp32": 19.5 * TFLOP}, _A100_SRC),
        # Datasheet: 24GB GDDR6, 300 GB/s; BF16/FP16 242 TFLOPS*, FP8 485 TFLOPS*, INT8 485 TOPS*, FP32 30.3 TFLOPS.
        Hardware("L4", 24 * GiB, 0.3 * TB,
                 {"bf16": 121 * TFLOP, "fp8": 242.5 * TFLOP, "int8": 242.5 * TFLOP, "fp32": 30.3 * TFLOP}, _L4_SRC),
    ]
}
THIS_MACHINE = "this machine"


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


_ALIASES = {"h100": "H100 SXM", "h100sxm5": "H100 SXM", "h200sxm": "H200", "a100": "A100 80GB", "a10080g": "A100 80GB"}


def hardware_names() -> list[str]:
    return [*HARDWARE_PRESETS, THIS_MACHINE]


def resolve_hardware(name: str) -> Hardware:
    """A preset by name (case and punctuation ignored), or "this machine", which runs the probe."""
    key = _key(name)
    if key in ("thismachine", "local", "probe"):
        return probe_this_machine()
    for preset in HARDWARE_PRESETS.values():
        if key == _key(preset.name) or _ALIASES.get(key) == preset.name:
            return preset
    raise ValueError(f"unknown hardware {name!r}; choose one of: {', '.join(hardware_names())}")


# --- the probe ---------------------------------------------------------------------------------------------------


def _best_time(fn, sync, min_seconds: float, min_reps: int = 3) -> float:
    """Best-of-N wall time of fn(): the minimum filters out the noise of a shared machine."""
    fn()  # warm-up: allocation, kernel selection, page faults
    sync()
    best, spent, reps = float("inf"), 0.0, 0
    while reps < min_reps or spent < min_seconds:
        t0 = time.perf_counter()
        fn()
        sync()
        dt = time.perf_counter() - t0
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best


def _matmul_size(largest: int, dtype, dev, sync, seconds: float) -> int:
    """The side of the probe's square matmul: `largest`, or less where a matmul is slow enough that a smaller one
    times it well. A CPU without bf16 instructions (an AVX2-only EPYC) multiplies bf16 at ~1 GFLOP/s, where a
    2048-wide one took ~20 s a call, and the probe several calls; doubling from 256 stops before a call would pass
    `seconds`."""
    import torch

    n = 256
    while n < largest:
        a = torch.randn(n, n, device=dev).to(dtype)
        a @ a  # the first call pays for setup (a BLAS handle, a thread pool), not the multiply
        sync()
        t0 = time.perf_counter()
        a @ a
        sync()
        if (time.perf_counter() - t0) * 8 > seconds:  # twice the side, eight times the work
            break
        n *= 2
    return n


def _cpu_name() -> str:
    name = cpuinfo_field("model name") or platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} threads"


def probe_this_machine(device: str | None = None, seconds: float = 0.25) -> Hardware:
    """Measure read bandwidth (sum over a tensor far larger than the caches) and bf16/fp32 matmul rates with torch.

    Achieved rates, not peaks: they are what the engine's own kernels can hope for on this machine.
    """
    import torch

    from inferlab.common.host_memory import advise_huge_pages, available_memory, zeroed_host_tensor

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        sync = lambda: torch.cuda.synchronize(dev)  # noqa: E731
        name = torch.cuda.get_device_name(dev)
        memory = torch.cuda.mem_get_info(dev)[1]
        nbytes, n_mm = 2 * GiB, {"bf16": 8192, "fp32": 4096}
    else:
        sync = lambda: None  # noqa: E731
        name, memory = _cpu_name(), available_memory()
        nbytes, n_mm = min(256 * 2**20, memory // 16), {"bf16": 2048, "fp32": 2048}

    if dev.type == "cpu":
        # On huge pages, as the engine keeps the weights it streams (layers/packed_linear.py:
        # place_streamed_weights). On 4 KiB pages the same sum read anything from 31 to 66.5 GB/s from one run to
        # the next on the 2-core EPYC, on 2 MiB pages 69-70 (docs/benchmarks.md, round 12).
        x = zeroed_host_tensor((nbytes // 4,), torch.float32)
        advise_huge_pages(x)
        x.fill_(1.0)
    else:
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    bandwidth = x.numel() * 4 / _best_time(lambda: x.sum(), sync, seconds)
    del x
    flops: dict[str, float] = {}
    for dt, torch_dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        n_mm[dt] = n = _matmul_size(n_mm[dt], torch_dt, dev, sync, seconds)
        a, b = torch.randn(n, n, device=dev).to(torch_dt), torch.randn(n, n, device=dev).to(torch_dt)
        flops[dt] = 2 * n**3 / _best_time(lambda: a @ b, sync, seconds)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    source = (
        f"measured by inferlab's probe on {dev.type} at {when}: best-of-N fp32 sum over {nbytes // 2**20} MiB"
        + (" on huge pages" if dev.type == "cpu" else "") + "; "
        f"{n_mm['bf16']}x{n_mm['bf16']} bf16 and {n_mm['fp32']}x{n_mm['fp32']} fp32 matmuls"
        + ("; memory = MemAvailable" if dev.type == "cpu" else "")
    )
    return Hardware(f"{THIS_MACHINE} ({name})", int(memory), bandwidth, flops, source, measured=True)
