"""KV blocks under speculation: nothing leaks after finish, abort or preemption mid-speculation, and a draft model
with its own KV pool (indexed by the target's block tables) recovers from preemption. Bad options are refused."""

from __future__ import annotations

from dataclasses import replace

import pytest

from inferlab import LLM, SamplingParams
from inferlab.common.errors import ModelLoadError
from inferlab.common.bundled import bundled_model_path
from inferlab.spec import SpeculativeConfigError, make_proposer
from speclib import ALWAYS, GREEDY, generate, speculating

BLOCKS = 12  # of 16 tokens: far less than 8 concurrent sequences need, so preemption happens all the time


@pytest.fixture(scope="module")
def tiny(llm):  # depends on llm: one intra-op thread
    per_block = 2 * 30 * 3 * 64 * 4 * 16  # K and V, 30 layers, 3 KV heads of 64, float32, 16 tokens
    return LLM(dtype="float32", kv_cache_memory=BLOCKS * per_block, max_num_seqs=8, num_threads=1)


@pytest.fixture(scope="module")
def fitting(prompts, expected):
    chosen = [i for i, p in enumerate(prompts) if len(p) + GREEDY.max_tokens + 8 <= BLOCKS * 16][:8]
    return [prompts[i] for i in chosen], [expected[i] for i in chosen]


DRAFT_MODEL = dict(speculative="draft", draft_model=str(bundled_model_path()), draft_layers=29)


@pytest.mark.parametrize("options", [dict(speculative="ngram"), dict(speculative="draft", draft_layers=29),
                                     DRAFT_MODEL], ids=["ngram", "draft-layers", "draft-model"])
def test_preemption_mid_speculation_keeps_outputs_and_frees_every_block(tiny, fitting, monkeypatch, options):
    prompts, expected = fitting
    sched = tiny.engine.scheduler
    preempted_while_speculating = []
    real_preempt = sched._preempt

    def preempt(seq):
        preempted_while_speculating.append(bool(seq.spec_token_ids) or len(tiny.engine.block_manager.table(
            seq.request_id)) * 16 > seq.num_tokens + 1)  # proposals pending, or blocks taken for the draft's K/V
        real_preempt(seq)

    monkeypatch.setattr(sched, "_preempt", preempt)
    with speculating(tiny, num_speculative_tokens=4, **options):
        outs = generate(tiny, prompts)
    assert any(preempted_while_speculating)
    for out, exp in zip(outs, expected):
        assert out.token_ids == exp


def test_abort_mid_speculation_frees_blocks(tiny, fitting):
    prompts, expected = fitting
    eng = tiny.engine
    with speculating(tiny, num_speculative_tokens=6, **DRAFT_MODEL):
        for i in range(3):
            eng.add_request(f"ab-{i}", prompts[i], GREEDY)
        got: dict[str, list[int]] = {}
        aborted = set()
        while eng.has_work():
            for out in eng.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
            for rid, seq in list(eng.requests.items()):
                if seq.spec_token_ids and rid != "ab-2" and rid not in aborted:
                    assert eng.abort(rid)  # between proposing and verifying
                    aborted.add(rid)
        assert aborted == {"ab-0", "ab-1"}
        assert got["ab-2"] == expected[2]


def test_finish_by_stop_inside_accepted_run_frees_blocks(tiny, fitting):
    prompts, expected = fitting
    stop_token = expected[0][5]
    sp = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_token])
    with speculating(tiny, num_speculative_tokens=8, speculative="draft", draft_layers=30):  # accepts everything
        out = generate(tiny, [prompts[0]], sp)[0]
    assert out.token_ids == expected[0][: expected[0].index(stop_token) + 1] and out.finish_reason == "stop"


def test_a_draft_with_another_vocabulary_is_refused(llm, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    eng = llm.engine
    with pytest.raises(ModelLoadError, match=r"vocabulary of 1000 tokens but the target .* has 49152"):
        make_proposer(replace(eng.config, speculative="draft", draft_model=str(tmp_path)), eng.runner, eng.tokenizer)


@pytest.mark.parametrize("options, message", [
    (dict(speculative="draft"), "needs --draft-model PATH or --draft-layers L"),
    (dict(speculative="draft", draft_layers=31), "between 1 and the draft's 30 layers, got 31"),
    (dict(speculative="draft", draft_layers=0), "between 1 and the draft's 30 layers, got 0"),
    (dict(speculative="ngram", num_speculative_tokens=0), "num-speculative-tokens must be an integer >= 1"),
    (dict(speculative="ngram", ngram_min=3, ngram_max=2), "ngram-min <= --ngram-max"),
    (dict(draft_layers=4), "need --speculative draft"),
    (dict(speculative="medusa"), "must be ngram or draft"),
])
def test_bad_options_are_refused_with_the_reason(llm, options, message):
    eng = llm.engine
    with pytest.raises(SpeculativeConfigError, match=message):
        make_proposer(replace(eng.config, **options), eng.runner, eng.tokenizer, ALWAYS)


def test_speculative_engine_from_the_config(tiny, fitting):
    """LLM(speculative=...) wires the proposer itself; counters reach the engine's stats."""
    prompts, expected = fitting
    llm = LLM(dtype="float32", kv_cache_memory=64 * 2**20, num_threads=1, speculative="ngram",
              num_speculative_tokens=3)
    outs = generate(llm, prompts[:2])
    assert [o.token_ids for o in outs] == expected[:2]
    s = llm.engine.stats()
    assert s.spec_num_drafts_total > 0 and len(s.spec_accepted_per_pos_total) <= 3
    assert sum(o.spec_proposed for o in outs) == s.spec_num_draft_tokens_total
