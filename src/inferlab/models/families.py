"""Which model class serves each architecture of models/config.py (SUPPORTED_ARCHITECTURES: the same keys)."""

from __future__ import annotations

from inferlab.models.config import ModelConfig
from inferlab.models.gemma3 import Gemma3ForCausalLM
from inferlab.models.llama import LlamaForCausalLM
from inferlab.models.qwen3 import Qwen3ForCausalLM

# Qwen2 and Mistral are Llama's layers with options the config sets (Q/K/V biases, a sliding window): one class.
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma3": Gemma3ForCausalLM,  # its own layers and model (models/gemma3.py); the causal-LM shell is Llama's
}


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    return MODEL_CLASSES[cfg.architecture]
