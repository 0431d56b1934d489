"""int8 weight-only quantization: symmetric, one scale per output channel (row).

w[n, k] ~= q[n, k] * scale[n], q in [-127, 127]. The scale is stored in bf16 (the dtype torch's own int8 CPU kernel
takes, which stays the path where inferlab's kernels cannot be built); q is computed against the already-rounded
scale, so the stored pair is the exact representation and `dequantize` reproduces what the kernels multiply by.
"""

from __future__ import annotations

import torch

from inferlab.kernels import int_gemv_kernels
from inferlab.quant.linear import QuantLinear

QMAX = 127  # symmetric range: -128 is left unused so that q and -q are both representable


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (any float dtype) -> (q int8 [out, in], scale bf16 [out]).

    Error bound per element: |w - q * scale| <= scale / 2, plus at most 2^-8 * |w| where bf16 rounded the
    scale down and the largest value was clamped to 127.
    """
    if w.dim() != 2:
        raise ValueError(f"int8 quantization needs a 2-D weight [out, in], got shape {tuple(w.shape)}")
    w = w.float()
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax)).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


class Int8Linear(QuantLinear):
    scheme = "int8"
    # From `python benchmarks/quantization.py kernels`: see docs/benchmarks.md (quantization).
    max_kernel_tokens = 16
    # Against dequantizing to fp32 + MKL on an AVX2 EPYC, ours and torch's kernel both won up to 64 tokens (ours
    # 2.4x at 64 and 1.3x at 128, torch's 1.05-1.15x at 64 and behind from 128) (`python
    # benchmarks/linear_kernels.py --fp32`, docs/benchmarks.md, round 23).
    kernel_rows_alone = True
    max_kernel_tokens_fp32 = 64
    # Activations stay unrounded here; quant/w8a8.py rounds them to int8 too, for VNNI (--quantization w8a8).

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor):
        super().__init__(qweight.shape[1], qweight.shape[0])
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    @classmethod
    def from_float(cls, w: torch.Tensor) -> "Int8Linear":
        return cls(*quantize_int8(w))

    def dequantize_rows(self, rows: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q, s = (self.qweight, self.scales) if rows is None else (self.qweight[rows], self.scales[rows])
        # q (|q| <= 127) and s are exact in bf16 and in fp32, so computing in `dtype` rounds the product once.
        return q.to(dtype) * s.to(dtype)[:, None]

    def find_kernels(self):
        # Where inferlab's integer kernels are not vectorised (neither AVX-512 BF16 nor AVX2), torch's own int8
        # kernel still beats dequantizing for one token: the module's stand-in below calls it.
        if self.device.type != "cpu":
            return None
        return int_gemv_kernels() or _TorchInt8Kernel

    def _kernel_mm(self, kernels, x: torch.Tensor) -> torch.Tensor:
        return kernels.int8_linear(x, self.qweight, self.scales)

    def _plan_fields(self, p, kinds) -> None:
        p.kind, p.a, p.b = kinds.INT8, self.qweight, self.scales


class _TorchInt8Kernel:
    @staticmethod
    def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        # torch's kernel takes bf16 activations and scales (its fp32 path is scalar and 20-60x slower, measured).
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), qweight, scales.to(torch.bfloat16))
        return y.to(x.dtype)
