"""Continuous batching must not change results: batch invariance, staggered arrivals, preemption, bad input."""

from __future__ import annotations

import pytest

from inferlab import LLM, SamplingParams
from inferlab.common.errors import InvalidRequestError, ModelLoadError

TEXTS = [
    "The history of the printing press begins in the fifteenth century, when",
    "def merge_sort(xs):\n    if len(xs) <= 1:\n        return xs\n",
    "A recipe for bread: mix flour, water, salt and yeast, then",
    "In mathematics, a prime number is",
    "The quick brown fox jumps over the lazy dog. " * 12,
    "Dear team, thank you for your hard work this quarter. Our results show that",
    "Photosynthesis is the process by which plants",
    "import numpy as np\n\nx = np.linspace(0, 1, 100)\n",
]


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    """n token-id prompts of mixed lengths (3 to ~140 tokens) cut from varied texts."""
    prompts = []
    for i in range(n):
        ids = tokenizer.encode(TEXTS[i % len(TEXTS)] * (1 + i % 3), add_special_tokens=False)
        prompts.append(ids[: 3 + (i * 37) % 140])
    return prompts


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(llm_fp32):
    prompts = make_prompts(llm_fp32.tokenizer, 32)
    return prompts, [llm_fp32.generate({"prompt_token_ids": p}, GREEDY)[0].token_ids for p in prompts]


def test_batch_of_32_with_staggered_arrivals_matches_alone(llm_fp32, alone):
    prompts, expected = alone
    eng = llm_fp32.engine
    results: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or eng.has_work():
        for _ in range(min(5, len(pending))):  # five new arrivals per step while the batch keeps running
            i, p = pending.pop(0)
            eng.add_request(f"stagger-{i}", p, GREEDY)
        for out in eng.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i in range(len(prompts)):
        assert results[f"stagger-{i}"] == expected[i], f"prompt {i} changed when batched"


def test_tiny_pool_preempts_and_still_matches(alone):
    prompts, expected = alone
    # 12 blocks of 16 tokens: far less than 8 concurrent sequences need, so preemption happens all the time.
    per_block = 2 * 30 * 3 * 64 * 4 * 16
    llm = LLM(dtype="float32", kv_cache_memory=12 * per_block, max_num_seqs=8)
    chosen = [i for i in range(len(prompts)) if len(prompts[i]) + 24 <= 12 * 16][:8]
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in chosen], GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    for i, out in zip(chosen, outs):
        assert out.token_ids == expected[i]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.block_tables
    # A prompt the pool can never hold is refused with the reason; the engine still serves the next request.
    with pytest.raises(InvalidRequestError, match="KV cache pool"):
        llm.engine.add_request("too-big", list(range(100, 300)), GREEDY)
    assert llm.generate({"prompt_token_ids": prompts[0]}, GREEDY)[0].token_ids == expected[0]


def test_bad_requests_do_not_disturb_running_ones(llm_fp32, alone):
    prompts, expected = alone
    eng = llm_fp32.engine
    got: dict[str, list[int]] = {}

    def collect(outputs):
        for out in outputs:
            got.setdefault(out.request_id, []).extend(out.new_token_ids)

    eng.add_request("good-a", prompts[1], GREEDY)
    collect(eng.step())
    with pytest.raises(InvalidRequestError, match="maximum context length is 8192"):
        eng.add_request("long", [5] * 9000, GREEDY)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        eng.add_request("zero", prompts[2], SamplingParams(max_tokens=0))
    with pytest.raises(InvalidRequestError, match="out of the vocabulary"):
        eng.add_request("vocab", [10**7], GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        eng.add_request("empty", "", GREEDY)
    eng.add_request("good-b", prompts[2], GREEDY)
    while eng.has_work():
        collect(eng.step())
    assert got == {"good-a": expected[1], "good-b": expected[2]}


def test_abort_frees_everything(llm_fp32, alone):
    prompts, _ = alone
    eng = llm_fp32.engine
    for i in range(4):
        eng.add_request(f"ab-{i}", prompts[i], SamplingParams(max_tokens=50))
    eng.step()
    eng.step()
    assert eng.abort("ab-0") and eng.abort("ab-3") and not eng.abort("ab-unknown")
    while eng.has_work():
        assert all(o.request_id not in ("ab-0", "ab-3") for o in eng.step())
    bm = eng.block_manager
    assert not bm.block_tables and bm.num_free_blocks == bm.num_blocks


def test_unknown_model_path_and_unsupported_architecture(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(model=str(tmp_path / "nope.gguf"))
    import gguf
    import numpy as np

    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="architecture 'mamba' is not supported"):
        LLM(model=str(path))
