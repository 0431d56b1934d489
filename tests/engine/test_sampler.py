"""The sampler's draws against the distribution they should follow: softmax(logits / T) cut to top-k / top-p, as
computed independently here in float64."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferlab.engine.sampler import Sampler, sample_from
from inferlab.engine.sampling_params import SamplingParams

N = 40_000


def _frequencies(tokens: torch.Tensor, V: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).double() / tokens.numel()


def _assert_follows(freq: torch.Tensor, p: torch.Tensor, n: int = N) -> None:
    """Every token within 5 standard errors of its probability over n draws (a false alarm about once in 10^5
    runs)."""
    se = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 5 * se + 1e-12).all(), (freq, p)


def test_draws_follow_the_tempered_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    for temperature in (1.0, 0.7, 1.5):
        params = [SamplingParams(temperature=temperature)] * N
        tokens = Sampler()(logits.expand(N, -1).clone(), params, [None] * N)
        _assert_follows(_frequencies(tokens, 6), (logits.double() / temperature).softmax(-1))


def test_top_k_and_top_p_cut_the_tail_and_renormalise():
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])
    p = logits.double().softmax(-1)  # 0.43, 0.26, 0.16, 0.06, 0.02, 0.01 (rounded)
    tokens = Sampler()(logits.expand(N, -1).clone(), [SamplingParams(top_k=2)] * N, [None] * N)
    _assert_follows(_frequencies(tokens, 6), torch.cat([p[:2] / p[:2].sum(), torch.zeros(4, dtype=p.dtype)]))
    # top_p = 0.8: keep tokens while the mass before them is below 0.8, i.e. the first three (0.43 + 0.26 < 0.8).
    tokens = Sampler()(logits.expand(N, -1).clone(), [SamplingParams(top_p=0.8)] * N, [None] * N)
    _assert_follows(_frequencies(tokens, 6), torch.cat([p[:3] / p[:3].sum(), torch.zeros(3, dtype=p.dtype)]))


def test_a_top_p_below_float32s_smallest_keeps_the_most_likely_token():
    """top_p = 1e-76 is valid (in (0, 1]) but 0 in a float32 tensor; it once masked every token, and the request
    failed in the sampler (found by the server's schema fuzzer)."""
    logits = torch.tensor([0.5, 3.0, 2.0, -1.0])
    tokens = Sampler()(logits.expand(64, -1).clone(), [SamplingParams(top_p=1e-76)] * 64, [None] * 64)
    assert tokens.tolist() == [1] * 64


def test_zero_probability_tokens_are_never_drawn():
    probs = torch.tensor([[0.0, 0.0, 0.3, 0.0, 0.7, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 2.0], [5.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    tokens = sample_from(probs.repeat(N // 3, 1), [None] * (N // 3 * 3)).view(-1, 3)
    assert set(tokens[:, 0].tolist()) == {2, 4} and set(tokens[:, 1].tolist()) == {5} and set(tokens[:, 2].tolist()) == {0}


def test_seeded_rows_draw_the_same_whatever_shares_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(8, 1000)
    params = [SamplingParams(temperature=1.0, seed=7)] + [SamplingParams(temperature=1.0)] * 7

    def gens(n):
        return [torch.Generator().manual_seed(7)] + [None] * (n - 1)

    alone = Sampler()(logits[:1], params[:1], gens(1))
    together = Sampler()(logits, params, gens(8))
    assert alone[0] == together[0]


def test_the_cpu_kernel_inverts_the_same_cdf_at_the_same_u():
    """kernels/sampling.cpp against the torch path (sampling_probs, then sample_from) given the same u, on
    SmolLM2's vocabulary size, over temperatures, greedy rows and grammar-style masks: each draw is the token whose
    interval of the torch path's CDF holds (1 - u) * total, up to the two paths' fp32 rounding of the cumulative
    mass (so a draw may be a neighbour when the target falls within ~1e-6 of an edge); masked tokens are never
    drawn; a row with no finite logit gives -1 and one with a NaN or +inf logit -2 (the Sampler's torch path)."""
    from inferlab.engine.sampler import UNSETTLED, sampling_probs
    from inferlab.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("inferlab's CPU kernels are not built here")
    g = torch.Generator().manual_seed(0)
    n, V = 300, 49_152
    logits = torch.randn(n, V, generator=g) * 4
    logits[::3, ::2] = float("-inf")
    temps = torch.tensor([0.0, 0.3, 0.7, 1.0, 1.5, 3.0])[torch.arange(n) % 6]
    u = torch.rand(n, generator=g)
    drawn = kernels.sample_rows(logits, temps, u)

    greedy = temps == 0
    assert torch.equal(drawn[greedy], logits[greedy].argmax(-1))
    params = [SamplingParams(temperature=t) for t in temps[~greedy].tolist()]
    probs = sampling_probs(logits[~greedy], params).double()
    cdf = probs.cumsum(-1)
    target = (1 - u[~greedy].double()) * cdf[:, -1]
    tok = drawn[~greedy]
    before = torch.where(tok > 0, cdf.gather(1, (tok - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    upto = cdf.gather(1, tok.unsqueeze(1)).squeeze(1)
    assert ((before <= target + 1e-6) & (target <= upto + 1e-6)).all()
    assert (probs.gather(1, tok.unsqueeze(1)) > 0).all()
    assert torch.isfinite(logits[~greedy].gather(1, tok.unsqueeze(1))).all()
    torch_draws = sample_from(sampling_probs(logits[~greedy], params), [None] * len(params), u[~greedy].clone())
    assert (torch_draws == tok).float().mean() > 0.98

    odd = torch.zeros(3, 8)
    odd[0] = float("-inf")
    odd[1, 3] = float("nan")
    odd[2, 5] = float("inf")
    assert kernels.sample_rows(odd, torch.ones(3), torch.full((3,), 0.5)).tolist() == [-1, UNSETTLED, UNSETTLED]


def test_greedy_and_sampled_rows_mix():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 0.0, 0.0]]).repeat(N // 2, 1)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * (N // 2)
    tokens = Sampler()(logits, params, [None] * N).view(-1, 2)
    assert (tokens[:, 0] == 1).all()
    _assert_follows(_frequencies(tokens[:, 1], 3), torch.full((3,), 1 / 3, dtype=torch.double), N // 2)


def test_temperatures_below_the_epsilon_are_greedy():
    from inferlab.engine.sampling_params import SAMPLING_EPS

    logits = torch.tensor([[0.1, 0.3, 0.2], [5.0, -1.0, 4.999]])
    for t in (0.0, 1e-300, 5e-324, SAMPLING_EPS / 2):
        params = [SamplingParams(temperature=t)] * 2
        assert params[0].greedy
        assert Sampler()(logits.clone(), params, [None, None]).tolist() == [1, 0]
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy


_INF = float("inf")
_LOGIT = st.one_of(st.floats(-1e4, 1e4), st.sampled_from([-_INF, _INF, 3.4e38, -3.4e38, 1e30, -1e30, 0.0]))


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(rows=st.lists(st.tuples(st.lists(_LOGIT, min_size=8, max_size=8),
                               st.one_of(st.just(0.0), st.floats(1e-300, 2.0)),
                               st.one_of(st.just(1.0), st.floats(1e-6, 1.0, exclude_min=False)),
                               st.one_of(st.just(0), st.integers(1, 8), st.integers(9, 2**63 - 1))),
                     min_size=1, max_size=4),
       nan_rows=st.lists(st.booleans(), min_size=4, max_size=4))
def test_no_parameters_and_no_logits_give_nan_probabilities(rows, nan_rows):
    """Over temperature, top_p and top_k extremes and logits holding +-inf, NaN and values that overflow when
    tempered: every row's probabilities are finite, non-negative, and either sum to 1 or (no finite logit) are all
    zero, in which case the sampler answers -1 for that row; a drawn token always has positive probability."""
    from inferlab.engine.sampler import sampling_probs

    logits = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    for i, nan in enumerate(nan_rows[:len(rows)]):
        if nan:
            logits[i, i % 8] = float("nan")
    params = [SamplingParams(temperature=t, top_p=p, top_k=k) for _, t, p, k in rows]
    probs = sampling_probs(logits.clone(), params)
    assert torch.isfinite(probs).all() and (probs >= 0).all(), (logits, probs)
    sums = probs.double().sum(-1)
    for i, s in enumerate(sums.tolist()):
        assert abs(s - 1) < 1e-4 or s == 0, (logits[i], params[i], probs[i])
    drawn = Sampler()(logits.clone(), params, [None] * len(rows)).tolist()
    for i, (tok, p) in enumerate(zip(drawn, params)):
        if p.greedy:
            assert 0 <= tok < 8
        elif sums[i] == 0:
            assert tok == -1
        else:
            assert probs[i, tok] > 0, (logits[i], p, probs[i], tok)
