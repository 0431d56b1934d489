"""Prefix caching through the engine: same outputs with and without it, exact hit counts, tenant isolation."""

from __future__ import annotations

import pytest

from inferlab import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SYSTEM = ("You are a meticulous assistant for a hardware store. Always answer with the aisle number first, then a "
          "short explanation. Aisles: 1 paint, 2 plumbing, 3 electrical, 4 garden, 5 tools, 6 fasteners. ") * 3


@pytest.fixture(scope="module")
def llm_nocache():
    return LLM(dtype="float32", kv_cache_memory=128 * 2**20, enable_prefix_caching=False)


def shared_prefix_prompts(tokenizer) -> list[list[int]]:
    base = tokenizer.encode(SYSTEM, add_special_tokens=False)
    questions = ["Where is the sandpaper?", "Where are the hose fittings?", "Do you sell light bulbs?",
                 "Where can I find wood screws?", "Where is the primer?", "Do you have shovels?"]
    return [base + tokenizer.encode(" Q: " + q, add_special_tokens=False) for q in questions]


def test_outputs_identical_with_and_without_prefix_caching(llm_fp32, llm_nocache):
    prompts = shared_prefix_prompts(llm_fp32.tokenizer)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    expected = [o.token_ids for o in llm_nocache.generate(reqs, GREEDY)]
    first = llm_fp32.generate(reqs[:1], GREEDY)[0]  # warms the cache with the shared prefix
    assert first.token_ids == expected[0]
    batched = llm_fp32.generate(reqs, GREEDY)  # every request now hits the cached prefix
    assert [o.token_ids for o in batched] == expected
    assert all(o.num_cached_tokens >= 16 * ((len(prompts[0]) - 40) // 16) for o in batched)


def test_hit_accounting_is_exact(llm_fp32):
    eng = llm_fp32.engine
    bs = eng.block_manager.block_size
    tok = llm_fp32.tokenizer
    prefix = tok.encode("Counting sheep: " + "one sheep, " * 60, add_special_tokens=False)[: 5 * bs]  # 5 full blocks
    a = prefix + tok.encode(" and then we slept.", add_special_tokens=False)
    b = prefix + tok.encode(" until morning came.", add_special_tokens=False)
    q0, h0 = eng.block_manager.prefix_queries, eng.block_manager.prefix_hits
    out_a = llm_fp32.generate({"prompt_token_ids": a}, GREEDY)[0]
    out_b = llm_fp32.generate({"prompt_token_ids": b}, GREEDY)[0]
    assert out_a.num_cached_tokens == 0
    assert out_b.num_cached_tokens == 5 * bs
    assert eng.block_manager.prefix_queries - q0 == len(a) + len(b)
    assert eng.block_manager.prefix_hits - h0 == 5 * bs
    stats = eng.stats()
    assert stats.prefix_cache_hits_total == eng.block_manager.prefix_hits


def test_different_salts_never_share(llm_fp32):
    tok = llm_fp32.tokenizer
    secret = tok.encode("Tenant A's private contract terms: " + "clause, " * 80, add_special_tokens=False)
    eng = llm_fp32.engine
    outs = {}
    tokens: dict[str, list[int]] = {}
    for rid, salt in [("a1", "tenant-a"), ("b1", "tenant-b"), ("a2", "tenant-a"), ("none", None)]:
        eng.add_request(rid, secret + [42], GREEDY, cache_salt=salt)
        while eng.has_work():
            for o in eng.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    outs[o.request_id] = o
    assert outs["a1"].num_cached_tokens == 0
    assert outs["b1"].num_cached_tokens == 0  # same prompt, other tenant: no hit, so no timing side channel
    assert outs["a2"].num_cached_tokens > 0  # same tenant: hit
    assert outs["none"].num_cached_tokens == 0
    # The salt changes what is shared, never what is generated: a hit gives the same greedy tokens as a miss.
    assert len(tokens["a1"]) == GREEDY.max_tokens
    assert tokens["a1"] == tokens["b1"] == tokens["a2"] == tokens["none"]
