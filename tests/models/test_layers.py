"""Paged attention and packed linear layers against dense float64 references (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inferlab.kernels import cpu_kernels, gemv_kernels
from inferlab.layers import attention as attention_mod
from inferlab.layers import kv_int8
from inferlab.layers.attention import AttentionGroup, AttentionMetadata, PagedAttention
from inferlab.layers.packed_linear import (PackedLinear, onednn_min_rows, pack_bf16, pack_linears, packing_available,
                                           place_streamed_weights, unpack_bf16, weight_bytes)

HEADS, KV_HEADS, DIM, BS, BLOCKS = 6, 2, 16, 4, 64


def dense_attention(q, k, v):
    """q: [heads, dim] for the last position; k, v: [L, kv_heads, dim] -> [heads, dim], in float64."""
    g = HEADS // KV_HEADS
    k, v = k.double().repeat_interleave(g, dim=1), v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("hd,lhd->hl", q.double(), k) * DIM**-0.5
    return torch.einsum("hl,lhd->hd", s.softmax(-1), v)


def layer_with_pool(dtype):
    layer = PagedAttention(HEADS, KV_HEADS, DIM)

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = nn.Module()
            self.self_attn.attn = layer

    attention_mod.allocate_kv_cache([Holder()], BLOCKS, BS, dtype, "cpu")
    return layer


@pytest.mark.parametrize("backend", ["kernel", "torch"])
@pytest.mark.parametrize("batch", [1, 3, 9])  # both sides of SDPA_MAX_DECODE_BATCH
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_dense_reference(backend, batch, dtype):
    assert attention_mod.SDPA_MAX_DECODE_BATCH < 9
    if backend == "kernel" and cpu_kernels() is None:
        pytest.skip("the CPU kernel could not be built here (the engine logs why and uses the torch path)")
    torch.manual_seed(0)
    layer = layer_with_pool(dtype)
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 40, batch)  # context lengths, the new token included
    free = rng.permutation(BLOCKS).tolist()
    tables = [[free.pop() for _ in range(-(-int(n) // BS))] for n in lens]
    # Fill each sequence's past K/V straight into its blocks, then run one decode step for the last token.
    pasts = []
    for n, table in zip(lens, tables):
        k, v = torch.randn(int(n), KV_HEADS, DIM).to(dtype), torch.randn(int(n), KV_HEADS, DIM).to(dtype)
        for pos in range(int(n) - 1):
            b, o = table[pos // BS], pos % BS
            layer.k_cache[:, b, o], layer.v_cache[:, b, o] = k[pos], v[pos]
        pasts.append((k, v))
    q = torch.randn(batch, HEADS, DIM).to(dtype)
    k_new = torch.stack([k[-1] for k, _ in pasts])
    v_new = torch.stack([v[-1] for _, v in pasts])
    slots = torch.tensor([t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lens)])
    nblk = max(len(t) for t in tables)
    bt = torch.zeros(batch, nblk, dtype=torch.long)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    mask = (torch.arange(nblk * BS)[None, :] < torch.tensor(lens)[:, None]).view(batch, 1, 1, -1)
    lens_t = torch.tensor(lens, dtype=torch.long) if backend == "kernel" else None  # no lengths: torch path
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=batch,
                             decode=AttentionGroup(bt, mask, None, None, context_lens=lens_t), extend=None)
    out = layer(q, k_new, v_new, meta).view(batch, HEADS, DIM)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (k, v) in enumerate(pasts):
        ref = dense_attention(q[i], k, v)
        assert torch.allclose(out[i].double(), ref, atol=tol, rtol=tol), (i, (out[i].double() - ref).abs().max())


@pytest.mark.parametrize("dim, group, block_size", [(64, 3, 16), (64, 1, 8), (128, 4, 32), (256, 2, 16)])
def test_decode_kernel_at_model_head_sizes(dim, group, block_size):
    """The kernel's vectorised bf16 path (head sizes 64/128/256; tiles of 16 keys inside blocks of 8-32) against
    float64 attention over the same bf16 values, with lengths that end mid-tile and mid-block."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernel could not be built here")
    torch.manual_seed(dim + group)
    kv_heads, blocks = 2, 48
    k = torch.randn(kv_heads, blocks, block_size, dim).to(torch.bfloat16)
    v = torch.randn(kv_heads, blocks, block_size, dim).to(torch.bfloat16)
    lens = torch.tensor([1, 15, 16, 17, 40, 100])
    nblk = -(-int(lens.max()) // block_size)
    tables = torch.stack([torch.randperm(blocks)[:nblk] for _ in lens])
    q = (2 * torch.randn(len(lens), kv_heads * group, dim)).to(torch.bfloat16)
    out = kernels.paged_decode_attention(q, k, v, tables, lens, dim**-0.5)
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        keys = k[:, tables[i, pos // block_size], pos % block_size].double()  # [kv_heads, n, dim]
        vals = v[:, tables[i, pos // block_size], pos % block_size].double()
        qi = q[i].double().view(kv_heads, group, dim)
        ref = ((qi @ keys.transpose(1, 2)) * dim**-0.5).softmax(-1) @ vals
        assert torch.allclose(out[i].double().view_as(ref), ref, atol=1e-2, rtol=1e-2), (i, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_is_batch_invariant(dtype):
    """A sequence's attention output is bit-identical alone and among others (each (sequence, KV head) pair does
    the same arithmetic whatever shares the batch)."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernel could not be built here")
    torch.manual_seed(0)
    k, v = torch.randn(KV_HEADS, BLOCKS, BS, DIM).to(dtype), torch.randn(KV_HEADS, BLOCKS, BS, DIM).to(dtype)
    q = torch.randn(8, HEADS, DIM).to(dtype)
    tables = torch.randint(0, BLOCKS, (8, 10))
    lens = torch.randint(1, 41, (8,))
    together = kernels.paged_decode_attention(q, k, v, tables, lens, DIM**-0.5)
    for i in range(8):
        alone = kernels.paged_decode_attention(q[i:i + 1], k, v, tables[i:i + 1], lens[i:i + 1], DIM**-0.5)
        assert torch.equal(alone[0], together[i])


@pytest.mark.parametrize("dim, group, block_size", [(64, 3, 16), (128, 4, 32), (64, 8, 8)])
def test_decode_kernel_runs_of_rows(dim, group, block_size):
    """Consecutive rows of one sequence (a chunk's tokens, each attending to keys 0..its position) are read as runs
    of up to 8 rows sharing each key tile: every row is bit-identical to the same row alone, and matches float64
    causal attention. Runs break where tables differ (two sequences sharing a prefix block, then diverging) or
    lengths are not consecutive."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernel could not be built here")
    torch.manual_seed(dim + group)
    kv_heads, blocks = 2, 64
    k = torch.randn(kv_heads, blocks, block_size, dim).to(torch.bfloat16)
    v = torch.randn(kv_heads, blocks, block_size, dim).to(torch.bfloat16)
    perm = torch.randperm(blocks)
    shared, a_own, b_own = perm[:1], perm[1:14], perm[14:27]
    table_a, table_b = torch.cat([shared, a_own]), torch.cat([shared, b_own])
    # A prefix-cache extend of 19 rows from position 40, a 3-row chunk from 0 on another table sharing block 0,
    # a decode on table a, and rows whose lengths step by one across the two tables.
    rows = [(table_a, n) for n in range(41, 60)] + [(table_b, n) for n in (1, 2, 3)] + [(table_a, 100)] \
        + [(table_a, block_size + 1), (table_b, block_size + 2), (table_b, block_size + 3)]
    tables = torch.stack([t for t, _ in rows])
    lens = torch.tensor([n for _, n in rows])
    q = (2 * torch.randn(len(rows), kv_heads * group, dim)).to(torch.bfloat16)
    out = kernels.paged_decode_attention(q, k, v, tables, lens, dim**-0.5)
    for i, n in enumerate(lens.tolist()):
        alone = kernels.paged_decode_attention(q[i:i + 1], k, v, tables[i:i + 1], lens[i:i + 1], dim**-0.5)
        assert torch.equal(alone[0], out[i]), i
        pos = torch.arange(n)
        keys = k[:, tables[i, pos // block_size], pos % block_size].double()
        vals = v[:, tables[i, pos // block_size], pos % block_size].double()
        qi = q[i].double().view(kv_heads, group, dim)
        ref = ((qi @ keys.transpose(1, 2)) * dim**-0.5).softmax(-1) @ vals
        assert torch.allclose(out[i].double().view_as(ref), ref, atol=1e-2, rtol=1e-2), (i, n)


@pytest.mark.parametrize("pool", ["bf16", "int8"])
@pytest.mark.parametrize("dim, group, kv_heads, block_size", [(64, 3, 3, 16), (128, 4, 2, 32), (64, 2, 1, 8)])
def test_decode_kernel_parts_fold_the_same_whatever_the_threads(pool, dim, group, kv_heads, block_size):
    """Long rows' keys are attended in parts of ~128 keys, spread over the threads, and folded in order: each row is
    bit-identical alone, in any batch and on 1 to 5 threads (which move the cuts between threads), and matches
    float64 attention over the pool's values. A lone decode, several beside it, and a run of rows across a part
    boundary (positions 120..131)."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernel could not be built here")
    torch.manual_seed(dim + group + block_size)
    blocks = 1536 // block_size
    k, v = (torch.randn(kv_heads, blocks, block_size, dim).to(torch.bfloat16) for _ in range(2))
    if pool == "int8":
        slots = torch.arange(blocks * block_size)
        pools = [torch.empty(kv_heads, blocks, block_size * kv_int8.row_bytes(dim), dtype=torch.int8) for _ in "kv"]
        for c, x in zip(pools, (k, v)):
            kv_int8.write(c, slots, x.view(kv_heads, -1, dim).transpose(0, 1))
        k, v = pools
        kd, vd = (kv_int8.dequantize(c, dim, torch.float64) for c in pools)
    else:
        kd, vd = k.double(), v.double()
    nblk = -(-1500 // block_size)
    table = torch.randperm(blocks)[:nblk]
    lens = [1500, 129, 128, 300, 17] + list(range(120, 132))
    tables = torch.stack([table if i >= 5 else torch.randperm(blocks)[:nblk] for i in range(len(lens))])
    lens = torch.tensor(lens)
    q = (2 * torch.randn(len(lens), kv_heads * group, dim)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            outs.append(kernels.paged_decode_attention(q, k, v, tables, lens, dim**-0.5))
            for i in (0, 3, 11):
                alone = kernels.paged_decode_attention(q[i:i + 1], k, v, tables[i:i + 1], lens[i:i + 1], dim**-0.5)
                assert torch.equal(alone[0], outs[0][i]), (n, i)
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        keys = kd[:, tables[i, pos // block_size], pos % block_size]
        vals = vd[:, tables[i, pos // block_size], pos % block_size]
        qi = q[i].double().view(kv_heads, group, dim)
        ref = ((qi @ keys.transpose(1, 2)) * dim**-0.5).softmax(-1) @ vals
        assert torch.allclose(outs[0][i].double().view_as(ref), ref, atol=1e-2, rtol=1e-2), (i, n)


@pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.bfloat16), reason="no packed bf16 here")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 100])  # both sides of GEMV_MAX_ROWS (the oneDNN fallback)
def test_packed_linear_equals_dense_matmul(rows):
    torch.manual_seed(0)
    lin = nn.Linear(96, 160, bias=False).to(torch.bfloat16)
    x = torch.randn(rows, 96).bfloat16()
    ref = x.double() @ lin.weight.double().T
    y = PackedLinear(lin)(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 160)
    # bf16 output: about three significant digits.
    assert torch.allclose(y.double(), ref, atol=2e-2, rtol=1e-2)
    assert torch.allclose(y, F.linear(x, lin.weight), atol=2e-2, rtol=1e-2)


@pytest.mark.skipif(gemv_kernels() is None, reason="inferlab's kernels need AVX-512 BF16 and a compiler")
@pytest.mark.parametrize("k", [576, 80, 34])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17])  # whole and partial tiles of 8 tokens
@pytest.mark.parametrize("n", [203, 219])  # 7 tiles of 32 outputs, the last with 11 (its second block empty) or 27
def test_packed_gemm_matches_float64(k, rows, n):
    g = torch.Generator().manual_seed(k + rows + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    packed = pack_bf16(w)
    assert packed.shape == (7, k // 2, 32, 2) and torch.equal(unpack_bf16(packed, n), w)
    y = gemv_kernels().packed_linear(x, packed, n)
    ref = x.double() @ w.double().T
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    # fp32 sums rounded once to bf16: within bf16's half-ulp of the exact product (plus fp32 summation slack).
    assert ((y.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-3 * (x.double().abs() @ w.double().abs().T)).all()
    for r in (0, rows - 1):  # a row's result ignores the other rows
        assert torch.equal(gemv_kernels().packed_linear(x[r:r + 1], packed, n), y[r:r + 1])
    y32 = gemv_kernels().packed_linear(x, packed, n, fp32_out=True)  # the logits' form: the fp32 sums
    assert y32.dtype == torch.float32 and torch.equal(y32.bfloat16(), y)
    assert ((y32.double() - ref).abs() <= 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6).all()


@pytest.mark.skipif(gemv_kernels() is None, reason="inferlab's kernels need AVX-512 BF16 and a compiler")
def test_packed_gemm_prefetch_setting_changes_no_value(monkeypatch):
    from inferlab.kernels import packed_prefetch_tokens

    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(203, 576, generator=g).bfloat16(), torch.randn(21, 576, generator=g).bfloat16()
    packed, kernels = pack_bf16(w), gemv_kernels()
    try:
        outs = []
        for tokens in (0, 1, 3, 8):  # no tile, one-token tiles, up to three, every tile (8 tokens and the rest, 5)
            kernels.set_packed_prefetch_tokens(tokens)
            outs.append([kernels.packed_linear(x[:m], packed, 203) for m in (1, 2, 3, 8, 21)])
    finally:
        kernels.set_packed_prefetch_tokens(packed_prefetch_tokens())
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))
    monkeypatch.setenv("INFERLAB_PACKED_PREFETCH_TOKENS", "3")
    assert packed_prefetch_tokens() == 3
    monkeypatch.setenv("INFERLAB_PACKED_PREFETCH_TOKENS", "all")
    with pytest.raises(ValueError, match="INFERLAB_PACKED_PREFETCH_TOKENS"):
        packed_prefetch_tokens()


@pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.bfloat16), reason="no packed bf16 here")
def test_pack_linears_keeps_tied_weights_and_skips_other_dtypes():
    emb = nn.Embedding(50, 32).to(torch.bfloat16)
    head = nn.Linear(32, 50, bias=False).to(torch.bfloat16)
    head.weight = emb.weight
    net = nn.ModuleDict({"emb": emb, "head": head, "f32": nn.Linear(32, 8, bias=False)})
    added = pack_linears(net)
    assert isinstance(net["head"], PackedLinear) and net["head"].weight is emb.weight
    assert type(net["f32"]) is nn.Linear  # fp32 stays on MKL's path: no packing
    # inferlab's layout pads the outputs to whole tiles of 32; oneDNN's keeps 50 rows (and is kept beside
    # inferlab's where the CPU has AMX).
    onednn = gemv_kernels() is None or onednn_min_rows() is not None
    assert added == ((64 if gemv_kernels() is not None else 0) + (50 if onednn else 0)) * 32 * 2


@pytest.mark.skipif(gemv_kernels() is None, reason="inferlab's kernels need AVX-512 BF16 and a compiler")
def test_pack_linears_drops_the_plain_weights_that_its_layout_holds():
    torch.manual_seed(0)
    emb = nn.Embedding(50, 32).to(torch.bfloat16)
    head = nn.Linear(32, 50, bias=False).to(torch.bfloat16)
    head.weight = emb.weight
    proj = nn.Linear(32, 70, bias=False).to(torch.bfloat16)
    w = proj.weight.detach().clone()
    net = nn.ModuleDict({"emb": emb, "head": head, "proj": proj})
    x = torch.randn(3, 32).bfloat16()
    before = F.linear(x, w)
    added = pack_linears(net)
    layer = net["proj"]
    # The tied head keeps the embedding's weight; the projection's lives in its packed copy only.
    assert [n for n, _ in net.named_parameters()] == ["emb.weight"]
    assert torch.equal(layer.weight, w) and torch.equal(net.state_dict()["proj.weight"], w)
    onednn = onednn_min_rows() is not None
    assert added == ((64 + 96) + (50 + 70 if onednn else 0)) * 32 * 2 - 70 * 32 * 2
    assert weight_bytes([net]) == (50 + 70) * 32 * 2  # as loaded: the draft's cost ratio counts it
    # Off the hot path the weight still answers: autograd, a repack.
    assert torch.equal(layer(x.clone().requires_grad_()).detach(), before)
    y = layer(x)
    layer.repack()
    assert torch.equal(layer(x), y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 80])  # one thread and several
def test_fused_norm_and_swiglu_round_like_the_unfused_ops(dtype, rows):
    """bf16: bit-identical to the separate torch ops (same rounding points); fp32: within summation-order ulps."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels could not be built here")
    g = torch.Generator().manual_seed(rows)
    x, r = torch.randn(rows, 576, generator=g).to(dtype), torch.randn(rows, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    h = x + r
    hf = h.float()
    ref = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)  # transformers' Llama order
    normed, summed = kernels.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(summed, h)
    gu = torch.randn(rows, 2 * 1536, generator=g).to(dtype)
    gate, up = gu.split(1536, dim=-1)
    ref_mlp = F.silu(gate) * up
    out = kernels.silu_mul(gu)
    if dtype == torch.bfloat16:
        assert torch.equal(normed, ref) and torch.equal(out, ref_mlp)
    else:
        assert torch.allclose(normed, ref, rtol=1e-5, atol=1e-5) and torch.allclose(out, ref_mlp, rtol=1e-5, atol=1e-6)
    alone, _ = kernels.add_rms_norm(x[:1], r[:1], w, 1e-5)
    assert torch.equal(alone[0], normed[0])  # rows never depend on each other: batch-invariant


def test_fused_swiglu_fp32_is_within_a_few_ulps_of_the_exact_silu():
    """fp32 SiLU (a vectorised exp with AVX2, expf in the scalar build) against SiLU in fp64 over the range where it
    is a normal float, within 4 ulps (torch's own is within ~3); zeros, infinities, NaN and the overflow of exp as
    torch's F.silu gives them."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels could not be built here")
    gate = torch.linspace(-85, 85, 200_001)
    out = kernels.silu_mul(torch.cat([gate, torch.ones_like(gate)]).view(1, -1))[0]
    exact = F.silu(gate.double())
    normal = exact != 0
    ulps = ((out.double() - exact).abs() / exact.abs())[normal] * 2**24
    assert ulps.max() <= 4, gate[normal][ulps.argmax()]
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-40, float("inf"), float("-inf"), float("nan"), -88.5,
                            -89.5, -200.0, 88.9, 89.5])
    out = kernels.silu_mul(torch.cat([special, torch.ones_like(special)]).view(1, -1))[0]
    ref = F.silu(special)
    assert torch.allclose(out, ref, rtol=4 * 2**-24, atol=0, equal_nan=True), (out, ref)
    assert torch.equal(out.signbit()[~ref.isnan()], ref.signbit()[~ref.isnan()])  # -0.0 where torch gives it


def test_fused_swiglu_rounds_like_torch_for_every_bf16_input():
    """SiLU of a bf16 value is a function of 65,536 inputs: the kernel's (a vectorised exp where built) equals torch's
    F.silu on every one of them, bit for bit, NaNs and subnormals included. The product with `up` is then exact
    in fp32 and rounds once, so SiLU(gate) * up is bit-identical for any input."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels could not be built here")
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    out = kernels.silu_mul(torch.cat([gate, torch.ones_like(gate)]).view(1, -1))[0]
    ref = F.silu(gate)
    same = (out.view(torch.int16) == ref.view(torch.int16)) | (out.isnan() & ref.isnan())
    assert same.all(), gate[~same][:8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rotary_kv_write_matches_rotary_then_store(dtype):
    """Q/K rotated as apply_rotary rotates them (bit-identical in bf16), and K/V stored at exactly their slots;
    rows past the slot mapping (padding) are rotated but never stored."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels could not be built here")
    from inferlab.layers.rotary import apply_rotary

    T, H, KVH, D = 5, 9, 3, 64
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g).to(dtype)
    cos, sin = torch.randn(T, 1, D, generator=g).to(dtype), torch.randn(T, 1, D, generator=g).to(dtype)
    kc, vc = torch.zeros(KVH, 10, 4, D, dtype=dtype), torch.zeros(KVH, 10, 4, D, dtype=dtype)
    slots = torch.tensor([5, 6, 17, 39])  # 4 of 5 rows: the last is padding
    q, k = kernels.rotary_kv_write(qkv, cos, sin, kc, vc, slots, H, KVH)
    ref = apply_rotary(qkv[:, :(H + KVH) * D].view(T, H + KVH, D), cos, sin)
    if dtype == torch.bfloat16:
        assert torch.equal(q, ref[:, :H]) and torch.equal(k, ref[:, H:])
    else:  # fp32: the compiler may fuse a multiply-add (one rounding fewer)
        assert torch.allclose(q, ref[:, :H], atol=1e-5) and torch.allclose(k, ref[:, H:], atol=1e-5)
    v = qkv[:, (H + KVH) * D:].view(T, KVH, D)
    for t, s in enumerate(slots.tolist()):
        assert torch.equal(kc[:, s // 4, s % 4], k[t]) and torch.equal(vc[:, s // 4, s % 4], v[t])
    assert int((kc != 0).any(-1).sum()) == KVH * len(slots)  # nothing else written


@pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.bfloat16), reason="no packed bf16 here")
def test_place_streamed_weights_moves_what_the_kernels_read_and_keeps_outputs():
    from inferlab.quant.int4 import Int4Linear
    from inferlab.quant.w8a8 import W8A8Linear

    g = torch.Generator().manual_seed(0)
    dense = nn.Linear(64, 96, bias=False).to(torch.bfloat16)
    net = nn.ModuleDict({"dense": dense, "int4": Int4Linear.from_float(torch.randn(96, 64, generator=g), 32),
                         "w8a8": W8A8Linear.from_float(torch.randn(96, 64, generator=g))})
    pack_linears(net)
    x = torch.randn(3, 64, generator=g).bfloat16()
    before = {name: m(x) for name, m in net.items()}
    plain = net["dense"].weight
    old = {(name, a): getattr(m, a) for name, m in net.items() for a in m.streamed_tensors()}
    assert ("int4", "qweight") in old and ("w8a8", "scales") in old
    moved = place_streamed_weights(net)
    assert moved == sum(t.numel() * t.element_size() for t in old.values())
    for (name, a), t in old.items():
        new = getattr(net[name], a)
        assert new.data_ptr() != t.data_ptr() and torch.equal(new, t)
    assert torch.equal(net["dense"].weight, plain)  # unpacked from the moved copy: the same weight
    for name, m in net.items():
        assert torch.equal(m(x), before[name])
