"""Fit arithmetic against hand-computed values from the published configs and datasheets."""

from __future__ import annotations

import json
import math

import pytest

from inferlab.lab.fit import FitRequest, fit, quant_scheme, weight_memory
from inferlab.lab.hardware import HARDWARE_PRESETS, GiB, resolve_hardware
from inferlab.lab.model_presets import MODEL_PRESETS, ModelSpec, resolve_model

H100 = HARDWARE_PRESETS["H100 SXM"]


# Totals as published on each model card / safetensors index; the per-layer sums are written out by hand.
@pytest.mark.parametrize(
    "name, expected",
    [
        # embed 128256·4096 twice (untied) + 32 × (attn 2·4096² + 2·4096·1024, mlp 3·4096·14336, norms 2·4096) + 4096
        ("Llama-3-8B", 2 * 128256 * 4096 + 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) + 4096),
        ("Llama-3-70B", 2 * 128256 * 8192 + 80 * (2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192) + 8192),
        # Qwen2 adds q/k/v biases: 3584 + 2·512 per layer
        ("Qwen2.5-7B",
         2 * 152064 * 3584 + 28 * (2 * 3584**2 + 2 * 3584 * 512 + 4608 + 3 * 3584 * 18944 + 2 * 3584) + 3584),
        # Mixtral: 8 experts and a 4096×8 router per layer
        ("Mixtral-8x7B",
         2 * 32000 * 4096 + 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 8 * 3 * 4096 * 14336 + 4096 * 8 + 2 * 4096) + 4096),
        ("7B", 2 * 32000 * 4096 + 32 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 4096),
    ],
)
def test_preset_param_counts(name, expected):
    assert MODEL_PRESETS[name].num_params == expected


def test_preset_param_counts_match_published_sizes():
    published = {"Llama-3-8B": 8.03e9, "Llama-3-70B": 70.55e9, "Qwen2.5-7B": 7.62e9, "Mixtral-8x7B": 46.70e9,
                 "7B": 6.74e9}
    for name, n in published.items():
        assert MODEL_PRESETS[name].num_params == pytest.approx(n, rel=2e-3), name
    # Mixtral's "12.9B active": two experts of eight per token.
    assert MODEL_PRESETS["Mixtral-8x7B"].active_params == pytest.approx(12.88e9, rel=2e-3)


def test_seed_figures_for_a_7b_model():
    spec = MODEL_PRESETS["7B"]
    fp16 = weight_memory(spec, quant_scheme("none", "fp16"), "fp16")
    int8 = weight_memory(spec, quant_scheme("int8"), "fp16")
    int4 = weight_memory(spec, quant_scheme("int4", group_size=32), "fp16")
    assert fp16.total == 2 * 6_738_415_616
    assert fp16.total == pytest.approx(14e9, rel=0.05)
    assert int8.total == pytest.approx(7e9, rel=0.05)
    # The rule of thumb counts weights only; int4's scales are stated on top of it.
    assert int4.quantized_bytes + int4.unquantized_bytes == pytest.approx(3.5e9, rel=0.05)
    linear = 32 * (4 * 4096**2 + 3 * 4096 * 11008) + 32000 * 4096  # blocks + untied LM head
    assert int4.quantized_bytes == linear // 2
    assert int4.scale_bytes == linear // 32 * 4  # a bf16 scale and zero point per 32 weights: 1/8 byte per weight
    assert int8.quantized_bytes == linear
    # int8: one fp16 scale per output channel: q,k,v,o 4×4096, gate/up 2×11008, down 4096 per layer; LM head 32000
    assert int8.scale_bytes == 2 * (32 * (4 * 4096 + 2 * 11008 + 4096) + 32000)
    assert int8.unquantized_bytes == 2 * (32000 * 4096 + 32 * 2 * 4096 + 4096)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("scheme", ["none", "int8", "int4", "w8a8", "bf16"])
def test_weight_memory_equals_the_engine_quantized_model(tied, scheme):
    """The engine's own quantizer is the oracle: build a small Llama, quantize it as the engine does, count its
    bytes (parameters and quantized buffers, each tensor once; the rotary tables are not weights)."""
    torch = pytest.importorskip("torch")
    from inferlab.models.config import ModelConfig
    from inferlab.models.llama import LlamaForCausalLM
    from inferlab.quant import quantize_model

    cfg = ModelConfig("llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=tied)
    dtype = "fp32" if scheme == "bf16" else "bf16"  # bf16 weights are for fp32 activations
    net = LlamaForCausalLM(cfg).to(torch.float32 if dtype == "fp32" else torch.bfloat16)
    quantize_model(net, scheme, 32)
    tensors = {id(t): t for n, t in [*net.named_parameters(), *net.named_buffers()] if "rotary" not in n}
    actual = sum(t.numel() * t.element_size() for t in tensors.values())
    spec = ModelSpec.from_model_config(cfg)
    assert weight_memory(spec, quant_scheme(scheme, dtype, group_size=32), dtype).total == actual


def test_kv_bytes_per_token():
    assert MODEL_PRESETS["Llama-3-8B"].kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert MODEL_PRESETS["Llama-3-70B"].kv_bytes_per_token(2) == 320 * 1024
    assert MODEL_PRESETS["7B"].kv_bytes_per_token(2) == 512 * 1024  # no GQA
    assert MODEL_PRESETS["Qwen2.5-7B"].kv_bytes_per_token(1) == 2 * 28 * 4 * 128


def test_bundled_model_against_its_gguf_tensors():
    gguf = pytest.importorskip("gguf")
    from inferlab.models.config import resolve_model_path

    try:
        path = resolve_model_path(None)
    except FileNotFoundError:
        pytest.skip("bundled model not installed")
    elements = sum(int(t.n_elements) for t in gguf.GGUFReader(str(path)).tensors)
    spec = resolve_model(None)
    assert spec.num_params == elements  # the file itself is the oracle
    assert spec.kv_bytes_per_token(2) == 2 * 30 * 3 * 64 * 2
    # Tied embeddings: the LM head is the table, which stays 16-bit; the linears are the 30 blocks only.
    w = weight_memory(spec, quant_scheme("none"), "bf16")
    assert w.quantized_bytes == 2 * 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)
    assert w.unquantized_bytes == 2 * (49152 * 576 + 30 * 2 * 576 + 576)


def test_kv_and_fit_for_a_request():
    spec = MODEL_PRESETS["Llama-3-8B"]
    r = fit(spec, H100, FitRequest(context=1000, concurrency=4, block_size=16))
    assert r.kv_tokens_per_seq == 1008  # 63 blocks of 16
    assert r.kv_bytes == 131072 * 1008 * 4
    assert r.budget_bytes == pytest.approx(0.9 * 80 * GiB)
    assert r.needed_bytes == r.weights["none"].total + r.kv_bytes + r.activation_bytes
    assert r.fits


def test_max_concurrency_is_the_boundary():
    spec, req = MODEL_PRESETS["Llama-3-8B"], FitRequest(context=8192, concurrency=1)
    n = fit(spec, H100, req).max_concurrency
    assert fit(spec, H100, FitRequest(context=8192, concurrency=n)).fits
    assert not fit(spec, H100, FitRequest(context=8192, concurrency=n + 1)).fits
    # At 64 sequences memory, not the model's 8,192 positions, bounds the context.
    ctx = fit(spec, H100, FitRequest(context=16, concurrency=64)).max_context
    assert 0 < ctx < spec.max_position_embeddings
    assert fit(spec, H100, FitRequest(context=ctx, concurrency=64)).fits
    assert not fit(spec, H100, FitRequest(context=ctx + 16, concurrency=64)).fits


def test_big_model_fits_only_where_it_should():
    spec = MODEL_PRESETS["Llama-3-70B"]
    l4 = HARDWARE_PRESETS["L4"]
    assert not fit(spec, l4, FitRequest(context=1024)).fits
    h200 = HARDWARE_PRESETS["H200"]
    # 141.1 GB of bf16 weights: over 90% of 141 GiB (136.3 GB), under 95% (143.8 GB).
    assert not fit(spec, h200, FitRequest(context=1024)).fits
    assert fit(spec, h200, FitRequest(context=1024, reserve_frac=0.05)).fits
    assert fit(spec, h200, FitRequest(context=1024, quantization="int8")).fits
    capped = fit(spec, h200, FitRequest(context=1024, quantization="int8", memory_budget=40 * 10**9))
    assert capped.budget_bytes == 40 * 10**9 and not capped.fits


def test_decode_roofline_hand_computed():
    spec = MODEL_PRESETS["Llama-3-8B"]
    r = fit(spec, H100, FitRequest(context=4096, concurrency=8))
    weights_read = 2 * (spec.num_params - 128256 * 4096)  # the untied embedding table is looked up, not read
    kv = 131072 * 4096
    one, eight = r.decode
    assert one.weight_bytes_read == weights_read
    assert one.memory_ms == pytest.approx((weights_read + kv) / 3.35e12 * 1e3)
    assert eight.memory_ms == pytest.approx((weights_read + 8 * kv) / 3.35e12 * 1e3)
    matmul = spec.num_params - 128256 * 4096 - (32 * 2 * 4096 + 4096)  # everything but the lookup and the norms
    flops_one = 2 * matmul + 4 * 32 * 32 * 128 * 4096
    assert one.flops == flops_one and eight.flops == 8 * flops_one
    assert one.compute_ms == pytest.approx(flops_one / 989.5e12 * 1e3)
    assert one.bound == "memory" and one.step_ms == one.memory_ms
    assert eight.tokens_per_s == pytest.approx(8 * 1e3 / eight.step_ms)
    assert r.machine_balance == pytest.approx(989.5e12 / 3.35e12)


def test_prefill_roofline_hand_computed():
    spec = MODEL_PRESETS["Llama-3-8B"]
    r = fit(spec, H100, FitRequest(context=4096, prompt_len=2000))
    body = 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    flops = 2 * 2000 * body + 2 * 32 * 32 * 128 * 2000**2 + 2 * 128256 * 4096
    assert r.prefill.flops == flops
    assert r.prefill.compute_ms == pytest.approx(flops / 989.5e12 * 1e3)
    assert r.prefill.bound == "compute"
    # w8a8 computes at the int8 rate where the hardware has one; int8 weight-only keeps bf16's
    w8 = fit(spec, H100, FitRequest(context=4096, prompt_len=2000, quantization="w8a8"))
    assert w8.prefill.compute_ms == pytest.approx(flops / 1979e12 * 1e3)
    assert fit(spec, H100, FitRequest(context=4096, prompt_len=2000, quantization="int8")).prefill.compute_ms == \
        pytest.approx(r.prefill.compute_ms)


def test_compute_bound_batch_closed_form():
    """Dense decode: flops = B·f, bytes = W + B·k, so intensity reaches R at B = R·W / (f − R·k)."""
    spec = MODEL_PRESETS["Llama-3-8B"]
    for ctx in (1, 256, 512):
        r = fit(spec, H100, FitRequest(context=ctx))
        R = 989.5e12 / 3.35e12
        W = 2 * (spec.num_params - 128256 * 4096)
        f = r.decode[0].flops
        k = 131072 * ctx
        expected = math.ceil(R * W / (f - R * k)) if f > R * k else None
        assert r.compute_bound_batch == expected, ctx
    assert fit(spec, H100, FitRequest(context=1)).compute_bound_batch_short == pytest.approx(R, rel=0.02)
    # At 8k context the KV reads (intensity ~ heads/kv_heads) keep decode memory-bound at any batch.
    assert fit(spec, H100, FitRequest(context=8192)).compute_bound_batch is None


def test_moe_reads_only_touched_experts():
    spec = MODEL_PRESETS["Mixtral-8x7B"]
    r = fit(spec, H100, FitRequest(context=16, concurrency=4096, reserve_frac=0.0, memory_budget=None))
    expert = 2 * 3 * 4096 * 14336
    all_read = r.weights["none"].total - 2 * 32000 * 4096
    one, many = r.decode
    assert one.weight_bytes_read == pytest.approx(all_read - 32 * 6 * expert)  # 2 of 8 experts per layer
    assert many.weight_bytes_read == pytest.approx(all_read)  # 4096 tokens touch every expert
    assert one.flops == pytest.approx(2 * (spec.active_params - 32000 * 4096 - 32 * 2 * 4096 - 4096) + 4 * 32 * 32 * 128 * 16)


def test_scheme_changes_decode_bytes_not_flops():
    spec = MODEL_PRESETS["Qwen2.5-7B"]
    a = fit(spec, H100, FitRequest(context=64)).decode[0]
    b = fit(spec, H100, FitRequest(context=64, quantization="int4")).decode[0]
    assert b.flops == a.flops and b.weight_bytes_read < a.weight_bytes_read / 2


def test_resolve_by_path_and_errors(tmp_path):
    mixtral = {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768}
    (tmp_path / "config.json").write_text(json.dumps(mixtral))
    spec = resolve_model(str(tmp_path))
    assert spec.num_params == MODEL_PRESETS["Mixtral-8x7B"].num_params
    llama = tmp_path / "llama"
    llama.mkdir()
    cfg = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8}
    (llama / "config.json").write_text(json.dumps(cfg))
    assert resolve_model(str(llama)).num_params == MODEL_PRESETS["Llama-3-8B"].num_params
    assert resolve_model("llama3-8b") is MODEL_PRESETS["Llama-3-8B"]  # case and punctuation ignored
    with pytest.raises(Exception, match="neither a model preset"):
        resolve_model("Llama-9-1T")
    with pytest.raises(ValueError, match="unknown hardware 'TPU'.*H100 SXM"):
        resolve_hardware("TPU")
    assert resolve_hardware("h100") is H100
    with pytest.raises(ValueError, match="concurrency must be at least 1"):
        fit(spec, H100, FitRequest(concurrency=0))
    with pytest.raises(ValueError, match="unknown quantization"):
        fit(spec, H100, FitRequest(quantization="int3"))
    with pytest.raises(ValueError, match="quantization bf16 keeps bf16 weights under fp32 activations"):
        fit(spec, H100, FitRequest(quantization="bf16", dtype="bf16"))
    assert "bf16" not in fit(spec, H100, FitRequest()).weights  # only beside fp32 activations
    fp32 = fit(spec, H100, FitRequest(dtype="fp32"))
    assert fp32.weights["bf16"].total < fp32.weights["none"].total


def test_cli_json_and_table(capsys):
    from inferlab.cli import main

    assert main(["fit", "--model", "7B", "--hardware", "A100 80GB", "--quantization", "int4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["selected"] == "int4" and d["fits"] is True
    assert d["weights"]["none"]["total"] == 2 * MODEL_PRESETS["7B"].num_params
    assert d["hardware_source"].startswith("NVIDIA A100")
    assert main(["fit", "--model", "Llama-3-70B", "--hardware", "L4", "--context", "2048"]) == 0
    out = capsys.readouterr().out
    assert "does not fit" in out and "roofline" in out
    assert main(["fit", "--model", "7B", "--hardware", "L4", "--memory-budget", "20"]) == 2
    assert "has no unit" in capsys.readouterr().err


def test_probe_measures_this_machine(monkeypatch):
    from inferlab.lab import hardware

    hw = hardware.probe_this_machine(seconds=0.02)
    monkeypatch.setattr(hardware, "probe_this_machine", lambda: hw)
    assert resolve_hardware("This Machine") is hw
    assert hw.measured and hw.name.startswith("this machine")
    assert hw.bandwidth > 0 and hw.flops["bf16"] > 0 and hw.flops["fp32"] > 0 and hw.memory_bytes > 0
    r = fit(ModelSpec("tiny", 1000, 64, 128, 2, 4, 2, 16, 512, True), hw, FitRequest(context=256))
    assert r.fits and r.hardware_measured


# Totals of each model's safetensors (model card / index metadata); Gemma-3-4B counts its text model only.
@pytest.mark.parametrize("name, published", [
    ("Llama-3.1-8B", 8_030_261_248), ("Llama-3.2-1B", 1_235_814_400), ("Llama-3.2-3B", 3_212_749_824),
    ("Qwen2.5-0.5B", 494_032_768), ("Qwen2.5-1.5B", 1_543_714_304), ("Qwen3-0.6B", 596_049_920),
    ("Qwen3-8B", 8_190_735_360), ("Gemma-3-270M", 268_098_176), ("Gemma-3-1B", 999_885_952),
    ("Mistral-7B", 7_241_732_096),
])
def test_family_preset_param_counts_are_the_published_totals(name, published):
    assert MODEL_PRESETS[name].num_params == published


def test_every_context_figure_is_capped_at_the_models_maximum():
    spec = resolve_model(None)  # SmolLM2-135M: 8,192 positions; an H100 holds millions of its tokens
    assert spec.max_position_embeddings == 8192
    r = fit(spec, H100, FitRequest(context=2048, concurrency=1))
    assert r.max_context == 8192
    r = fit(MODEL_PRESETS["Llama-3-70B"], H100, FitRequest(context=2048, concurrency=64, quantization="int4"))
    assert 0 < r.max_context < 8192  # a budget-bound figure is not raised to the cap


def test_sliding_window_layers_hold_at_most_their_window():
    g = MODEL_PRESETS["Gemma-3-270M"]  # 3 global + 15 local (512) layers; 1 KV head of 256: 1 KiB per layer-token
    per_layer_token = 2 * 1 * 256 * 2
    assert g.kv_bytes_per_seq(32768, 2) == (3 * 32768 + 15 * 512) * per_layer_token
    assert g.kv_bytes_per_seq(300, 2) == 18 * 300 * per_layer_token  # within the window every layer holds all
    m = MODEL_PRESETS["Mistral-7B"]  # every layer windowed at 4096: KV stops growing there
    assert m.kv_bytes_per_seq(32768, 2) == m.kv_bytes_per_seq(4096, 2) == 4096 * m.kv_bytes_per_token(2)
    r = fit(m, H100, FitRequest(context=32768, concurrency=8, block_size=16))
    assert r.kv_bytes == 8 * 4096 * m.kv_bytes_per_token(2)
    assert r.max_context == 32768  # the window bounds the KV, so only the model's limit bounds the context
    assert r.decode[-1].kv_bytes_read == 8 * 4096 * m.kv_bytes_per_token(2)
