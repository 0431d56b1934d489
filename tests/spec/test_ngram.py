"""Prompt lookup without a model: which n-gram matches and what it proposes."""

from __future__ import annotations

import numpy as np

from inferlab.spec.ngram import find_ngram_proposal


def propose(tokens, n_min=1, n_max=4, k=4):
    return find_ngram_proposal(np.asarray(tokens), n_min, n_max, k)


def test_copies_what_followed_the_suffix_earlier():
    #        0  1  2  3  4  5  6  7  8
    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6]
    assert propose(tokens) == [7, 8, 9, 1]
    assert propose(tokens, k=2) == [7, 8]


def test_the_longest_n_gram_wins():
    # The 1-gram "3" last appeared before 9; the 2-gram "2 3" appeared before 4.
    tokens = [2, 3, 4, 4, 3, 9, 2, 3]
    assert propose(tokens, k=1) == [4]
    assert propose(tokens, n_max=1, k=1) == [9]


def test_most_recent_full_match_else_earliest():
    tokens = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2]
    assert propose(tokens, k=2) == [20, 21]  # both earlier matches have 2 tokens after them: the recent one
    tokens = [1, 2, 3, 4, 5, 1, 2, 9, 1, 2]
    assert propose(tokens, n_max=2, k=8) == [3, 4, 5, 1, 2, 9, 1, 2]  # none has 8 after it: the earliest has most


def test_no_match_or_too_short_proposes_nothing():
    assert propose([1, 2, 3, 4]) == []
    assert propose([7]) == []
    assert propose([3, 3], n_min=2) == []
    assert propose([3, 3]) == [3]


def test_the_suffix_itself_is_not_a_match():
    assert propose([9, 1, 2, 3], n_min=3, n_max=3) == []
