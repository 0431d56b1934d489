"""bf16 weights under fp32 activations (`--quantization bf16`), for a CPU that cannot multiply bf16.

Without AVX-512 BF16 (an AVX2-only EPYC, say) the engine computes in fp32, and an fp32 weight is twice the bytes
a decode step streams. Here the linear weights are kept in bf16 (the weights the bf16 default serves on a CPU
that has it: a GGUF file's blocks dequantized, then rounded once) and inferlab's kernel (kernels/gemv.cpp,
bf16_weight_linear) widens them to fp32 in registers: each product and sum is fp32, so only the weights' rounding
differs from `--quantization none` in fp32. Past the kernel's step size the weight is widened once per call and
MKL's sgemm multiplies it (F.linear), as quant/linear.py's dense path does for the other schemes.
"""

from __future__ import annotations

import torch

from inferlab.kernels import int_gemv_kernels
from inferlab.quant.linear import QuantLinear


class Bf16Linear(QuantLinear):
    scheme = "bf16"
    # Against the weights widened to fp32 + MKL (the path past it) on SmolLM2-135M's 30 layers, 2-core AVX2 EPYC:
    # 1 token 10-15 vs 40-141 ms, 32 tokens 68-70 vs 156, 64 tokens 172 vs 189, two runs (`python
    # benchmarks/linear_kernels.py --fp32`, docs/benchmarks.md, round 24). oneDNN's packed fp32 GEMM, which would
    # need an fp32 copy of the weights, is level at 16 tokens and ahead from 24 (64: 125 ms).
    max_kernel_tokens_fp32 = 64
    kernel_rows_alone = True

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight.shape[1], weight.shape[0])
        self.register_buffer("weight", weight)

    @classmethod
    def from_float(cls, w: torch.Tensor) -> "Bf16Linear":
        if w.dim() != 2:
            raise ValueError(f"bf16 weights need a 2-D weight [out, in], got shape {tuple(w.shape)}")
        return cls(w.detach().to(torch.bfloat16).contiguous())

    def kernel_token_limit(self, dtype: torch.dtype = torch.bfloat16) -> int:
        # The kernel takes fp32 activations only; bf16 ones multiply the weight as it is (F.linear).
        return self.max_kernel_tokens_fp32 if dtype == torch.float32 else 0

    def pack_dense(self) -> int:
        return 0  # fp32 activations never read a packed bf16 copy

    def find_kernels(self):
        return int_gemv_kernels() if self.device.type == "cpu" else None

    def dequantize_rows(self, rows: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = self.weight if rows is None else self.weight[rows]
        return w.to(dtype)

    def _kernel_mm(self, kernels, x: torch.Tensor) -> torch.Tensor:
        return kernels.bf16_weight_linear(x, self.weight)

    def _plan_fields(self, p, kinds) -> None:
        p.kind, p.a = kinds.BF16, self.weight
