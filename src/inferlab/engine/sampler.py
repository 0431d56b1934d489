"""Batched sampling: temperature, top-k and top-p for the whole batch in a few tensor ops.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1) is a draw from p), so a seeded request draws
its noise from its own generator and gets the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import torch

from inferlab.engine.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (-inf) everything outside each row's top-k and top-p nucleus. top_k: [N] long (0 = off), top_p: [N]."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, logits.shape[-1]).unsqueeze(1)
        drop |= torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0) >= k
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Keep a token if the mass before it is below p (so the first token is always kept).
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    mask = torch.empty_like(drop).scatter_(1, sorted_idx, drop)
    return logits.masked_fill(mask, float("-inf"))


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's sampling distribution after temperature, top-k and top-p (greedy rows: temperature 1)."""
    dev = logits.device
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=dev)
    logits = logits / temps.unsqueeze(1)
    if any(p.top_k > 0 for p in params) or any(p.top_p < 1.0 for p in params):
        top_k = torch.tensor([p.top_k for p in params], device=dev) if any(p.top_k > 0 for p in params) else None
        top_p = torch.tensor([p.top_p for p in params], device=dev) if any(p.top_p < 1 for p in params) else None
        logits = apply_top_k_top_p(logits, top_k, top_p)
    return logits.softmax(dim=-1)


def exponential_noise(shape: tuple[int, int], generators: list[torch.Generator | None], device) -> torch.Tensor:
    q = torch.empty(shape, device=device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            q[i].exponential_(generator=g)
    return q


class Sampler:
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
        """logits: [N, V] float32 -> sampled token ids [N]."""
        greedy = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy
        probs = sampling_probs(logits, params)
        q = exponential_noise(tuple(probs.shape), generators, probs.device)
        sampled = probs.div_(q).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        return torch.where(is_greedy, greedy, sampled)
