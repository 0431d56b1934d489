"""Shared by the speculative-decoding tests: the session's float32 engine on one thread, 16 varied prompts, and
their greedy outputs without speculation (the oracle)."""

from __future__ import annotations

import pytest
import torch

from speclib import GREEDY, TEXTS


@pytest.fixture(scope="module")
def llm(llm_fp32):
    # One intra-op thread: on a shared, loaded machine OpenMP threads spin against each other.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield llm_fp32
    torch.set_num_threads(threads)
    llm_fp32.engine.proposer = None


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


@pytest.fixture(scope="module")
def expected(llm, prompts):
    assert llm.engine.proposer is None
    return [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
