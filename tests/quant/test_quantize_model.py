"""quantize_model on a small Llama built from the project's own model class (random weights, no file)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from torch import nn

from inferlab.models.config import ModelConfig
from inferlab.models.llama import LlamaForCausalLM
from inferlab.kernels import int_gemv_kernels
from inferlab.quant import (HEAD_MAX_KERNEL_TOKENS, Bf16Linear, Int4Linear, Int8Linear, QuantEmbedding, RawGGUFWeight,
                            W8A8Linear, quantize_model)

CFG = ModelConfig(architecture="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=64)


def tiny_model(dtype=torch.float32, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    net = LlamaForCausalLM(CFG)
    for name, p in net.named_parameters():
        if "norm" not in name:
            nn.init.normal_(p, std=0.05)
    return net.to(dtype).eval().requires_grad_(False)


def logits(net: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    from inferlab.layers.attention import AttentionMetadata, allocate_kv_cache

    # A causal pass over a scratch pool with one slot per token (ModelRunner.score's pass, without a runner).
    allocate_kv_cache(net.model.layers, len(ids), 1, net.model.norm.weight.dtype, ids.device)
    meta = AttentionMetadata(slot_mapping=torch.arange(len(ids)), num_decode_tokens=0, decode=None, extend=None,
                             causal_only=True)
    with torch.inference_mode():
        return net.compute_logits(net(ids, torch.arange(len(ids)), meta))


def unique_bytes(net: nn.Module) -> int:
    ts = {id(t): t for t in list(net.parameters()) + list(net.buffers())}
    return sum(t.numel() * t.element_size() for t in ts.values())


IDS = torch.randint(0, CFG.vocab_size, (24,), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("scheme,tol", [("int8", 0.03), ("int4", 0.25), ("w8a8", 0.03)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_model_tracks_the_float_model(scheme, tol, dtype):
    net = tiny_model(dtype)
    ref = logits(net, IDS)
    before = unique_bytes(net)
    desc = quantize_model(net, scheme, 32)
    assert not [n for n, m in net.named_modules() if isinstance(m, nn.Linear)]
    layer_cls = {"int8": Int8Linear, "int4": Int4Linear, "w8a8": W8A8Linear}[scheme]
    assert isinstance(net.model.layers[1].mlp.gate_up_proj, layer_cls)
    # the tied head's default scheme: int8 under int8 and int4, w8a8 under w8a8
    head_cls = W8A8Linear if scheme == "w8a8" else Int8Linear
    assert isinstance(net.lm_head, head_cls)
    assert net.lm_head.max_kernel_tokens == max(HEAD_MAX_KERNEL_TOKENS, head_cls.max_kernel_tokens)
    assert isinstance(net.model.embed_tokens, QuantEmbedding)
    assert desc.startswith(scheme) and "8 linear layers quantized from" in desc and "lm_head (tied to" in desc
    out = logits(net, IDS)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 0 < rel < tol, rel
    assert unique_bytes(net) < before * (0.6 if dtype == torch.bfloat16 else 0.3)


def test_bf16_weights_compute_the_rounded_model_in_fp32():
    """--quantization bf16 is the float32 model with its linear weights (and the tied table) rounded to bf16: the
    oracle is that model, built by rounding the weights in place and left as nn.Linear layers (MKL's fp32 GEMM)."""
    net, rounded = tiny_model(), tiny_model()
    with torch.no_grad():
        for m in rounded.modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(m.weight.bfloat16().float())  # the tied embedding shares lm_head's weight
    ref = logits(rounded, IDS)
    before = unique_bytes(net)
    desc = quantize_model(net, "bf16")
    assert desc.startswith("bf16: 8 linear layers quantized from float32") and "lm_head (tied to" in desc
    assert isinstance(net.model.layers[1].mlp.down_proj, Bf16Linear) and isinstance(net.lm_head, Bf16Linear)
    assert isinstance(net.model.embed_tokens, QuantEmbedding)
    out = logits(net, IDS)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert not torch.equal(out, logits(tiny_model(), IDS))  # the rounding is real
    assert unique_bytes(net) < before * 0.6
    # inferlab's kernel computes a row alone: the fp32 model needs no row padding where it is vectorised
    net.decide_row_padding()
    assert net.pad_rows == (int_gemv_kernels() is None)


def test_bf16_weights_under_bf16_activations_are_refused():
    net = tiny_model(torch.bfloat16)
    with pytest.raises(ValueError, match="--quantization bf16 keeps bf16 weights under float32 activations.*"
                                         "this model runs in bfloat16: use --dtype float32"):
        quantize_model(net, "bf16")
    assert isinstance(net.lm_head, nn.Linear)  # refused before anything was replaced


def test_embedding_reads_the_quantized_head():
    net = tiny_model()
    quantize_model(net, "int4", 32, head_scheme="int4")
    assert isinstance(net.lm_head, Int4Linear)
    ids = torch.tensor([[3, 511], [0, 64]])
    emb = net.model.embed_tokens(ids)
    assert emb.shape == (2, 2, 128) and emb.dtype == torch.float32
    assert torch.equal(emb.reshape(4, 128), net.lm_head.dequantize()[ids.reshape(-1)])


def test_raw_gguf_weights_take_the_direct_path():
    net = tiny_model()
    raw, ref = {}, {}
    for name, m in net.named_modules():
        if isinstance(m, nn.Linear) and name != "lm_head":
            data = quantize(m.weight.numpy(), GGMLQuantizationType.Q4_1)
            raw[name] = RawGGUFWeight("Q4_1", data, tuple(m.weight.shape))
            ref[name] = torch.from_numpy(dequantize(data, GGMLQuantizationType.Q4_1))
    raw["lm_head"] = RawGGUFWeight("Q8_0", quantize(net.lm_head.weight.numpy(), GGMLQuantizationType.Q8_0),
                                   tuple(net.lm_head.weight.shape))
    desc = quantize_model(net, "int4", 32, raw=raw)
    assert "8 linear layers GGUF Q4_1 blocks loaded directly" in desc and "int8, requantized from GGUF Q8_0" in desc
    for name, r in ref.items():
        assert torch.equal(net.get_submodule(name).dequantize(), r), name


def test_int4_keeps_the_layers_a_gguf_file_holds_wider_at_int8():
    # A Q4_K_M mixes widths: its Q5_0/Q6_K layers stay int8 under --quantization int4, its 4-bit ones become int4.
    net = tiny_model()
    raw = {}
    for name, m in net.named_modules():
        if isinstance(m, nn.Linear) and name != "lm_head":
            ggml = GGMLQuantizationType.Q5_0 if name.endswith("down_proj") else GGMLQuantizationType.Q4_1
            raw[name] = RawGGUFWeight(ggml.name, quantize(m.weight.numpy(), ggml), tuple(m.weight.shape))
    wide = {n for n, r in raw.items() if r.ggml_type == "Q5_0"}
    desc = quantize_model(net, "int4", 32, raw=raw, keep_int8=wide)
    assert "2 linear layers requantized from GGUF Q5_0, kept at int8 (the file holds it in more than 4 bits)" in desc
    for name in raw:
        assert isinstance(net.get_submodule(name), Int8Linear if name in wide else Int4Linear), name
    assert logits(net, IDS).isfinite().all()


@pytest.mark.slow
def test_the_loader_marks_the_layers_a_gguf_file_holds_in_more_than_4_bits():
    from inferlab.common.bundled import gemma3_model_path
    from inferlab.models.config import read_model_config
    from inferlab.models.loader import _load_gguf

    path = gemma3_model_path()  # Q4_K_M: Q4_K layers beside Q5_0 and Q6_K ones
    _, raw, wide = _load_gguf(path, read_model_config(path), keep_raw=True)
    assert wide and all(raw[n].ggml_type != "Q4_K" for n in wide if n in raw)
    assert any(r.ggml_type == "Q4_K" for n, r in raw.items() if n not in wide)


def test_none_changes_nothing_and_bad_input_is_refused():
    net = tiny_model()
    assert quantize_model(net, "none", 32) == "none (float weights)"
    assert isinstance(net.lm_head, nn.Linear)
    with pytest.raises(ValueError, match="unknown quantization scheme 'int3'"):
        quantize_model(net, "int3", 32)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.qkv_proj: int4 group size 96"):
        quantize_model(net, "int4", 96)
    assert isinstance(net.lm_head, nn.Linear)  # refused before anything was replaced


def test_the_model_pads_rows_where_its_own_dtype_and_device_need_it():
    net = tiny_model(torch.float32)
    assert net.pad_rows  # CPU float32: MKL's sgemm rounds a row by the batch's row count (batch_invariant_rows)
    assert not net.to(torch.bfloat16).pad_rows  # every move decides again
    assert net.float().pad_rows
    quantize_model(net, "int8")  # the quantized layers keep their own dtypes; the model's stays float32
    assert net.pad_rows
    with torch.device("meta"):
        assert not LlamaForCausalLM(CFG).pad_rows
