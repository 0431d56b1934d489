"""Llama-architecture decoder for batched serving: a flat batch of tokens from many sequences in, hidden states out.

Q/K/V and gate/up projections are fused into one matmul each, so a layer is four matmuls plus attention.

Decode runs in C++ where it can: a decode-only step with bf16 on the CPU and inferlab's kernels behind every
projection goes through kernels/decode_layers.cpp, all layers in one call (LlamaModel.build_decode_plan). That
is a second implementation of LlamaDecoderLayer.forward below (with LlamaAttention's fused rotary path,
PagedAttention._decode, LlamaMLP, RMSNorm, and each projection's forward()), kept in step with it by construction
and by test: it calls the same kernels in the same order, each projection describes itself through
KernelLinear.plan_linear (layers/packed_linear.py) as a PlanLinear whose kind is a kernels.ProjKind, and
tests/models/test_decode_plan.py checks that greedy generations are token-identical with the plan and without it.
A change to the layers' kernel path must be made on both sides.

The same classes serve the families whose layers are Llama's with options from the config: Qwen2 (biases on the
Q/K/V projection) and Mistral (a sliding attention window, applied by PagedAttention); Qwen3 adds its QK-norm in
models/qwen3.py. Gemma 3 has layers of its own (models/gemma3.py) on the same attention, norms and kernels. The
C++ plan takes QK-norm and Gemma 3's layer (each layer and attention sets its options on its PlanLayer:
plan_norms, plan_options); it has no bias, so Qwen2 decodes through the Python layers, and a windowed model uses
it for steps whose every context fits the window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inferlab.kernels import cpu_kernels, kernels_for, kernels_for_pool
from inferlab.layers.attention import AttentionMetadata, PagedAttention
from inferlab.layers.norm import RMSNorm
from inferlab.layers.packed_linear import ONEDNN_EXACT_ROWS, ONEDNN_ROW_QUANTUM, KernelLinear, PackedLinear
from inferlab.layers.rotary import RotaryEmbedding, apply_rotary
from inferlab.models.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window)

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, q_size + 2 * kv_size], Q/K before rotary (Qwen3 normalises them here)."""
        return self.qkv_proj(x)

    def plan_options(self, p) -> None:
        """Set the options of this attention on its kernels.PlanLayer (Llama's has none)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.project_qkv(x)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        a = self.attn
        kernels = kernels_for_pool(qkv, a.k_cache, cos)
        if kernels is not None:
            # Rotary for Q and K and the K/V write into the pool, in one pass (ten ops fewer per layer).
            q, k = kernels.rotary_kv_write(qkv, cos, sin, a.k_cache, a.v_cache, meta.slot_mapping, self.num_heads,
                                           self.num_kv_heads)
            return self.o_proj(a(q, k, v, meta, kv_written=True))
        # Q and K heads lie side by side: rotate them in one pass (per-op overhead dominates at batch 1).
        qk = qkv[:, :self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        o = a(q, k, v, meta)
        return self.o_proj(o)


class LlamaMLP(nn.Module):
    gelu = False  # the decode plan's activation: SiLU here, GELU-tanh for Gemma 3's MLP

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        kernels = kernels_for(gate_up) if gate_up.dim() == 2 else None
        if kernels is not None:
            return self.down_proj(kernels.silu_mul(gate_up))  # one pass, the unfused ops' rounding
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: type[LlamaAttention] = LlamaAttention):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, residual, cos, sin, meta):
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def plan_norms(self, p) -> None:
        """Set this layer's norms on its kernels.PlanLayer: before attention and before the MLP."""
        p.input_norm = self.input_layernorm.weight.detach()
        p.post_norm = self.post_attention_layernorm.weight.detach()


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: type[LlamaAttention] = LlamaAttention):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, attention) for _ in range(cfg.num_layers))
        self.sliding_window = cfg.sliding_window
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.decode_plan = None  # see build_decode_plan
        self.decode_plan_max_tokens = 0

    def forward(self, input_ids, positions, meta, num_layers: int | None = None):
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        if self.plan_applies(x, meta, num_layers):
            g = meta.decode
            x, residual = cpu_kernels().decode_layers(self.decode_plan, x, cos, sin, cos, sin, meta.slot_mapping,
                                                      g.block_tables, g.context_lens)
        else:
            residual = None
            for layer in self.layers[:num_layers]:
                x, residual = layer(x, residual, cos, sin, meta)
        x, _ = self.norm(x, residual)
        return x

    def plan_applies(self, x: torch.Tensor, meta: AttentionMetadata, num_layers: int | None) -> bool:
        """Whether the decode plan runs this step: all layers, decodes only, within the projections' kernels, and
        every context within the sliding window (the C++ attention attends to the whole context)."""
        g = meta.decode
        return (self.decode_plan is not None and num_layers is None and meta.extend is None and g is not None
                and x.shape[0] == meta.num_decode_tokens == meta.slot_mapping.shape[0] <= self.decode_plan_max_tokens
                and g.context_lens is not None
                and (self.sliding_window is None or int(g.context_lens.max()) <= self.sliding_window))

    def build_decode_plan(self) -> bool:
        """Prepare the one-call path for decode-only steps (see the module's docstring). It applies where every
        projection has a kernel of inferlab's own for small steps, the activations and norms are one dtype the
        kernels take (bf16, or fp32 where every projection is quantized: an AVX2 CPU's default) and the KV pool is
        that dtype or int8; steps past a projection's kernel need its packed weight, so the plan covers decodes of
        up to `decode_plan_max_tokens` tokens (all, with packed weights). Call after the KV pool is allocated (the
        plan holds each layer's slice of it) and the row padding is decided (fp32 steps it pads never take the
        plan). Says whether it applies."""
        self.decode_plan, self.decode_plan_max_tokens = None, 0
        kernels = cpu_kernels()
        first = self.layers[0]
        if kernels is None or first.self_attn.attn.k_cache.numel() == 0:
            return False
        dtype = first.input_layernorm.weight.dtype
        if kernels_for_pool(first.input_layernorm.weight, first.self_attn.attn.k_cache) is None:
            return False
        layers, max_tokens = [], 1 << 62
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            if getattr(a.qkv_proj, "bias", None) is not None:  # Qwen2: the plan has no bias
                return False
            projs = [m.plan_linear(dtype) if isinstance(m, KernelLinear) else None
                     for m in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(p is None for p in projs):
                return False
            for p in projs:
                if p.packed is None and p.onednn is None:
                    max_tokens = min(max_tokens, p.kernel_max_tokens)
            p = kernels.PlanLayer()
            layer.plan_norms(p)
            a.plan_options(p)
            p.k_cache, p.v_cache = a.attn.k_cache, a.attn.v_cache
            p.qkv, p.o, p.gate_up, p.down = projs
            layers.append(p)
        plan = kernels.DecodePlan()
        plan.layers = layers
        plan.eps = self.layers[0].input_layernorm.eps
        plan.scale = first.self_attn.attn.scale
        plan.heads, plan.kv_heads = first.self_attn.num_heads, first.self_attn.num_kv_heads
        plan.gelu = first.mlp.gelu
        plan.onednn_row_quantum, plan.onednn_exact_rows = ONEDNN_ROW_QUANTUM, ONEDNN_EXACT_ROWS
        self.decode_plan, self.decode_plan_max_tokens = plan, max_tokens
        return True


def batch_invariant_rows(n: int) -> int:
    """Row counts at which CPU fp32 GEMM (MKL) rounds every row exactly as it does inside a large batch.

    Measured with torch 2.13: sgemm results for a row differ when the matrix has 1-3, 5-7 or 9-11 rows (other
    kernels), and are bit-identical for 4, 8 and any count >= 12. bf16 (oneDNN) is invariant at every count.
    Padding to these counts makes a sequence's greedy output independent of what shares its batch.
    """
    return 4 if n <= 4 else 8 if n <= 8 else max(n, 12)


class LlamaForCausalLM(nn.Module):
    attention: type[LlamaAttention] = LlamaAttention  # the family's attention (models/qwen3.py overrides it)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, self.attention)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.decide_row_padding()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.decide_row_padding()  # after every device or dtype move (.to(), to_empty(), .float(), ...)
        return self

    def decide_row_padding(self) -> None:
        """CPU float32 steps are padded to batch_invariant_rows, unless every projection is oneDNN's packed fp32
        GEMM, which rounds a row the same at every row count (layers/packed_linear.py: onednn_fp32_packing). Decided
        again after every move and once the layers are packed (engine/model_runner.py)."""
        w = self.model.norm.weight  # keeps the model's float dtype whatever quantization replaced
        self.pad_rows = w.device.type == "cpu" and w.dtype == torch.float32 and not all(
            isinstance(m, KernelLinear) and m.rounds_rows_alone()
            for m in self.modules() if isinstance(m, (nn.Linear, KernelLinear)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        T = input_ids.shape[0]
        if self.pad_rows and batch_invariant_rows(T) > T:
            pad = batch_invariant_rows(T) - T  # padding rows are computed, never attended to, then dropped
            return self.model(F.pad(input_ids, (0, pad)), F.pad(positions, (0, pad)), meta)[:T]
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        if self.pad_rows and batch_invariant_rows(n) > n:
            return self.lm_head(F.pad(hidden, (0, 0, 0, batch_invariant_rows(n) - n)))[:n].float()
        if isinstance(self.lm_head, PackedLinear):
            return self.lm_head.forward_float(hidden)  # bf16 on the CPU: the packed kernel's fp32 sums
        return self.lm_head(hidden).float()
