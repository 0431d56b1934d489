"""Batch -> tensors -> forward -> logits. Owns the model, the KV pool and the per-step input preparation."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from inferlab.engine.scheduler import ScheduledBatch
from inferlab.engine.sequence import Sequence
from inferlab.layers.attention import AttentionGroup, AttentionMetadata, allocate_kv_cache, bind_kv_cache
from inferlab.layers.packed_linear import pack_linears, place_streamed_weights
from inferlab.models.llama import LlamaForCausalLM


# A step with multi-token queries (prefill chunks, prefix-cache extends, speculative verification), with or without
# decodes beside them, runs each new token as a row of the decode kernel, attending to keys 0..its own position
# through its sequence's block table, so the whole step stays on the decode plan's one C++ call (models/llama.py)
# instead of the Python layers with a batched SDPA over gathered keys (or, for a lone prompt from position 0, the
# causal SDPA over its fresh K/V). The kernel reads a sequence's consecutive rows as runs sharing each key tile
# (kernels/paged_decode_attention.cpp). Beside decodes this won at every size measured (`python
# benchmarks/mixed_step.py`, 7 decodes, bundled model, bf16): 1.29-1.42x faster steps for chunks of 64-512 tokens of
# prompts of 1,000-7,000 tokens (a 512-token chunk at 7,000: 870 against 1,227 ms); without them (`python
# benchmarks/extend_step.py`) 1.1-1.4x for lone and batched fresh prompts of 32-512 tokens and for prefix-cache
# hits of 16-128 tokens on 1,000-3,000 cached, and 1.43x a token for n-gram verification. The bound only keeps
# contexts past those measured (512 rows x 32k keys) on the layers.
ROW_ATTENTION_MAX_KEYS = 1 << 24
ROW_ATTENTION_MAX_TOKENS = 512


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_index: torch.Tensor  # rows of the flat batch whose logits are needed
    sample_seqs: list[Sequence]  # sequences that reach their last known token this step and so sample
    logits_per_seq: list[int]  # rows each of them gets (1, or 1 + proposals when verifying)
    # Prompt positions whose logits a prompt-logprobs request needs: (sequence, first position, count). Their rows
    # follow the sampling rows in logits_index.
    prompt_spans: list[tuple[Sequence, int, int]] = field(default_factory=list)

    @property
    def num_sample_rows(self) -> int:
        return sum(self.logits_per_seq)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 device: torch.device, pack_weights: bool = True):
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Bytes the packed copies of bf16 CPU weights add, net of the plain ones they replace (layers/packed_linear.py).
        self.packed_weight_bytes = pack_linears(model) if pack_weights else 0
        model.decide_row_padding()
        place_streamed_weights(model)
        self.kv_cache = allocate_kv_cache(model.model.layers, num_blocks, block_size, kv_dtype, device)
        # Small decode steps in one C++ call where every layer has the kernels for it (models/llama.py).
        model.model.build_decode_plan()

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def prepare(self, batch: ScheduledBatch, block_tables: list[list[int]]) -> StepInputs:
        seqs, ns = batch.seqs, batch.num_new_tokens
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        lens = np.asarray(ns, dtype=np.int64)
        ids: list[int] = []
        for s, c, n in zip(seqs, starts.tolist(), ns):
            toks = s.token_ids if not s.spec_token_ids else s.token_ids + s.spec_token_ids
            ids.extend(toks[c:c + n])
        positions, meta = self.layout(block_tables, starts, lens, batch.num_decodes)
        ends = np.cumsum(lens)
        sample_seqs, per_seq, rows = [], [], []
        for i, s in enumerate(seqs):
            if int(starts[i] + lens[i]) >= s.num_tokens:  # reaches the end of known tokens: sample (and verify)
                k = len(s.spec_token_ids)
                sample_seqs.append(s)
                per_seq.append(k + 1)
                rows.extend(range(int(ends[i]) - k - 1, int(ends[i])))
        spans = self._prompt_logprob_rows(seqs, starts, lens, ends, rows)
        dev = self.device
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=positions,
            meta=meta,
            logits_index=torch.tensor(rows, dtype=torch.long, device=dev),
            sample_seqs=sample_seqs,
            logits_per_seq=per_seq,
            prompt_spans=spans,
        )

    @staticmethod
    def _prompt_logprob_rows(seqs: list[Sequence], starts: np.ndarray, lens: np.ndarray, ends: np.ndarray,
                             rows: list[int]) -> list[tuple[Sequence, int, int]]:
        """Append to `rows` the flat rows of prompt positions p (predicting token p + 1 < prompt length) that a
        prompt-logprobs request has not collected yet; chunked prefill collects them over several steps, and a
        preempted request's recompute skips what it already has."""
        spans = []
        for i, s in enumerate(seqs):
            if s.params.prompt_logprobs is None:
                continue
            c = int(starts[i])
            lo, hi = max(c, len(s.prompt_logprobs)), min(c + int(lens[i]), s.num_prompt_tokens - 1)
            if hi > lo:
                first_row = int(ends[i] - lens[i]) + lo - c
                rows.extend(range(first_row, first_row + hi - lo))
                spans.append((s, lo, hi - lo))
        return spans

    def layout(self, block_tables: list[list[int]], starts: np.ndarray, lens: np.ndarray,
               num_decodes: int) -> tuple[torch.Tensor, AttentionMetadata]:
        """Positions [T] and attention metadata for a flat batch in which sequence i contributes lens[i] tokens
        from position starts[i], its K/V going to the blocks of block_tables[i]; the first num_decodes sequences
        have one token each. Shared by the target's steps and a draft model's passes (spec/draft.py)."""
        bs = self.block_size
        cu = np.concatenate(([0], np.cumsum(lens)))
        seq_of_token = np.repeat(np.arange(len(lens)), lens)
        positions = np.arange(int(cu[-1])) - cu[:-1][seq_of_token] + starts[seq_of_token]
        bt = np.zeros((len(lens), max(len(t) for t in block_tables)), dtype=np.int64)
        for i, t in enumerate(block_tables):
            bt[i, : len(t)] = t
        slots = bt[seq_of_token, positions // bs] * bs + positions % bs
        ends = starts + lens  # context length after this step
        d = num_decodes
        if d < len(lens) and self._rows_pay(positions, int(cu[d])):
            # Every token a row of its own, attending to keys 0..its position: see ROW_ATTENTION_MAX_KEYS.
            bt, starts, d = bt[seq_of_token], positions, len(positions)
            lens, ends = np.ones_like(positions), positions + 1
        decode = extend = None
        causal_only = d == 0 and len(lens) == 1 and starts[0] == 0
        if d and not causal_only:
            decode = self._group(bt[:d], starts[:d], lens[:d], ends[:d])
        if len(lens) > d and not causal_only:
            extend = self._group(bt[d:], starts[d:], lens[d:], ends[d:])
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.from_numpy(slots).to(dev), num_decode_tokens=d, decode=decode,
                                 extend=extend, causal_only=bool(causal_only))
        return torch.from_numpy(positions).to(dev), meta

    def _rows_pay(self, positions: np.ndarray, first_chunk_token: int) -> bool:
        """Whether a step's multi-token queries should run as one-token rows (see ROW_ATTENTION_MAX_KEYS): only
        where the decode plan then takes the whole step (models/llama.py: plan_applies). Off it, rows would meet the
        layers' torch decode path, which gathers every row's keys."""
        chunk = positions[first_chunk_token:]
        m = self.model.model
        window = getattr(m, "sliding_window", None)
        return (m.decode_plan is not None and len(positions) <= m.decode_plan_max_tokens
                and (window is None or int(positions.max()) < window)
                and len(chunk) <= ROW_ATTENTION_MAX_TOKENS
                and int(chunk.sum()) + len(chunk) <= ROW_ATTENTION_MAX_KEYS)

    def _group(self, bt: np.ndarray, starts: np.ndarray, lens: np.ndarray, ends: np.ndarray) -> AttentionGroup:
        bs = self.block_size
        nblk = int(-(-ends.max() // bs))
        bt = bt[:, :nblk]
        max_q = int(lens.max())
        L = nblk * bs
        q_i = np.minimum(np.arange(max_q)[None, :], lens[:, None] - 1)  # padded queries repeat the last real one
        key = np.arange(L)[None, None, :]
        # query i of a sequence sits at position start + i and may see keys 0..start+i.
        mask = key <= (starts[:, None] + q_i)[:, :, None]
        dev = self.device
        q_index = out_index = None
        if max_q > 1:
            cu = np.concatenate(([0], np.cumsum(lens)[:-1]))
            q_index = torch.from_numpy(cu[:, None] + q_i).to(dev)
            valid = np.arange(max_q)[None, :] < lens[:, None]
            out_index = torch.from_numpy(np.flatnonzero(valid)).to(dev)
        return AttentionGroup(
            block_tables=torch.from_numpy(np.ascontiguousarray(bt)).to(dev),
            mask=torch.from_numpy(mask[:, None]).to(dev),
            q_index=q_index,
            out_index=out_index,
            context_lens=torch.from_numpy(np.ascontiguousarray(ends, dtype=np.int64)).to(dev),
        )

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor | None:
        """Run the forward pass; return float32 logits for inputs.logits_index rows (None if there are none)."""
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if not inputs.sample_seqs and not inputs.prompt_spans:
            return None
        return self.model.compute_logits(hidden[inputs.logits_index])

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> list[float]:
        """log p(token_i | tokens_<i) for i >= 1 (perplexity), in one causal pass that attends only to its own
        fresh K/V. Its K/V writes go to a scratch pool the size of the sequence, bound to the layers for the pass,
        so scoring never touches the live pool (whose blocks belong to the scheduler)."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        T = ids.shape[0]
        meta = AttentionMetadata(slot_mapping=torch.arange(T, device=self.device), num_decode_tokens=0,
                                 decode=None, extend=None, causal_only=True)
        layers = self.model.model.layers
        allocate_kv_cache(layers, T, 1, self.kv_cache.dtype, self.device)
        try:
            hidden = self.model(ids, torch.arange(T, device=self.device), meta)
        finally:
            bind_kv_cache(layers, self.kv_cache)
        logp = self.model.compute_logits(hidden[:-1]).log_softmax(-1)
        return logp.gather(1, ids[1:, None]).squeeze(1).tolist()
