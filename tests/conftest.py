"""Shared fixtures. Models are loaded once per session: loading takes seconds and every model test reuses them."""

from __future__ import annotations

import os

import pytest

# Tests run model work in several threads and processes at once (pytest, server subprocesses, clients) on a
# 2-core machine. OpenMP's default spin-waiting then makes each parallel region wait for descheduled spinners:
# measured here, a batch-1 decode step took 1.5 s with spinning and 0.1 s with passive waiting under such load.
# Must be set before torch (and so libgomp) is first imported; subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def llm_fp32():
    from inferlab import LLM

    # float32 so that comparisons with the transformers oracle are exact up to kernel rounding.
    return LLM(dtype="float32", kv_cache_memory=400 * 2**20)  # > 8192 tokens: the context, not the pool, limits


@pytest.fixture(scope="session")
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM

    from inferlab.common.bundled import bundled_model_path

    p = bundled_model_path()
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
