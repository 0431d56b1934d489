"""Batch -> tensors -> forward -> logits. Owns the model, the KV pool and the per-step input preparation."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inferlab.engine.scheduler import ScheduledBatch
from inferlab.engine.sequence import Sequence
from inferlab.layers.attention import AttentionGroup, AttentionMetadata, allocate_kv_cache
from inferlab.layers.packed_linear import pack_linears
from inferlab.models.llama import LlamaForCausalLM


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_index: torch.Tensor  # rows of the flat batch whose logits are needed
    sample_seqs: list[Sequence]  # sequences that reach their last known token this step and so sample
    logits_per_seq: list[int]  # rows each of them gets (1, or 1 + proposals when verifying)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 device: torch.device, pack_weights: bool = True):
        self.model = model
        model.pad_rows = device.type == "cpu" and next(model.parameters()).dtype == torch.float32
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Extra bytes held by packed copies of bf16 CPU weights (see layers/packed_linear.py).
        self.packed_weight_bytes = pack_linears(model) if pack_weights else 0
        self.kv_cache = allocate_kv_cache(model.model.layers, num_blocks, block_size, kv_dtype, device)
        # Small decode steps in one C++ call where every layer has the kernels for it (models/llama.py).
        model.model.build_decode_plan()

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def prepare(self, batch: ScheduledBatch, block_tables: list[list[int]]) -> StepInputs:
        bs = self.block_size
        seqs, ns = batch.seqs, batch.num_new_tokens
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        lens = np.asarray(ns, dtype=np.int64)
        cu = np.concatenate(([0], np.cumsum(lens)))
        T = int(cu[-1])
        ids: list[int] = []
        for s, c, n in zip(seqs, starts.tolist(), ns):
            toks = s.token_ids if not s.spec_token_ids else s.token_ids + s.spec_token_ids
            ids.extend(toks[c:c + n])
        seq_of_token = np.repeat(np.arange(len(seqs)), lens)
        positions = np.arange(T) - cu[:-1][seq_of_token] + starts[seq_of_token]
        max_blocks = max(len(t) for t in block_tables)
        bt = np.zeros((len(seqs), max_blocks), dtype=np.int64)
        for i, t in enumerate(block_tables):
            bt[i, : len(t)] = t
        slots = bt[seq_of_token, positions // bs] * bs + positions % bs
        ends = starts + lens  # context length after this step

        d = batch.num_decodes
        decode = extend = None
        causal_only = d == 0 and len(seqs) == 1 and starts[0] == 0
        if d and not causal_only:
            decode = self._group(bt[:d], starts[:d], lens[:d], ends[:d])
        if len(seqs) > d and not causal_only:
            extend = self._group(bt[d:], starts[d:], lens[d:], ends[d:])

        sample_seqs, per_seq, rows = [], [], []
        for i, s in enumerate(seqs):
            if int(ends[i]) >= s.num_tokens:  # reaches the end of known tokens: sample (and verify proposals)
                k = len(s.spec_token_ids)
                sample_seqs.append(s)
                per_seq.append(k + 1)
                rows.extend(range(int(cu[i + 1]) - k - 1, int(cu[i + 1])))
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            num_decode_tokens=d,
            decode=decode,
            extend=extend,
            causal_only=bool(causal_only),
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.from_numpy(positions).to(dev),
            meta=meta,
            logits_index=torch.tensor(rows, dtype=torch.long, device=dev),
            sample_seqs=sample_seqs,
            logits_per_seq=per_seq,
        )

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
        """Run the forward pass; return float32 logits for inputs.logits_index rows (None if nobody samples)."""
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if not inputs.sample_seqs:
            return None
        return self.model.compute_logits(hidden[inputs.logits_index])

    @torch.inference_mode()
    def forward_hidden(self, inputs: StepInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, inputs.meta)
