"""Engine configuration: one dataclass, shared by the offline API, the server and the lab.

Each field is also a command-line flag (`--` + its name with dashes), derived in `add_cli_args` from the field's
type, default and metadata, so a new option is written once."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, Field, asdict, dataclass, field, fields

from inferlab.common.units import parse_bytes


def _flag(help: str, **argparse_options) -> dict:
    return {"help": help, **argparse_options}


def _optional_int(text: str) -> int | None:
    return None if text.strip().lower() == "none" else int(text)


def _optional_float(text: str) -> float | None:
    return None if text.strip().lower() == "none" else float(text)


def _bytes(text: str) -> int:
    """A size with a unit ('512MiB', '2GB'), or a bare byte count."""
    return parse_bytes(text, "--kv-cache-memory", bare="B")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = field(default=None, metadata=_flag(
        "GGUF file or Hugging Face folder (default: the bundled SmolLM2-135M-Instruct)"))
    dtype: str = field(default="auto", metadata=_flag(
        "activations and KV cache; auto = bfloat16 where the device does bf16 matmul fast",
        choices=["auto", "float32", "bfloat16"]))
    kv_cache_dtype: str = field(default="auto", metadata=_flag(
        "KV cache; int8: each K/V row of a head rounded to int8 with its own scale, about half of bf16's bytes "
        "(layers/kv_int8.py); bfloat16: half of float32's under --dtype float32; auto = --dtype",
        choices=["auto", "bfloat16", "int8"]))
    device: str = field(default="auto", metadata=_flag("auto | cpu | cuda[:N]"))
    block_size: int = field(default=16, metadata=_flag("tokens per KV block"))
    kv_cache_memory: int | None = field(default=None, metadata=_flag(
        "KV pool size, e.g. 512MiB or 2GB (default: room for --max-num-seqs sequences at the full context, "
        "capped at min(1 GiB, 20%% of free memory); see engine/kv_pool.py)", type=_bytes))
    max_num_seqs: int = field(default=64, metadata=_flag("running sequences per step"))
    max_num_batched_tokens: int = field(default=512, metadata=_flag(
        "tokens (prefill chunks + decodes) per step"))
    max_prefill_tokens_with_decodes: int | None = field(default=None, metadata=_flag(
        "prefill tokens a step may carry beside running decodes: bounds their inter-token latency while new "
        "prompts are prefilled ('none' = up to --max-num-batched-tokens)", type=_optional_int))
    decode_stall_ratio: float | None = field(default=1.5, metadata=_flag(
        "while sequences decode, a step may carry prefill tokens until it takes this many times what its decodes "
        "alone take, from step costs measured as the engine runs (engine/step_budget.py); 'none' = no bound. "
        "--max-prefill-tokens-with-decodes, when given, bounds by a fixed count instead", type=_optional_float))
    max_model_len: int | None = field(default=None, metadata=_flag("context length (default: the model's)"))
    enable_prefix_caching: bool = field(default=True, metadata=_flag("reuse the KV blocks of shared prompt prefixes"))
    quantization: str = field(default="auto", metadata=_flag(
        "weight quantization; w8a8: int8 weights and int8 activations per 32 inputs (VNNI, CPU); bf16: bf16 "
        "weights under float32 activations; auto = bf16 where --dtype auto falls back to float32 (a CPU without "
        "AVX-512 BF16, where inferlab's kernel for them is built: the weights the bfloat16 default serves), else none",
        choices=["auto", "none", "int8", "int4", "w8a8", "bf16"]))
    quant_group_size: int = field(default=32, metadata=_flag("weights per quantization scale"))
    speculative: str | None = field(default=None, metadata=_flag("speculative decoding", choices=["ngram", "draft"]))
    num_speculative_tokens: int = field(default=4, metadata=_flag("proposals per speculative step"))
    ngram_min: int = field(default=1, metadata=_flag("shortest n-gram the ngram proposer matches"))
    ngram_max: int = field(default=4, metadata=_flag("longest n-gram the ngram proposer matches"))
    draft_model: str | None = field(default=None, metadata=_flag("draft model for --speculative draft"))
    draft_layers: int | None = field(default=None, metadata=_flag(
        "layers of the draft (alone: the target's own first layers)"))
    pack_weights: bool = field(default=True, metadata=_flag(
        "CPU bf16: keep a packed bf16 copy of each weight (dequantized for int8/int4) for steps of many tokens "
        "(faster, more memory); CPU fp32 where inferlab's kernels are not vectorised (no AVX-512 BF16): oneDNN's "
        "packed fp32 layout"))
    num_threads: int | None = field(default=None, metadata=_flag("torch intra-op threads (default: torch's)"))
    step_trace: str | None = field(default=None, metadata=_flag(
        "write one JSON line per engine step (its batch, start and duration) to this file, for `inferlab simulate "
        "calibrate served`; a disaggregated server writes one file per worker (FILE.prefill0, FILE.decode0)"))
    seed: int = field(default=0, metadata=_flag(
        "seed of the random stream shared by requests that set no seed of their own (as vLLM's --seed)"))

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        cap = self.max_prefill_tokens_with_decodes
        if cap is not None and cap < 1:
            raise ValueError(f"max_prefill_tokens_with_decodes must be at least 1 (or None for no cap), got {cap}")
        if self.decode_stall_ratio is not None and not self.decode_stall_ratio > 1.0:
            raise ValueError(f"decode_stall_ratio must be above 1 (or None for no bound), got {self.decode_stall_ratio}")

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def flag(name: str) -> str:
        """The command-line flag of a field: max_num_seqs -> --max-num-seqs."""
        return "--" + name.replace("_", "-")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("engine")
        for f in fields(cls):
            g.add_argument(cls.flag(f.name), default=f.default, **_argparse_options(f))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def _argparse_options(f: Field) -> dict:
    assert f.default is not MISSING, f"EngineConfig.{f.name} needs a default to be a flag"
    options = dict(f.metadata)
    kind = str(f.type).replace(" | None", "")  # annotations are strings (from __future__ import annotations)
    if kind == "bool":
        options["action"] = argparse.BooleanOptionalAction
    elif "type" not in options and "choices" not in options:
        options["type"] = {"int": int, "str": str}[kind]
    return options
