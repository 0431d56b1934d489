"""Golden greedy outputs of the default engine (bundled model, default options: bf16 with inferlab's CPU kernels on
an AVX-512 BF16 machine), llama2.c's cheapest decisive test. The recorded tokens came from the engine before a
change; the test says whether the change kept them.

Regenerate (only when a change is meant to alter outputs, and say why in the commit; it records the path without
oneDNN's GEMM, which the test pins):
    .venv/bin/python tests/engine/golden_bf16.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GOLDEN = Path(__file__).with_name("golden") / "bf16_greedy.json"
PROMPTS = [
    "The capital of France is",
    "def quicksort(xs):\n",
    [{"role": "user", "content": "Name three uses of a paperclip."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}],
]
MAX_TOKENS = 64


def engine_path(llm) -> dict:
    """What decides the numerics: a machine where these differ takes another path and other roundings."""
    from inferlab.kernels import gemv_kernels
    from inferlab.layers.packed_linear import PackedLinear

    eng = llm.engine
    packed = [m for m in eng.runner.model.modules() if isinstance(m, PackedLinear)]
    return {"dtype": str(eng.dtype), "device": str(eng.device), "cpu_kernels": gemv_kernels() is not None,
            "decode_plan": eng.runner.model.model.decode_plan is not None,
            "onednn_rows": packed[0].onednn_rows if packed else None}


def generate(llm) -> dict:
    from inferlab import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    batched = [o.token_ids for o in llm.generate(PROMPTS, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in PROMPTS]
    return {"path": engine_path(llm), "batched": batched, "alone": alone}


if __name__ == "__main__":
    import os

    from inferlab import LLM

    os.environ["INFERLAB_ONEDNN_MIN_ROWS"] = "0"  # the batch-invariant path, which the test pins (see there)
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(generate(LLM()), indent=None) + "\n")
    print(f"wrote {GOLDEN}", file=sys.stderr)
