"""Shared fixtures. Models are loaded once per session: loading takes seconds and every model test reuses them."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def llm_fp32():
    from inferlab import LLM

    # float32 so that comparisons with the transformers oracle are exact up to kernel rounding.
    return LLM(dtype="float32", kv_cache_memory=256 * 2**20)


@pytest.fixture(scope="session")
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM

    from inferlab.models.bundled import bundled_model_path

    p = bundled_model_path()
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
