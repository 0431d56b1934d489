"""The off switch's cost model, without a model: when speculation pays and when it does not."""

from __future__ import annotations

import pytest

from inferlab.spec.proposer import SpecPolicy, expected_tokens


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_ngram_pays_alone_and_stops_paying_as_the_batch_grows():
    p = SpecPolicy(token_cost=0.06)
    assert p.pays(1, [0.5], [4], draft_cost=0.0)
    assert p.pays(4, [0.5] * 4, [4] * 4, draft_cost=0.0)
    assert not p.pays(32, [0.5] * 32, [4] * 32, draft_cost=0.0)
    # A batch with one speculating sequence among many pays its share only if it is accepted often.
    assert p.pays(16, [0.9], [4], draft_cost=0.0)
    assert not p.pays(16, [0.1], [4], draft_cost=0.0)


def test_low_acceptance_does_not_pay():
    p = SpecPolicy(token_cost=0.06)
    assert not p.pays(1, [0.05], [4], draft_cost=0.0)


def test_a_draft_nearly_as_big_as_the_target_never_pays_but_a_small_one_can():
    p = SpecPolicy(token_cost=0.06)
    assert not p.pays(1, [0.8], [4], draft_cost=0.93)
    assert p.pays(1, [0.8], [4], draft_cost=0.05)


def test_always_and_nothing_to_verify():
    assert SpecPolicy(always=True).pays(64, [0.0], [8], draft_cost=1.0)
    assert not SpecPolicy().pays(4, [], [], draft_cost=0.0)
