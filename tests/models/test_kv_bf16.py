"""A bf16 KV pool under fp32 activations (`--dtype float32 --kv-cache-dtype bfloat16`, as a CPU without AVX-512 BF16
computes): the kernels that write and read it against the fp32 pool they would otherwise use, and the bundled
model served from it against float32 transformers."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import hf_token_logprobs

from inferlab import LLM, SamplingParams
from inferlab.kernels import cpu_kernels

TEXT = ("The lighthouse on Grey Point had been automatic for eleven years, but nobody had told the lighthouse "
        "that. Every evening at dusk its lamp still came on with a small hesitation.")


def _kernels():
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels could not be built here")
    return kernels


def test_fused_rotary_write_stores_the_fp32_rows_rounded_to_bf16():
    """rotary_kv_write into a bf16 pool under fp32 returns the Q and K it returns on an fp32 pool, and stores those
    K rows and the V rows each rounded to bf16 (to nearest, as torch's .to(bfloat16))."""
    kernels = _kernels()
    T, H, KVH, D, bs, blocks = 5, 9, 3, 64, 4, 10
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g) * 3
    cos, sin = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    slots = torch.tensor([5, 6, 17, 39])  # the last row is padding: never stored
    k32, v32 = (torch.zeros(KVH, blocks, bs, D) for _ in range(2))
    q_ref, k_ref = kernels.rotary_kv_write(qkv, cos, sin, k32, v32, slots, H, KVH)
    k16, v16 = (torch.zeros(KVH, blocks, bs, D, dtype=torch.bfloat16) for _ in range(2))
    q, k = kernels.rotary_kv_write(qkv, cos, sin, k16, v16, slots, H, KVH)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(k16, k32.to(torch.bfloat16)) and torch.equal(v16, v32.to(torch.bfloat16))
    assert not torch.equal(k16.float(), k32) and int(k16.ne(0).any(-1).sum()) == KVH * 4  # rounded; 4 rows stored


@pytest.mark.parametrize("dim, group, block_size", [(64, 3, 16), (128, 4, 32), (32, 2, 4)])
def test_decode_kernel_reads_the_bf16_pool_as_its_fp32_widening(dim, group, block_size):
    """paged_decode_attention on a bf16 pool under an fp32 query gives the bits it gives on the same pool widened to
    fp32 (the widening is exact and the arithmetic the same), for sequences whose blocks are scattered."""
    kernels = _kernels()
    kvh, blocks, B = 2, 24, 5
    g = torch.Generator().manual_seed(2)
    kc, vc = (torch.randn(kvh, blocks, block_size, dim, generator=g).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(B, kvh * group, dim, generator=g)
    lens = torch.tensor([1, block_size, block_size + 3, 3 * block_size - 1, 4 * block_size])
    tables = torch.stack([torch.randperm(blocks, generator=g)[:4] for _ in range(B)])
    out = kernels.paged_decode_attention(q, kc, vc, tables, lens, dim**-0.5)
    ref = kernels.paged_decode_attention(q, kc.float(), vc.float(), tables, lens, dim**-0.5)
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    # and it is attention: one sequence against float64 softmax(q k^T) v over its own keys
    i, n = 3, int(lens[3])
    keys = kc.double()[:, tables[i]].reshape(kvh, -1, dim)[:, :n]
    vals = vc.double()[:, tables[i]].reshape(kvh, -1, dim)[:, :n]
    qi = q[i].double().view(kvh, group, dim)
    exact = ((qi @ keys.transpose(1, 2)) * dim**-0.5).softmax(-1) @ vals
    assert torch.allclose(out[i].double().view_as(exact), exact, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_bundled_model_on_a_bf16_pool_tracks_float32(hf_model):
    """The engine in fp32 on a bf16 pool (the decode plan where it runs, the layers' kernels or torch paths
    elsewhere, prefix-cache extends gathering rounded K/V) stays close to float32 transformers, with twice the
    blocks of an fp32 pool of the same bytes."""
    mem = 32 * 2**20
    llm = LLM(dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory=mem)
    eng = llm.engine
    assert eng.dtype == torch.float32 and eng.runner.kv_cache.dtype == torch.bfloat16
    fp32 = LLM(dtype="float32", kv_cache_memory=mem)
    assert eng.block_manager.num_blocks == pytest.approx(2 * fp32.engine.block_manager.num_blocks, abs=1)

    sp = SamplingParams(temperature=0, max_tokens=8)
    assert "Paris" in llm.generate(["The capital of France is"], sp)[0].text
    alone = llm.generate([TEXT], sp)[0]
    hits = eng.stats().prefix_cache_hits_total
    again = llm.generate([TEXT], sp)[0]
    assert eng.stats().prefix_cache_hits_total - hits >= 32 and again.token_ids == alone.token_ids

    ids = llm.tokenizer.encode(TEXT, add_special_tokens=False)
    ref = hf_token_logprobs(hf_model, ids)
    q = torch.tensor(llm.score(ids))
    assert abs(q.mean() - ref.mean()) < 0.01 * abs(ref.mean())
    assert torch.corrcoef(torch.stack([q, ref]))[0, 1] > 0.995
    # Not vacuous: scoring reads the rounded K/V (the fp32 pool scores differently).
    assert not torch.equal(q, torch.tensor(fp32.score(ids)))
