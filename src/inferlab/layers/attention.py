"""Paged attention over a block-structured KV pool.

A step's tokens arrive flat: first the decode tokens (one per sequence, query length 1), then the "extend" tokens
(prefill chunks, or several tokens per sequence when verifying speculative proposals). Decodes go to inferlab's CPU
kernel, which reads the pool in place through the block tables (or, without it, to a batched matmul over gathered
keys); extends to one batched SDPA call over keys gathered through the block tables. Grouping keeps a long prefill
chunk from padding every decode query to its length. (Where the decode plan runs the step, the model runner turns
every extend token into a decode row of its own instead: engine/model_runner.py, ROW_ATTENTION_MAX_KEYS.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inferlab.common.host_memory import advise_huge_pages, zeroed_host_tensor
from inferlab.kernels import kernels_for_pool
from inferlab.layers import kv_int8


@dataclass(slots=True)
class AttentionGroup:
    block_tables: torch.Tensor  # [B, max_blocks] int64 block ids (padding points at block 0, masked out)
    mask: torch.Tensor  # [B, 1, max_q, max_blocks * block_size] bool, True = may attend
    q_index: torch.Tensor | None  # [B, max_q] rows of the group's flat tokens (padded queries repeat row 0)
    out_index: torch.Tensor | None  # [n_tokens] positions in the padded [B * max_q] output that hold real tokens
    context_lens: torch.Tensor | None = None  # [B] int64 keys each sequence attends to after this step
    # Rows of a layer's pool viewed as [kv_heads * num_blocks, block_size * dim], made by the first layer that
    # gathers and reused by the rest: (kv_heads, num_blocks, index).
    gather_rows: tuple[int, int, torch.Tensor] | None = None
    # `mask` narrowed to a sliding window, made by the first windowed layer and reused by the rest: (window, mask).
    window_mask: tuple[int, torch.Tensor] | None = None


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat KV slot of each new token: block_id * block_size + offset
    num_decode_tokens: int
    decode: AttentionGroup | None
    extend: AttentionGroup | None
    # A lone prefill from position 0 (no decodes, no cached prefix) attends only to its own fresh K/V.
    causal_only: bool = False


# Decode batches up to this size use torch's SDPA; larger ones a plain matmul-softmax-matmul (see _decode).
SDPA_MAX_DECODE_BATCH = 4


class PagedAttention(nn.Module):
    """The KV pool layout is [kv_heads, num_blocks, block_size, head_dim] per layer, heads outermost: a block of one
    head is one contiguous run, which the CPU decode kernel reads in place, and gathering a batch's blocks yields
    [kv_heads, B, L, head_dim] with each (head, sequence) contiguous, which batched matmuls read without a copy.
    (Blocks outermost needed a transposing copy after every gather; measured, that and torch's SDPA decode kernel
    with one query row made decode attention 3-10x slower.)"""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # A query at position p attends to keys p - window + 1 .. p (transformers' sliding-window mask). Blocks
        # out of every window stay allocated: the window narrows the masks, not the pool.
        self.sliding_window = sliding_window
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        # Bound to this layer's slice of the pool by allocate_kv_cache: [kv_heads, num_blocks, block_size, head_dim],
        # or [kv_heads, num_blocks, block bytes] for an int8 pool (layers/kv_int8.py).
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                kv_written: bool = False) -> torch.Tensor:
        """q: [T, heads, dim], k/v: [T, kv_heads, dim] -> [T, heads * dim]. Rows beyond the slot mapping are
        padding (see models/llama.py: batch_invariant_rows): neither stored nor attended, returned as zeros.
        kv_written: the new K/V are already in the pool (the fused rotary kernel stores them)."""
        T = meta.slot_mapping.shape[0]
        if q.shape[0] > T:
            out = self.forward(q[:T], k[:T], v[:T], meta, kv_written)
            return F.pad(out, (0, 0, 0, q.shape[0] - T))
        if not kv_written and self.k_cache.dtype == torch.int8:
            kv_int8.write(self.k_cache, meta.slot_mapping, k)
            kv_int8.write(self.v_cache, meta.slot_mapping, v)
        elif not kv_written:
            k_flat = self.k_cache.view(self.num_kv_heads, -1, self.head_dim)
            v_flat = self.v_cache.view(self.num_kv_heads, -1, self.head_dim)
            k_flat.index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(k_flat.dtype))
            v_flat.index_copy_(1, meta.slot_mapping, v.transpose(0, 1).to(v_flat.dtype))

        if meta.causal_only:
            if self.k_cache.dtype == torch.int8:
                # Attend to the K/V as the pool holds them, as every later step will (and so perplexity scoring,
                # which runs this path, measures the int8 pool).
                k, v = (kv_int8.round_trip(x) for x in (k, v))
            elif self.k_cache.dtype != k.dtype:  # a bf16 pool under fp32, likewise
                k, v = (x.to(self.k_cache.dtype).to(x.dtype) for x in (k, v))
            w = self.sliding_window
            mask = None
            if w is not None and T > w:
                i = torch.arange(T, device=q.device)
                mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - w)
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True,
            )
            return o.squeeze(0).transpose(0, 1).reshape(T, -1)

        out = q.new_empty(T, self.num_heads, self.head_dim)
        d = meta.num_decode_tokens
        if meta.decode is not None:
            out[:d] = self._decode(q[:d], meta.decode)
        if meta.extend is not None:
            g = meta.extend
            qp = q[d:][g.q_index].transpose(1, 2)  # [B, heads, max_q, dim]
            k_past, v_past = self._gather(g, q.dtype)
            o = F.scaled_dot_product_attention(qp, k_past.transpose(0, 1), v_past.transpose(0, 1),
                                               attn_mask=self._mask(g), scale=self.scale, enable_gqa=True)
            out[d:] = o.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)[g.out_index]
        return out.view(T, -1)

    def _gather(self, g: AttentionGroup, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's blocks, in order: [kv_heads, B, L, dim] for K and for V, in `dtype`. One
        row gather over the pool seen as 2-D (a memcpy per block; index_select along dim 1 of the 4-D pool measured
        2x slower)."""
        H, N = self.k_cache.shape[:2]
        block_numel = self.k_cache[0, 0].numel()
        B, nblk = g.block_tables.shape
        if g.gather_rows is None or g.gather_rows[:2] != (H, N):
            rows = (torch.arange(H, device=g.block_tables.device)[:, None] * N + g.block_tables.view(1, -1)).view(-1)
            g.gather_rows = (H, N, rows)
        rows = g.gather_rows[2]
        k, v = (c.view(H * N, block_numel).index_select(0, rows) for c in (self.k_cache, self.v_cache))
        if self.k_cache.dtype == torch.int8:
            k, v = (kv_int8.dequantize(x, self.head_dim, dtype) for x in (k, v))
        elif self.k_cache.dtype != dtype:  # a bf16 pool under fp32
            k, v = k.to(dtype), v.to(dtype)
        shape = (H, B, -1, self.head_dim)
        return k.view(shape), v.view(shape)

    def _mask(self, g: AttentionGroup) -> torch.Tensor:
        """The group's causal mask, narrowed to the sliding window where there is one."""
        w = self.sliding_window
        if w is None or g.mask.shape[-1] <= w:
            return g.mask
        if g.window_mask is None or g.window_mask[0] != w:
            # Keys 0..p are allowed for a query at position p, so p = (allowed keys) - 1.
            pos = g.mask.sum(-1, keepdim=True) - 1
            key = torch.arange(g.mask.shape[-1], device=g.mask.device)
            g.window_mask = (w, g.mask & (key > pos - w))
        return g.window_mask[1]

    def _decode(self, q: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        """One query per sequence."""
        B = q.shape[0]
        kernels = kernels_for_pool(q, self.k_cache) if g.context_lens is not None else None
        if kernels is not None and self.sliding_window is not None \
                and int(g.context_lens.max()) > self.sliding_window:
            kernels = None  # the C++ kernel attends to the whole context: past the window, the masked torch path
        if kernels is not None:
            return kernels.paged_decode_attention(q, self.k_cache, self.v_cache, g.block_tables, g.context_lens,
                                                  self.scale)
        # The torch path: gather the past, then the query heads sharing a KV head become that head's query rows
        # ([kv_heads, B, group, dim]), so grouped-query attention is a plain batched matmul with no K/V expansion.
        k, v = self._gather(g, q.dtype)
        qg = q.view(B, self.num_kv_heads, self.group, self.head_dim).transpose(0, 1).to(k.dtype)
        mask = self._mask(g).view(1, B, 1, -1)  # [B, 1, 1, L] -> broadcast over heads and the group's rows
        if B <= SDPA_MAX_DECODE_BATCH:
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scale)
        else:
            # Scores from a batched matmul in the cache dtype, softmax in fp32: the numerics of transformers'
            # eager attention. torch's flash kernel for CPU, which accumulates scores in fp32, measured 2-3x
            # slower from 16 sequences up, as its work per (sequence, head) is one query row.
            s = torch.matmul(qg, k.transpose(-1, -2)).float().mul_(self.scale).masked_fill_(~mask, float("-inf"))
            o = torch.matmul(s.softmax(-1).to(v.dtype), v)
        return o.transpose(0, 1).reshape(B, self.num_heads, self.head_dim).to(q.dtype)


def allocate_kv_cache(layers, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> torch.Tensor:
    """One pool for the given decoder layers, [layers, 2 (K, V), kv_heads, num_blocks, block_size, head_dim],
    each layer's attention bound to its slice; with dtype int8, [layers, 2, kv_heads, num_blocks, block bytes]
    (layers/kv_int8.py)."""
    attns = [layer.self_attn.attn for layer in layers]
    a = attns[0]
    shape = (len(attns), 2, a.num_kv_heads, num_blocks) + (
        (block_size * kv_int8.row_bytes(a.head_dim),) if dtype == torch.int8 else (block_size, a.head_dim))
    # On the CPU, a mapping of its own (zero pages from the kernel, returned whole when the pool goes).
    pool = (zeroed_host_tensor(shape, dtype) if torch.device(device).type == "cpu"
            else torch.zeros(shape, dtype=dtype, device=device))
    # 2 MiB pages before the first write: decode attention reads scattered 2 KiB blocks, a TLB miss each on 4 KiB
    # pages (16 sequences x 192 tokens, blocks scattered over a 1 GiB pool: 9.0 -> 6.6 ms a step, measured).
    advise_huge_pages(pool)
    # Touched now, not by the first requests: left to fault in while serving, each new huge page (zeroed, and
    # compacted for where THP defrag is "madvise") landed inside a step, and 1-stream decode ran ~10% slower
    # (87 against 98 tok/s, peers.py c1, measured). The pool is counted in the idle memory target anyway.
    pool.zero_()
    bind_kv_cache(layers, pool)
    return pool


def bind_kv_cache(layers, pool: torch.Tensor) -> None:
    """Point each layer's attention at its slice of `pool` (see allocate_kv_cache)."""
    for i, layer in enumerate(layers):
        layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache = pool[i, 0], pool[i, 1]
