"""Prompt-lookup proposals (Saxena 2023; vLLM's `ngram`): find the sequence's latest n-gram earlier in its own
prompt and output, and propose the tokens that followed it. No model: it pays when the output copies from the
input (rewriting, summarising, editing code) and proposes nothing when there is no match."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from inferlab.engine.sequence import Sequence
from inferlab.spec.proposer import Proposer, SpecPolicy, StepContext


def find_ngram_proposal(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest suffix n-gram, n from n_max down to n_min.

    Among the occurrences, the most recent one with k tokens after it wins (recent context predicts best); when
    none has k, the earliest (the longest continuation)."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        # Windows start at 0..L-1-n and end before the last token, so each has a continuation and none is the suffix.
        windows = sliding_window_view(tokens[: L - 1], n)
        hits = np.flatnonzero((windows == tokens[L - n:]).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= L]
            i = int(full[-1] if full.size else hits[0])
            return tokens[i + n: i + n + k].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, ngram_min: int, ngram_max: int, policy: SpecPolicy | None = None):
        super().__init__(num_speculative_tokens, policy)
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def draft(self, seqs: list[Sequence], ks: list[int], ctx: StepContext) -> list[list[int]]:
        return [find_ngram_proposal(np.asarray(s.token_ids), self.ngram_min, self.ngram_max, k)
                for s, k in zip(seqs, ks)]
