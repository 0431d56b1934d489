"""Paged attention over a block-structured KV pool.

A step's tokens arrive flat: first the decode tokens (one per sequence, query length 1), then the "extend" tokens
(prefill chunks, or several tokens per sequence when verifying speculative proposals). Each group is attended in one
batched SDPA call over keys gathered through the block tables; grouping keeps a long prefill chunk from padding every
decode query to its length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class AttentionGroup:
    block_tables: torch.Tensor  # [B, max_blocks] int64 block ids (padding points at block 0, masked out)
    mask: torch.Tensor  # [B, 1, max_q, max_blocks * block_size] bool, True = may attend
    q_index: torch.Tensor | None  # [B, max_q] rows of the group's flat tokens (padded queries repeat row 0)
    out_index: torch.Tensor | None  # [n_tokens] positions in the padded [B * max_q] output that hold real tokens


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat KV slot of each new token: block_id * block_size + offset
    num_decode_tokens: int
    decode: AttentionGroup | None
    extend: AttentionGroup | None
    # A lone prefill from position 0 (no decodes, no cached prefix) attends only to its own fresh K/V.
    causal_only: bool = False


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        # Bound by the model runner to this layer's slice of the pool: [num_blocks, block_size, kv_heads, head_dim].
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, heads, dim], k/v: [T, kv_heads, dim] -> [T, heads * dim]. Rows beyond the slot mapping are
        padding (see models/llama.py: batch_invariant_rows): neither stored nor attended, returned as zeros."""
        T = meta.slot_mapping.shape[0]
        if q.shape[0] > T:
            out = self.forward(q[:T], k[:T], v[:T], meta)
            return F.pad(out, (0, 0, 0, q.shape[0] - T))
        k_flat = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_flat = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))

        if meta.causal_only:
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                is_causal=True, scale=self.scale, enable_gqa=True,
            )
            return o.squeeze(0).transpose(0, 1).reshape(T, -1)

        out = q.new_empty(T, self.num_heads, self.head_dim)
        d = meta.num_decode_tokens
        if meta.decode is not None:
            # [D, heads, 1, dim]
            out[:d] = self._attend(q[:d].unsqueeze(2), meta.decode).squeeze(2)
        if meta.extend is not None:
            g = meta.extend
            qe = q[d:]
            qp = qe[g.q_index].transpose(1, 2)  # [B, heads, max_q, dim]
            o = self._attend(qp, g).transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)
            out[d:] = o[g.out_index]
        return out.view(T, -1)

    def _attend(self, q: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        B = g.block_tables.shape[0]
        # Gather each sequence's blocks into a contiguous [B, kv_heads, L, dim] view of its past.
        k = self.k_cache[g.block_tables].view(B, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_cache[g.block_tables].view(B, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=g.mask, scale=self.scale, enable_gqa=True
        )
