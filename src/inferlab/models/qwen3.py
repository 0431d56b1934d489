"""Qwen3: Llama's layers (models/llama.py) with an RMSNorm over each Q and K head before rotary (QK-norm), and a
head_dim of its own (the config's, not hidden / heads)."""

from __future__ import annotations

import torch

from inferlab.layers.norm import RMSNorm
from inferlab.models.config import ModelConfig
from inferlab.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        T, d = qkv.shape[0], self.head_dim
        # Heads as rows of a 2-D tensor: the norm's kernel path, with the reference's rounding points.
        q, _ = self.q_norm(qkv[:, :self.q_size].reshape(-1, d))
        k, _ = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].reshape(-1, d))
        return torch.cat([q.view(T, -1), k.view(T, -1), qkv[:, self.q_size + self.kv_size:]], dim=1)

    def plan_options(self, p) -> None:
        p.q_norm, p.k_norm = self.q_norm.weight.detach(), self.k_norm.weight.detach()


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention = Qwen3Attention
