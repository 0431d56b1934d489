"""The default KV pool: --max-num-seqs sequences at the full context, capped by min(1 GiB, 20% of free memory);
--kv-cache-memory overrides it. Model-free, then once through a real engine."""

from __future__ import annotations

import pytest

from inferlab.engine.kv_pool import size_kv_pool

MiB, GiB = 2**20, 2**30
BLOCK = 368_640  # SmolLM2-135M, bf16, 16 tokens: 30 layers x (K, V) x 3 heads x 64 dims x 2 bytes x 16


def test_pool_holds_max_num_seqs_sequences_at_the_full_context_when_that_fits():
    p = size_kv_pool(BLOCK, 16, max_num_seqs=4, max_model_len=8192, kv_cache_memory=None, free_bytes=64 * GiB)
    assert p.num_blocks == 4 * 8192 // 16  # llama.cpp's 4 slots x 8192: 32k tokens
    # a context that is not a whole number of blocks rounds each sequence up
    p = size_kv_pool(BLOCK, 16, max_num_seqs=3, max_model_len=1000, kv_cache_memory=None, free_bytes=64 * GiB)
    assert p.num_blocks == 3 * 63


def test_the_cap_is_1_gib_or_a_fifth_of_free_memory_whichever_is_less():
    p = size_kv_pool(BLOCK, 16, max_num_seqs=64, max_model_len=8192, kv_cache_memory=None, free_bytes=64 * GiB)
    assert p.num_blocks == GiB // BLOCK  # 64 x 8192 tokens would be 11 GiB
    assert "capped" in p.reason
    p = size_kv_pool(BLOCK, 16, max_num_seqs=64, max_model_len=8192, kv_cache_memory=None, free_bytes=2 * GiB)
    assert p.num_blocks == int(0.2 * 2 * GiB) // BLOCK


def test_kv_cache_memory_overrides_the_formula_both_ways():
    small = size_kv_pool(BLOCK, 16, max_num_seqs=64, max_model_len=8192, kv_cache_memory=64 * MiB,
                         free_bytes=64 * GiB)
    assert small.num_blocks == 64 * MiB // BLOCK and small.reason == "--kv-cache-memory"
    big = size_kv_pool(BLOCK, 16, max_num_seqs=1, max_model_len=512, kv_cache_memory=4 * GiB, free_bytes=64 * GiB)
    assert big.num_blocks == 4 * GiB // BLOCK  # more than one 512-token sequence needs: the user asked for it


def test_a_pool_smaller_than_one_block_is_refused_with_the_block_size():
    with pytest.raises(ValueError, match=f"--kv-cache-memory 1000 B holds no KV block .{BLOCK} B each"):
        size_kv_pool(BLOCK, 16, max_num_seqs=1, max_model_len=512, kv_cache_memory=1000, free_bytes=GiB)


@pytest.mark.slow
def test_the_engine_sizes_its_default_pool_by_the_formula():
    from inferlab import LLM, SamplingParams
    from inferlab.common.process_memory import resident_bytes

    llm = LLM(dtype="float32", max_num_seqs=3, max_model_len=1000, num_threads=1)
    engine = llm.engine
    per_block = engine.model_config.kv_bytes_per_token(4) * 16
    assert engine.block_manager.num_blocks == 3 * 63
    assert engine.runner.kv_cache_bytes == 3 * 63 * per_block
    assert engine.max_model_len == 1000
    # touched at start (faulting pages in while serving slowed 1-stream decode): all of it resident, and zeros
    pool = engine.runner.kv_cache
    assert resident_bytes(pool.data_ptr(), engine.runner.kv_cache_bytes) == engine.runner.kv_cache_bytes
    assert not pool.any()
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.token_ids) == 4
