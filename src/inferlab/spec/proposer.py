"""What every proposer shares: who speculates this step (the off switch), verification, and the counters.

The engine calls `verify` right after a forward pass that scored proposals, and `propose` at the end of the step.
A subclass only drafts tokens (`draft`), optionally with their distributions (`draft_probs`, for sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferlab.engine.sequence import Sequence
from inferlab.spec.verify import verify_proposals


@dataclass(slots=True)
class SpecPolicy:
    """When speculation does not pay, skip it. Verifying k proposals costs the target k extra tokens of compute in
    the step; that is nearly free while decode is memory-bound (small batches) and a loss once the step is
    compute-bound (large batches) or when proposals are rejected. benchmarks/speculative.py measures both."""

    max_batch: int = 8  # no speculation in a step with more decoding sequences than this
    min_acceptance: float = 0.3  # a sequence whose acceptance-rate average falls below this ...
    cooldown_steps: int = 16  # ... sits out this many steps, then tries again from `initial_acceptance`
    initial_acceptance: float = 0.5
    ema_weight: float = 0.3  # weight of the latest verification in the running acceptance rate


@dataclass(slots=True)
class SeqSpecState:
    acceptance: float
    cooldown: int = 0
    num_preemptions: int = 0
    draft_computed: int = 0  # draft proposers with their own KV: leading tokens whose draft K/V are valid


class Proposer:
    def __init__(self, num_speculative_tokens: int, policy: SpecPolicy | None = None):
        self.k = num_speculative_tokens
        self.policy = policy or SpecPolicy()
        self.states: dict[str, SeqSpecState] = {}
        self.draft_probs: dict[str, torch.Tensor] = {}  # request id -> [k, V] q of its pending proposals
        # The off switch, counted: steps skipped for the batch size, sequence-steps skipped for low acceptance.
        self.num_steps_skipped_batch = 0
        self.num_seq_steps_cooling = 0

    def draft(self, engine, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] proposed tokens for each sequence (may set self.draft_probs for sampled requests)."""
        raise NotImplementedError

    # -- called by the engine ---------------------------------------------------------------------------------
    def propose(self, engine, running: list[Sequence]) -> None:
        """Set spec_token_ids on the running sequences that should speculate in the next step."""
        old = self.states
        self.states = {s.request_id: old.get(s.request_id) or SeqSpecState(self.policy.initial_acceptance)
                       for s in running}
        self.draft_probs = {}
        # Only sequences that are decoding (all but the last token computed); a prefill is still catching up.
        decoding = [s for s in running if s.num_computed_tokens == s.num_tokens - 1 and not s.is_finished]
        if not decoding:
            return
        if len(decoding) > self.policy.max_batch:
            self.num_steps_skipped_batch += 1
            return
        seqs, ks = [], []
        for s in decoding:
            st = self.states[s.request_id]
            if st.cooldown:
                st.cooldown -= 1
                self.num_seq_steps_cooling += 1
                if not st.cooldown:
                    st.acceptance = self.policy.initial_acceptance
                continue
            # All k accepted yields k + 1 tokens: never propose past max_tokens or the context length.
            k = min(self.k, s.params.max_tokens - s.num_output_tokens - 1, engine.max_model_len - s.num_tokens - 1)
            if k > 0:
                seqs.append(s)
                ks.append(k)
        if seqs:
            for s, proposal in zip(seqs, self.draft(engine, seqs, ks)):
                s.spec_token_ids = proposal

    def verify(self, engine, inputs, logits: torch.Tensor) -> list[list[int]]:
        """Tokens to append for each of inputs.sample_seqs: accepted proposals + the target's next token."""
        seqs = inputs.sample_seqs
        proposals = [list(s.spec_token_ids) for s in seqs]
        results = verify_proposals(
            logits, inputs.logits_per_seq, proposals,
            [self.draft_probs.get(s.request_id) if s.spec_token_ids else None for s in seqs],
            [s.params for s in seqs], [engine._generators.get(s.request_id) for s in seqs])
        self.draft_probs = {}
        c = engine.stats_counters
        for s, proposal, (a, _) in zip(seqs, proposals, results):
            k = len(proposal)
            if not k:
                continue
            # The target computed the last token and the accepted proposals; the K/V at rejected positions is
            # garbage that nobody attends to and the next writes overwrite. Blocks past what is kept go back.
            s.num_computed_tokens += 1 + a
            s.spec_token_ids = []
            engine.block_manager.trim(s, s.num_computed_tokens + 1)
            s.spec_proposed += k
            s.spec_accepted += a
            c.spec_num_drafts_total += 1
            c.spec_num_draft_tokens_total += k
            c.spec_num_accepted_tokens_total += a
            if len(c.spec_accepted_per_pos_total) < k:
                c.spec_accepted_per_pos_total.extend([0] * (k - len(c.spec_accepted_per_pos_total)))
            for j in range(a):
                c.spec_accepted_per_pos_total[j] += 1
            st = self.states.get(s.request_id)
            if st is not None:
                w = self.policy.ema_weight
                st.acceptance = (1 - w) * st.acceptance + w * a / k
                if st.acceptance < self.policy.min_acceptance:
                    st.cooldown = self.policy.cooldown_steps
        return [tokens for _, tokens in results]
