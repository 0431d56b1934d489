"""The activations as inferlab's int8-activation kernels round them (kernels/gemv.cpp's W4A8, kernels/w8a8_gemm.cpp):
an independent statement of the rounding, for tests that need the kernels' exact product."""

from __future__ import annotations

import torch


def int8_groups(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 rounded per token and group of 32: a = round(x * (127 / max|x|)) in fp32, half to even;
    returned dequantized, a * max|x| / 127, in float64."""
    g = x.reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    a = torch.round(g * inv)
    return (a.double() * (amax / 127.0).double()).reshape(x.shape)
