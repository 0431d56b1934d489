"""The int8 KV pool (layers/kv_int8.py, `--kv-cache-dtype int8`): its rounding, the kernels that write and read it
against torch oracles, and the bundled model served from it against float32 transformers."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import hf_token_logprobs

from inferlab import LLM, SamplingParams
from inferlab.kernels import cpu_kernels, gemv_kernels, int_gemv_kernels
from inferlab.layers import kv_int8

TEXT = ("The lighthouse on Grey Point had been automatic for eleven years, but nobody had told the lighthouse "
        "that. Every evening at dusk its lamp still came on with a small hesitation.")


def test_rows_round_within_half_a_step_and_zero_rows_stay_zero():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-3, 3, 50)[:, None, None]
    x[7, 1] = 0
    q, s = kv_int8.quantize_rows(x)
    assert q.dtype == torch.int8 and s.shape == x.shape[:-1]
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    err = (q.float() * s[..., None] - x).abs()
    assert (err <= s[..., None] / 2 * (1 + 1e-6)).all()
    assert (err.amax(-1) > s / 100).any()  # not vacuous: the rounding moved values
    assert s[7, 1] == 0 and not q[7, 1].any()
    assert torch.equal(kv_int8.round_trip(x), q.float() * s[..., None])


def _pool(kv_heads, blocks, block_size, dim):
    return torch.zeros(kv_heads, blocks, block_size * kv_int8.row_bytes(dim), dtype=torch.int8)


def test_written_rows_land_in_their_slots_and_nowhere_else():
    kvh, blocks, bs, dim = 3, 6, 4, 64
    pool = _pool(kvh, blocks, bs, dim)
    x = torch.randn(5, kvh, dim)
    slots = torch.tensor([0, 5, 6, 21, 23])
    kv_int8.write(pool, slots, x)
    values, scales = kv_int8.split_blocks(pool, dim)
    q, s = kv_int8.quantize_rows(x)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(values[:, slot // bs, slot % bs], q[t]) and torch.equal(scales[:, slot // bs, slot % bs], s[t])
    assert int((scales != 0).sum()) == kvh * len(slots) and int(values.ne(0).any(-1).sum()) == kvh * len(slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rotary_write_rounds_bit_for_bit_as_torch(dtype):
    """rotary_kv_write into an int8 pool stores exactly kv_int8.write's bytes for the K it returns and the V rows."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels could not be built here")
    T, H, KVH, D, bs = 5, 9, 3, 64, 4
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(T, (H + 2 * KVH) * D, generator=g) * 3).to(dtype)
    qkv[2, (H + KVH) * D:(H + KVH + 1) * D] = 0  # an all-zero V row
    cos, sin = torch.randn(T, 1, D, generator=g).to(dtype), torch.randn(T, 1, D, generator=g).to(dtype)
    kc, vc = _pool(KVH, 10, bs, D), _pool(KVH, 10, bs, D)
    slots = torch.tensor([5, 6, 17, 39])  # the last row is padding: never stored
    q, k = kernels.rotary_kv_write(qkv, cos, sin, kc, vc, slots, H, KVH)
    kr, vr = _pool(KVH, 10, bs, D), _pool(KVH, 10, bs, D)
    kv_int8.write(kr, slots, k[:4])
    kv_int8.write(vr, slots, qkv[:4, (H + KVH) * D:].view(4, KVH, D))
    assert torch.equal(kc, kr) and torch.equal(vc, vr) and kc.any()


def _filled_pools(kvh: int, blocks: int, block_size: int, dim: int):
    """A K and a V int8 pool with every slot written (rows of varied scale), and their rows dequantized to float64
    ([kvh, blocks, block_size, dim]) for the reference."""
    k, v = _pool(kvh, blocks, block_size, dim), _pool(kvh, blocks, block_size, dim)
    slots = torch.arange(blocks * block_size)
    kv_int8.write(k, slots, torch.randn(len(slots), kvh, dim) * torch.rand(len(slots), 1, 1) * 4)
    kv_int8.write(v, slots, torch.randn(len(slots), kvh, dim) * torch.rand(len(slots), 1, 1) * 4)
    return (k, v, *(kv_int8.dequantize(c, dim, torch.float64) for c in (k, v)))


@pytest.mark.parametrize("dim, group, block_size", [(64, 3, 16), (64, 1, 8), (128, 4, 32), (256, 2, 16), (32, 2, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_kernel_reads_the_int8_pool(dim, group, block_size, dtype):
    """paged_decode_attention over an int8 pool against float64 attention over the pool's dequantized rows, with
    lengths that end mid-tile and mid-block (dim 32: the generic path; the others the vectorised one)."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels could not be built here")
    torch.manual_seed(dim + group)
    kvh, blocks = 2, 48
    k, v, kd, vd = _filled_pools(kvh, blocks, block_size, dim)  # [kvh, blocks, block_size, dim]
    lens = torch.tensor([1, 15, 16, 17, 40, 100])
    nblk = -(-int(lens.max()) // block_size)
    tables = torch.stack([torch.randperm(blocks)[:nblk] for _ in lens])
    q = (2 * torch.randn(len(lens), kvh * group, dim)).to(dtype)
    out = kernels.paged_decode_attention(q, k, v, tables, lens, dim**-0.5)
    # an fp32 query is still rounded to int16 against its largest element for the integer scores (1/65,534 of it)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        keys, vals = (c[:, tables[i, pos // block_size], pos % block_size] for c in (kd, vd))
        qi = q[i].double().view(kvh, group, dim)
        ref = ((qi @ keys.transpose(1, 2)) * dim**-0.5).softmax(-1) @ vals
        assert torch.allclose(out[i].double().view_as(ref), ref, atol=tol, rtol=tol), (i, n)


@pytest.mark.parametrize("dim, group, block_size", [(64, 3, 16), (128, 4, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_kernel_reads_runs_of_rows_from_the_int8_pool(dim, group, block_size, dtype):
    """A chunk's consecutive rows (each one key longer, one block table) read as runs sharing each widened key tile:
    each row bit-identical to the row alone and within the float64 reference over the dequantized pool; runs break
    where two tables that share a first block part."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels could not be built here")
    torch.manual_seed(dim + group)
    kvh, blocks = 2, 48
    k, v, kd, vd = _filled_pools(kvh, blocks, block_size, dim)
    perm = torch.randperm(blocks)
    table_a, table_b = perm[:8], torch.cat([perm[:1], perm[8:15]])
    rows = [(table_a, n) for n in range(30, 41)] + [(table_a, block_size + 1), (table_b, block_size + 2)]
    tables = torch.stack([t for t, _ in rows])
    lens = torch.tensor([n for _, n in rows])
    q = (2 * torch.randn(len(rows), kvh * group, dim)).to(dtype)
    out = kernels.paged_decode_attention(q, k, v, tables, lens, dim**-0.5)
    # an fp32 query is still rounded to int16 against its largest element for the integer scores (1/65,534 of it)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
    for i, n in enumerate(lens.tolist()):
        alone = kernels.paged_decode_attention(q[i:i + 1], k, v, tables[i:i + 1], lens[i:i + 1], dim**-0.5)
        assert torch.equal(alone[0], out[i]), i
        pos = torch.arange(n)
        keys, vals = (c[:, tables[i, pos // block_size], pos % block_size] for c in (kd, vd))
        qi = q[i].double().view(kvh, group, dim)
        ref = ((qi @ keys.transpose(1, 2)) * dim**-0.5).softmax(-1) @ vals
        assert torch.allclose(out[i].double().view_as(ref), ref, atol=tol, rtol=tol), (i, n)


@pytest.mark.slow
def test_bundled_model_on_an_int8_pool_tracks_float32(hf_model):
    """Greedy text, the pool's bytes and log-likelihoods: the engine on an int8 pool (the default dtype's
    activations, the decode plan where it runs, decodes and prefix-cache extends reading rounded K/V) stays close to
    float32 transformers."""
    llm = LLM(kv_cache_dtype="int8", kv_cache_memory=32 * 2**20)
    eng = llm.engine
    assert eng.runner.kv_cache.dtype == torch.int8
    # The plan runs where inferlab's kernels take every projection: bf16 on AVX-512 BF16, or the bf16 weights that
    # --quantization auto keeps under fp32 activations on an AVX2 CPU; elsewhere the layers, in fp32.
    bf16_weights = eng.dtype == torch.float32 and int_gemv_kernels() is not None
    assert eng.config.quantization == ("bf16" if bf16_weights else "none")
    assert (eng.runner.model.model.decode_plan is not None) == (gemv_kernels() is not None or bf16_weights)
    default = LLM(kv_cache_memory=32 * 2**20)
    # Same bytes of pool, ~1.9x the blocks where the default is bf16 (rows of 64 values are 128 bytes; int8 rows
    # 68), ~3.8x where it is fp32.
    row = 64 * default.engine.runner.kv_cache.element_size()
    assert eng.block_manager.num_blocks == pytest.approx(default.engine.block_manager.num_blocks * row / 68, rel=0.01)

    sp = SamplingParams(temperature=0, max_tokens=8)
    first = llm.generate(["The capital of France is"], sp)[0]
    assert "Paris" in first.text
    # A cached prefix: the prompt's blocks read back through the gather path (extend) give the same continuation.
    alone = llm.generate([TEXT], sp)[0]
    hits = eng.stats().prefix_cache_hits_total
    again = llm.generate([TEXT], sp)[0]
    assert eng.stats().prefix_cache_hits_total - hits >= 32 and again.token_ids == alone.token_ids

    ids = llm.tokenizer.encode(TEXT, add_special_tokens=False)
    ref = hf_token_logprobs(hf_model, ids)
    q = torch.tensor(llm.score(ids))
    assert abs(q.mean() - ref.mean()) < 0.03 * abs(ref.mean())
    assert torch.corrcoef(torch.stack([q, ref]))[0, 1] > 0.98
    # Not vacuous: scoring reads the rounded K/V (the same model on a pool of its own dtype scores differently).
    assert not torch.allclose(q, torch.tensor(default.score(ids)), atol=1e-3)
