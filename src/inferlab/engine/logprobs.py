"""Log-probabilities of sampled and prompt tokens, for requests that ask (OpenAI's `logprobs`, `echo`).

They are of the model's raw distribution, log_softmax(logits), before temperature, top-k and top-p: what vLLM returns
by default (its `logprobs_mode=raw_logprobs`). The processed distribution would make a greedy request's logprobs
undefined (temperature 0), put -inf on every token a top-k/top-p cut removed, and differ from what evaluation
harnesses compare against (a transformers forward pass, lm-evaluation-harness's `hf` model). Requests that ask none
cost nothing: only their rows are gathered and normalised, in one batched log_softmax and one top-k per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # outputs.py and sampling_params.py, which the server imports, need only the dataclass
    import torch

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit, vLLM's default max_logprobs


class Decoder(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(slots=True)
class TokenLogprob:
    """One position: the token there, its log-probability, and the `top` most likely tokens (id, text, log-prob).
    The first prompt token has no log-probability (None): nothing predicts it."""

    token_id: int
    token: str
    logprob: float | None
    top: list[tuple[int, str, float]] = field(default_factory=list)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int],
                   tokenizer: Decoder) -> list[TokenLogprob]:
    """logits [R, V] (float32, raw), the token at each row and how many alternatives each row wants -> one entry a
    row. One log_softmax, one gather and one top-k for all rows; tolist() once."""
    import torch

    logp = logits.float().log_softmax(dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    chosen = logp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    k = max(num_top, default=0)
    top_v, top_i = (logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long()))
    top_v, top_i = top_v.tolist(), top_i.tolist()
    out = []
    for r, (tok, lp, n) in enumerate(zip(token_ids, chosen, num_top)):
        top = [(t, tokenizer.decode([t]), v) for t, v in zip(top_i[r][:n], top_v[r][:n])]
        out.append(TokenLogprob(tok, tokenizer.decode([tok]), lp, top))
    return out
