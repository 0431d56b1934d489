"""The acceptance rules, without a model: greedy = longest matching prefix + the target's next token; speculative
sampling emits tokens distributed exactly as the target's p (chi-square tests with a fixed seed)."""

from __future__ import annotations

import pytest
import torch

from inferlab import SamplingParams
from inferlab.engine.sampler import sampling_probs
from inferlab.spec.verify import rejection_sample, verify_proposals

GREEDY = SamplingParams(temperature=0)
# Each chi-square check below fails a correct implementation with probability ALPHA over random seeds (the seed
# is fixed, so the outcome is deterministic); 6 checks in this file: family-wise false-alarm rate <= 0.6%.
ALPHA = 1e-3


def one_hot_logits(rows: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(rows), vocab)
    logits[torch.arange(len(rows)), torch.tensor(rows)] = 5.0
    return logits


def test_greedy_accepts_the_longest_matching_prefix_then_the_targets_token():
    # Sequence 0: 3 proposals, target agrees on the first two.   Sequence 1: no proposals (one row).
    # Sequence 2: 2 proposals, all accepted -> the bonus token.   Sequence 3: first proposal wrong.
    # Sequence 4: a prefill chunk whose earlier rows are not scored: only its last k + 1 rows count.
    logits = one_hot_logits([4, 5, 9, 1] + [7] + [2, 3, 8] + [6, 0] + [9, 1, 2])
    rows = [4, 1, 3, 2, 3]
    proposals = [[4, 5, 6], [], [2, 3], [5], [1]]
    out = verify_proposals(logits, rows, proposals, [None] * 5, [GREEDY] * 5, [None] * 5)
    assert out == [(2, [4, 5, 9]), (0, [7]), (2, [2, 3, 8]), (0, [6]), (1, [1, 2])]


def test_greedy_match_after_a_mismatch_is_not_accepted():
    logits = one_hot_logits([1, 9, 3, 4])
    assert verify_proposals(logits, [4], [[1, 2, 3]], [None], [GREEDY], [None]) == [(1, [1, 9])]


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against expected probabilities; cells with tiny expectation pooled."""
    n = counts.sum()
    expected = probs.double() * n
    keep = expected >= 5
    obs = torch.cat([counts[keep].double(), counts[~keep].double().sum().view(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    if exp[-1] < 5:  # pooled cell still too small: fold it into the largest
        obs, exp = obs[:-1], exp[:-1]
        obs[exp.argmax()] += counts[~keep].sum()
        exp[exp.argmax()] += expected[~keep].sum()
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(exp) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()


V, K, N = 8, 3, 40_000


def synthetic(seed: int, one_hot: bool):
    """Context-independent target p_j and draft q_j per position, N independent sequences drafting K tokens."""
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(K + 1, V, generator=g) * 1.5).softmax(-1)
    if one_hot:  # n-gram lookup: a deterministic proposal, q one-hot on it
        drafts = torch.randint(0, V, (N, K), generator=g)
        q = torch.nn.functional.one_hot(drafts, V).float()
    else:
        qj = (torch.randn(K, V, generator=g) * 1.5).softmax(-1)
        drafts = torch.stack([torch.multinomial(qj[j], N, replacement=True, generator=g) for j in range(K)], 1)
        q = qj.unsqueeze(0).expand(N, K, V)
    u = torch.rand(N, K, generator=g)
    noise = torch.empty(N, V).exponential_(generator=g)
    return p, drafts, q, u, noise


def emitted(p, drafts, q, u, noise):
    num_acc, nxt = rejection_sample(p.unsqueeze(0).expand(N, K + 1, V), drafts, q, torch.full((N,), K), u, noise)
    # The token emitted at output position j: the accepted proposal, or the resampled/bonus token at j = num_acc.
    tok = torch.where(torch.arange(K + 1) < num_acc.unsqueeze(1), torch.cat([drafts, drafts[:, :1]], 1),
                      nxt.unsqueeze(1))
    return num_acc, tok


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-q", "ngram-one-hot"])
def test_speculative_sampling_preserves_the_target_distribution(one_hot):
    p, drafts, q, u, noise = synthetic(1234, one_hot)
    num_acc, tok = emitted(p, drafts, q, u, noise)
    # Position 0 is always emitted; position 1 when the first proposal was accepted (an event independent of
    # everything drawn for position 1, so the token there must still follow p_1).
    assert chi_square_pvalue(torch.bincount(tok[:, 0], minlength=V), p[0]) > ALPHA
    second = tok[num_acc >= 1, 1]
    assert len(second) > 2000
    assert chi_square_pvalue(torch.bincount(second, minlength=V), p[1]) > ALPHA
    assert 0 < (num_acc == K).sum() < N  # the bonus path and the rejection path both ran


def test_the_chi_square_test_catches_a_wrong_rule():
    """Power check: the same test must reject rules that are subtly wrong."""
    p, drafts, q, u, noise = synthetic(1234, one_hot=False)
    # Wrong 1: accept every proposal the target gives any mass (u = 0) -> the draft's q leaks into the output.
    _, tok = emitted(p, drafts, q, torch.zeros_like(u), noise)
    assert chi_square_pvalue(torch.bincount(tok[:, 0], minlength=V), p[0]) < 1e-9
    # Wrong 2: on rejection sample from p instead of the residual max(0, p - q).
    num_acc, nxt = rejection_sample(p.unsqueeze(0).expand(N, K + 1, V), drafts, q, torch.full((N,), K), u, noise)
    resampled_from_p = (p[0].expand(N, V) / noise).argmax(1)
    tok0 = torch.where(num_acc >= 1, drafts[:, 0], resampled_from_p)
    assert chi_square_pvalue(torch.bincount(tok0, minlength=V), p[0]) < 1e-9


def test_engine_verification_samples_from_the_target_with_temperature_and_top_k():
    """Through verify_proposals, the engine's entry point: rows laid out per sequence, the target's sampling
    distribution after temperature and top-k, a draft q for half the sequences and one-hot (n-gram) for the rest."""
    torch.manual_seed(99)
    n, vocab, k = 8000, 12, 2
    params = SamplingParams(temperature=0.7, top_k=6)
    target_logits = torch.randn(k + 1, vocab) * 2
    p = sampling_probs(target_logits, [params] * (k + 1))
    q_draft = (torch.randn(k, vocab) * 2).softmax(-1)
    proposals, qs = [], []
    for i in range(n):
        if i % 2:
            proposals.append(torch.multinomial(q_draft, 1).squeeze(1).tolist())
            qs.append(q_draft)
        else:
            proposals.append([i % vocab, (i // 2) % vocab])  # arbitrary fixed proposals, some outside top-k
            qs.append(None)
    logits = target_logits.repeat(n, 1)
    out = verify_proposals(logits, [k + 1] * n, proposals, qs, [params] * n, [None] * n)
    first = torch.tensor([toks[0] for _, toks in out])
    assert chi_square_pvalue(torch.bincount(first, minlength=vocab), p[0]) > ALPHA
    assert (p[0][first] > 0).all()  # never a token outside the target's top-k
    assert all(len(toks) == a + 1 and toks[:a] == prop[:a] for (a, toks), prop in zip(out, proposals))


def test_seeded_rows_draw_from_their_own_generator():
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=1.0, seed=7)
    results = []
    for neighbours in (0, 3):  # the same seeded request, alone and next to others with more proposals
        gens = [torch.Generator().manual_seed(7)] + [None] * neighbours
        rows = [3] + [4] * neighbours
        all_logits = torch.cat([logits] + [torch.randn(4, 50) for _ in range(neighbours)])
        props = [[1, 2]] + [[3, 4, 5]] * neighbours
        results.append(verify_proposals(all_logits, rows, props, [None] * (1 + neighbours),
                                        [params] * (1 + neighbours), gens)[0])
    assert results[0] == results[1]
