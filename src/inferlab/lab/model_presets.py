"""Model shapes for `inferlab fit`: presets of well-known architectures and models read from a path.

`ModelSpec` carries what the engine's `ModelConfig` does not (mixture-of-experts fields, attention biases), because
fit must count the parameters of architectures inferlab does not serve. Preset figures are copied from each model's
published config.json (the `source` field names it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from inferlab.common.errors import ModelLoadError


@dataclass(slots=True, frozen=True)
class ModelSpec:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # per expert for mixture-of-experts models
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int = 1  # 1 = a dense MLP
    num_experts_per_tok: int = 1
    qkv_bias: bool = False  # Qwen2 has biases on q, k and v
    qk_norm: bool = False  # Qwen3 and Gemma 3: an RMSNorm of head_dim weights on Q and on K
    norms_per_layer: int = 2  # Gemma 3 also normalises after attention and after the MLP: 4
    # Layers that attend only to the last `sliding_window` tokens (Mistral-7B-v0.1: all; Gemma 3: five in six);
    # a KV cache that drops what falls out of the window holds at most that many tokens for them.
    sliding_window: int | None = None
    sliding_layers: int = 0
    source: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    # Parameter counts, split the way memory and FLOPs need them. Every linear layer of a block and the LM head
    # (when untied) is quantizable; the embedding table, norms, biases and the router stay in 16-bit.
    @property
    def attn_linear_params(self) -> int:  # q, k, v, o of one layer
        h, d = self.hidden_size, self.head_dim
        return 2 * h * self.num_heads * d + 2 * h * self.num_kv_heads * d

    @property
    def expert_params(self) -> int:  # gate, up, down of one expert of one layer
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def small_params_per_layer(self) -> int:  # two RMSNorm weights, q/k/v biases, the router
        bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.qkv_bias else 0
        router = self.hidden_size * self.num_experts if self.is_moe else 0
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
        return self.norms_per_layer * self.hidden_size + bias + router + qk_norm

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:  # 0 when tied: the LM head is the embedding table
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        per_layer = self.attn_linear_params + self.num_experts * self.expert_params + self.small_params_per_layer
        return self.num_layers * per_layer + self.hidden_size + self.embedding_params + self.lm_head_params

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (a mixture-of-experts model uses num_experts_per_tok experts)."""
        return self.num_params - self.num_layers * (self.num_experts - self.num_experts_per_tok) * self.expert_params

    @property
    def quantizable_params(self) -> int:
        return self.num_layers * (self.attn_linear_params + self.num_experts * self.expert_params) + self.lm_head_params

    @property
    def quantizable_out_features(self) -> int:
        """Output channels of all quantizable linear layers: one int8 scale each (per-channel quantization)."""
        d, h, i = self.head_dim, self.hidden_size, self.intermediate_size
        attn = (self.num_heads + 2 * self.num_kv_heads) * d + h
        mlp = self.num_experts * (2 * i + h)
        return self.num_layers * (attn + mlp) + (self.vocab_size if not self.tie_word_embeddings else 0)

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """Of a context every layer attends to in full (sliding-window layers hold less: kv_bytes_per_seq)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def kv_layer_tokens(self, context: int) -> int:
        """Cached tokens summed over layers for one sequence of `context` tokens (what attention reads, too)."""
        if not self.sliding_window:
            return self.num_layers * context
        return (self.num_layers - self.sliding_layers) * context + self.sliding_layers * min(context, self.sliding_window)

    def kv_bytes_per_seq(self, context: int, dtype_bytes: float) -> float:
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes * self.kv_layer_tokens(context)

    @classmethod
    def from_model_config(cls, cfg, source: str = "") -> "ModelSpec":
        return cls(
            name=cfg.name, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=cfg.tie_word_embeddings, qkv_bias=cfg.attention_bias, qk_norm=cfg.qk_norm,
            sliding_window=cfg.sliding_window,
            sliding_layers=sum(cfg.is_sliding(i) for i in range(cfg.num_layers)), norms_per_layer=cfg.norms_per_layer,
            source=source,
        )

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str, source: str = "") -> "ModelSpec":
        """Shape fields of a Hugging Face config.json, for the decoder families that share Llama's layout."""
        try:
            hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
            return cls(
                name=name, vocab_size=cfg["vocab_size"], hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or hidden // heads,
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                num_experts=cfg.get("num_local_experts") or 1,
                num_experts_per_tok=cfg.get("num_experts_per_tok") or 1,
                # Qwen2 always has q/k/v biases and its config.json does not say so.
                qkv_bias=bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2",
                source=source,
            )
        except KeyError as e:
            raise ModelLoadError(f"{name}: config.json lacks {e.args[0]!r}, which fit needs") from None


_HF = "https://huggingface.co/{}/blob/main/config.json"

MODEL_PRESETS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec("Llama-3-8B", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                  num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
                  tie_word_embeddings=False, source=_HF.format("meta-llama/Meta-Llama-3-8B")),
        ModelSpec("Llama-3-70B", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                  num_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
                  tie_word_embeddings=False, source=_HF.format("meta-llama/Meta-Llama-3-70B")),
        ModelSpec("Qwen2.5-7B", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                  num_heads=28, num_kv_heads=4, head_dim=128, max_position_embeddings=131072,
                  tie_word_embeddings=False, qkv_bias=True, source=_HF.format("Qwen/Qwen2.5-7B")),
        ModelSpec("Mixtral-8x7B", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
                  num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=32768,
                  tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                  source=_HF.format("mistralai/Mixtral-8x7B-v0.1")),
        ModelSpec("Llama-3.1-8B", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                  num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
                  tie_word_embeddings=False, source=_HF.format("meta-llama/Llama-3.1-8B")),
        ModelSpec("Llama-3.2-1B", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                  num_heads=32, num_kv_heads=8, head_dim=64, max_position_embeddings=131072,
                  tie_word_embeddings=True, source=_HF.format("meta-llama/Llama-3.2-1B")),
        ModelSpec("Llama-3.2-3B", vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_layers=28,
                  num_heads=24, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
                  tie_word_embeddings=True, source=_HF.format("meta-llama/Llama-3.2-3B")),
        ModelSpec("Qwen2.5-0.5B", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                  num_heads=14, num_kv_heads=2, head_dim=64, max_position_embeddings=32768,
                  tie_word_embeddings=True, qkv_bias=True, source=_HF.format("Qwen/Qwen2.5-0.5B")),
        ModelSpec("Qwen2.5-1.5B", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                  num_heads=12, num_kv_heads=2, head_dim=128, max_position_embeddings=131072,
                  tie_word_embeddings=True, qkv_bias=True, source=_HF.format("Qwen/Qwen2.5-1.5B")),
        ModelSpec("Qwen3-0.6B", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                  num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
                  tie_word_embeddings=True, qk_norm=True, source=_HF.format("Qwen/Qwen3-0.6B")),
        ModelSpec("Qwen3-8B", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                  num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
                  tie_word_embeddings=False, qk_norm=True, source=_HF.format("Qwen/Qwen3-8B")),
        # Gemma 3: every sixth layer global, the rest local (sliding window); four norms per layer and QK-norm.
        ModelSpec("Gemma-3-270M", vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18,
                  num_heads=4, num_kv_heads=1, head_dim=256, max_position_embeddings=32768,
                  tie_word_embeddings=True, qk_norm=True, norms_per_layer=4, sliding_window=512, sliding_layers=15,
                  source=_HF.format("google/gemma-3-270m")),
        ModelSpec("Gemma-3-1B", vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_layers=26,
                  num_heads=4, num_kv_heads=1, head_dim=256, max_position_embeddings=32768,
                  tie_word_embeddings=True, qk_norm=True, norms_per_layer=4, sliding_window=512, sliding_layers=22,
                  source=_HF.format("google/gemma-3-1b-pt")),
        ModelSpec("Gemma-3-4B", vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_layers=34,
                  num_heads=8, num_kv_heads=4, head_dim=256, max_position_embeddings=131072,
                  tie_word_embeddings=True, qk_norm=True, norms_per_layer=4, sliding_window=1024, sliding_layers=29,
                  source=_HF.format("google/gemma-3-4b-pt") + " (text_config; the vision tower is not counted)"),
        ModelSpec("Mistral-7B", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
                  num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=32768,
                  tie_word_embeddings=False, sliding_window=4096, sliding_layers=32,
                  source=_HF.format("mistralai/Mistral-7B-v0.1")),
        # The generic "7B" is Llama-2-7B's shape (multi-head attention, no GQA): the model behind the rule of thumb
        # "7B: ~14 GB in FP16, ~7 GB in INT8, ~3.5 GB in INT4".
        ModelSpec("7B", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                  num_kv_heads=32, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=False,
                  source=_HF.format("meta-llama/Llama-2-7b-hf")),
    ]
}


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def resolve_model(model: str | None) -> ModelSpec:
    """A preset name, a GGUF file or a Hugging Face folder; None = the bundled model."""
    if model is not None:
        for preset in MODEL_PRESETS.values():
            if _key(model) == _key(preset.name):
                return preset
        if not Path(model).expanduser().exists():
            raise ModelLoadError(
                f"{model!r} is neither a model preset ({', '.join(MODEL_PRESETS)}) nor an existing path "
                f"(give a GGUF file or a Hugging Face folder with config.json)"
            )
    from inferlab.models.config import read_model_config, resolve_model_path

    path = resolve_model_path(model)
    try:
        return ModelSpec.from_model_config(read_model_config(path), source=str(path))
    except ModelLoadError:
        # fit only needs shapes, so it also reads config.json of families the engine does not serve (Mixtral, Qwen2).
        cfg_path = path / "config.json" if path.is_dir() else None
        if cfg_path is None or not cfg_path.is_file():
            raise
        return ModelSpec.from_hf_config(json.loads(cfg_path.read_text()), name=path.name, source=str(cfg_path))
