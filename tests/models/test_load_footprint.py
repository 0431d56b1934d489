"""Loading a model imports only what serving uses: torch._dynamo (with sympy and triton, ~160 MiB resident) came in
through nn.init and arithmetic on the meta device. Checked in a fresh interpreter, since this one may have imported
them for other tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

pytestmark = pytest.mark.slow


def test_loading_and_generating_import_no_compiler_stack():
    code = ("import sys\n"
            "from inferlab import LLM, SamplingParams\n"
            "llm = LLM(dtype='bfloat16', kv_cache_memory=32 * 2**20, num_threads=1)\n"
            "out = llm.generate(['Hello'], SamplingParams(max_tokens=3, temperature=0))[0]\n"
            "assert len(out.token_ids) == 3, out\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'sympy', 'triton') if m in sys.modules))\n")
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_forget_gguf_files_drops_the_cached_reader():
    from inferlab.common.bundled import bundled_model_path
    from inferlab.models.config import forget_gguf_files, open_gguf

    path = bundled_model_path()
    first = open_gguf(path)
    assert open_gguf(path) is first  # kept for the next load in this process
    forget_gguf_files()
    assert open_gguf.cache_info().currsize == 0
    assert open_gguf(path) is not first
