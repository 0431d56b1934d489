"""Weight-only quantization at load time: one module per scheme (int8.py, int4.py, w8a8.py, bf16.py), GGUF blocks
in gguf_q4.py.

`quantize_model` swaps every `nn.Linear` of a loaded model for the scheme's QuantLinear, in place. A tied LM head
(`lm_head.weight is embed_tokens.weight`) is quantized once and the embedding then reads its rows from it
(QuantEmbedding), so the float table is freed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping

import torch
from torch import nn

from inferlab.quant.bf16 import Bf16Linear, check_bf16_shape
from inferlab.quant.embedding import QuantEmbedding
from inferlab.quant.gguf_q4 import RawGGUFWeight, dequantize_raw, q4_1_blocks, q4_k_groups
from inferlab.quant.int4 import Int4Linear, check_int4_shape, pack_int4
from inferlab.quant.int8 import Int8Linear
from inferlab.quant.linear import QuantLinear
from inferlab.quant.w8a8 import W8A8Linear, check_w8a8_shape

SCHEMES = ("none", "int8", "int4", "w8a8", "bf16")
# The tied embedding/LM head's scheme per model scheme. int4 keeps it int8, as llama.cpp's Q4_1 files keep it
# Q8_0. Measured on SmolLM2-135M, corpus perplexity vs none (bf16) 10.615: int4 layers + int8 head 10.634
# (+0.2%), int4 layers + int4 head 11.240 (+5.9%): the 4-bit head costs 30x more than all 4-bit layers together.
# w8a8 keeps its own: 10.675 with the head in w8a8, 10.680 with it int8 weight-only, and at 64 rows a step its
# kernel took the head from 6.3 to 3.1 ms (`benchmarks/step_profile.py`).
HEAD_SCHEME = {"int8": "int8", "int4": "int8", "w8a8": "w8a8", "bf16": "bf16"}

# GGUF types that hold a weight in more than 4 bits. A quantized file that mixes widths (a Q4_K_M keeps some layers
# Q5_0 or Q6_K) kept those wide on purpose, and --quantization int4 keeps them at int8 instead of cutting them to 4
# bits: requantizing Gemma 3 270M's Q5_0/Q6_K layers to int4 cost +29% corpus perplexity, keeping them +2.2%, and
# with its Q4_K groups loaded as they are (q4_k_groups) +0.37% (inferlab eval, measured).
# Float files are quantized as asked.
WIDE_GGUF_TYPES = frozenset({"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"})

# Without a packed copy, the LM head's kernel stays ahead of dequantize + bf16 matmul up to ~24 tokens (dequantizing
# the 49152x576 head writes a 56 MB temporary that no cache holds), further than the layers' (measured).
HEAD_MAX_KERNEL_TOKENS = 24

__all__ = ["SCHEMES", "HEAD_SCHEME", "HEAD_MAX_KERNEL_TOKENS", "WIDE_GGUF_TYPES", "Bf16Linear", "Int4Linear",
           "Int8Linear", "QuantEmbedding", "QuantLinear", "RawGGUFWeight", "W8A8Linear", "quantize_model",
           "quantize_weight"]


def quantize_weight(w: torch.Tensor | None, scheme: str, group_size: int,
                    raw: RawGGUFWeight | None = None) -> tuple[QuantLinear, str]:
    """One weight [out, in] -> (its QuantLinear, how it was made). `raw`, when given, is the same weight as the
    GGUF file stores it and is preferred over `w` (it is the more precise source)."""
    if scheme == "int4" and raw is not None and raw.ggml_type == "Q4_1" and group_size == 32:
        return Int4Linear.from_q4_1(*q4_1_blocks(raw)), "GGUF Q4_1 blocks loaded directly (no requantization)"
    if scheme == "int4" and raw is not None and raw.ggml_type == "Q4_K" and group_size == 32:
        groups = q4_k_groups(raw)
        if groups is not None:
            q, d, m = groups
            return Int4Linear(pack_int4(q, 32), d, m, 32), "GGUF Q4_K groups loaded directly (scales to fp16)"
    if raw is not None:
        src, how = dequantize_raw(raw), f"requantized from GGUF {raw.ggml_type}"
    elif w is not None:
        src, how = w, f"quantized from {str(w.dtype).removeprefix('torch.')}"
    else:
        raise ValueError("quantize_weight needs a float weight or a raw GGUF weight")
    if scheme == "int8":
        return Int8Linear.from_float(src), how
    if scheme == "int4":
        return Int4Linear.from_float(src, group_size), how
    if scheme == "w8a8":
        return W8A8Linear.from_float(src), how
    if scheme == "bf16":
        return Bf16Linear.from_float(src), how
    raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")


def quantize_model(model: nn.Module, scheme: str, group_size: int = 32,
                   raw: Mapping[str, RawGGUFWeight] | None = None, head_scheme: str | None = None,
                   keep_int8: Collection[str] = ()) -> str:
    """Replace every nn.Linear(bias=False) of `model` with a QuantLinear, in place, and say what was done.

    raw: GGUF weights keyed by the Linear's qualified name ("model.layers.0.self_attn.qkv_proj", "lm_head").
    head_scheme: the tied LM head's scheme (default HEAD_SCHEME[scheme]).
    keep_int8: Linears that int4 keeps at int8 (a GGUF file stores them in more than 4 bits: WIDE_GGUF_TYPES).
    Quantize after any `model.to(device, dtype)`: the quantized layers keep their own dtypes.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if scheme == "none":
        return "none (float weights)"
    head_scheme = head_scheme or HEAD_SCHEME[scheme]
    if head_scheme not in SCHEMES[1:]:
        raise ValueError(f"unknown head scheme {head_scheme!r}; choose one of {', '.join(SCHEMES[1:])}")
    raw = raw or {}
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    biased = [n for n, m in linears if m.bias is not None]
    if biased and scheme != "bf16":  # fail before changing anything
        raise ValueError(f"--quantization {scheme} needs bias-free linear layers (inferlab's int8/int4 kernels have "
                         f"no bias), but {biased[0]} has a bias ({len(biased)} layers do, e.g. Qwen2's Q/K/V "
                         f"projections); serve this model with --quantization none (or bf16, under float32)")
    if scheme == "bf16" and any(m.weight.dtype != torch.float32 for _, m in linears):
        dtype = next(m.weight.dtype for _, m in linears if m.weight.dtype != torch.float32)
        raise ValueError(f"--quantization bf16 keeps bf16 weights under float32 activations (a CPU without bf16 "
                         f"arithmetic), but this model runs in {str(dtype).removeprefix('torch.')}: use --dtype "
                         f"float32, or --quantization none to serve its weights as they are")
    if scheme in ("int4", "w8a8", "bf16"):  # fail before changing anything
        check = {"int4": lambda shape: check_int4_shape(shape, group_size), "w8a8": check_w8a8_shape,
                 "bf16": check_bf16_shape}[scheme]
        for name, m in linears:
            try:
                check(tuple(m.weight.shape))
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
    embeddings = {id(m.weight): n for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    float_bytes = sum(m.weight.numel() * m.weight.element_size() for _, m in linears)
    quant_bytes = 0
    layers: Counter[str] = Counter()
    head_note = ""
    for name, lin in linears:
        tied_to = embeddings.get(id(lin.weight))
        s = head_scheme if tied_to is not None else "int8" if scheme == "int4" and name in keep_int8 else scheme
        q, how = quantize_weight(lin.weight.detach(), s, group_size, raw.get(name))
        if lin.bias is not None:
            q.bias = lin.bias.detach()  # bf16 only (the others refused biased layers above)
        q.to(lin.weight.device)
        _replace(model, name, q)
        quant_bytes += q.weight_bytes()
        if tied_to is not None:
            q.max_kernel_tokens = max(q.max_kernel_tokens, HEAD_MAX_KERNEL_TOKENS)
            _replace(model, tied_to, QuantEmbedding(q, lin.weight.dtype))
            head_note = f"; {name} (tied to {tied_to}, which now reads its rows from it): {s}, {how}"
        else:
            layers[how if s == scheme else f"{how}, kept at {s} (the file holds it in more than 4 bits)"] += 1
    g = f" group {group_size}" if scheme == "int4" else "" if scheme == "bf16" else " per-channel"
    body = ", ".join(f"{n} linear layers {how}" for how, n in layers.items())
    return (f"{scheme}{g}: {body}{head_note}; linear weights {float_bytes / 2**20:.1f} MiB -> "
            f"{quant_bytes / 2**20:.1f} MiB")


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
