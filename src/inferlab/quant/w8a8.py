"""W8A8: int8 weights (quant/int8.py's per-output-channel scales) multiplied by int8 activations on VNNI.

Each step's activations are rounded to int8 per token and group of 32 inputs (kernels/w8a8_gemm.cpp, where the
perplexity measurements that chose the group size are), so vpdpbusd multiplies 64 byte pairs per instruction,
twice the pairs of the bf16 GEMM's vdpbf16ps. Measured on SmolLM2-135M's 30 layers (`python
benchmarks/linear_kernels.py`, every path in one process): faster than inferlab's packed bf16 GEMM at every step
size (1.4-1.9x, 1 to 512 rows) and level with or faster than the weight-only int8 kernel from 1 token, so this
scheme runs it at every step size and keeps neither a bf16 copy nor the plain int8 weight.

The weight is kept only in the kernel's layout (`pack_w8a8`); `dequantize_rows` unpacks it (a tied embedding's
lookups read their rows from it). Where the kernel is not built (other devices, CPUs without AVX-512 BF16) the layer
multiplies the dequantized weight, unpacked per step, by unrounded activations: weight-only int8 there, and slow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inferlab.quant.int8 import quantize_int8
from inferlab.quant.linear import QuantLinear

GROUP = 32  # inputs per activation scale (the kernel's)
BLOCK = 16  # outputs per line of the layout


def check_w8a8_shape(shape: tuple[int, int]) -> None:
    if shape[1] % GROUP:
        raise ValueError(f"w8a8 rounds activations in groups of {GROUP} inputs, but this layer has {shape[1]} inputs")


def pack_w8a8(q: torch.Tensor) -> torch.Tensor:
    """q int8 [N, K] -> uint8 [ceil(N / 16), K / 4, 16, 4] holding q + 128: for each block of 16 outputs, lines of 64
    bytes with the 16 outputs' weights for 4 consecutive inputs (the operand vpdpbusd multiplies by a broadcast
    quad of activations). Rows past N hold q = 0."""
    n, k = q.shape
    check_w8a8_shape((n, k))
    u = (q.to(torch.int16) + 128).to(torch.uint8)
    u = F.pad(u, (0, 0, 0, -n % BLOCK), value=128)
    return u.view(-1, BLOCK, k // 4, 4).transpose(1, 2).contiguous()


def unpack_w8a8(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_w8a8: int8 [n, K]."""
    blocks, quads = packed.shape[:2]
    q = packed.transpose(1, 2).reshape(blocks * BLOCK, quads * 4)[:n]
    return (q.to(torch.int16) - 128).to(torch.int8)


class W8A8Linear(QuantLinear):
    scheme = "w8a8"
    max_kernel_tokens = max_kernel_tokens_fp32 = 1 << 62  # the kernel at every step size (see the module's docstring)

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, out_features: int):
        super().__init__(qweight.shape[1] * 4, out_features)
        self.register_buffer("qweight", qweight)  # pack_w8a8's layout
        self.register_buffer("scales", scales)  # bf16 [N]

    @classmethod
    def from_float(cls, w: torch.Tensor) -> "W8A8Linear":
        check_w8a8_shape(tuple(w.shape))
        q, scales = quantize_int8(w)
        return cls(pack_w8a8(q), scales, w.shape[0])

    def pack_dense(self) -> int:
        return 0  # the kernel beats the bf16 GEMM at every step size: no bf16 copy

    def dequantize_rows(self, rows: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if rows is None:
            q, s = unpack_w8a8(self.qweight, self.out_features), self.scales
        else:  # a tied embedding's lookups: only the rows asked for
            q = self.qweight[rows // BLOCK, :, rows % BLOCK].reshape(len(rows), self.in_features)
            q, s = (q.to(torch.int16) - 128).to(torch.int8), self.scales[rows]
        return q.to(dtype) * s.to(dtype)[:, None]

    def _kernel_mm(self, kernels, x: torch.Tensor) -> torch.Tensor:
        return kernels.w8a8_linear(x, self.qweight, self.scales, self.out_features)

    def _plan_fields(self, p, kinds) -> None:
        p.kind, p.a, p.b, p.out_features = kinds.W8A8, self.qweight, self.scales, self.out_features
