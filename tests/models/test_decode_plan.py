"""The one-call path for decode steps (kernels/decode_layers.cpp) computes exactly what the layers compute one by
one: same kernels, same order, so greedy generations are token-for-token identical with it and without it, for
steps inferlab's gemv takes (1-4 tokens) and for larger ones that use the packed weights; for Llama (the bundled
model), and for Qwen3's QK-norm and Gemma 3's layer on tiny random-weight models."""

from __future__ import annotations

import pytest
import torch
from row_invariant import onednn_from_rows
from tiny_models import build_hf_model, save_hf

from inferlab import LLM, SamplingParams
from inferlab.kernels import cpu_kernels, gemv_kernels, int_gemv_kernels

pytestmark = pytest.mark.slow
needs_bf16_kernels = pytest.mark.skipif(gemv_kernels() is None,
                                        reason="the bf16 plan needs inferlab's AVX-512 BF16 kernels")
needs_int_kernels = pytest.mark.skipif(int_gemv_kernels() is None,
                                       reason="inferlab's integer kernels are not vectorised here")

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time, in a quiet village,"]
MORE = ["The three primary colours are", "import numpy as np\n", "Dear Sir or Madam,", "In 1969, the first"]


def _generate(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    wide = [o.token_ids for o in llm.generate(PROMPTS + MORE, sp)]  # decode steps of 7 tokens: packed weights
    together = [o.token_ids for o in llm.generate(PROMPTS, sp)]  # decode steps of 3 tokens
    alone = [llm.generate([p], sp)[0].token_ids for p in PROMPTS]  # decode steps of 1
    return wide + together + alone


def _compare_with_and_without(llm: LLM, monkeypatch) -> None:
    import inferlab.engine.model_runner as model_runner

    # Prefills on the layers' SDPA both times, so that the plan serves exactly the decode steps; prefill tokens as
    # rows of the plan are test_prefill_chunks_beside_decodes_run_on_the_plan_as_rows's.
    monkeypatch.setattr(model_runner, "ROW_ATTENTION_MAX_KEYS", 0)
    model = llm.engine.runner.model.model
    kernels, calls = cpu_kernels(), []
    real = kernels.decode_layers
    monkeypatch.setattr(kernels, "decode_layers", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    with_plan = _generate(llm)
    assert set(calls) == {1, 3, 7}  # the plan really served the decode steps, wide, batched and alone
    plan, model.decode_plan = model.decode_plan, None
    calls.clear()
    without = _generate(llm)
    assert not calls and with_plan == without
    model.decode_plan = plan


@needs_bf16_kernels
@pytest.mark.parametrize("quantization", ["none", "int8", "int4", "w8a8"])
def test_plan_is_token_identical_to_the_layers(quantization, monkeypatch):
    llm = LLM(quantization=quantization, dtype="bfloat16", kv_cache_memory=64 * 2**20)
    model = llm.engine.runner.model.model
    assert model.decode_plan is not None
    kernels = cpu_kernels()
    # Every projection is handed to C++ as the kind of layer it is (the tied LM head is not a layer's projection).
    kind = {"none": kernels.ProjKind.PACKED, "int8": kernels.ProjKind.INT8, "int4": kernels.ProjKind.INT4,
            "w8a8": kernels.ProjKind.W8A8}
    assert {getattr(layer, n).kind for layer in model.decode_plan.layers
            for n in ("qkv", "o", "gate_up", "down")} == {kind[quantization]}
    assert all(layer.q_norm is None and layer.post_attn_norm is None for layer in model.decode_plan.layers)
    _compare_with_and_without(llm, monkeypatch)


@needs_bf16_kernels
@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_plan_on_onednn_copies_is_token_identical_to_the_layers(quantization, monkeypatch):
    """Where the CPU has AMX, dense steps of four rows or more multiply by oneDNN's pre-packed copy
    (layers/packed_linear.py, onednn_min_rows); forced from two rows here, so that the plan's call into oneDNN runs
    on any CPU."""
    with onednn_from_rows(2):
        llm = LLM(quantization=quantization, dtype="bfloat16", kv_cache_memory=64 * 2**20)
    plan = llm.engine.runner.model.model.decode_plan
    projs = [getattr(layer, n) for layer in plan.layers for n in ("qkv", "o", "gate_up", "down")]
    assert all(p.onednn is not None and p.onednn.is_mkldnn for p in projs)
    # bf16: inferlab's copy for one row beside oneDNN's; int4: the kernel up to 4 tokens, oneDNN's copy beyond.
    assert all((p.packed is not None) == (quantization == "none") for p in projs)
    _compare_with_and_without(llm, monkeypatch)


@needs_bf16_kernels
def test_plan_on_an_int8_kv_pool_is_token_identical_to_the_layers(monkeypatch):
    llm = LLM(quantization="w8a8", kv_cache_dtype="int8", kv_cache_memory=32 * 2**20)
    plan = llm.engine.runner.model.model.decode_plan
    assert plan is not None and {layer.k_cache.dtype for layer in plan.layers} == {torch.int8}
    _compare_with_and_without(llm, monkeypatch)


@pytest.mark.parametrize("quantization, dtype", [pytest.param("none", "bfloat16", marks=needs_bf16_kernels),
                                                 pytest.param("int4", "bfloat16", marks=needs_bf16_kernels),
                                                 pytest.param("int4", "float32", marks=needs_int_kernels)])
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_plan_serves_qwen3_and_gemma3_layers_token_identically(family, quantization, dtype, tmp_path_factory,
                                                               monkeypatch):
    from inferlab.models.loader import load_tokenizer

    # Gemma's window (64) holds every context here: the plan serves every decode step (it declines past it).
    extra = {"sliding_window": 64} if family == "gemma3" else {}
    folder = save_hf(build_hf_model(family, **extra), load_tokenizer(None), tmp_path_factory.mktemp(family) / "hf")
    llm = LLM(model=str(folder), quantization=quantization, dtype=dtype, kv_cache_memory=16 * 2**20)
    model = llm.engine.runner.model.model
    plan = model.decode_plan
    assert plan is not None and plan.gelu == (family == "gemma3")
    assert all(layer.q_norm is not None and layer.k_norm is not None for layer in plan.layers)
    if family == "gemma3":
        assert [layer.local for layer in plan.layers] == [True, False, True]
        assert all(layer.post_attn_norm is not None and layer.post_ff_norm is not None for layer in plan.layers)
    _compare_with_and_without(llm, monkeypatch)


def test_no_plan_where_the_kernels_do_not_apply(llm_fp32):
    assert llm_fp32.engine.runner.model.model.decode_plan is None  # fp32: the layers run one by one


@needs_int_kernels
@pytest.mark.parametrize("quantization", ["int8", "int4", "bf16"])
def test_fp32_plan_on_the_integer_kernels_is_token_identical_to_the_layers(quantization, monkeypatch):
    """fp32 activations (the default on a CPU without AVX-512 BF16) take the plan where every projection is
    quantized (bf16 weights included); inferlab's kernels for them compute each row alone, so the steps are not
    padded to more rows either (models/llama.py: decide_row_padding)."""
    llm = LLM(quantization=quantization, dtype="float32", kv_cache_memory=64 * 2**20)
    model = llm.engine.runner.model
    assert not model.pad_rows and model.model.decode_plan is not None
    _compare_with_and_without(llm, monkeypatch)



TEXT = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps aloud so that the "
        "silence would not settle on him. ") * 6


@needs_bf16_kernels
def test_prefill_chunks_beside_decodes_run_on_the_plan_as_rows(monkeypatch):
    """A prompt prefilled in 24-token chunks while three streams decode: with row attention each chunk token is a
    row of the plan's decode kernel (engine/model_runner.py: ROW_ATTENTION_MAX_KEYS), without it the chunks take
    the layers' batched SDPA. Either way the prompt's logprobs are those of one causal pass over it in float32
    (LLM.score, which tests/models checks against transformers) within bf16's rounding, equally close (measured:
    rows max 0.12 / mean 0.012 nats, SDPA 0.18 / 0.011), and the streams beside it decode the same tokens (the same
    GEMMs and decode kernel serve their rows both ways)."""
    import numpy as np

    import inferlab.engine.model_runner as model_runner

    fp32 = LLM(dtype="float32", kv_cache_memory=64 * 2**20)
    ids = fp32.tokenizer.encode(TEXT, add_special_tokens=False)
    reference = np.array(fp32.score(ids))
    del fp32
    llm = LLM(dtype="bfloat16", kv_cache_memory=64 * 2**20, max_prefill_tokens_with_decodes=24,
              enable_prefix_caching=False)
    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=len(ids) // 24 + 8, ignore_eos=True)
    kernels = cpu_kernels()
    real = kernels.decode_layers

    def mixed_run(max_keys: int) -> tuple[np.ndarray, list[int], list[list[int]]]:
        plan_rows = []
        monkeypatch.setattr(kernels, "decode_layers", lambda *a: plan_rows.append(a[1].shape[0]) or real(*a))
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"d{i}", p, sp)
        monkeypatch.setattr(model_runner, "ROW_ATTENTION_MAX_KEYS", 0)
        eng.step()  # their prompts, together, the same way both times
        monkeypatch.setattr(model_runner, "ROW_ATTENTION_MAX_KEYS", max_keys)
        eng.add_request("x", ids, SamplingParams(max_tokens=1, prompt_logprobs=0))
        outs: dict[str, list] = {}
        while eng.has_work():
            for o in eng.step():
                outs.setdefault(o.request_id, []).append(o)
        lp = outs["x"][-1].prompt_logprobs
        assert [e.token_id for e in lp] == ids
        err = np.abs(np.array([e.logprob for e in lp[1:]]) - reference)
        return err, plan_rows, [[t for o in outs[f"d{i}"] for t in o.new_token_ids] for i in range(3)]

    err_rows, plan_rows, streams_rows = mixed_run(model_runner.ROW_ATTENTION_MAX_KEYS)
    err_sdpa, plan_sdpa, streams_sdpa = mixed_run(0)
    chunks = -(-len(ids) // 24)
    assert sum(n == 3 + 24 for n in plan_rows) >= chunks - 1  # the mixed steps ran on the plan
    assert not any(n == 3 + 24 for n in plan_sdpa)  # ... and without rows, on the layers
    for err in (err_rows, err_sdpa):
        assert err.max() < 0.3 and err.mean() < 0.02, (err.max(), err.mean())
    assert streams_rows == streams_sdpa


@needs_bf16_kernels
def test_steps_without_decodes_run_on_the_plan_as_rows(monkeypatch):
    """A lone prompt, prompts arriving together and a prefix-cache hit run their tokens as rows of the plan too.
    Each row's arithmetic is the same whatever shares its step (the packed GEMMs and the decode kernel are
    row-invariant), so a prefix-cache hit computes the very bits of the whole prompt computed afresh, and a prompt
    gives the same tokens alone and among others; the prompt's logprobs are those of one float32 causal pass
    (LLM.score) within bf16's rounding."""
    import numpy as np

    fp32 = LLM(dtype="float32", kv_cache_memory=64 * 2**20)
    ids = fp32.tokenizer.encode(TEXT, add_special_tokens=False)
    reference = np.array(fp32.score(ids))
    del fp32
    kernels = cpu_kernels()
    real, rows = kernels.decode_layers, []
    monkeypatch.setattr(kernels, "decode_layers", lambda *a: rows.append(a[1].shape[0]) or real(*a))
    cached = LLM(dtype="bfloat16", kv_cache_memory=64 * 2**20).engine
    fresh = LLM(dtype="bfloat16", kv_cache_memory=64 * 2**20, enable_prefix_caching=False).engine

    def run(eng, prompts: list[list[int]], params: SamplingParams) -> list[dict]:
        outs: dict[str, dict] = {}
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", {"prompt_token_ids": p}, params)
        while eng.has_work():
            for o in eng.step():
                got = outs.setdefault(o.request_id, {"tokens": [], "logprobs": [], "cached": o.num_cached_tokens})
                got["tokens"] += o.new_token_ids
                got["logprobs"] += [e.logprob for e in o.logprobs or []]
                got["prompt_logprobs"] = got.get("prompt_logprobs") or o.prompt_logprobs
        return [outs[f"r{i}"] for i in range(len(prompts))]

    lone = run(cached, [ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert rows[0] == len(ids)  # the prompt's one step, on the plan
    err = np.abs(np.array([e.logprob for e in lone["prompt_logprobs"][1:]]) - reference)
    assert err.max() < 0.3 and err.mean() < 0.02, (err.max(), err.mean())

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    longer = ids + ids[:40]
    run(cached, [ids], sp)  # now in the prefix cache
    rows.clear()
    hit = run(cached, [longer], sp)[0]
    assert hit["cached"] > 0 and rows[0] == len(longer) - hit["cached"]
    whole = run(fresh, [longer], sp)[0]
    assert whole["cached"] == 0
    assert hit["tokens"] == whole["tokens"] and hit["logprobs"] == whole["logprobs"]  # the same bits

    prompts = [ids[:30], ids[5:60], longer[::2]]
    together = run(fresh, prompts, sp)
    assert [o["tokens"] for o in together] == [run(fresh, [p], sp)[0]["tokens"] for p in prompts]


@needs_bf16_kernels
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_onednn_steps_on_padded_rows_compute_the_same_bits(kv_cache_dtype, monkeypatch):
    """oneDNN builds a GEMM for each row count it meets, so steps of more than ONEDNN_EXACT_ROWS rows multiply rows
    padded to a multiple of ONEDNN_ROW_QUANTUM (layers/packed_linear.py). The padding changes no bit: a 70-token
    prompt's logprobs, its generated tokens and every block of the KV pool (bf16 or int8) come out the same with rows
    exact, on the plan (rows padded once for the step, the padding writing no K/V) and on the layers (each GEMM
    padded)."""
    import numpy as np

    import inferlab.engine.model_runner as model_runner
    import inferlab.layers.packed_linear as packed_linear

    quantum = packed_linear.ONEDNN_ROW_QUANTUM
    assert packed_linear.ONEDNN_EXACT_ROWS < 70 and 70 % quantum
    kernels = cpu_kernels()
    real, widths = kernels.decode_layers, []

    def spy(*a):
        x, residual = real(*a)
        widths.append((x.shape[0], x.untyped_storage().nbytes() // (x.shape[1] * x.element_size())))
        return x, residual

    monkeypatch.setattr(kernels, "decode_layers", spy)

    def run(q: int, max_keys: int) -> tuple[list, list, list[np.ndarray]]:
        monkeypatch.setattr(packed_linear, "ONEDNN_ROW_QUANTUM", q)
        monkeypatch.setattr(model_runner, "ROW_ATTENTION_MAX_KEYS", max_keys)
        with onednn_from_rows(2):
            llm = LLM(dtype="bfloat16", kv_cache_memory=16 * 2**20, enable_prefix_caching=False,
                      kv_cache_dtype=kv_cache_dtype)
        model = llm.engine.runner.model.model
        model.decode_plan.onednn_row_quantum = q
        eng = llm.engine
        eng.add_request("r", {"prompt_token_ids": llm.tokenizer.encode(TEXT, add_special_tokens=False)[:70]},
                        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0))
        outs = [o for _ in range(4) for o in eng.step()]
        assert outs[-1].finished
        pool = [t.view(torch.uint8).clone().numpy() for layer in model.layers
                for t in (layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache)]
        return [e.logprob for e in outs[0].prompt_logprobs[1:]], [t for o in outs for t in o.new_token_ids], pool

    exact = run(1, model_runner.ROW_ATTENTION_MAX_KEYS)
    assert widths[0] == (70, 70)
    widths.clear()
    padded = run(quantum, model_runner.ROW_ATTENTION_MAX_KEYS)
    assert widths[0] == (70, -(-70 // quantum) * quantum)  # the plan ran the step on padded rows, handed back 70
    layers_exact, layers_padded = run(1, 0), run(quantum, 0)
    for a, b in ((exact, padded), (layers_exact, layers_padded)):
        assert a[0] == b[0] and a[1] == b[1]
        assert all((x == y).all() for x, y in zip(a[2], b[2]))
