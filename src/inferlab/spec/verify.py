"""Verification of speculative proposals: which proposed tokens the target accepts, and the token that follows.

Greedy: accept the longest prefix of proposals equal to the target's argmax, then emit the target's argmax at the
first mismatch (or after the last proposal). The output is the target's greedy output, token for token.

Sampling (Leviathan et al. 2023, Chen et al. 2023): proposal d_j drawn from the draft's q_j is accepted with
probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the next token is drawn from the residual
normalise(max(0, p_j - q_j)); if all are accepted it is drawn from p_{k+1}. Each emitted token is then distributed
exactly as the target's p. A proposer without a distribution (n-gram lookup) is a draft with a one-hot q: it is
accepted with probability p(d) and the residual is p with d removed.
"""

from __future__ import annotations

import torch

from inferlab.engine.sampler import exponential_noise, sampling_probs
from inferlab.engine.sampling_params import SamplingParams


def rejection_sample(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                     num_draft: torch.Tensor, uniforms: torch.Tensor, noise: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative-sampling rule for a batch of B sequences with up to K proposals each.

    target_probs [B, K+1, V], draft_tokens [B, K] (long), draft_probs [B, K, V], num_draft [B] (valid proposals
    per row; rows beyond are padding), uniforms [B, K] in [0, 1), noise [B, V] ~ Exp(1).
    Returns (num_accepted [B], next_token [B]).
    """
    B, K = draft_tokens.shape
    rows = torch.arange(B, device=draft_tokens.device)
    if K:
        p_d = target_probs[:, :K].gather(2, draft_tokens.unsqueeze(2)).squeeze(2)
        q_d = draft_probs.gather(2, draft_tokens.unsqueeze(2)).squeeze(2)
        valid = torch.arange(K, device=draft_tokens.device).unsqueeze(0) < num_draft.unsqueeze(1)
        # u < p/q, written without the division so that q = 0 (impossible for a drawn token) cannot produce NaN.
        accept = (uniforms * q_d < p_d) & valid
        num_accepted = accept.int().cumprod(dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(B, dtype=torch.long, device=draft_tokens.device)
    p_next = target_probs[rows, num_accepted]
    rejected = num_accepted < num_draft
    if K:
        q_next = draft_probs[rows, num_accepted.clamp(max=K - 1)]
        residual = (p_next - q_next).clamp_(min=0)
        # The residual of a row that was rejected has positive mass unless p == q, where rejection has probability
        # 0 and only rounding in u * q < p could get here: fall back to p then.
        use_residual = rejected & (residual.sum(dim=1) > 0)
        p_next = torch.where(use_residual.unsqueeze(1), residual, p_next)
    # Exponential race: argmax(w / E) is a draw from w / sum(w), no normalisation needed.
    next_token = (p_next / noise).argmax(dim=1)
    return num_accepted.long(), next_token


def _uniforms(ks: list[int], K: int, generators: list[torch.Generator | None], device) -> torch.Tensor:
    u = torch.rand((len(ks), K), device=device)
    for i, (k, g) in enumerate(zip(ks, generators)):
        if g is not None and k:
            # Only k draws: a seeded request's stream must not depend on how many proposals its neighbours got.
            u[i, :k] = torch.rand(k, generator=g, device=device)
    return u


def verify_proposals(logits: torch.Tensor, rows_per_seq: list[int], proposals: list[list[int]],
                     draft_probs: list[torch.Tensor | None], params: list[SamplingParams],
                     generators: list[torch.Generator | None]) -> list[tuple[int, list[int]]]:
    """One engine step's verification. logits [sum(rows_per_seq), V]: sequence i owns rows_per_seq[i] consecutive
    rows, the last len(proposals[i]) + 1 of which score its proposals and the token after them. draft_probs[i] is
    the draft's [k_i, V] distribution (None: a one-hot proposer, or a greedy request). Returns per sequence
    (number of proposals accepted, tokens to append = accepted proposals + the target's next token)."""
    dev = logits.device
    B = len(rows_per_seq)
    ks = [len(p) for p in proposals]
    K = max(ks, default=0)
    ends = torch.tensor(rows_per_seq, device=dev).cumsum(0)
    starts = ends - torch.tensor([k + 1 for k in ks], device=dev)
    # Row of position j (0..K) for each sequence; padding positions repeat the last real row.
    kk = torch.tensor(ks, device=dev)
    row_idx = starts.unsqueeze(1) + torch.minimum(torch.arange(K + 1, device=dev).unsqueeze(0), kk.unsqueeze(1))
    drafts = torch.tensor([p + [0] * (K - len(p)) for p in proposals], dtype=torch.long, device=dev).view(B, K)

    greedy_tok = logits.argmax(dim=-1)[row_idx]  # [B, K+1]
    match = (drafts == greedy_tok[:, :K]) & (torch.arange(K, device=dev).unsqueeze(0) < kk.unsqueeze(1))
    num_acc = match.int().cumprod(dim=1).sum(dim=1) if K else torch.zeros(B, dtype=torch.long, device=dev)
    next_tok = greedy_tok.gather(1, num_acc.long().unsqueeze(1)).squeeze(1)

    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        s_idx = torch.tensor(sampled, device=dev)
        V = logits.shape[-1]
        flat_rows = row_idx[s_idx].reshape(-1)
        row_params = [params[i] for i in sampled for _ in range(K + 1)]
        p = sampling_probs(logits[flat_rows], row_params).view(len(sampled), K + 1, V)
        q = torch.zeros(len(sampled), K, V, device=dev)
        for j, i in enumerate(sampled):
            if draft_probs[i] is not None:
                q[j, : ks[i]] = draft_probs[i]
            elif ks[i]:
                q[j, torch.arange(ks[i], device=dev), drafts[i, : ks[i]]] = 1.0
        gens = [generators[i] for i in sampled]
        u = _uniforms([ks[i] for i in sampled], K, gens, dev)
        noise = exponential_noise((len(sampled), V), gens, dev)
        s_acc, s_next = rejection_sample(p, drafts[s_idx], q, kk[s_idx], u, noise)
        num_acc = num_acc.long().index_copy(0, s_idx, s_acc)
        next_tok = next_tok.index_copy(0, s_idx, s_next)

    acc, nxt = num_acc.tolist(), next_tok.tolist()
    return [(a, proposals[i][:a] + [nxt[i]]) for i, a in enumerate(acc)]
