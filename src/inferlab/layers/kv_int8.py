"""The int8 KV pool (`--kv-cache-dtype int8`): each K or V row of one head rounded to int8 with its own scale.

A layer's pool is [kv_heads, num_blocks, block_size * (head_dim + 4)] bytes: each (head, block) holds its
block_size rows of head_dim int8 values, then their block_size fp32 scales. Rows stay 64-byte aligned for the CPU
decode kernel, a block's scales are one vector load, and a block is still one contiguous run that the gathers, the
prefix cache and the KV transfer move as a whole. Half of bf16's bytes plus 4 per row (53% at head_dim 64).

A row's scale is max|x| / 127 and its values round(x / scale), written once when the token's K/V are stored: one
scale per (token, head) needs no re-rounding of a block as it fills, which a per-block scale would. The kernels
(rotary_kv_write.cpp, paged_decode_attention.cpp) compute the same bytes; tests/layers/test_kv_int8.py checks it.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one fp32 scale per row


def row_bytes(head_dim: int) -> int:
    """Pool bytes one token's K (or V) of one head takes."""
    return head_dim + SCALE_BYTES


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], fp32 scales [...]); an all-zero row gets scale 0 and zeros."""
    xf = x.float()
    scale = xf.abs().amax(-1) / 127
    q = torch.where(scale[..., None] > 0, xf / scale[..., None], 0.0).round_().clamp_(-127, 127)
    return q.to(torch.int8), scale


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """x as the pool gives it back: rounded to int8 rows and scaled again, in x's dtype."""
    q, scale = quantize_rows(x)
    return (q.float() * scale[..., None]).to(x.dtype)


def split_blocks(blocks: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of blocks [..., block_size * (D + 4)] int8: values [..., block_size, D] int8, scales [..., block_size]
    fp32."""
    block_size = blocks.shape[-1] // row_bytes(head_dim)
    values = blocks[..., :block_size * head_dim].unflatten(-1, (block_size, head_dim))
    return values, blocks[..., block_size * head_dim:].view(torch.float32)


def write(cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    """Round x [T, kv_heads, D] and store token t at flat slot slot_mapping[t] of cache [kv_heads, N, bytes]."""
    values, scales = split_blocks(cache, x.shape[-1])
    block_size = values.shape[2]
    blk, off = slot_mapping // block_size, slot_mapping % block_size
    q, s = quantize_rows(x.transpose(0, 1))  # [kv_heads, T, D], [kv_heads, T]
    values[:, blk, off] = q
    scales[:, blk, off] = s


def dequantize(blocks: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., block_size * (D + 4)] int8 -> [..., block_size, D] in dtype."""
    values, scales = split_blocks(blocks, head_dim)
    return (values.float() * scales[..., None]).to(dtype)
