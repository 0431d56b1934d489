"""n > 1 over the API with the official `openai` client: choice i of a seeded request samples what a request with
seed + i samples alone, the choices share the prompt's full KV blocks, and each has its own finish reason."""

from __future__ import annotations

import pytest


pytestmark = pytest.mark.slow

PROMPT = "In the old harbour town, the fishermen gathered every morning at dawn to mend their nets and talk about"


def test_n_choices_equal_requests_with_the_derived_seeds_and_share_the_prompt_blocks(api, llm_fp32):
    eng = llm_fp32.engine
    model, bs = eng.model_name, eng.block_manager.block_size
    prompt = PROMPT + " a storm that nobody else remembered."  # unique to this test: no earlier cache entries
    ids, _ = eng.tokenize_prompt(prompt)
    hits0 = eng.stats().prefix_cache_hits_total
    r = api.completions.create(model=model, prompt=prompt, n=4, seed=11, temperature=1.0, max_tokens=12)
    # Choices 1..3 found every full block of choice 0's prompt in the cache; only the partial tail is recomputed.
    assert eng.stats().prefix_cache_hits_total - hits0 == 3 * bs * ((len(ids) - 1) // bs)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.text for c in r.choices]
    alone = [api.completions.create(model=model, prompt=prompt, seed=11 + i, temperature=1.0, max_tokens=12)
             for i in range(4)]
    assert texts == [a.choices[0].text for a in alone] and len(set(texts)) > 1
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)

    # Streamed, chat: chunks carry the choice index; each choice ends with its own finish reason.
    msgs = [{"role": "user", "content": "Write one sentence about the sea."}]
    stream = api.chat.completions.create(model=model, messages=msgs, n=3, seed=5, temperature=1.0, max_tokens=10,
                                         stream=True, stream_options={"include_usage": True})
    got: dict[int, str] = {i: "" for i in range(3)}
    finish: dict[int, str] = {}
    usage = None
    for ch in stream:
        usage = ch.usage or usage
        for c in ch.choices:
            got[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    alone = [api.chat.completions.create(model=model, messages=msgs, seed=5 + i, temperature=1.0, max_tokens=10)
             for i in range(3)]
    assert [got[i] for i in range(3)] == [a.choices[0].message.content for a in alone]
    assert [finish[i] for i in range(3)] == [a.choices[0].finish_reason for a in alone]
    assert usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_per_choice_finish_reasons(api, llm_fp32):
    """A stop string ends some choices early and not others: each reports its own reason."""
    eng = llm_fp32.engine
    r = api.completions.create(model=eng.model_name, prompt=PROMPT, n=6, seed=3, temperature=1.0, max_tokens=16,
                               stop=[" the"])
    reasons = [c.finish_reason for c in r.choices]
    for c in r.choices:
        alone = api.completions.create(model=eng.model_name, prompt=PROMPT, seed=3 + c.index, temperature=1.0,
                                       max_tokens=16, stop=[" the"]).choices[0]
        assert (c.text, c.finish_reason) == (alone.text, alone.finish_reason)
    assert set(reasons) <= {"stop", "length"}


def test_the_largest_seed_wraps_for_later_choices(api, llm_fp32):
    """seed + i past 2^64 - 1 (the largest seed the API takes) wraps to what a request with (seed + i) mod 2^64
    draws, instead of reaching torch.Generator.manual_seed out of range on the engine thread."""
    model = llm_fp32.engine.model_name
    r = api.completions.create(model=model, prompt=PROMPT, n=2, seed=2**64 - 1, temperature=1.0, max_tokens=8)
    alone = [api.completions.create(model=model, prompt=PROMPT, seed=s, temperature=1.0, max_tokens=8)
             for s in (2**64 - 1, 0)]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    after = api.completions.create(model=model, prompt="Still serving?", max_tokens=2, extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 2  # the engine thread is alive and serving
