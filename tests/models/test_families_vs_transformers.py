"""Qwen2 (untied and tied heads), Qwen3 and Mistral (sliding window 8) against transformers on tiny random-weight
models the tests build (tests/models/tiny_models.py), loaded by inferlab from the Hugging Face folder and from a
GGUF file: log-probabilities of every position, and greedy continuations token-for-token, batched and alone, with
prefix caching on and off, for prompts shorter and longer than Mistral's window. float32 throughout."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import hf_generate
from tiny_models import build_hf_model, save_gguf, save_hf

from inferlab import LLM, SamplingParams

pytestmark = pytest.mark.slow

FAMILIES = ["qwen2", "qwen2-tied", "qwen3", "mistral"]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    # Longer than Mistral's window (8) and than a KV block (16).
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning rowed out",
    "The three primary colors are",
]
N = 48


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> (transformers model, HF folder, GGUF file), built once per module."""
    from inferlab.common.bundled import bundled_model_path
    from inferlab.models.loader import load_tokenizer

    tok = load_tokenizer(None)
    out = {}
    for fam in FAMILIES:
        m = build_hf_model(fam)
        root = tmp_path_factory.mktemp(fam)
        out[fam] = (m, save_hf(m, tok, root / "hf"), save_gguf(m, fam, root / f"{fam}.gguf", bundled_model_path()))
    return out, tok


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", kv_cache_memory=32 * 2**20, **kw)


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers(built, family, fmt):
    models, _ = built
    hf, folder, gguf_file = models[family]
    refs: dict[tuple[int, ...], list[int]] = {}
    for caching in (True, False):
        llm = _llm(folder if fmt == "hf" else gguf_file, enable_prefix_caching=caching)
        cfg = llm.engine.model_config
        # llama.cpp writes Mistral as the llama architecture; the window comes from its own key.
        arch = {"qwen2-tied": "qwen2", "mistral": "mistral" if fmt == "hf" else "llama"}.get(family, family)
        assert (cfg.architecture, cfg.sliding_window) == (arch, 8 if family == "mistral" else None)
        # The model's own tokenizer (transformers may load a saved one as its family's class, which splits text
        # its own way): the oracle gets the same ids.
        ids = [llm.engine.tokenize_prompt(p)[0] for p in PROMPTS]
        assert len(ids[2]) > 16 > 8
        refs.update({tuple(x): hf_generate(hf, x, N) for x in ids if tuple(x) not in refs})
        expected = [refs[tuple(x)] for x in ids]
        if caching:
            # Log-probabilities of every position of the long prompt (one causal pass). Tolerance: fp32 kernels
            # round differently from transformers' ops in the last bits; logits here span tens of units.
            with torch.no_grad():
                ref = hf(torch.tensor([ids[2]])).logits[0].float().log_softmax(-1)
            ref_lp = ref[:-1].gather(1, torch.tensor(ids[2][1:])[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(llm.score(ids[2])), ref_lp, atol=1e-3, rtol=1e-4)
        sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
        batched = [o.token_ids for o in llm.generate(PROMPTS, sp)]
        assert batched == expected, f"{family}/{fmt}: batched greedy diverged (prefix caching {caching})"
        again = llm.generate(PROMPTS, sp)  # the same prompts again: with caching, their prefixes are reused
        assert [o.token_ids for o in again] == expected
        assert (sum(o.num_cached_tokens for o in again) > 0) == caching
        alone = [llm.generate([x], sp)[0].token_ids for x in ids]  # token ids in, one at a time
        assert alone == expected, f"{family}/{fmt}: greedy alone diverged (prefix caching {caching})"


def test_decode_plan_declines_layers_it_does_not_implement(built):
    """The C++ plan has no Q/K/V biases: for Qwen2 it is not built (the Python layers run decode) rather than
    computing something else. Qwen3's QK-norm it has (tests/models/test_decode_plan.py checks it token for token)."""
    from inferlab.kernels import gemv_kernels

    models, _ = built
    # Qwen3's plan needs what every plan needs: inferlab's AVX-512 BF16 kernels.
    for family, has_plan in (("qwen2", False), ("qwen3", gemv_kernels() is not None)):
        llm = LLM(model=str(models[family][1]), dtype="bfloat16", kv_cache_memory=32 * 2**20)
        model = llm.engine.runner.model.model
        assert model.build_decode_plan() is has_plan and (model.decode_plan is not None) is has_plan


@pytest.mark.skipif(__import__("inferlab.kernels", fromlist=["gemv_kernels"]).gemv_kernels() is None,
                    reason="the plan needs inferlab's AVX-512 BF16 kernels")
def test_windowed_decode_plan_is_exact(built, monkeypatch):
    """Mistral keeps the plan for decode steps whose every context fits the window and leaves the rest to the
    layers' masked attention: greedy bf16 generations are identical with the plan and without it."""
    from inferlab.kernels import cpu_kernels

    models, _ = built
    llm = LLM(model=str(models["mistral"][1]), dtype="bfloat16", kv_cache_memory=32 * 2**20)
    model = llm.engine.runner.model.model
    assert model.decode_plan is not None
    kernels, calls = cpu_kernels(), []
    real = kernels.decode_layers
    monkeypatch.setattr(kernels, "decode_layers", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    short = [[1, 2], [3, 4, 5]]  # contexts 2..27: the first steps fit the window of 8, the later ones do not

    def run():
        return [o.token_ids for o in llm.generate(short, sp)] + [o.token_ids for o in llm.generate(PROMPTS, sp)]

    with_plan = run()
    assert calls  # the plan served the steps that fit
    model.decode_plan = None
    assert run() == with_plan


def test_quantization_refuses_biased_layers_and_serves_qwen3(built):
    models, _ = built
    with pytest.raises(ValueError, match="needs bias-free linear layers.*qkv_proj has a bias"):
        LLM(model=str(models["qwen2"][1]), dtype="bfloat16", quantization="int8", kv_cache_memory=32 * 2**20)
    # Qwen3's projections are bias-free: int8 quantizes them, and its log-probabilities stay near the float model's
    # (per-channel int8 of these random weights: a few percent).
    q = LLM(model=str(models["qwen3"][1]), dtype="float32", quantization="int8", kv_cache_memory=32 * 2**20)
    assert q.engine.runner.model.model.layers[0].self_attn.qkv_proj.__class__.__name__ == "Int8Linear"
    ids = q.engine.tokenize_prompt(PROMPTS[2])[0]
    with torch.no_grad():
        ref = models["qwen3"][0](torch.tensor([ids])).logits[0].float().log_softmax(-1)
    ref_lp = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    ours = torch.tensor(q.score(ids))
    torch.testing.assert_close(ours, ref_lp, rtol=0.05, atol=0.5)


def test_bf16_weights_serve_biased_qwen2_as_transformers_does_on_the_rounded_weights(built):
    """--quantization bf16 (what auto picks on a CPU without AVX-512 BF16) keeps Qwen2's Q/K/V biases: the oracle
    is transformers' model with its weights rounded to bf16, biases as they are, computing in fp32."""
    import copy

    models, _ = built
    hf, folder, _ = models["qwen2"]
    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for m in rounded.modules():
            if isinstance(m, torch.nn.Linear):  # the head too; this Qwen2's embedding is untied: it stays fp32
                m.weight.copy_(m.weight.bfloat16().float())
    llm = _llm(folder, quantization="bf16")
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert type(qkv).__name__ == "Bf16Linear" and qkv.bias is not None and qkv.qweight.dtype == torch.bfloat16
    ids = [llm.engine.tokenize_prompt(p)[0] for p in PROMPTS]
    with torch.no_grad():
        ref = rounded(torch.tensor([ids[2]])).logits[0].float().log_softmax(-1)
    ref_lp = ref[:-1].gather(1, torch.tensor(ids[2][1:])[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(llm.score(ids[2])), ref_lp, atol=1e-3, rtol=1e-4)
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, sp)] == [hf_generate(rounded, x, N) for x in ids]


def test_gemma3_hf_folder_matches_transformers(tmp_path):
    """Gemma 3 from a Hugging Face folder (config.json: Gemma3ForCausalLM; norm weights stored as the w of (1 + w),
    which the loader turns into 1 + w), tiny and random (tiny_models.hf_config: a query scale other than head_dim,
    a logit soft-cap, linear rope scaling, window 8): log-probabilities and greedy continuations, batched and alone.
    The GGUF path is tested on the real 270M in test_gemma3_vs_transformers.py."""
    from inferlab.models.loader import load_tokenizer

    hf = build_hf_model("gemma3")
    folder = save_hf(hf, load_tokenizer(None), tmp_path / "gemma3")
    llm = _llm(folder)
    cfg = llm.engine.model_config
    assert (cfg.architecture, cfg.sliding_window, cfg.layer_sliding, cfg.rope_scaling_factor,
            cfg.query_pre_attn_scalar, cfg.final_logit_softcapping) == ("gemma3", 8, (True, False, True), 2.0, 24, 30.0)
    ids = [llm.engine.tokenize_prompt(p)[0] for p in PROMPTS]
    with torch.no_grad():
        ref = hf(torch.tensor([ids[2]])).logits[0].float().log_softmax(-1)
    ref_lp = ref[:-1].gather(1, torch.tensor(ids[2][1:])[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(llm.score(ids[2])), ref_lp, atol=1e-3, rtol=1e-4)
    expected = [hf_generate(hf, x, N) for x in ids]
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, sp)] == expected
    assert [llm.generate([x], sp)[0].token_ids for x in ids] == expected
