"""lm-evaluation-harness's `local-completions` model against the server gives the accuracy and per-item
log-likelihoods of its `hf` model on the same fp32 weights (within 1e-3), on a multiple-choice task from a local
file. The standalone version, with `inferlab serve` as a process: benchmarks/lm_eval_parity.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from server_testkit import LiveServer

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval", reason="lm_eval is in the dev extra")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from lm_eval_parity import ITEMS, TASK  # noqa: E402 - the task and its items, shared with the script


def test_local_completions_matches_the_hf_model(llm_fp32, hf_model, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from inferlab.server.api import ServerConfig, build_app

    tok = tmp_path / "tokenizer"
    llm_fp32.tokenizer.save_pretrained(tok)
    with open(tmp_path / "mc.jsonl", "w") as f:
        for q, choices, answer in ITEMS:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    (tmp_path / "inferlab_mc.yaml").write_text(TASK.format(data=tmp_path / "mc.jsonl"))
    tasks = TaskManager(include_path=str(tmp_path))

    def run(model, model_args=None):
        out = simple_evaluate(model=model, model_args=model_args, tasks=["inferlab_mc"], batch_size=1,
                              task_manager=tasks, log_samples=True)
        samples = sorted(out["samples"]["inferlab_mc"], key=lambda s: s["doc_id"])
        return out["results"]["inferlab_mc"]["acc,none"], [[r[0] for r in s["filtered_resps"]] for s in samples]

    with LiveServer(build_app(llm_fp32.engine, ServerConfig())) as s:
        ours = run("local-completions", f"model={llm_fp32.engine.model_name},base_url={s.base}/v1/completions,"
                                        f"tokenizer={tok},tokenizer_backend=huggingface,num_concurrent=1")
    ref = run(HFLM(pretrained=hf_model, tokenizer=str(tok), batch_size=1))
    assert len(ours[1]) == len(ITEMS) and ours[0] == ref[0]
    assert max(abs(a - b) for xs, ys in zip(ours[1], ref[1]) for a, b in zip(xs, ys)) < 1e-3
