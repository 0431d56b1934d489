"""The off switch's cost model, without a model: when speculation pays and when it does not.

Units: a one-token decode step costs 1, each token in a step adds token_cost; `accepted` is a sequence's running
mean of proposals accepted per verification."""

from __future__ import annotations

from inferlab.spec.proposer import SpecPolicy

P = SpecPolicy(token_cost=0.06)


def test_ngram_pays_alone_and_stops_paying_as_the_batch_grows():
    assert P.pays(1, [1.0], [4], draft_cost=0.0)
    assert P.pays(4, [1.0] * 4, [4] * 4, draft_cost=0.0)
    assert not P.pays(32, [1.0] * 32, [4] * 32, draft_cost=0.0)
    # ... unless what is accepted grows with it (copying tasks: 2.3 per verification measured at 16 concurrent).
    assert P.pays(16, [2.3] * 16, [4] * 16, draft_cost=0.0)


def test_proposals_riding_along_a_prefill_chunk_are_nearly_free():
    assert not P.pays(16, [1.0] * 16, [4] * 16, draft_cost=0.0)
    assert P.pays(16, [1.0] * 16, [4] * 16, draft_cost=0.0, prefill_tokens=496)


def test_long_contexts_make_the_extra_tokens_relatively_cheap():
    # 16 sequences of ~270 tokens: attention over the context costs as much as the weights (measured).
    assert P.pays(16, [1.0] * 16, [4] * 16, draft_cost=0.0, context_tokens=16 * 270)


def test_one_speculating_sequence_in_a_batch_pays_only_if_often_accepted():
    assert P.pays(16, [3.0], [4], draft_cost=0.0)
    assert not P.pays(16, [0.2], [4], draft_cost=0.0)


def test_a_sequence_with_rejected_proposals_does_not_pay():
    assert not P.pays(1, [0.1], [4], draft_cost=0.0)
    # The gain is capped by what can be accepted: a long record does not justify a short proposal for free.
    assert P.pays(1, [4.0], [1], draft_cost=0.0) == P.pays(1, [1.0], [1], draft_cost=0.0)


def test_a_draft_nearly_as_big_as_the_target_never_pays_but_a_small_one_can():
    assert not P.pays(1, [3.5], [4], draft_cost=0.93)
    assert P.pays(1, [3.0], [4], draft_cost=0.05)


def test_always_and_nothing_to_verify():
    assert SpecPolicy(always=True).pays(64, [0.0], [8], draft_cost=1.0)
    assert not SpecPolicy().pays(4, [], [], draft_cost=0.0)
