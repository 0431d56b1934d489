"""The bundled model in every quantization mode (slow: each mode loads the model once).

The float32 model (`llm_fp32`, shared with the engine tests) is the reference: the quantized models must load
through the intended path, use less memory, generate, and stay close to it; and the evaluation must catch a
deliberately broken quantization.
"""

from __future__ import annotations

import pytest
import torch

from inferlab import LLM, SamplingParams
from inferlab.lab import eval as ev
from inferlab.quant import Int4Linear, Int8Linear, QuantEmbedding, QuantLinear, W8A8Linear

pytestmark = pytest.mark.slow

TEXT = ("The lighthouse on Grey Point had been automatic for eleven years, but nobody had told the lighthouse "
        "that. Every evening at dusk its lamp still came on with a small hesitation.")
PROMPTS = ["The capital of France is", [{"role": "user", "content": "What is 12 + 7?"}], "def add(a, b):\n    return"]


@pytest.fixture(scope="module", params=["int8", "int4", "w8a8"])
def qllm(request):
    return LLM(quantization=request.param, kv_cache_memory=64 * 2**20)


def test_loads_through_the_intended_path(qllm, llm_fp32):
    scheme = qllm.engine.config.quantization
    model = qllm.engine.runner.model
    layer_cls = {"int8": Int8Linear, "int4": Int4Linear, "w8a8": W8A8Linear}[scheme]
    assert all(isinstance(model.model.layers[i].mlp.down_proj, layer_cls) for i in range(len(model.model.layers)))
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    assert isinstance(model.lm_head, W8A8Linear if scheme == "w8a8" else Int8Linear)
    path = qllm.engine.quant_path
    if scheme == "int4":  # the bundled file is Q4_1: no requantization of the layers
        assert "210 linear layers" not in path and "120 linear layers GGUF Q4_1 blocks loaded directly" in path
    else:
        assert "120 linear layers requantized from GGUF Q4_1" in path
    assert "requantized from GGUF Q8_0" in path  # the tied head/embedding
    # fp32 weights are 4 bytes a parameter; int8 ~1 and int4 ~0.6 (plus fp32 norms), head int8 in all.
    assert qllm.engine.weight_bytes < llm_fp32.engine.weight_bytes * (0.22 if scheme == "int4" else 0.3)


def test_generates_and_tracks_the_float_model(qllm, llm_fp32):
    outs = qllm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    assert all(len(o.token_ids) >= 1 and o.text for o in outs)
    assert "Paris" in outs[0].text
    ids = qllm.tokenizer.encode(TEXT, add_special_tokens=False)
    q, ref = torch.tensor(qllm.score(ids)), torch.tensor(llm_fp32.score(ids))
    # Mean log-likelihood within a few percent of float32's, and per-token log-probs strongly correlated.
    assert abs(q.mean() - ref.mean()) < 0.05 * abs(ref.mean())
    assert torch.corrcoef(torch.stack([q, ref]))[0, 1] > 0.97


@pytest.mark.parametrize("qllm", ["int8"], indirect=True)  # one broken mode is enough
def test_eval_catches_zeroed_scales(qllm, tmp_path):
    (tmp_path / "prose_x.txt").write_text(TEXT * 2)
    settings = ev.EvalSettings(window=64, max_prompts=3, continuation_prompts=3, continuation_tokens=6,
                               task_max_tokens=4, corpus=str(tmp_path))
    gate = ev.Gate(max_ppl_increase=0.10, min_agreement=0.5)
    healthy = ev.evaluate(qllm, settings)
    layers = [m for m in qllm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    saved = [m.scales.clone() for m in layers]
    try:
        for m in layers:
            m.scales.zero_()
        broken = ev.evaluate(qllm, settings)
    finally:
        for m, s in zip(layers, saved):
            m.scales.copy_(s)
    report = {**broken, **ev.compare(broken, healthy)}
    fails = gate.check(report)
    assert any("perplexity rose" in f for f in fails) and any("greedy agreement" in f for f in fails)
    assert report["perplexity"]["perplexity"] > 10 * healthy["perplexity"]["perplexity"]
    assert gate.check({**healthy, **ev.compare(healthy, healthy)}) == []
