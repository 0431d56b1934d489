"""int4 weight-only quantization: asymmetric, one fp16 (scale d, minimum m) pair per group of `group_size` input
columns: GGUF's Q4_1, generalised to any even group size.

    w[n, k] ~= d[n, g] * q[n, k] + m[n, g],   q in [0, 15], g = k // group_size

Packing: row n's bytes [g * G/2, (g + 1) * G/2) hold group g; byte j holds the group's element j in its low nibble
and element G/2 + j in its high nibble. For G = 32 that is Q4_1's own block layout, so a Q4_1 weight keeps the
file's nibble bytes and its fp16 (d, m) as they are: the layer multiplies by exactly llama.cpp's values.

inferlab's CPU kernel (kernels/gemv.cpp) reads this layout directly; it needs K % 64 == 0 and G = 32 or a
multiple of 64. With G = 32 it also rounds the activations to int8 per group of 32, as llama.cpp's Q8_1 does, and
multiplies in integers (VNNI, or AVX2 on a CPU without AVX-512); larger groups keep bf16 activations (AVX-512 BF16
only). Other shapes, other devices, and a machine where the kernels cannot be built dequantize and use the dense
matmul.
"""

from __future__ import annotations

import torch

from inferlab.kernels import gemv_kernels, int_gemv_kernels
from inferlab.quant.linear import QuantLinear

FP16_MAX = 65504.0


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q uint8 [out, in] in 0..15, d fp16 [out, in/group], m fp16 [out, in/group]).

    Min/max per group: d = (max - min) / 15 and m = min, both rounded to fp16 before q is computed against them.
    Error bound per element: d / 2 from rounding, plus fp16's rounding of m (2^-11 |m|) and, where d was rounded
    down and the group's largest value clamps at 15, 15 * 2^-11 * d.
    """
    check_int4_shape(tuple(w.shape), group_size)
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    if max(hi.abs().max().item(), lo.abs().max().item()) > FP16_MAX:
        raise ValueError(f"int4 quantization keeps its scales in fp16: weights must lie within +-{FP16_MAX:g}")
    d = ((hi - lo) / 15).to(torch.float16)
    m = lo.to(torch.float16)
    df = d.float()[..., None]
    # A constant group (d == 0 after rounding) stores q = 0: its value is m.
    q = torch.where(df > 0, torch.round((wg - m.float()[..., None]) / df.clamp_min(1e-30)), 0).clamp_(0, 15)
    return q.to(torch.uint8).reshape(n, k), d, m


def check_int4_shape(shape: tuple[int, ...], group_size: int) -> None:
    if len(shape) != 2:
        raise ValueError(f"int4 quantization needs a 2-D weight [out, in], got shape {shape}")
    if group_size < 2 or group_size % 2 or shape[1] % group_size:
        raise ValueError(f"int4 group size {group_size} must be even and divide the input width {shape[1]} "
                         f"(for this model try 32 or 64)")


def pack_int4(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """q uint8 [N, K] (values 0..15) -> uint8 [N, K / 2] in the group layout above."""
    n, k = q.shape
    g = q.reshape(n, k // group_size, 2, group_size // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of `pack_int4`: uint8 [N, K / 2] -> uint8 [N, K]."""
    n, half = packed.shape
    b = packed.reshape(n, half * 2 // group_size, 1, group_size // 2)
    return torch.cat([b & 0xF, b >> 4], dim=2).reshape(n, half * 2)


class Int4Linear(QuantLinear):
    scheme = "int4"
    # From `python benchmarks/quantization.py kernels`: see docs/benchmarks.md (quantization).
    max_kernel_tokens = 48
    # On an AVX2 EPYC the kernel ran SmolLM2-135M's layers ahead of dequantizing to fp32 + MKL up to 256 tokens
    # (1.8x at 128, 1.15-1.24x at 256) and behind at 512 (`python benchmarks/linear_kernels.py --fp32`,
    # docs/benchmarks.md, round 23).
    kernel_rows_alone = True
    max_kernel_tokens_fp32 = 256

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                 from_q4_1: bool = False):
        super().__init__(qweight.shape[1] * 2, qweight.shape[0])
        self.group_size = group_size
        self.from_q4_1 = from_q4_1
        self.register_buffer("qweight", qweight)  # uint8 [N, K/2]
        # fp16 [N, K/group] d and m, stored as their int16 bit patterns so that a later `model.to(dtype)` cannot
        # round them: they are the exact representation (`d`, `m` view them as fp16).
        self.register_buffer("scales", scales.to(torch.float16).view(torch.int16))
        self.register_buffer("mins", mins.to(torch.float16).view(torch.int16))

    @property
    def d(self) -> torch.Tensor:
        return self.scales.view(torch.float16)

    @property
    def m(self) -> torch.Tensor:
        return self.mins.view(torch.float16)

    @classmethod
    def from_float(cls, w: torch.Tensor, group_size: int) -> "Int4Linear":
        q, d, m = quantize_int4(w, group_size)
        return cls(pack_int4(q, group_size), d, m, group_size)

    @classmethod
    def from_q4_1(cls, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> "Int4Linear":
        """A GGUF Q4_1 weight as the file stores it: nibble bytes uint8 [N, K/2] (block after block), d and m fp16
        [N, K/32]. Nothing is converted: the bytes are the layout of group size 32."""
        return cls(packed.contiguous(), d, m, 32, from_q4_1=True)

    def find_kernels(self):
        if self.device.type != "cpu" or self.in_features % 64:
            return None
        # Group 32 multiplies integers, which the AVX2 build does too; larger groups multiply bf16 (AVX-512 BF16).
        g = self.group_size
        return int_gemv_kernels() if g == 32 else gemv_kernels() if g % 64 == 0 else None

    def dequantize_rows(self, rows: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        p, d, m = (self.qweight, self.d, self.m) if rows is None else (self.qweight[rows], self.d[rows], self.m[rows])
        g = self.group_size
        q = unpack_int4(p, g).reshape(p.shape[0], -1, g).float()
        # fp32 d * q + m: the operations, order and precision of gguf.quants' Q4_1 reference dequantizer.
        return (d.float()[..., None] * q + m.float()[..., None]).reshape(p.shape[0], self.in_features).to(dtype)

    def _kernel_mm(self, kernels, x: torch.Tensor) -> torch.Tensor:
        # The kernel reads the int16 buffers as the fp16 bit patterns they are.
        return kernels.int4_linear(x, self.qweight, self.scales, self.mins, self.group_size)

    def _plan_fields(self, p, kinds) -> None:
        p.kind, p.a, p.b, p.c, p.group = kinds.INT4, self.qweight, self.scales, self.mins, self.group_size

    def extra_repr(self) -> str:
        src = ", from GGUF Q4_1" if self.from_q4_1 else ""
        return f"{super().extra_repr()}, group_size={self.group_size}{src}"
