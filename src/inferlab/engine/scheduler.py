"""Iteration-level scheduling with chunked prefill and preemption by recompute.

Each step has a token budget. Running sequences are served first, in admission order: a decode takes one token
(plus its speculative proposals), a sequence still prefilling takes the next chunk that fits. When the pool cannot
grow a sequence, the most recently admitted running sequence is preempted (its blocks freed, its tokens recomputed
later; the prefix cache usually makes that cheap). Waiting sequences are admitted in arrival order while blocks,
budget and the sequence limit allow, and never in a step that had to preempt.

While any sequence decodes, a step's prefill tokens are bounded apart, since every decoding request waits for the
whole step: by default to what keeps the step within --decode-stall-ratio times its decodes' own time, from step
costs the engine measures as it runs (engine/step_budget.py); with --max-prefill-tokens-with-decodes, to a fixed
count instead.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from inferlab.engine.block_manager import BlockManager
from inferlab.engine.sequence import Sequence, SequenceStatus
from inferlab.engine.step_budget import PrefillBudget


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)  # query-length-1 sequences first, then the others
    num_new_tokens: list[int] = field(default_factory=list)  # per sequence, speculative proposals included
    num_decodes: int = 0  # leading sequences with exactly one new token
    num_attended: int = 0  # keys those decodes attend to, their new one included
    preempted: list[Sequence] = field(default_factory=list)
    prefill_cap: int | None = None  # the bound on prefill tokens beside decodes it was scheduled under (None: none)
    drain: int = 0  # the prefill budget's held drain rate then (tokens a step; 0: none held)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_tokens_with_decodes: int | None = None, prefill_budget: PrefillBudget | None = None):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Prefill tokens a step may carry beside decodes: a fixed count, else what the measured budget allows,
        # else (both None) up to the step budget.
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes
        self.prefill_budget = prefill_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_first(self, seqs: list[Sequence]) -> None:
        """Queue ahead of the others: the forked choices of a request whose prompt blocks were just cached."""
        self.waiting.extendleft(reversed(seqs))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        prefill_cap = self._prefill_cap()
        prefill_budget = budget if prefill_cap is None else prefill_cap

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if not _decoding(seq) and prefill_budget <= 0:
                i += 1
                continue
            wanted = seq.num_tokens + len(seq.spec_token_ids) - seq.num_computed_tokens
            if seq.spec_token_ids and wanted > budget:
                seq.spec_token_ids = []  # not enough budget to verify: plain decode this step
                wanted = seq.num_tokens - seq.num_computed_tokens
            n = min(wanted, budget) if _decoding(seq) else min(wanted, budget, prefill_budget)
            while not self.bm.allocate(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                chosen.append((seq, n))
                budget -= n
                if not _decoding(seq):
                    prefill_budget -= n
                i += 1

        while (self.waiting and min(budget, prefill_budget) > 0 and len(self.running) < self.max_num_seqs
               and not preempted):
            seq = self.waiting[0]
            cached = self.bm.find_cached_prefix(seq) if seq.num_computed_tokens == 0 else []
            num_cached = len(cached) * self.bm.block_size
            n = min(seq.num_tokens - num_cached, budget, prefill_budget)
            if not self.bm.allocate(seq, num_cached + n, cached):
                break
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
                self.bm.record_lookup(seq.num_prompt_tokens, num_cached)
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.perf_counter()
            self.running.append(seq)
            chosen.append((seq, n))
            budget -= n
            prefill_budget -= n

        chosen.sort(key=lambda sn: sn[1] != 1)  # stable: decodes first, then chunks, each in admission order
        return ScheduledBatch(
            seqs=[s for s, _ in chosen],
            num_new_tokens=[n for _, n in chosen],
            num_decodes=sum(1 for _, n in chosen if n == 1),
            num_attended=sum(s.num_computed_tokens + 1 for s, n in chosen if n == 1),
            preempted=preempted,
            prefill_cap=prefill_cap,
            drain=self.prefill_budget.drain if self.prefill_budget is not None else 0,
        )

    def _prefill_cap(self) -> int | None:
        """Prefill tokens this step may carry beside the running decodes (None: no bound)."""
        decoding = [s for s in self.running if _decoding(s)]
        if not decoding:
            return None
        if self.max_prefill_tokens_with_decodes is not None:
            return self.max_prefill_tokens_with_decodes
        if self.prefill_budget is None:
            return None
        backlog = (sum(s.num_tokens - s.num_computed_tokens for s in self.running if not _decoding(s))
                   + sum(s.num_tokens - s.num_computed_tokens for s in self.waiting))
        if backlog == 0:  # no prompt to bound
            self.prefill_budget.queue_empty()
            return None
        return self.prefill_budget.tokens(len(decoding), sum(s.num_computed_tokens + 1 for s in decoding), backlog)

    def observe(self, batch: ScheduledBatch, seconds: float) -> None:
        """A step's measured time, for the prefill budget's cost model."""
        if self.prefill_budget is not None:
            self.prefill_budget.observe(batch.num_decodes, batch.num_attended, batch.num_tokens - batch.num_decodes,
                                        seconds)

    def set_proposals(self, proposals: dict[Sequence, list[int]]) -> None:
        """Speculative tokens to verify in the next step (from the proposer)."""
        for seq, tokens in proposals.items():
            seq.spec_token_ids = tokens

    def update_from_output(self, batch: ScheduledBatch, sampled: dict[Sequence, list[int]]) -> None:
        """Account for what a step computed, before its sampled tokens are appended: every scheduled token's K/V is
        now in the pool except rejected proposals (their K/V is garbage nobody attends to, overwritten next), full
        computed blocks go to the prefix cache, and blocks past what a speculative sequence kept go back.

        `sampled` maps each sequence that reached its last token to the tokens it gains: accepted proposals and
        then the target's next token."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            k = len(seq.spec_token_ids)
            if k:
                accepted = len(sampled[seq]) - 1
                seq.num_computed_tokens += n - (k - accepted)
                seq.spec_token_ids = []
                seq.spec_proposed += k
                seq.spec_accepted += accepted
                self.bm.trim(seq, seq.num_computed_tokens + 1)
            else:
                seq.num_computed_tokens += n
            self.bm.cache_computed_blocks(seq)

    def hand_off(self, seq: Sequence) -> None:
        """Prefill role: seq has computed its prompt and sampled its first token. It leaves the schedule but keeps
        its blocks until its KV has been copied out; finish() then frees them (full ones stay in the prefix
        cache). Holding them is what makes prefill wait when the decode side is full: its pool fills up."""
        self.running.remove(seq)
        seq.status = SequenceStatus.HANDING_OFF

    def admit_injected(self, seq: Sequence, cached_blocks: list[int]) -> bool:
        """Decode role: seq arrives with its prompt's KV computed by another engine and its first token sampled.
        Allocate blocks for all its tokens (the prompt's, `cached_blocks` first when the prefix cache holds some,
        and room for the first token's K/V, computed by its first decode step here), count the prompt as computed
        and run it as a decode. The caller copies the prompt's K/V into the non-cached blocks before the next
        step. False, changing nothing, while preempted sequences wait (they go first) or slots or blocks are short:
        the KV then stays in the transport, which is the decode side's backpressure on prefill."""
        if self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        if not self.bm.allocate(seq, seq.num_tokens, cached_blocks):
            return False
        self.bm.record_lookup(seq.num_prompt_tokens, len(cached_blocks) * self.bm.block_size)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished, aborted or handed-off sequence from wherever it is and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        seq.status = SequenceStatus.FINISHED
        self.bm.free(seq)


def _decoding(seq: Sequence) -> bool:
    """Past its prompt: generating (a preempted sequence recomputing its tokens counts as prefilling)."""
    return seq.num_computed_tokens >= seq.num_tokens - 1
