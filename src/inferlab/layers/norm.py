"""RMSNorm, computed in float32 and cast back, as Llama's reference does (the cast order matters for bf16 parity)."""

from __future__ import annotations

import torch
from torch import nn

from inferlab.kernels import kernels_for


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new_residual). With a residual, adds it first: the pre-norm block's `h = x + r; norm(h)`."""
        kernels = kernels_for(x, self.weight) if x.dim() == 2 else None
        if kernels is not None:
            return kernels.add_rms_norm(x, residual, self.weight, self.eps)  # same rounding points, one pass
        if residual is not None:
            x = x + residual
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype), x
