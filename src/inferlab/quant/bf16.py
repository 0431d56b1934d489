"""bf16 weights under fp32 activations (`--quantization bf16`), for a CPU that cannot multiply bf16.

Without AVX-512 BF16 (an AVX2-only EPYC, say) the engine computes in fp32, and an fp32 weight is twice the bytes
a decode step streams. Here the linear weights are kept in bf16 (the weights the bf16 default serves on a CPU
that has it: a GGUF file's blocks dequantized, then rounded once), in the packed layout of inferlab's bf16 GEMM
(layers/packed_linear.py: pack_bf16), and kernels/packed_gemm.cpp's packed_linear_fp32 widens them to fp32 in
registers at every step size: each product and sum is fp32, so only the weights' rounding differs from
`--quantization none` in fp32, and a row's result is the same bits whatever shares its step (no row padding).
It is `--quantization auto`'s choice where `--dtype auto` falls back to fp32 (engine/llm_engine.py:
resolve_quantization), so it takes every family's layers, biased ones (Qwen2's Q/K/V) included.
"""

from __future__ import annotations

import torch

from inferlab.kernels import int_gemv_kernels
from inferlab.layers.packed_linear import pack_bf16, unpack_bf16
from inferlab.quant.linear import QuantLinear


def check_bf16_shape(shape: tuple[int, int]) -> None:
    if len(shape) != 2:
        raise ValueError(f"bf16 weights need a 2-D weight [out, in], got shape {shape}")
    if shape[1] % 2:
        raise ValueError(f"bf16 weights need an even number of inputs (the packed layout pairs them), got {shape[1]}")


class Bf16Linear(QuantLinear):
    scheme = "bf16"
    # The kernel at every step size: on SmolLM2-135M's 30 layers, 2-core AVX2 EPYC, it is ahead of MKL's sgemm on
    # the widened weights and of oneDNN's packed fp32 GEMM (which would need an fp32 copy) from 1 to 256 tokens
    # (1 token 2.6-2.8x oneDNN's, 64 tokens 1.03-1.28x) and level or ahead at 512 (`python
    # benchmarks/linear_kernels.py --fp32`, two runs: docs/benchmarks.md, round 24).
    max_kernel_tokens_fp32 = 1 << 62
    kernel_rows_alone = True

    def __init__(self, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None):
        super().__init__(packed.shape[1] * 2, out_features)
        self.register_buffer("qweight", packed)  # pack_bf16's layout, named as the other schemes' weights
        self.register_buffer("bias", bias)  # kept in the activations' dtype, added to the product

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> "Bf16Linear":
        check_bf16_shape(tuple(w.shape))
        return cls(pack_bf16(w.detach()), w.shape[0], None if bias is None else bias.detach())

    def kernel_token_limit(self, dtype: torch.dtype = torch.bfloat16) -> int:
        # The kernel takes fp32 activations only; bf16 ones multiply the weight as it is (F.linear).
        return self.max_kernel_tokens_fp32 if dtype == torch.float32 else 0

    def pack_dense(self) -> int:
        return 0  # the weight is packed already

    def find_kernels(self):
        return int_gemv_kernels() if self.device.type == "cpu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y if self.bias is None else y + self.bias

    def plan_linear(self, dtype: torch.dtype = torch.bfloat16):
        return None if self.bias is not None else super().plan_linear(dtype)  # the plan adds no bias

    def dequantize_rows(self, rows: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if rows is None:
            return unpack_bf16(self.qweight, self.out_features).to(dtype)
        # a tied embedding's lookups: only the rows asked for
        return self.qweight[rows // 32, :, rows % 32, :].reshape(len(rows), self.in_features).to(dtype)

    def _kernel_mm(self, kernels, x: torch.Tensor) -> torch.Tensor:
        return kernels.packed_linear_fp32(x, self.qweight, self.out_features)

    def _plan_fields(self, p, kinds) -> None:
        p.kind, p.a, p.out_features = kinds.BF16, self.qweight, self.out_features
