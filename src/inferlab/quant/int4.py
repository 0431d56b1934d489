"""int4 weight-only quantization: asymmetric, one (scale, zero) pair per group of `group_size` input columns.

The representation is torch's int4 CPU kernel's (`aten._weight_int4pack_mm_for_cpu`, tinygemm's convention):

    w[n, k] ~= (q[n, k] - 8) * scale[g, n] + zero[g, n],   q in [0, 15], g = k // group_size

Packing (checked against `aten._convert_weight_to_int4pack_for_cpu` in the tests): rows are taken in blocks of 64;
within a block the bytes are laid out [k, 32] and byte j holds row j in its low nibble and row j + 32 in its high
nibble. Output rows are padded to a multiple of 64 with zero rows; the kernel's extra outputs are sliced off.

Scales and zeros are bf16 (the kernel reads them in the activation dtype). Weights that come from a GGUF Q4_1
file also keep the file's own fp16 (d, m) so that `dequantize` reproduces llama.cpp's values exactly; see
`Int4Linear.from_q4_1`.
"""

from __future__ import annotations

import torch

from inferlab.quant.linear import KERNEL_DTYPE, QuantLinear

BLOCK_N = 64  # rows per packing block of the CPU kernel


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q uint8 [out, in] in 0..15, scale bf16 [out, in/group], zero bf16 [out, in/group]).

    Min/max per group: scale = (max - min) / 15, zero = min + 8 * scale, both rounded to bf16 before q is
    computed against them. Error bound per element: scale / 2 from rounding, plus the bf16 rounding of zero
    (2^-9 |zero|) and of scale where the group's extreme values are clamped (15 * 2^-9 * scale).
    """
    check_int4_shape(tuple(w.shape), group_size)
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    # A constant group gets a tiny positive scale: q lands on 8 and the value on zero (= the constant).
    scale = ((hi - lo) / 15).clamp_min(1e-20).to(KERNEL_DTYPE)
    zero = (lo + 8 * scale.float()).to(KERNEL_DTYPE)
    q = torch.round((wg - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp_(0, 15)
    return q.to(torch.uint8).reshape(n, k), scale, zero


def check_int4_shape(shape: tuple[int, ...], group_size: int) -> None:
    if len(shape) != 2:
        raise ValueError(f"int4 quantization needs a 2-D weight [out, in], got shape {shape}")
    if group_size < 2 or group_size % 2 or shape[1] % group_size:
        raise ValueError(f"int4 group size {group_size} must be even and divide the input width {shape[1]} "
                         f"(for this model try 32 or 64)")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] (N a multiple of 64, values 0..15) -> the CPU kernel's packed uint8 [N, K // 2]."""
    n, k = q.shape
    blocks = q.reshape(n // BLOCK_N, 2, BLOCK_N // 2, k).transpose(2, 3)  # [nb, half, k, 32]
    return (blocks[:, 0] | (blocks[:, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor, k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of `pack_int4`: uint8 [N, K] (or [len(rows), K] for the given row indices)."""
    blocks = packed.reshape(-1, k, BLOCK_N // 2)  # [nb, k, 32]
    if rows is None:
        nib = torch.stack([blocks & 0xF, blocks >> 4], dim=1)  # [nb, half, k, 32]
        return nib.transpose(2, 3).reshape(-1, k)
    b, j = rows // BLOCK_N, rows % BLOCK_N
    byte = blocks[b, :, j % (BLOCK_N // 2)]  # [len(rows), k]
    return (byte >> (4 * (j >= BLOCK_N // 2)).to(torch.uint8)[:, None]) & 0xF


class Int4Linear(QuantLinear):
    scheme = "int4"
    # Measured with benchmarks/quantization.py kernels: the int4 kernel beats bf16 up to ~8 tokens (1.5-2x at 1
    # token) and beats dequantize + bf16 matmul up to ~64-96 (dequantizing costs ~6 passes over the weight).
    max_kernel_tokens = 96

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, in_features: int, out_features: int,
                 group_size: int, q4_1_dm: torch.Tensor | None = None):
        super().__init__(in_features, out_features)
        self.group_size = group_size
        self.register_buffer("qweight", packed)  # uint8 [N_pad, K/2], kernel layout
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # bf16 [K/group, N_pad, 2]
        # GGUF Q4_1 source only: the file's fp16 (d, m) [N, K/32, 2] (value = d * q + m), stored as their int16
        # bit patterns so that a later `model.to(dtype)` cannot round them.
        self.register_buffer("q4_1_dm", q4_1_dm)

    @classmethod
    def from_float(cls, w: torch.Tensor, group_size: int) -> "Int4Linear":
        q, scale, zero = quantize_int4(w, group_size)
        return cls._build(q, scale, zero, group_size)

    @classmethod
    def from_q4_1(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> "Int4Linear":
        """A GGUF Q4_1 weight without requantization: q uint8 [N, K] in 0..15, d and m fp16 [N, K/32].

        Q4_1 is d * q + m = (q - 8) * d + (m + 8 d), so the kernel gets scale = d and zero = m + 8 d. Rounding
        happens only there: d and m + 8 d (formed in fp32) are rounded to bf16 for the kernel, so the kernel's
        products differ from llama.cpp's by at most 2^-9 relative in scale and zero. `dequantize` uses the kept
        fp16 (d, m) and equals gguf's reference dequantizer bit for bit.
        """
        zero = (m.float() + 8 * d.float()).to(KERNEL_DTYPE)
        layer = cls._build(q, d.to(KERNEL_DTYPE), zero, 32)
        layer.q4_1_dm = torch.stack([d, m], dim=-1).to(torch.float16).view(torch.int16)
        return layer

    @classmethod
    def _build(cls, q, scale, zero, group_size) -> "Int4Linear":
        n, k = q.shape
        pad = -n % BLOCK_N
        if pad:
            q = torch.cat([q, q.new_full((pad, k), 8)])
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
            zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K/group, N_pad, 2]
        return cls(pack_int4(q), sz, k, n, group_size)

    def dequantize_rows(self, rows: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        k, n = self.in_features, self.out_features
        q = unpack_int4(self.qweight, k, rows)
        if rows is None:
            q = q[:n]
        if self.q4_1_dm is not None:
            dm = self.q4_1_dm if rows is None else self.q4_1_dm[rows]
            d, m = dm.view(torch.float16).float().unbind(-1)
            qg = q.reshape(q.shape[0], k // 32, 32).float()
            # The same operations, order and precision as gguf.quants' Q4_1 reference: fp32 d * q + m.
            return (d[..., None] * qg + m[..., None]).reshape(q.shape[0], k).to(dtype)
        return self._apply_scales(q, self.scales_and_zeros[:, rows if rows is not None else slice(0, n)], dtype)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """[out, in], a transposed view of a contiguous [in, out]: built in the packed layout's own order (blocks
        of 64 rows, k-major), so the nibbles are never transposed one by one and the arithmetic runs in place.
        Uses the kernel's bf16 (scale, zero) even for Q4_1 weights, so large and small steps agree."""
        k, g, half = self.in_features, self.group_size, BLOCK_N // 2
        nb = self.qweight.shape[0] // BLOCK_N
        p = self.qweight.view(nb, k, half)
        cdtype = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
        # Contiguous scale and zero: broadcasting a strided operand over the weight is ~10x slower (measured).
        sz = self.scales_and_zeros.to(cdtype).view(k // g, nb, 1, BLOCK_N, 2).transpose(0, 1)  # [nb, K/g, 1, 64, 2]
        scale, zero = sz[..., 0].contiguous(), sz[..., 1].contiguous()
        w = torch.cat([p & 0xF, p >> 4], dim=2).view(nb, k // g, g, BLOCK_N).to(cdtype)  # [nb, K/g, g, 64]
        w.sub_(8).mul_(scale).add_(zero)
        wt = w.view(nb, k, BLOCK_N).transpose(0, 1).reshape(k, nb * BLOCK_N)  # [in, out_pad]
        return wt[:, : self.out_features].t().to(dtype)

    def _apply_scales(self, q: torch.Tensor, sz: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # In bf16 when the model is bf16: one rounding per operation and no fp32 temporary of the whole weight.
        cdtype = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
        scale, zero = sz.to(cdtype).transpose(0, 1).unbind(-1)  # [rows, K/group]
        g = self.group_size
        qg = q.reshape(q.shape[0], self.in_features // g, g).to(cdtype)
        return ((qg - 8) * scale[..., None] + zero[..., None]).reshape(q.shape[0], self.in_features).to(dtype)

    def _kernel_mm(self, x: torch.Tensor) -> torch.Tensor:
        # .to() is a no-op unless someone cast the model after quantizing (bf16 -> fp32 -> bf16 is exact).
        sz = self.scales_and_zeros.to(KERNEL_DTYPE)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, self.group_size, sz)
        return y if y.shape[1] == self.out_features else y[:, : self.out_features]

    def extra_repr(self) -> str:
        src = ", from GGUF Q4_1" if self.q4_1_dm is not None else ""
        return f"{super().extra_repr()}, group_size={self.group_size}{src}"
