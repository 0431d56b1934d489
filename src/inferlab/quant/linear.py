"""The shared shape of a weight-quantized linear layer: a fast kernel for small steps, dequantize + dense matmul
for large ones.

Measured on the project's 2-core AVX-512 BF16 EPYC with torch 2.13 (`python benchmarks/quantization.py kernels`):
torch's int8/int4 weight-only CPU kernels are 2-4x faster than a bf16 matmul for one token (they read 2-4x fewer
weight bytes), but they stop scaling at a few tokens while bf16 keeps going, so from about 16 tokens a step
the bf16 matmul wins. Past `max_kernel_tokens` we therefore dequantize the weight into a temporary dense copy and
use the dense matmul: the dequantization is a fixed cost (~0.2-0.5 ms for a 576x3072 layer) that a large step
amortises, and no second copy of the weights is kept, so the memory saving stays whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Both CPU kernels take bf16 activations; their fp32 paths are scalar and 20-60x slower (measured), so an fp32
# model's activations are rounded to bf16 for the kernel and the result is cast back.
KERNEL_DTYPE = torch.bfloat16


class QuantLinear(nn.Module):
    """Stands in for `nn.Linear(in_features, out_features, bias=False)`: forward(x [..., in]) -> [..., out] in x's dtype.

    Subclasses store the quantized weight as buffers (so `.to(device)` moves it and `state_dict()` saves it) and
    implement `dequantize_rows` and, where a CPU kernel exists, `_kernel_mm`.
    """

    scheme = ""
    # Steps with more tokens than this dequantize and run the dense matmul (see the module docstring).
    max_kernel_tokens = 0

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= self.max_kernel_tokens and self.kernel_available():
            y = self._kernel_mm(x2.to(KERNEL_DTYPE)).to(x.dtype)
        else:
            y = self.dense_mm(x2)
        return y.reshape(*x.shape[:-1], self.out_features)

    def kernel_available(self) -> bool:
        """The fused kernels are torch's CPU ones; on other devices the layer dequantizes (correct, not fast)."""
        return self.device.type == "cpu"

    @property
    def device(self) -> torch.device:
        return next(self.buffers()).device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The full weight [out, in] as the quantized values represent it."""
        return self.dequantize_rows(None, dtype)

    def dense_mm(self, x: torch.Tensor) -> torch.Tensor:
        """The large-step path: x [T, in] -> [T, out]."""
        return F.linear(x, self.dense_weight(x.dtype))

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the kernel multiplies by, built fast for the large-step path (default: `dequantize`)."""
        return self.dequantize(dtype)

    def dequantize_rows(self, rows: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `rows` (all when None) of the dequantized weight: [len(rows), in]. Embedding lookups use this."""
        raise NotImplementedError

    def _kernel_mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"
