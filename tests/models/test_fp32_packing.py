"""fp32 layers on oneDNN's pre-packed GEMM, the path where inferlab's kernels are not built vectorised (a CPU without
AVX-512 BF16, whose default dtype is fp32: layers/packed_linear.py, onednn_fp32_packing). The packing itself is
forced, so that it runs on every CPU; the claims the engine rests on there, that a row's result does not depend on
the other rows of its step (so the model drops the row padding of batch_invariant_rows) and that greedy tokens stay
transformers', were measured on such a CPU (an AVX2-only EPYC) and are tested where the path is the default."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_oracle import hf_generate
from tiny_models import build_hf_model, save_hf
from torch import nn

from inferlab import LLM, SamplingParams
from inferlab.layers import packed_linear
from inferlab.layers.packed_linear import PackedLinear, onednn_fp32_packing, pack_linears, weight_bytes

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time, in a quiet village, there"]


@pytest.fixture
def fp32_packing(monkeypatch):
    monkeypatch.setattr(packed_linear, "onednn_fp32_packing", lambda: True)


def test_fp32_layers_pack_for_onednn(fp32_packing):
    torch.manual_seed(0)
    emb = nn.Embedding(50, 96)
    head = nn.Linear(96, 50, bias=False)
    head.weight = emb.weight
    proj = nn.Linear(96, 136, bias=False)
    w = proj.weight.detach().clone()
    net = nn.ModuleDict({"emb": emb, "head": head, "proj": proj, "biased": nn.Linear(96, 8)})
    loaded = weight_bytes([net])
    added = pack_linears(net)
    layer = net["proj"]
    assert isinstance(layer, PackedLinear) and layer.packed.is_mkldnn and layer.packed.dtype == torch.float32
    assert type(net["biased"]) is nn.Linear  # only bias-free layers are packed
    # No torch gemv reads an fp32 layer's plain weight: the projection's lives in its packed copy only, and a
    # read unpacks it; the tied head keeps the embedding's. So packing adds the head's copy alone.
    assert "weight" not in layer._parameters and torch.equal(layer.weight, w)
    assert torch.equal(net.state_dict()["proj.weight"], w) and net["head"].weight is emb.weight
    assert added == 50 * 96 * 4 and weight_bytes([net]) == loaded
    x = torch.randn(70, 96)
    y = layer(x)
    ref = x.double() @ w.double().T
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(net["head"](x[:3]), F.linear(x[:3], emb.weight), atol=1e-5, rtol=1e-5)


where_default = pytest.mark.skipif(not onednn_fp32_packing(), reason="fp32 packs for oneDNN only where inferlab's "
                                   "kernels are not vectorised (no AVX-512 BF16)")


@where_default
def test_onednn_fp32_rounds_each_row_alone():
    torch.manual_seed(0)
    layer = PackedLinear(nn.Linear(576, 1536, bias=False))  # one of SmolLM2-135M's shapes
    x = torch.randn(300, 576)
    with torch.no_grad():
        y = layer(x)
        for rows in (1, 2, 3, 4, 5, 7, 9, 11, 12, 17, 64, 65, 129):  # MKL's sgemm rounds 1-3, 5-7, 9-11 otherwise
            assert torch.equal(layer(x[:rows]), y[:rows]), rows
            assert torch.equal(layer(x[rows:2 * rows]), y[rows:2 * rows]), rows


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    from inferlab.models.loader import load_tokenizer

    tok = load_tokenizer(None)
    out = {}
    for family in ("mistral", "qwen2"):
        hf = build_hf_model(family)
        out[family] = (hf, save_hf(hf, tok, tmp_path_factory.mktemp(family)))
    return out


@where_default
def test_engine_on_fp32_packing_drops_row_padding_and_keeps_greedy_tokens(tiny_folders):
    hf, folder = tiny_folders["mistral"]
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=32 * 2**20)
    model = llm.engine.runner.model
    projections = [m for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    assert projections and all(isinstance(m, PackedLinear) and m.packed.is_mkldnn for m in projections)
    assert not model.pad_rows  # every GEMM rounds a row alone: no padding to batch_invariant_rows
    ids = [llm.engine.tokenize_prompt(p)[0] for p in PROMPTS]
    expected = [hf_generate(hf, x, 24) for x in ids]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, sp)] == expected  # decode steps of 3 rows, unpadded
    assert [llm.generate([p], sp)[0].token_ids for p in PROMPTS] == expected  # of 1 row
    assert llm.generate(PROMPTS * 3, sp)[4].token_ids == expected[1]  # of 9 rows


def test_biased_projections_keep_the_row_padding(fp32_packing, tiny_folders):
    """Qwen2's q/k/v carry biases, so they stay torch's F.linear (MKL), which needs the padding."""
    _, folder = tiny_folders["qwen2"]
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=32 * 2**20)
    model = llm.engine.runner.model
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    assert any(type(m) is nn.Linear for m in model.modules()) and model.pad_rows
