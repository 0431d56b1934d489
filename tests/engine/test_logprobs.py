"""Logprobs through the engine: sampled and prompt logprobs equal the model's own scoring pass (`LLM.score`, which
tests/models checks against transformers), across chunked prefill, a prefix-cache hit and speculative-free steps."""

from __future__ import annotations

import math

import pytest

from inferlab import SamplingParams

TEXT = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps aloud so that the "
        "silence would not settle on him. ") * 24  # > 512 tokens: the default step budget, so prefill is chunked


def run(eng, reqs: dict[str, tuple[list[int], SamplingParams]]):
    for rid, (ids, p) in reqs.items():
        eng.add_request(rid, ids, p)
    outs: dict[str, list] = {rid: [] for rid in reqs}
    while eng.has_work():
        for o in eng.step():
            outs[o.request_id].append(o)
    return outs


def test_prompt_and_sampled_logprobs_equal_the_scoring_pass(llm_fp32):
    eng = llm_fp32.engine
    ids = llm_fp32.tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > eng.config.max_num_batched_tokens
    # The first run puts the prompt's blocks in the prefix cache; the scored ones must not skip them.
    run(eng, {"warm": (ids, SamplingParams(temperature=0, max_tokens=1))})
    outs = run(eng, {
        "score": (ids, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=3, echo=True)),
        "gen": (ids[:40], SamplingParams(temperature=0.8, seed=7, max_tokens=6, logprobs=2, ignore_eos=True)),
    })
    (only,) = outs["score"]
    assert only.finished and only.finish_reason == "length" and only.new_token_ids == []
    assert only.num_cached_tokens == 0 and only.prompt_text == TEXT[:len(only.prompt_text)]
    lp = only.prompt_logprobs
    assert len(lp) == len(ids) and lp[0].logprob is None and lp[0].token_id == ids[0]
    assert [e.token_id for e in lp] == ids
    ref = llm_fp32.score(ids)
    assert max(abs(e.logprob - r) for e, r in zip(lp[1:], ref)) < 1e-3
    for e in lp[1:]:
        assert len(e.top) == 3 and e.top[0][2] >= e.top[1][2] >= e.top[2][2] and e.top[0][2] >= e.logprob - 1e-6

    gen = outs["gen"]
    new = [t for o in gen for t in o.new_token_ids]
    entries = [e for o in gen for e in o.logprobs]
    assert [e.token_id for e in entries] == new and len(new) == 6
    ref = llm_fp32.score(ids[:40] + new)[-6:]  # raw distribution: temperature does not enter (engine/logprobs.py)
    assert max(abs(e.logprob - r) for e, r in zip(entries, ref)) < 1e-3
    assert all(len(e.top) == 2 and math.isfinite(e.top[1][2]) for e in entries)
    assert gen[0].prompt_logprobs is None and gen[0].prompt_text is None


def test_max_tokens_zero_needs_prompt_logprobs():
    from inferlab.common.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="only with prompt logprobs"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match=r"logprobs must be an integer in \[0, 20\]"):
        SamplingParams(logprobs=21)
