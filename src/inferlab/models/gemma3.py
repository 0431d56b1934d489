"""Gemma 3 (text): Llama's shape with five differences, each a few lines here over the shared layers and kernels.

- Layers alternate: five local ones attend within a sliding window (PagedAttention's window), then one global one
  attends to everything (models/config.py: layer_sliding). The two kinds rotate with their own bases (local 10k,
  global the config's rope_theta with its linear scaling): two rotary tables, gathered once per step each.
- QK-norm (Qwen3's, models/qwen3.py) and queries scaled by query_pre_attn_scalar ** -0.5.
- Four norms per layer: before and after attention, before and after the MLP (the "sandwich"); the residual is
  added after the post-norms.
- RMSNorm multiplies by (1 + w). The layers keep (1 + w) as their weight, so the plain RMSNorm (and its kernel)
  serves: GGUF files already store 1 + w (llama.cpp's converter adds the 1; transformers' GGUF reader takes it off
  again), Hugging Face checkpoints store w and models/loader.py adds the 1.
- A GELU (tanh approximation) gated MLP, embeddings scaled by sqrt(hidden) in the model's dtype (as transformers
  does: bf16 rounds sqrt(640) = 25.30 to 25.25), and an optional final logit soft-cap.

Decode steps whose every context fits the window run all layers in one C++ call (kernels/decode_layers.cpp, built
by LlamaModel.build_decode_plan): each layer sets its sandwich norms and the attention its QK-norm and rotary table
on its PlanLayer, and the plan's activation is GELU. Longer contexts run the Python layers (the C++ attention
attends to the whole context).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inferlab.kernels import cpu_kernels
from inferlab.layers.attention import AttentionMetadata, PagedAttention
from inferlab.layers.norm import RMSNorm
from inferlab.layers.rotary import RotaryEmbedding
from inferlab.models.config import ModelConfig
from inferlab.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel
from inferlab.models.qwen3 import Qwen3Attention


class Gemma3Attention(Qwen3Attention):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg)
        self.is_sliding = cfg.is_sliding(layer)
        window = cfg.sliding_window if self.is_sliding else None
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, window)
        self.attn.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5

    def plan_options(self, p) -> None:
        super().plan_options(p)
        p.local = self.is_sliding


class Gemma3MLP(LlamaMLP):
    gelu = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = Gemma3Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = Gemma3MLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, x, residual, cos, sin, meta):
        """x: the previous layer's (post-normed) MLP output, not yet added to `residual` (None for layer 0)."""
        h, residual = self.input_layernorm(x, residual)
        h, _ = self.post_attention_layernorm(self.self_attn(h, cos, sin, meta))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        h, _ = self.post_feedforward_layernorm(self.mlp(h))
        return h, residual

    def plan_norms(self, p) -> None:
        p.input_norm = self.input_layernorm.weight.detach()
        p.post_attn_norm = self.post_attention_layernorm.weight.detach()
        p.post_norm = self.pre_feedforward_layernorm.weight.detach()  # the norm before the MLP, as in Llama's plan
        p.post_ff_norm = self.post_feedforward_layernorm.weight.detach()


class Gemma3Model(LlamaModel):
    """Llama's decode plan (build_decode_plan, plan_applies) over Gemma's layers."""

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embed_scale = cfg.hidden_size**0.5
        self.sliding_window = cfg.sliding_window  # the local layers' (plan_applies)
        self.init_rotary()
        self.decode_plan = None  # see build_decode_plan
        self.decode_plan_max_tokens = 0

    def init_rotary(self, device: torch.device | None = None) -> None:
        """The two rotary tables (buffers computed at construction; models/loader.py rebuilds them on the device)."""
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling_factor).to(device)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                            cfg.rope_local_theta or cfg.rope_theta).to(device)

    def forward(self, input_ids, positions, meta: AttentionMetadata, num_layers: int | None = None):
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale).to(x.dtype)  # fp32 first, as transformers rounds it
        rotary = {False: self.rotary.cos_sin(positions, x.dtype), True: self.rotary_local.cos_sin(positions, x.dtype)}
        if self.plan_applies(x, meta, num_layers):
            g = meta.decode
            x, residual = cpu_kernels().decode_layers(self.decode_plan, x, *rotary[False], *rotary[True],
                                                      meta.slot_mapping, g.block_tables, g.context_lens)
        else:
            residual = None
            for layer in self.layers[:num_layers]:
                cos, sin = rotary[layer.self_attn.is_sliding]
                x, residual = layer(x, residual, cos, sin, meta)
        x, _ = self.norm(x, residual)
        return x


class Gemma3ForCausalLM(LlamaForCausalLM):
    """The tied head (the embedding table, unscaled) and the padding of batch_invariant_rows are Llama's."""

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        self.config = cfg
        self.model = Gemma3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight
        self.decide_row_padding()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
