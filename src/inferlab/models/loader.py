"""Build a model from a GGUF file or a Hugging Face safetensors folder, and load its tokenizer from the same files."""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from inferlab.common.errors import ModelLoadError
from inferlab.layers.rotary import RotaryEmbedding
from inferlab.models.config import ModelConfig, open_gguf, read_model_config, resolve_model_path
from inferlab.models.families import model_class
from inferlab.models.llama import LlamaForCausalLM
from inferlab.quant import WIDE_GGUF_TYPES, RawGGUFWeight, quantize_model


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    path: Path
    load_seconds: float = 0.0
    quant_path: str = "none"  # how the weights were quantized, for the log and /metrics


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's conversion-time Q/K row permutation (interleaved RoPE pairs -> rotate-half layout)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: Path, cfg: ModelConfig,
               keep_raw: bool) -> tuple[dict[str, torch.Tensor], dict[str, RawGGUFWeight], set[str]]:
    """The float state dict, and (keep_raw) each linear weight as the file stores it, keyed by the nn.Linear's
    qualified name (for quantized loading without a dequantize-requantize round trip)."""
    from gguf.quants import dequantize

    reader = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}

    def floats(name: str) -> np.ndarray:
        t = tensors[name]
        return dequantize(t.data, t.tensor_type).reshape(tuple(int(x) for x in reversed(t.shape)))

    def raw_rows(name: str) -> np.ndarray:
        t = tensors[name]
        return np.asarray(t.data).view(np.uint8).reshape(int(t.shape[-1]), -1)

    sd: dict[str, torch.Tensor] = {}
    raw: dict[str, RawGGUFWeight] = {}
    wide: set[str] = set()  # Linears the file stores (in part) in more than 4 bits

    def fused(dst: str, parts: list[tuple[str, int | None]]) -> None:
        """parts: (gguf name, heads to un-permute by or None). Rows are concatenated in order."""
        mats = [_unpermute(floats(n), h) if h else floats(n) for n, h in parts]
        sd[dst + ".weight"] = torch.from_numpy(np.concatenate(mats, axis=0))
        if keep_raw:
            types = {tensors[n].tensor_type.name for n, _ in parts}
            if types & WIDE_GGUF_TYPES:
                wide.add(dst)
            if len(types) == 1:
                rows = [_unpermute(raw_rows(n), h) if h else raw_rows(n) for n, h in parts]
                data = np.ascontiguousarray(np.concatenate(rows, axis=0))
                raw[dst] = RawGGUFWeight(types.pop(), data, tuple(sd[dst + ".weight"].shape))

    def norm(name: str) -> torch.Tensor:
        w = torch.from_numpy(floats(name).copy())
        # Gemma's (1 + w) norms: the file holds 1 + w already. 1 + (s - 1) rounds as transformers does (its GGUF
        # reader subtracts the 1, its RMSNorm adds it back), so float32 logits match it bit for bit.
        return 1 + (w - 1) if gemma else w

    gemma = cfg.architecture == "gemma3"
    sd["model.embed_tokens.weight"] = torch.from_numpy(floats("token_embd.weight").copy())
    sd["model.norm.weight"] = norm("output_norm.weight")
    if "output.weight" in tensors:
        fused("lm_head", [("output.weight", None)])
    elif keep_raw:
        t = tensors["token_embd.weight"]
        raw["lm_head"] = RawGGUFWeight(t.tensor_type.name, raw_rows(t.name), (cfg.vocab_size, cfg.hidden_size))
    # llama.cpp's converter permutes Q/K rows for the llama architecture only (its Qwen2/Qwen3 converters do not;
    # transformers' GGUF reader undoes it for llama alone too).
    hq, hk = (cfg.num_heads, cfg.num_kv_heads) if cfg.architecture == "llama" else (None, None)
    for i in range(cfg.num_layers):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm(b + "attn_norm.weight")
        if gemma:  # the sandwich norms: llama.cpp's ffn_norm is Gemma's pre-MLP norm
            sd[p + "post_attention_layernorm.weight"] = norm(b + "post_attention_norm.weight")
            sd[p + "pre_feedforward_layernorm.weight"] = norm(b + "ffn_norm.weight")
            sd[p + "post_feedforward_layernorm.weight"] = norm(b + "post_ffw_norm.weight")
        else:
            sd[p + "post_attention_layernorm.weight"] = norm(b + "ffn_norm.weight")
        fused(p + "self_attn.qkv_proj",
              [(b + "attn_q.weight", hq), (b + "attn_k.weight", hk), (b + "attn_v.weight", None)])
        if cfg.attention_bias:
            bias = [floats(b + f"attn_{n}.bias") for n in "qkv"]
            bias = [_unpermute(x, h) if h else x for x, h in zip(bias, (hq, hk, None))]
            sd[p + "self_attn.qkv_proj.bias"] = torch.from_numpy(np.concatenate(bias))
        if cfg.qk_norm:
            for n in "qk":
                sd[p + f"self_attn.{n}_norm.weight"] = norm(b + f"attn_{n}_norm.weight")
        fused(p + "self_attn.o_proj", [(b + "attn_output.weight", None)])
        fused(p + "mlp.gate_up_proj", [(b + "ffn_gate.weight", None), (b + "ffn_up.weight", None)])
        fused(p + "mlp.down_proj", [(b + "ffn_down.weight", None)])
    return sd, raw, wide


def _load_hf(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files (only safetensors weights are supported)")
    src: dict[str, torch.Tensor] = {}
    for f in files:
        src.update(load_file(str(f)))
    sd = {k: v for k, v in src.items() if "rotary_emb" not in k and not any(
        s in k for s in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.qkv_proj.weight"] = torch.cat(
            [src[p + f"self_attn.{n}_proj.weight"] for n in ("q", "k", "v")], dim=0)
        if cfg.attention_bias:
            sd[p + "self_attn.qkv_proj.bias"] = torch.cat([src[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
        sd[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [src[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up")], dim=0)
    if cfg.architecture == "gemma3":
        # Gemma's checkpoints hold w of its (1 + w) norms (models/gemma3.py keeps 1 + w); its head is the embedding.
        sd = {k: (1 + v.float()) if k.endswith("norm.weight") else v for k, v in sd.items()
              if k != "lm_head.weight"}
    return sd


# nn.Module constructors fill their parameters with random values (nn.init); on the meta device torch runs those
# through Python reference kernels whose first call imports torch._dynamo, and with it sympy and triton: ~160 MiB
# resident that a server never uses (measured: import torch 219 MiB RSS, + torch._dynamo 381 MiB). The loaded
# weights replace the values anyway, so construction skips the fill, as transformers' no_init_weights does.
_INIT_FILLS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
               "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")


@contextlib.contextmanager
def _skip_init_fills() -> Iterator[None]:
    saved = {n: getattr(torch.nn.init, n) for n in _INIT_FILLS if hasattr(torch.nn.init, n)}
    for n in saved:
        setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def load_model(model: str | Path | None, dtype: torch.dtype, device: torch.device,
               quantization: str = "none", quant_group_size: int = 32) -> LoadedModel:
    t0 = time.perf_counter()
    path = resolve_model_path(model)
    cfg = read_model_config(path)
    if path.is_file():
        sd, raw, wide = _load_gguf(path, cfg, keep_raw=quantization != "none")
    else:
        sd, raw, wide = _load_hf(path, cfg), {}, set()
    with torch.device("meta"), _skip_init_fills():
        net = model_class(cfg)(cfg)
    # The converted tensors become the parameters (assign=True): no second copy of the model to copy them into, and
    # no meta -> device empty_like (torch's reference kernel for it imports sympy, ~35 MiB). Each float source is
    # dropped once converted, so the float32 dequantized weights and the bf16 ones never all coexist.
    weights = {}
    for k in list(sd):
        weights[k] = sd.pop(k).to(device=device, dtype=dtype)
    missing, unexpected = net.load_state_dict(weights, strict=False, assign=True)
    del weights
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelLoadError(f"{path}: weights do not match the architecture (missing {missing[:4]}, unexpected {unexpected[:4]})")
    if cfg.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    # Rotary tables are buffers computed at construction: rebuild them on the real device.
    if hasattr(net.model, "init_rotary"):
        net.model.init_rotary(device)
    else:
        net.model.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta).to(device)
    if left := [n for n, t in [*net.named_parameters(), *net.named_buffers()] if t.is_meta]:
        raise ModelLoadError(f"{path}: the file has no weights for {left[:4]}")
    net = net.to(device=device, dtype=dtype).eval()
    net.requires_grad_(False)
    loaded = LoadedModel(net, cfg, path)
    if quantization != "none":
        loaded.quant_path = quantize_model(net, quantization, quant_group_size, raw=raw, keep_int8=wide)
    loaded.load_seconds = time.perf_counter() - t0
    return loaded


def _tokenizer_cache_dir(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("INFERLAB_CACHE", Path.home() / ".cache" / "inferlab"))
    return root / "tokenizers" / key


def load_tokenizer(model: str | Path | None):
    """The fast tokenizer and chat template from the model's own files (transformers builds it from GGUF too).

    Building a tokenizer from a GGUF vocabulary takes seconds, so the result is saved once under
    ~/.cache/inferlab/tokenizers (keyed by the file's path, size and mtime) and reloaded from there.
    """
    from transformers import AutoTokenizer

    path = resolve_model_path(model)
    try:
        if path.is_dir():
            return AutoTokenizer.from_pretrained(str(path))
        cache = _tokenizer_cache_dir(path)
        if (cache / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(str(cache))
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        try:
            tok.save_pretrained(str(cache))
        except OSError:
            pass  # a read-only home is fine: we just rebuild next time
        return tok
    except Exception as e:  # transformers raises many kinds; the user needs the path and the reason
        raise ModelLoadError(f"{path}: cannot build a tokenizer from the model files ({e})") from e
