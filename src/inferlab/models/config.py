"""Architecture hyper-parameters of a decoder, read from a GGUF header or a Hugging Face config.json."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from inferlab.common.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
# Hugging Face names (config.json `architectures`, then `model_type`) -> inferlab's family name (GGUF's
# general.architecture; llama.cpp's converter writes Mistral as "llama", without a sliding window).
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral", "Gemma3ForCausalLM": "gemma3", "llama": "llama", "qwen2": "qwen2",
    "qwen3": "qwen3", "mistral": "mistral", "gemma3_text": "gemma3",
}
# Gemma 3: five local (sliding-window) layers, then one global, repeated (transformers' default layer_types, and
# llama.cpp's swa pattern for gemma3: GGUF files do not store it). Local layers rotate with base 10k.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    eos_token_id: int | None = None
    name: str = ""
    attention_bias: bool = False  # biases on the Q/K/V projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on Q and K before rotary (Qwen3)
    sliding_window: int | None = None  # each token attends to itself and the window - 1 tokens before it (Mistral)
    # Gemma 3's extras. layer_sliding: which layers use the window (empty: all of them, when there is one).
    layer_sliding: tuple[bool, ...] = ()
    rope_local_theta: float | None = None  # the rotary base of the sliding layers, when it differs
    rope_scaling_factor: float = 1.0  # linear position scaling of the global layers' rotary (Gemma 3 4B+: 8)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (default: head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    norms_per_layer: int = 2  # Gemma 3 also normalises after attention and after the MLP: 4

    def is_sliding(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return self.layer_sliding[layer] if self.layer_sliding else True

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * self.num_heads * self.head_dim * 2 + h * self.num_kv_heads * self.head_dim * 2
        if self.attention_bias:
            attn += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if self.qk_norm:
            attn += 2 * self.head_dim
        per_layer = attn + 3 * h * i + self.norms_per_layer * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def resolve_model_path(model: str | Path | None) -> Path:
    if model is None:
        from inferlab.common.bundled import bundled_model_path

        return bundled_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist (give a GGUF file or a Hugging Face folder)")
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelLoadError(f"{str(path)!r} is a folder without config.json (a Hugging Face model folder needs one)")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"{str(path)!r} is not a .gguf file; give a GGUF file or a Hugging Face folder")
    return path


def read_model_config(model: str | Path | None) -> ModelConfig:
    path = resolve_model_path(model)
    return _from_gguf(path) if path.is_file() else _from_hf(path)


def _check_arch(arch: str, path: Path) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path.name}: architecture {arch!r} is not supported (inferlab implements: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )


@functools.lru_cache(maxsize=4)
def open_gguf(path: Path):
    """Parsing a GGUF header (its vocabulary) takes seconds: read each file once per process. Tensors are memory-mapped."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # the gguf reader raises bare ValueError/struct errors on garbage
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e


def forget_gguf_files() -> None:
    """Drop the readers open_gguf keeps: a process that loads no more models (a server once started) gets back the
    parsed header's Python objects and the file's mapped pages (bundled SmolLM2: 233 MiB resident, 140 of it heap)."""
    open_gguf.cache_clear()


def gguf_metadata(path: Path) -> dict:
    """Scalar and string fields of a GGUF header (arrays such as the vocabulary are left out)."""
    from gguf import GGUFValueType

    reader = open_gguf(path)
    meta: dict = {}
    for key, f in reader.fields.items():
        if not f.types or f.types[0] == GGUFValueType.ARRAY:
            continue
        part = f.parts[f.data[0]]
        meta[key] = bytes(part).decode("utf-8", "replace") if f.types[0] == GGUFValueType.STRING else part.tolist()[0]
    meta["_tensor_names"] = [t.name for t in reader.tensors]
    vocab = reader.fields.get("tokenizer.ggml.tokens")
    meta["_vocab_size"] = len(vocab.data) if vocab is not None else None
    return meta


def _from_gguf(path: Path) -> ModelConfig:
    meta = gguf_metadata(path)
    arch = meta.get("general.architecture", "?")
    _check_arch(arch, path)

    def g(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    hidden, heads = g("embedding_length"), g("attention.head_count")
    vocab = g("vocab_size") or meta["_vocab_size"]
    window = g("attention.sliding_window")
    extra = {}
    if arch == "gemma3":
        extra = _gemma3_fields(g("block_count"), g("rope.scaling.type"), g("rope.scaling.factor"), None, None,
                               GEMMA3_LOCAL_ROPE_THETA, path)
        # GGUF has no query_pre_attn_scalar: llama.cpp scales queries by head_dim ** -0.5 (the 27B aside, which
        # it special-cases), as the config of every smaller Gemma 3 does (query_pre_attn_scalar = head_dim = 256).
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=g("feed_forward_length"),
        num_layers=g("block_count"),
        num_heads=heads,
        num_kv_heads=g("attention.head_count_kv", heads),
        head_dim=g("attention.key_length", hidden // heads),
        max_position_embeddings=g("context_length", 2048),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in meta["_tensor_names"],
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        name=meta.get("general.name", path.stem),
        attention_bias="blk.0.attn_q.bias" in meta["_tensor_names"],
        qk_norm="blk.0.attn_q_norm.weight" in meta["_tensor_names"],
        sliding_window=int(window) if window else None,
        **extra,
    )


def _gemma3_fields(num_layers: int, scaling_type, scaling_factor, layer_types, pattern, local_theta,
                   path: Path) -> dict:
    if scaling_type not in (None, "none", "linear", "default"):
        raise ModelLoadError(f"{path.name}: Gemma 3 rope scaling {scaling_type!r} is not supported (inferlab "
                             f"implements linear scaling, as Gemma 3 4B+ uses)")
    pattern = pattern or GEMMA3_SLIDING_PATTERN
    if layer_types:
        sliding = tuple(t == "sliding_attention" for t in layer_types)
    else:
        sliding = tuple(bool((i + 1) % pattern) for i in range(num_layers))
    factor = float(scaling_factor) if scaling_type == "linear" and scaling_factor else 1.0
    return dict(layer_sliding=sliding, rope_local_theta=float(local_theta), rope_scaling_factor=factor,
                norms_per_layer=4)


def _from_hf(path: Path) -> ModelConfig:
    cfg = json.loads((path / "config.json").read_text())
    names = [*(cfg.get("architectures") or []), cfg.get("model_type", "?")]
    model_type = next((HF_ARCHITECTURES[n] for n in names if n in HF_ARCHITECTURES), names[-1])
    _check_arch(model_type, path)
    # Qwen2/3 configs carry a sliding_window that applies only with use_sliding_window (never, in released models).
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    rope = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    extra = {}
    if model_type == "gemma3":
        window = cfg.get("sliding_window", 4096)
        full = rope.get("full_attention") or {}
        local = rope.get("sliding_attention") or {}
        scaling = cfg.get("rope_scaling") or full
        theta = cfg.get("rope_theta", full.get("rope_theta", 1_000_000.0))
        extra = _gemma3_fields(cfg["num_hidden_layers"], scaling.get("rope_type", scaling.get("type")),
                               scaling.get("factor"), cfg.get("layer_types"), cfg.get("sliding_window_pattern"),
                               cfg.get("rope_local_base_freq", local.get("rope_theta", GEMMA3_LOCAL_ROPE_THETA)), path)
        extra.update(query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
                     final_logit_softcapping=cfg.get("final_logit_softcapping"),
                     tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)))
        if cfg.get("attn_logit_softcapping") is not None:
            raise ModelLoadError(f"{path.name}: attn_logit_softcapping is not supported (Gemma 3 has none)")
    return ModelConfig(
        architecture=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or hidden // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope_theta=float(theta),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        **{"tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)), **extra},
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        name=path.name,
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),  # Qwen2 always has them
        qk_norm=model_type in ("qwen3", "gemma3"),
        sliding_window=int(window) if window else None,
    )
