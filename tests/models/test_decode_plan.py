"""The one-call path for decode steps (kernels/decode_layers.cpp) computes exactly what the layers compute one by
one: same kernels, same order, so greedy generations are token-for-token identical with it and without it, for
steps inferlab's gemv takes (1-4 tokens) and for larger ones that use the packed weights."""

from __future__ import annotations

import pytest

from inferlab import LLM, SamplingParams
from inferlab.kernels import cpu_kernels, gemv_kernels

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(gemv_kernels() is None, reason="the plan needs inferlab's AVX-512 BF16 kernels")]

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time, in a quiet village,"]
MORE = ["The three primary colours are", "import numpy as np\n", "Dear Sir or Madam,", "In 1969, the first"]


def _generate(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    wide = [o.token_ids for o in llm.generate(PROMPTS + MORE, sp)]  # decode steps of 7 tokens: packed weights
    together = [o.token_ids for o in llm.generate(PROMPTS, sp)]  # decode steps of 3 tokens
    alone = [llm.generate([p], sp)[0].token_ids for p in PROMPTS]  # decode steps of 1
    return wide + together + alone


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_plan_is_token_identical_to_the_layers(quantization, monkeypatch):
    llm = LLM(quantization=quantization, dtype="bfloat16", kv_cache_memory=64 * 2**20)
    model = llm.engine.runner.model.model
    assert model.decode_plan is not None
    kernels, calls = cpu_kernels(), []
    # Every projection is handed to C++ as the kind of layer it is (the tied LM head is not a layer's projection).
    kind = {"none": kernels.ProjKind.PACKED, "int8": kernels.ProjKind.INT8, "int4": kernels.ProjKind.INT4}
    assert {getattr(layer, n).kind for layer in model.decode_plan.layers
            for n in ("qkv", "o", "gate_up", "down")} == {kind[quantization]}
    real = kernels.decode_layers
    monkeypatch.setattr(kernels, "decode_layers", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    with_plan = _generate(llm)
    assert set(calls) == {1, 3, 7}  # the plan really served the decode steps, wide, batched and alone
    plan, model.decode_plan = model.decode_plan, None
    calls.clear()
    without = _generate(llm)
    assert not calls
    assert with_plan == without
    model.decode_plan = plan


def test_no_plan_where_the_kernels_do_not_apply(llm_fp32):
    assert llm_fp32.engine.runner.model.model.decode_plan is None  # fp32: the layers run one by one
