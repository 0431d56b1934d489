"""Speculative decoding inside the engine changes nothing a greedy request sees: the same tokens, the same stops.

The oracle is the same engine without speculation (itself checked against transformers in tests/models and
batch-invariant in tests/engine). Proposers are swapped on the session's float32 engine through make_proposer,
the path LLMEngine.__init__ takes, with a policy that always speculates so every step exercises verification.
"""

from __future__ import annotations

import pytest

from inferlab import SamplingParams
from inferlab.spec import SpecPolicy
from row_invariant import row_invariant_packing
from speclib import GREEDY, TEXTS, generate, speculating

# A draft of the target's first 29 of 30 layers agrees with it on about half the tokens (both the accept and the
# reject paths run); 2 layers agree on almost none but cost little (SmolLM2-135M's shallow layers predict poorly).
# Greedy identity does not depend on the draft's quality: the target rewrites every position it verifies.


def method(name: str, k: int, draft_layers: int = 29) -> dict:
    if name == "ngram":
        return dict(speculative="ngram", num_speculative_tokens=k)
    return dict(speculative="draft", num_speculative_tokens=k, draft_layers=draft_layers)


@pytest.mark.parametrize("name", ["ngram", "draft"])
def test_greedy_alone_is_unchanged_for_k_1_to_8(llm, prompts, expected, name):
    proposed = accepted = 0
    for i, p in enumerate(prompts):
        k = 1 + i % 8  # every K twice over the 16 prompts
        # The 29-layer draft costs k near-full passes per step: it gets K = 1..4 once, the 2-layer one the rest.
        with speculating(llm, **method(name, k, 29 if i < 4 else 2)):
            out = generate(llm, [p])[0]
        assert out.token_ids == expected[i], f"{name} K={k} changed prompt {i}: {TEXTS[i]!r}"
        proposed, accepted = proposed + out.spec_proposed, accepted + out.spec_accepted
    assert 0 < accepted < proposed  # proposals were both accepted and rejected


@pytest.mark.parametrize("name", ["ngram", "draft"])
def test_greedy_in_batches_is_unchanged_for_k_1_to_8(llm, prompts, expected, name):
    for k in range(1, 9):
        # The draft costs up to k forward passes per step: it gets batches of 4, n-gram lookup batches of 8.
        size = 4 if name == "draft" else 8
        chosen = [(k * size + j) % len(prompts) for j in range(size)]  # each prompt in several batches
        with speculating(llm, **method(name, k, 29 if k in (1, 3) else 2)):
            outs = generate(llm, [prompts[i] for i in chosen])
        for i, out in zip(chosen, outs):
            assert out.token_ids == expected[i], f"{name} K={k} changed prompt {i} in a batch"


def test_spec_and_plain_sequences_share_steps_with_staggered_arrivals(llm, prompts, expected):
    """Arrivals while others speculate: prefill chunks, plain decodes and verifications in the same steps."""
    eng = llm.engine
    got: dict[str, list[int]] = {}
    # Verifying costs 0.2 of a step per token here: speculation pays for a lone sequence, not in a batch.
    with speculating(llm, SpecPolicy(token_cost=0.2), speculative="ngram", num_speculative_tokens=5):
        pending = list(range(len(prompts)))
        while pending or eng.has_work():
            if pending:
                i = pending.pop(0)
                eng.add_request(f"mix-{i}", prompts[i], GREEDY)
            for out in eng.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert eng.proposer.num_steps_skipped > 0  # the off switch engaged once the batch grew
    for i in range(len(prompts)):
        assert got[f"mix-{i}"] == expected[i]


def step_deltas(llm, prompt, params) -> list[list[int]]:
    """The tokens one request gains at each engine step."""
    eng = llm.engine
    eng.add_request("deltas", prompt, params)
    deltas = []
    while eng.has_work():
        deltas += [o.new_token_ids for o in eng.step()]
    return deltas


def test_stops_are_exact_when_several_tokens_are_accepted_at_once(llm, prompts):
    # Prompt 15 makes the model repeat the prompt's sentence: the n-gram proposer gets runs accepted at once.
    p = prompts[15]
    long = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with speculating(llm, speculative="ngram", num_speculative_tokens=8):
        deltas = step_deltas(llm, p, long)
    # Stop in the middle of a step that accepted several proposals at once, at a token not seen before it.
    at = next(i for i, d in enumerate(deltas) if len(d) >= 4 and d[2] not in [t for e in deltas[:i] for t in e] + d[:2])
    before = [t for d in deltas[:at] for t in d]
    stop_token = deltas[at][2]
    stop_text = llm.tokenizer.decode(deltas[at][1:3])
    assert stop_text.strip() and stop_text not in llm.tokenizer.decode(before + deltas[at][:1])
    cases = [
        SamplingParams(temperature=0, max_tokens=32, stop=[stop_text]),
        SamplingParams(temperature=0, max_tokens=32, stop=[stop_text], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=len(before) + 2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
    ]
    plain = [generate(llm, [p], sp)[0] for sp in cases]
    with speculating(llm, speculative="ngram", num_speculative_tokens=8):
        spec = [generate(llm, [p], sp)[0] for sp in cases]
    for sp, a, b in zip(cases, plain, spec):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), sp
    assert spec[2].token_ids[-1] == stop_token and len(spec[2].token_ids) == len(before) + 3
    assert len(spec[3].token_ids) == len(before) + 2 and spec[3].finish_reason == "length"
    assert len(spec[4].token_ids) == 1 and spec[4].spec_proposed == 0  # never proposes past max_tokens


def test_eos_is_honoured_with_speculation(llm):
    messages = [{"role": "user", "content": "Repeat after me: the cat sat on the mat."}]
    sp = SamplingParams(temperature=0, max_tokens=32)
    plain = llm.chat(messages, sp)[0]
    assert plain.finish_reason == "stop"  # the model ends its turn itself
    for name in ("ngram", "draft"):
        with speculating(llm, **method(name, 4)):
            out = llm.chat(messages, sp)[0]
        assert (out.token_ids, out.text, out.finish_reason) == (plain.token_ids, plain.text, "stop")


def test_sampling_with_speculation_counts_and_seeds(llm, prompts):
    """Sampled requests: seeded ones reproduce under the same speculation, counters add up per request."""
    sp = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=s, ignore_eos=True) for s in range(4)]
    batch = [prompts[i] for i in (0, 4, 10, 14)]
    eng = llm.engine
    for name in ("ngram", "draft"):
        with speculating(llm, **method(name, 4)):
            before = eng.stats()
            first = generate(llm, batch, sp)
            after = eng.stats()
            again = generate(llm, batch, sp)
        assert [o.token_ids for o in first] == [o.token_ids for o in again]
        assert all(len(o.token_ids) == 8 for o in first)
        assert sum(o.spec_proposed for o in first) == (after.spec_num_draft_tokens_total
                                                      - before.spec_num_draft_tokens_total)
        assert sum(o.spec_accepted for o in first) == (after.spec_num_accepted_tokens_total
                                                      - before.spec_num_accepted_tokens_total)
        per_pos = after.spec_accepted_per_pos_total
        assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # position j accepted only if j - 1 was
        assert per_pos[0] <= after.spec_num_drafts_total


def test_low_acceptance_turns_speculation_off_for_a_while(llm, prompts):
    # A 2-layer draft (a quarter of the target's weight bytes, mostly the head) is almost always wrong: at 1.5
    # tokens accepted per verification it would pay, after a rejection it cannot, and the sequence sits out 5 steps.
    policy = SpecPolicy(token_cost=0.0, initial_accepted=1.5, cooldown_steps=5)
    with speculating(llm, policy, speculative="draft", num_speculative_tokens=4, draft_layers=2) as proposer:
        out = generate(llm, [prompts[12]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert 0.2 < proposer.draft_cost < 0.3
    assert proposer.num_seq_steps_cooling > 0
    assert out.spec_proposed < 4 * 12  # far fewer proposals than speculating every step would make


def test_greedy_on_the_bf16_decode_plan_is_unchanged(prompts):
    """On the default bf16 engine every verification step runs as rows of the decode plan's kernel, which are
    row-invariant like plain decodes, so speculation keeps greedy tokens exactly there too (through the layers'
    batched SDPA a verified position could round otherwise than its plain decode and part at a near-tie). With
    AMX, only on the row-invariant path (row_invariant.py)."""
    from inferlab import LLM
    from inferlab.kernels import gemv_kernels

    if gemv_kernels() is None:
        pytest.skip("the decode plan needs inferlab's AVX-512 BF16 kernels")
    with row_invariant_packing():
        llm = LLM(dtype="bfloat16", kv_cache_memory=64 * 2**20)
    assert llm.engine.runner.model.model.decode_plan is not None
    longer = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = [o.token_ids for o in generate(llm, prompts, longer)]
    with speculating(llm, speculative="ngram", num_speculative_tokens=4) as proposer:
        spec = [o.token_ids for o in generate(llm, prompts, longer)]
    assert spec == plain
    assert proposer.counters.num_accepted_tokens > 0
