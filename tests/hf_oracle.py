"""The transformers oracle's greedy continuation and token log-likelihoods, shared by the model tests (tests/ is on
sys.path: conftest.py)."""

from __future__ import annotations

import torch


def hf_generate(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation by transformers' model with its own KV cache, never stopping at EOS (the engine's
    ignore_eos; `generate` would stop there whatever its config says)."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(n - 1):
            out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def hf_token_logprobs(model, ids: list[int]) -> torch.Tensor:
    """The log-probability transformers' model gives each of ids[1:] after the ids before it (one forward pass):
    what the engine's `score(ids)` returns."""
    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    return lp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
