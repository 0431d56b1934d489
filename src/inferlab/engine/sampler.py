"""Batched sampling: temperature, top-k and top-p for the whole batch in a few tensor ops.

A row is drawn by inverting its CDF with one uniform number, which a seeded request takes from its own generator,
so it gets the same tokens whatever else shares the batch. The exponential race (argmax of p / E, E ~ Exp(1)) that
this replaced needs a random number per vocabulary entry: torch's exponential_ took 15 ms for 16 rows of SmolLM2's
49,152 logits, half as long as the model's step, and 60 ms for 64; the CDF costs a cumsum (0.4 / 1.5 ms). The
cumsum accumulates in double and rounds each entry to fp32 once, so a token's drawn mass is its probability within
~6e-8 (tokens below that are drawn at most that often). Speculative verification still uses the race
(spec/verify.py), where the residual draws are few.

On the CPU, a batch with temperature alone (no top-k or top-p; greedy rows beside) is drawn by one kernel call
(kernels/sampling.cpp): the same inversion at the same u, each row read twice and no [N, V] tensor written; the
torch path below took 1.3 ms of a 16-sequence step and 3.4 ms of a 64-sequence one. A row the kernel leaves
unsettled (a NaN or +inf logit) sends the batch down the torch path with the same u.

No parameter makes a probability NaN: temperatures below SAMPLING_EPS are greedy (sampling_params.py), and a row
whose softmax is NaN anyway (logits that overflow when tempered, +inf, NaN, or no finite logit at all) is detected
from its first column alone (softmax's NaN is all-or-nothing per row: it divides by the row's sum) and recomputed
from sanitised logits, so the common path pays for no extra pass over the vocabulary. A row left with no token to
draw gets all-zero probabilities, and the sampler answers -1 for it: the engine fails that request alone.
"""

from __future__ import annotations

import torch

from inferlab.engine.sampling_params import SamplingParams
from inferlab.kernels import kernels_for

UNSETTLED = -2  # kernels/sampling.cpp's answer for a row with a NaN or +inf logit


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (-inf) everything outside each row's top-k and top-p nucleus. top_k: [N] long (0 = off), top_p: [N]."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, logits.shape[-1]).unsqueeze(1)
        drop |= torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0) >= k
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Keep a token if the mass before it is below p. The first token always: a valid p under float32's
        # smallest (1e-76 from a fuzzer) is 0 in the tensor, and 0 >= 0 dropped every token (a 500, not a token).
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
        drop[:, 0] = False
    mask = torch.empty_like(drop).scatter_(1, sorted_idx, drop)
    return logits.masked_fill(mask, float("-inf"))


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's sampling distribution after temperature, top-k and top-p (greedy rows: temperature 1)."""
    probs = _tempered_softmax(logits, params, sanitise=False)
    bad = probs[:, 0].isnan()
    if bool(bad.any()):  # rare: see the module docstring
        rows = bad.nonzero().squeeze(1)
        probs[rows] = _tempered_softmax(logits[rows], [params[i] for i in rows.tolist()], sanitise=True)
    return probs


def _tempered_softmax(logits: torch.Tensor, params: list[SamplingParams], sanitise: bool) -> torch.Tensor:
    dev, V = logits.device, logits.shape[-1]
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=dev)
    logits = logits / temps.unsqueeze(1)
    if sanitise:  # NaN is never drawn; +-inf become the largest finite values so that softmax stays defined
        big = torch.finfo(logits.dtype).max
        logits = logits.nan_to_num_(nan=float("-inf"), posinf=big, neginf=float("-inf"))
    if any(p.top_k > 0 for p in params) or any(p.top_p < 1.0 for p in params):
        top_k = torch.tensor([min(p.top_k, V) for p in params], device=dev) if any(p.top_k > 0 for p in params) \
            else None
        top_p = torch.tensor([p.top_p for p in params], device=dev) if any(p.top_p < 1 for p in params) else None
        logits = apply_top_k_top_p(logits, top_k, top_p)
    probs = logits.softmax(dim=-1)
    return probs.nan_to_num_(nan=0.0) if sanitise else probs  # a row with no finite logit: nothing to draw


def exponential_noise(shape: tuple[int, int], generators: list[torch.Generator | None], device) -> torch.Tensor:
    q = torch.empty(shape, device=device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            q[i].exponential_(generator=g)
    return q


def uniforms(n: int, generators: list[torch.Generator | None], device) -> torch.Tensor:
    """One uniform number in [0, 1) a row; a seeded row's from its own generator."""
    u = torch.rand(n, device=device)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, generator=g, device=device)
    return u


def sample_from(probs: torch.Tensor, generators: list[torch.Generator | None],
                u: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row of probs [N, V] (non-negative; rows need not sum to 1; zero entries are never drawn):
    the first token whose cumulative mass reaches (1 - u) * total, u uniform in [0, 1) (drawn here unless given);
    -1 for a row with no mass."""
    cdf = probs.cumsum(dim=-1)
    if u is None:
        u = uniforms(probs.shape[0], generators, probs.device)
    target = (1 - u).mul_(cdf[:, -1])  # in (0, total]: never lands on a leading run of zero-probability tokens
    drawn = torch.searchsorted(cdf, target.unsqueeze(1)).squeeze(1).clamp_(max=probs.shape[-1] - 1)
    return drawn.masked_fill_(~(cdf[:, -1] > 0), -1)


class Sampler:
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
        """logits: [N, V] float32 -> sampled token ids [N]; -1 for a sampled row with no token to draw."""
        greedy = [p.greedy for p in params]
        if all(greedy):
            return logits.argmax(dim=-1)
        # A seeded request's u is drawn after whatever its parameters can make raise (LLMEngine._sample retries a
        # failed batch request by request, and the others must draw what they would have drawn).
        kernels = None if any(p.top_k > 0 or p.top_p < 1.0 for p in params) else kernels_for(logits)
        if kernels is not None:
            temps = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
            u = uniforms(logits.shape[0], generators, logits.device)
            drawn = kernels.sample_rows(logits, temps, u)
            if not bool((drawn == UNSETTLED).any()):
                return drawn
            probs = sampling_probs(logits, params)  # raises nothing `temps` did not: no top-k/p; logits sanitised
        else:
            probs = sampling_probs(logits, params)
            u = uniforms(logits.shape[0], generators, logits.device)
        sampled = sample_from(probs, generators, u)
        if not any(greedy):
            return sampled
        is_greedy = torch.tensor(greedy, device=logits.device)
        return torch.where(is_greedy, logits.argmax(dim=-1), sampled)
