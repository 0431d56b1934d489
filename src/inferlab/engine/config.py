"""Engine configuration: one dataclass, shared by the offline API, the server and the lab."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # GGUF file or Hugging Face folder; None = the bundled SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto | float32 | bfloat16 (auto: bfloat16 where the device does bf16 matmul fast)
    device: str = "auto"  # auto | cpu | cuda[:N]
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: int | None = None  # bytes for the KV pool; None = a share of free memory, capped
    max_num_seqs: int = 64  # running sequences per step
    max_num_batched_tokens: int = 512  # tokens (prefill chunks + decodes) per step
    # prefill tokens a step may add beside decodes (bounds inter-token latency); None = up to the step budget
    max_prefill_tokens_with_decodes: int | None = None
    max_model_len: int | None = None  # None = the model's context length
    enable_prefix_caching: bool = True
    quantization: str = "none"  # none | int8 | int4
    quant_group_size: int = 32
    speculative: str | None = None  # None | ngram | draft
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    draft_model: str | None = None
    draft_layers: int | None = None
    # CPU bf16: keep a packed bf16 copy of each weight, dequantized for int8/int4 (faster, more memory)
    pack_weights: bool = True
    num_threads: int | None = None  # torch intra-op threads; None = leave torch's default
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        cap = self.max_prefill_tokens_with_decodes
        if cap is not None and cap < 1:
            raise ValueError(f"max_prefill_tokens_with_decodes must be at least 1 (or None for no cap), got {cap}")

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: bundled SmolLM2-135M-Instruct)")
        g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
        g.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
        g.add_argument("--block-size", type=int, default=16)
        g.add_argument("--kv-cache-memory", type=_parse_bytes, default=None, help="KV pool size, e.g. 512MiB or 2GB")
        g.add_argument("--max-num-seqs", type=int, default=64)
        g.add_argument("--max-num-batched-tokens", type=int, default=512)
        g.add_argument("--max-prefill-tokens-with-decodes", type=_optional_int, default=None,
                       help="prefill tokens a step may carry beside running decodes: bounds their inter-token "
                            "latency while new prompts are prefilled ('none' = up to --max-num-batched-tokens)")
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
        g.add_argument("--quantization", default="none", choices=["none", "int8", "int4"])
        g.add_argument("--quant-group-size", type=int, default=32)
        g.add_argument("--speculative", default=None, choices=["ngram", "draft"])
        g.add_argument("--num-speculative-tokens", type=int, default=4)
        g.add_argument("--ngram-min", type=int, default=1)
        g.add_argument("--ngram-max", type=int, default=4)
        g.add_argument("--draft-model", default=None)
        g.add_argument("--draft-layers", type=int, default=None)
        g.add_argument("--pack-weights", action=argparse.BooleanOptionalAction, default=True,
                       help="CPU bf16: keep a packed bf16 copy of each weight (dequantized for int8/int4) "
                            "for steps of many tokens (faster, more memory)")
        g.add_argument("--num-threads", type=int, default=None)
        g.add_argument("--seed", type=int, default=0)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def _optional_int(text: str) -> int | None:
    return None if text.strip().lower() == "none" else int(text)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _parse_bytes(text: str) -> int:
    """'512MiB', '2GB', '1073741824' -> bytes."""
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if unit not in _UNITS or not num:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a size: use a number with B, KB, MB, GB, KiB, MiB or GiB")
    return int(float(num) * _UNITS[unit])
