"""GGUF K-quants (Q4_K, Q5_K, Q6_K: what llama.cpp's Q4_K_M files hold) in a model file: inferlab's loader turns
each tensor into exactly the floats of gguf's reference dequantizer, and the model then computes what transformers
computes from the same file.

gguf-py has no K-quant quantizer, so the blocks are hand-built: random bytes, with the fp16 super-block scales
(d, and dmin for Q4_K/Q5_K) set so that weights have a sensible spread.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

pytestmark = pytest.mark.slow

# head_dim 128: transformers (5.x) reads no key_length from a qwen3 GGUF and assumes Qwen3Config's default.
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 256, 512, 2, 1, 128, 2
# Tensor -> type, covering every K-quant type in each role (Q4_K_M itself mixes Q4_K and Q6_K, with Q5_K in _M/_S
# variants of other sizes).
TYPES = {"attn_q": T.Q4_K, "attn_k": T.Q5_K, "attn_v": T.Q6_K, "attn_output": T.Q4_K, "ffn_gate": T.Q5_K,
         "ffn_up": T.Q5_K, "ffn_down": T.Q6_K, "token_embd": T.Q6_K}


def kquant_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, cols / 256 * block bytes] of random K-quant blocks whose weights have std ~ 1 / sqrt(cols)."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    scale_at = [nbytes - 2] if qtype == T.Q6_K else [0, 2]  # Q6_K: d last; Q4_K/Q5_K: d, dmin first

    def set_scales(v: float) -> None:
        for at in scale_at:
            b[..., at:at + 2] = np.frombuffer(np.float16(v).tobytes(), dtype=np.uint8)

    set_scales(1.0)
    spread = dequantize(b.reshape(rows, -1), qtype).std()
    set_scales(cols ** -0.5 / spread)
    return b.reshape(rows, -1)


def write_kquant_qwen3(path, seed: int = 0):
    """A tiny Qwen3 GGUF (tied head) with K-quant linear weights and embedding; returns {tensor name: blocks}."""
    from inferlab.common.bundled import bundled_model_path
    import gguf

    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "qwen3")
    w.add_name("tiny-qwen3-kquants")
    for f, v in (("block_count", LAYERS), ("context_length", 1024), ("embedding_length", HIDDEN),
                 ("feed_forward_length", INTER), ("head_count", HEADS), ("head_count_kv", KV_HEADS),
                 ("key_length", HEAD_DIM), ("value_length", HEAD_DIM)):
        getattr(w, f"add_{f}")(v)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    for key, f in gguf.GGUFReader(str(bundled_model_path())).fields.items():
        if key.startswith("tokenizer."):
            w.add_key_value(key, f.contents(), f.types[0], f.types[1] if len(f.types) > 1 else None)
    vocab = len(gguf.GGUFReader(str(bundled_model_path())).fields["tokenizer.ggml.tokens"].data)
    blocks = {}

    def quant(name: str, role: str, rows: int, cols: int) -> None:
        blocks[name] = kquant_blocks(TYPES[role], rows, cols, rng)
        w.add_tensor(name, blocks[name], raw_dtype=TYPES[role])

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1 + 0.2 * rng.standard_normal(n)).astype(np.float32))

    quant("token_embd.weight", "token_embd", vocab, HIDDEN)
    norm("output_norm.weight", HIDDEN)
    shapes = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
              "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight", HIDDEN)
        norm(f"blk.{i}.ffn_norm.weight", HIDDEN)
        norm(f"blk.{i}.attn_q_norm.weight", HEAD_DIM)
        norm(f"blk.{i}.attn_k_norm.weight", HEAD_DIM)
        for role, (rows, cols) in shapes.items():
            quant(f"blk.{i}.{role}.weight", role, rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return blocks


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("kq") / "tiny-qwen3-kquants.gguf"
    return path, write_kquant_qwen3(path)


def test_every_kquant_tensor_loads_as_gguf_reference_floats(kquant_file):
    from inferlab.models.loader import load_model

    path, blocks = kquant_file
    net = load_model(path, torch.float32, torch.device("cpu")).model
    ref = {n: torch.from_numpy(dequantize(b, TYPES[n.split(".")[-2] if n.startswith("blk") else "token_embd"]))
           for n, b in blocks.items()}
    assert torch.equal(net.model.embed_tokens.weight, ref["token_embd.weight"])
    for i in range(LAYERS):
        a, m, b = net.model.layers[i].self_attn, net.model.layers[i].mlp, f"blk.{i}."
        assert torch.equal(a.qkv_proj.weight, torch.cat([ref[b + f"attn_{n}.weight"] for n in "qkv"]))
        assert torch.equal(a.o_proj.weight, ref[b + "attn_output.weight"])
        assert torch.equal(m.gate_up_proj.weight, torch.cat([ref[b + "ffn_gate.weight"], ref[b + "ffn_up.weight"]]))
        assert torch.equal(m.down_proj.weight, ref[b + "ffn_down.weight"])


def test_kquant_model_matches_transformers_on_the_same_file(kquant_file):
    from transformers import AutoModelForCausalLM

    from inferlab import LLM, SamplingParams

    path, _ = kquant_file
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory=32 * 2**20)
    ids = llm.engine.tokenize_prompt("The capital of France is Paris, and the capital of Italy is")[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    ref_lp = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(llm.score(ids)), ref_lp, atol=1e-3, rtol=1e-4)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0].token_ids
    with torch.no_grad():
        tokens, o = [], hf(torch.tensor([ids]), use_cache=True)
        tokens.append(int(o.logits[0, -1].argmax()))
        for _ in range(31):
            o = hf(torch.tensor([tokens[-1:]]), past_key_values=o.past_key_values, use_cache=True)
            tokens.append(int(o.logits[0, -1].argmax()))
    assert out == tokens


def test_int8_requantizes_kquant_weights(kquant_file):
    """K-quants are dequantized at load; --quantization int8 then quantizes from the file's exact floats."""
    from inferlab.models.loader import load_model

    path, _ = kquant_file
    loaded = load_model(path, torch.float32, torch.device("cpu"), quantization="int8")
    for t in ("Q4_K", "Q5_K", "Q6_K"):
        assert f"requantized from GGUF {t}" in loaded.quant_path


def test_int4_takes_q4_k_groups_as_they_are():
    """Under int4 a Q4_K weight keeps each group's q; d * sc and -dmin * m become fp16, so every weight is within
    fp16's rounding of those two (2^-11 of each, relative) of gguf's own dequantization."""
    from inferlab.quant import quantize_weight
    from inferlab.quant.gguf_q4 import RawGGUFWeight

    blocks = kquant_blocks(T.Q4_K, 16, 512, np.random.default_rng(3))
    ref = torch.from_numpy(dequantize(blocks, T.Q4_K).astype(np.float32)).reshape(16, 512)
    layer, how = quantize_weight(None, "int4", 32, RawGGUFWeight("Q4_K", blocks, (16, 512)))
    assert how.startswith("GGUF Q4_K groups loaded directly")
    d, m = layer.d.float().repeat_interleave(32, 1), layer.m.float().repeat_interleave(32, 1)
    bound = 2.0 ** -11 * (15 * d.abs() + m.abs()) + 1e-7
    assert ((layer.dequantize().float() - ref).abs() <= bound).all()
    # Requantizing the same floats refits each group's grid: several times further off somewhere.
    refit, _ = quantize_weight(ref, "int4", 32)
    assert (refit.dequantize().float() - ref).abs().max() > 4 * (layer.dequantize().float() - ref).abs().max()
