"""Tiny random-weight models of each family, built with transformers (the oracle) and saved as a Hugging Face folder
and as a GGUF file written with the `gguf` package under llama.cpp's tensor names and metadata keys.

They use SmolLM2's tokenizer (49,152 tokens), so the vocabularies agree and text prompts work. Weights are drawn
wider than transformers' default init so that logits are spread out: greedy argmax ties (whose winner a last-bit
rounding difference could flip) then practically never happen.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

VOCAB = 49152
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6)


def hf_config(family: str, **extra):
    import transformers

    if family == "qwen2":
        return transformers.Qwen2Config(**SHAPE, tie_word_embeddings=False, **extra)
    if family == "qwen2-tied":
        return transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True, **extra)
    if family == "qwen3":  # head_dim 32 != hidden / heads (16): the explicit head_dim is used
        return transformers.Qwen3Config(**SHAPE, head_dim=32, tie_word_embeddings=True, **extra)
    if family == "mistral":
        return transformers.MistralConfig(**SHAPE, sliding_window=8, tie_word_embeddings=False, **extra)
    if family == "gemma3":
        # What the real 270M (tests/models/test_gemma3_vs_transformers.py) does not have: a query_pre_attn_scalar
        # other than head_dim, a final logit soft-cap, linear rope scaling on the global layers; window 8.
        shape = {**SHAPE, "num_hidden_layers": 3}
        kw = dict(head_dim=32, sliding_window=8, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
        return transformers.Gemma3TextConfig(**shape, **{**kw, **extra})
    raise ValueError(family)


def build_hf_model(family: str, seed: int = 0, **extra):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(family, **extra)
    cfg._attn_implementation = "eager"  # its sliding window is applied in eager attention
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1:  # biases
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.0 if "embed" in name else 2.0 / p.shape[1] ** 0.5))
    return model


def save_hf(model, tokenizer, path: Path) -> Path:
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return path


GGUF_ARCH = {"qwen2": "qwen2", "qwen2-tied": "qwen2", "qwen3": "qwen3", "mistral": "llama"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute (applied to Q/K of the llama architecture only)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def save_gguf(model, family: str, path: Path, tokenizer_gguf: Path) -> Path:
    """The model as llama.cpp's converter would write it (float32 tensors), with the tokenizer of `tokenizer_gguf`."""
    import gguf

    arch = GGUF_ARCH[family]
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{family}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]) if getattr(c, "rope_parameters", None)
                         else float(c.rope_theta))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if family == "mistral":
        # llama.cpp's converter leaves Mistral's window out (it writes the llama architecture); inferlab reads the
        # key where a file has it, which is what this file tests.
        w.add_sliding_window(c.sliding_window)
    reader = gguf.GGUFReader(str(tokenizer_gguf))
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    perm = arch == "llama"

    def t(name: str, a: np.ndarray) -> None:
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))

    t("token_embd.weight", sd["model.embed_tokens.weight"])
    t("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_word_embeddings:
        t("output.weight", sd["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        t(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        t(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        for n, h in (("q", heads), ("k", kv_heads), ("v", None)):
            for kind in ("weight", "bias"):
                key = p + f"self_attn.{n}_proj.{kind}"
                if key in sd:
                    t(b + f"attn_{n}.{kind}", _permute(sd[key], h) if perm and h else sd[key])
        for n in "qk":
            if p + f"self_attn.{n}_norm.weight" in sd:
                t(b + f"attn_{n}_norm.weight", sd[p + f"self_attn.{n}_norm.weight"])
        t(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        for n in ("gate", "up", "down"):
            t(b + f"ffn_{n}.weight", sd[p + f"mlp.{n}_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
