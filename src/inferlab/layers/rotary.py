"""Rotary position embedding in the rotate-half layout (Hugging Face's; GGUF Q/K rows are un-permuted at load)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling_factor: float = 1.0):
        """scaling_factor: linear position scaling (positions / factor), transformers' "linear" rope type."""
        super().__init__()
        # Computed on the CPU, then moved to the default device: under the loader's meta-device context the
        # arithmetic would run through torch's Python reference kernels, whose first call imports torch._dynamo
        # (with sympy and triton, ~160 MiB resident that serving never uses).
        cpu = torch.device("cpu")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=cpu).float() / head_dim))
        if scaling_factor != 1.0:
            inv_freq = inv_freq / scaling_factor
        t = torch.arange(max_position, dtype=torch.float32, device=cpu)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        device = torch.get_default_device()
        self.register_buffer("cos_cache", emb.cos().to(device), persistent=False)
        self.register_buffer("sin_cache", emb.sin().to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered once per step and shared by every layer: [T, 1, head_dim] each."""
        return self.cos_cache[positions].to(dtype).unsqueeze(1), self.sin_cache[positions].to(dtype).unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]."""
    return x * cos + _rotate_half(x) * sin
