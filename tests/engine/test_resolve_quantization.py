"""--quantization auto: bf16 weights where --dtype auto fell back to float32 (a CPU without AVX-512 BF16) and
inferlab's kernel for them is vectorised; none elsewhere, and whenever the dtype or the scheme was asked for."""

from __future__ import annotations

import pytest
import torch

import inferlab.engine.llm_engine as llm_engine
from inferlab.engine.llm_engine import resolve_quantization

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("name", ["none", "int8", "int4", "w8a8", "bf16"])
def test_an_explicit_scheme_is_kept(name):
    assert resolve_quantization(name, "auto", torch.float32, CPU) == name


def test_auto_takes_bf16_weights_only_under_an_fp32_fallback_with_the_kernel(monkeypatch):
    monkeypatch.setattr(llm_engine, "int_gemv_kernels", lambda: object())
    assert resolve_quantization("auto", "auto", torch.float32, CPU) == "bf16"
    assert resolve_quantization("auto", "auto", torch.bfloat16, CPU) == "none"  # bf16 activations: bf16 weights
    assert resolve_quantization("auto", "float32", torch.float32, CPU) == "none"  # float32 asked for: its weights
    assert resolve_quantization("auto", "auto", torch.float32, CUDA) == "none"
    monkeypatch.setattr(llm_engine, "int_gemv_kernels", lambda: None)  # the scalar build, or INFERLAB_KERNELS=0
    assert resolve_quantization("auto", "auto", torch.float32, CPU) == "none"
