"""The engine against an independent implementation: transformers' LlamaForCausalLM loaded from the same GGUF."""

from __future__ import annotations

import pytest
import torch

from hf_oracle import hf_generate

from inferlab import SamplingParams

PLAIN = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
]
CHAT = [
    [{"role": "user", "content": "What is 12 times 7?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What color is the sky?"}],
    [{"role": "user", "content": "Explain what a hash table is in two sentences."}],
]


def _ids(llm, prompt) -> list[int]:
    return llm.engine.tokenize_prompt(prompt)[0]


@pytest.mark.parametrize("prompt", PLAIN[:2] + CHAT[:2], ids=["plain0", "plain1", "chat0", "chat1"])
def test_last_position_logits_match(llm_fp32, hf_model, prompt):
    ids = _ids(llm_fp32, prompt)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0, -1].float()
    eng = llm_fp32.engine
    # Through the real paged path: one prefill step, logits of the last position.
    from inferlab.engine.scheduler import ScheduledBatch
    from inferlab.engine.sequence import Sequence
    from inferlab.engine.outputs import RequestMetrics

    seq = Sequence("logits-probe", ids, SamplingParams(temperature=0), RequestMetrics(0.0))
    assert eng.block_manager.allocate(seq, len(ids))
    try:
        inputs = eng.runner.prepare(ScheduledBatch([seq], [len(ids)], 0), [eng.block_manager.table("logits-probe")])
        ours = eng.runner.execute(inputs)[0]
    finally:
        eng.block_manager.free(seq)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_score_matches_transformers_logprobs(llm_fp32, hf_model):
    ids = _ids(llm_fp32, PLAIN[2])
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    ref_lp = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(llm_fp32.score(ids)), ref_lp, atol=2e-4, rtol=1e-4)


def test_greedy_64_tokens_identical_to_generate(llm_fp32, hf_model):
    prompts = PLAIN + CHAT
    outs = llm_fp32.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = _ids(llm_fp32, prompt)
        with torch.no_grad():
            ref = hf_generate(hf_model, ids, 64)
        assert out.token_ids == ref, f"diverged for {prompt!r}"
        assert len(out.token_ids) == 64 and out.finish_reason == "length"


@pytest.mark.slow
def test_bf16_weights_greedy_identical_to_transformers_on_the_rounded_weights(hf_model):
    """--quantization bf16 (bf16 weights, fp32 activations: quant/bf16.py) against transformers' model with the
    same rounding done to its weights, computing in fp32: prefills, batched and single decode steps."""
    import copy

    from inferlab import LLM

    rounded = copy.deepcopy(hf_model)
    with torch.no_grad():
        for m in rounded.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                m.weight.copy_(m.weight.bfloat16().float())
    llm = LLM(quantization="bf16", dtype="float32", kv_cache_memory=64 * 2**20)
    prompts = PLAIN[:2] + CHAT[:2]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    together = llm.generate(prompts, sp)
    alone = llm.generate(prompts[:1], sp)
    for prompt, out in zip(prompts, together):
        ref = hf_generate(rounded, _ids(llm, prompt), 32)
        assert out.token_ids == ref, f"diverged for {prompt!r}"
    assert alone[0].token_ids == together[0].token_ids
