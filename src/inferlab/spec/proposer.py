"""What every proposer shares: who speculates this step (the off switch), verification, and the counters.

The engine calls `verify` right after a forward pass that scored proposals, and `propose` at the end of the step;
the scheduler sets the proposals on the sequences and accounts for what was accepted. A proposer gets what it may
read of the engine as arguments (`StepContext`) and owns only its own state: per-sequence acceptance, the drafts'
distributions, and the speculation counters. A subclass only drafts tokens (`draft`), optionally with their
distributions (`draft_probs`, for sampling).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from inferlab.common.errors import ModelLoadError
from inferlab.engine.sequence import Sequence
from inferlab.spec.verify import verify_proposals


class SpeculativeConfigError(ModelLoadError):
    """The speculative-decoding options cannot work together. A ModelLoadError, so that it stops the engine at
    startup the way a model that cannot load does (and `inferlab serve` reports it the same way)."""


@dataclass(slots=True)
class SpecPolicy:
    """When speculation does not pay, skip it: a cost model in units of a one-token decode step.

    A step costs 1 + token_cost * (tokens in it) + context_cost * (context tokens its decoding sequences attend
    to): decode reads all weights once however many tokens it carries, then pays per token, and attention reads
    every sequence's whole KV whatever its query length. Each batched draft pass costs draft_cost of a target pass
    (its share of the weight bytes). A step of B decoding sequences with C context tokens and P prefill tokens,
    some sequences verifying k_i proposals of which they have lately had g_i accepted per verification, yields
    B + sum(min(g_i, k_i)) tokens. Speculate when that per unit of cost beats B tokens at the plain step's cost:
    proposals riding along a prefill chunk or long contexts are nearly free.
    Checked per sequence first (a sequence whose own record cannot pay sits out `cooldown_steps`, then tries again
    from `initial_accepted`), then for the whole step (larger batches make every extra token dearer).
    The running mean of accepted tokens per verification, not a per-token rate, is what predicts the gain:
    acceptance comes in runs (a copied span is accepted whole, new text not at all).
    """

    # `benchmarks/speculative.py --only steptime` on a 2-core EPYC (bfloat16, one thread): a decode step costs
    # about 42 ms + 2.5 ms per token + 0.064 ms per context token (attention dominates from a few hundred tokens
    # of context at 16 sequences). A GPU at small batch has a far smaller token_cost: speculation pays longer.
    token_cost: float = 0.06
    context_cost: float = 0.0015
    initial_accepted: float = 1.0
    cooldown_steps: int = 16
    ema_weight: float = 0.3  # weight of the latest verification in the running mean
    always: bool = False  # speculate every step whatever it costs (tests, and the benchmark's "always" rows)

    def pays(self, num_decoding: int, accepted: list[float], ks: list[int], draft_cost: float,
             prefill_tokens: int = 0, context_tokens: int = 0) -> bool:
        if self.always:
            return True
        if not ks:
            return False
        c = self.token_cost
        plain_cost = 1 + c * (num_decoding + prefill_tokens) + self.context_cost * context_tokens
        tokens = num_decoding + sum(min(g, k) for g, k in zip(accepted, ks))
        draft_pass = 1 + c * len(ks) + self.context_cost * context_tokens  # the draft model's pass, unscaled
        cost = plain_cost + c * sum(ks) + draft_cost * max(ks) * draft_pass
        return tokens / cost > num_decoding / plain_cost


@dataclass(slots=True)
class SeqSpecState:
    accepted: float  # running mean of proposals accepted per verification
    cooldown: int = 0
    num_preemptions: int = 0
    draft_computed: int = 0  # draft proposers with their own KV: leading tokens whose draft K/V are valid


@dataclass(slots=True)
class SpecCounters:
    """Monotonic speculation counters, exported as vLLM's spec_decode metrics."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepContext:
    """What a proposer may read of the engine at the end of a step, and the one thing it may ask of it: blocks for
    the positions a draft model writes ahead of verification."""

    waiting_tokens: int  # prompt tokens of requests not yet admitted
    max_num_batched_tokens: int
    max_model_len: int
    generators: Mapping[str, torch.Generator]  # seeded requests' own random streams
    block_table: Callable[[str], list[int]]
    allocate: Callable[[Sequence, int], bool]  # grow a sequence's blocks to hold n tokens; False if none are free


class Proposer:
    def __init__(self, num_speculative_tokens: int, policy: SpecPolicy | None = None):
        self.k = num_speculative_tokens
        self.policy = policy or SpecPolicy()
        self.states: dict[str, SeqSpecState] = {}
        self.draft_probs: dict[str, torch.Tensor] = {}  # request id -> [k, V] q of its pending proposals
        self.counters = SpecCounters()
        # The off switch, counted: steps where speculating would not pay, sequence-steps sat out for low acceptance.
        self.num_steps_skipped = 0
        self.num_seq_steps_cooling = 0

    @property
    def draft_cost(self) -> float:
        """One draft pass over a batch, as a fraction of a target pass over it (0: drafting needs no model)."""
        return 0.0

    def draft(self, seqs: list[Sequence], ks: list[int], ctx: StepContext) -> list[list[int]]:
        """Up to ks[i] proposed tokens for each sequence (may set self.draft_probs for sampled requests)."""
        raise NotImplementedError

    # -- called by the engine ---------------------------------------------------------------------------------
    def propose(self, running: list[Sequence], ctx: StepContext) -> dict[Sequence, list[int]]:
        """Proposals for the running sequences that should speculate in the next step."""
        old, policy = self.states, self.policy
        self.states = {s.request_id: old.get(s.request_id) or SeqSpecState(policy.initial_accepted)
                       for s in running}
        self.draft_probs = {}
        # Only sequences that are decoding (all but the last token computed) speculate; the others still prefill,
        # and with the waiting ones they will likely fill the rest of the next step's token budget.
        decoding, prefill = [], ctx.waiting_tokens
        for s in running:
            if s.num_computed_tokens == s.num_tokens - 1:
                decoding.append(s)
            else:
                prefill += s.num_tokens - s.num_computed_tokens
        prefill = min(prefill, max(0, ctx.max_num_batched_tokens - len(decoding)))
        seqs, ks = [], []
        for s in decoding:
            st = self.states[s.request_id]
            if st.cooldown:
                st.cooldown -= 1
                self.num_seq_steps_cooling += 1
                if not st.cooldown:
                    st.accepted = policy.initial_accepted
                continue
            # All k accepted yields k + 1 tokens: never propose past max_tokens or the context length.
            k = min(self.k, s.params.max_tokens - s.num_output_tokens - 1, ctx.max_model_len - s.num_tokens - 1)
            if k <= 0:
                continue
            if not policy.pays(1, [st.accepted], [k], self.draft_cost, context_tokens=s.num_tokens):
                st.cooldown = policy.cooldown_steps
                continue
            seqs.append(s)
            ks.append(k)
        if self.draft_cost == 0 and seqs:  # free to draft: decide on what was actually proposed
            proposals = self.draft(seqs, ks, ctx)
            ks = [len(p) for p in proposals]
        if not any(ks):
            return {}
        if not policy.pays(len(decoding), [self.states[s.request_id].accepted for s in seqs], ks, self.draft_cost,
                           prefill, sum(s.num_tokens for s in decoding)):
            self.num_steps_skipped += 1
            return {}
        if self.draft_cost > 0:
            proposals = self.draft(seqs, ks, ctx)
        return {s: p for s, p in zip(seqs, proposals) if p}

    def verify(self, logits: torch.Tensor, logits_per_seq: list[int], seqs: list[Sequence],
               generators: Mapping[str, torch.Generator]) -> list[list[int]]:
        """Tokens to append for each sequence that sampled: accepted proposals + the target's next token."""
        proposals = [s.spec_token_ids for s in seqs]
        results = verify_proposals(
            logits, logits_per_seq, proposals,
            [self.draft_probs.get(s.request_id) if s.spec_token_ids else None for s in seqs],
            [s.params for s in seqs], [generators.get(s.request_id) for s in seqs])
        self.draft_probs = {}
        c = self.counters
        for s, proposal, (a, _) in zip(seqs, proposals, results):
            k = len(proposal)
            if not k:
                continue
            c.num_drafts += 1
            c.num_draft_tokens += k
            c.num_accepted_tokens += a
            if len(c.accepted_per_pos) < k:
                c.accepted_per_pos.extend([0] * (k - len(c.accepted_per_pos)))
            for j in range(a):
                c.accepted_per_pos[j] += 1
            st = self.states.get(s.request_id)
            if st is not None:
                w = self.policy.ema_weight
                st.accepted = (1 - w) * st.accepted + w * a
        return [tokens for _, tokens in results]
