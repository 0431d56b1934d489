"""The default bf16 path keeps its recorded greedy outputs (see golden_bf16.py for how they are made).

Where the CPU has AMX, the default sends steps of four rows or more to oneDNN's GEMM (layers/packed_linear.py), whose
roundings differ from inferlab's kernel's, so a sequence's tokens there can depend on what shared its steps. The
test pins the batch-invariant path (row_invariant.py), so it runs on every CPU."""

from __future__ import annotations

import json

import pytest

from golden_bf16 import GOLDEN, engine_path, generate
from row_invariant import row_invariant_packing


@pytest.fixture(scope="module")
def llm_default():
    from inferlab import LLM

    with row_invariant_packing():
        return LLM()


def test_default_engine_reproduces_recorded_greedy_outputs(llm_default):
    recorded = json.loads(GOLDEN.read_text())
    if engine_path(llm_default) != recorded["path"]:
        pytest.skip(f"this machine takes another numeric path ({engine_path(llm_default)}) than the recording "
                    f"({recorded['path']})")
    got = generate(llm_default)
    assert got["batched"] == recorded["batched"]
    assert got["alone"] == recorded["alone"]
    assert all(len(t) == 64 for t in got["alone"])
    # Every prefill runs as rows of the batch-invariant decode kernel, so a prompt's tokens do not depend on what
    # shared its steps (before, a lone prompt's causal SDPA and a batch's gathered SDPA rounded differently).
    assert got["batched"] == got["alone"]
