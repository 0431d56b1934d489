"""lm-evaluation-harness against `inferlab serve` vs its own `hf` model on the same weights (fp32): a small
multiple-choice task from a local file (no dataset download), accuracy and per-item log-likelihoods compared.

    PYTHONPATH=src python benchmarks/lm_eval_parity.py [--port 8011] [--limit 0]

What runs: `inferlab serve --dtype float32`, then lm_eval's `local-completions` model on its /v1/completions
(echo + logprobs, as lm_eval scores choices) and lm_eval's `hf` model on the bundled GGUF (transformers dequantizes
it to fp32, the weights inferlab loads). Prints one JSON line: accuracy of each, items, max |delta loglikelihood|.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ITEMS = [
    ("What colour is the sky on a clear day?", ["green", "blue", "red", "black"], 1),
    ("How many legs does a spider have?", ["six", "four", "eight", "ten"], 2),
    ("What is the capital of France?", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("Which animal says moo?", ["cat", "dog", "cow", "duck"], 2),
    ("What do bees make?", ["milk", "honey", "silk", "wool"], 1),
    ("What is frozen water called?", ["steam", "ice", "fog", "sand"], 1),
    ("Which planet do we live on?", ["Mars", "Venus", "Earth", "Jupiter"], 2),
    ("How many days are in a week?", ["five", "seven", "ten", "three"], 1),
    ("What is the opposite of hot?", ["cold", "warm", "loud", "tall"], 0),
    ("Which fruit is yellow and curved?", ["apple", "grape", "banana", "cherry"], 2),
    ("What do you use to write on paper?", ["a spoon", "a pen", "a shoe", "a cup"], 1),
    ("Which season comes after winter?", ["autumn", "summer", "spring", "monsoon"], 2),
    ("What is two plus two?", ["three", "four", "five", "six"], 1),
    ("Where do fish live?", ["in trees", "in water", "in the sky", "in sand"], 1),
    ("Which instrument has keys and pedals?", ["drum", "flute", "piano", "violin"], 2),
    ("What do plants need from the sun?", ["light", "noise", "salt", "smoke"], 0),
    ("What shape is a ball?", ["square", "round", "flat", "triangular"], 1),
    ("Which is the largest ocean?", ["Atlantic", "Indian", "Arctic", "Pacific"], 3),
    ("What do cows eat?", ["grass", "rocks", "metal", "plastic"], 0),
    ("What is the colour of snow?", ["white", "purple", "orange", "brown"], 0),
]

TASK = """task: inferlab_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def evaluate(model: str, model_args: str, include: Path, limit: int | None) -> tuple[float, list[list[float]]]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model=model, model_args=model_args, tasks=["inferlab_mc"], batch_size=1, limit=limit,
                          task_manager=TaskManager(include_path=str(include)), log_samples=True, device="cpu")
    samples = sorted(out["samples"]["inferlab_mc"], key=lambda s: s["doc_id"])
    lls = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
    return out["results"]["inferlab_mc"]["acc,none"], lls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--limit", type=int, default=0, help="items to run (0: all)")
    args = ap.parse_args()
    from inferlab.common.bundled import bundled_model_path
    from inferlab.models.loader import load_tokenizer

    gguf = bundled_model_path()
    tmp = Path(tempfile.mkdtemp(prefix="lm_eval_parity_"))
    load_tokenizer(None).save_pretrained(tmp / "tokenizer")
    with open(tmp / "mc.jsonl", "w") as f:
        for q, choices, answer in ITEMS:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    (tmp / "inferlab_mc.yaml").write_text(TASK.format(data=tmp / "mc.jsonl"))
    limit = args.limit or None

    server = subprocess.Popen([sys.executable, "-m", "inferlab.cli", "serve", "--dtype", "float32", "--port",
                               str(args.port), "--log-level", "warning"], env=os.environ.copy())
    try:
        base = f"http://127.0.0.1:{args.port}"
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("inferlab serve did not start")
            time.sleep(1)
        ours = evaluate("local-completions",
                        f"model=SmolLM2-135M-Instruct,base_url={base}/v1/completions,tokenizer={tmp / 'tokenizer'},"
                        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1", tmp, limit)
    finally:
        server.terminate()
        server.wait(60)
    ref = evaluate("hf", f"pretrained={gguf.parent},gguf_file={gguf.name},tokenizer={tmp / 'tokenizer'},"
                         "dtype=float32", tmp, limit)
    diff = max(abs(a - b) for xs, ys in zip(ours[1], ref[1]) for a, b in zip(xs, ys))
    print(json.dumps({"items": len(ours[1]), "acc_inferlab": ours[0], "acc_hf": ref[0],
                      "max_abs_loglikelihood_diff": diff}))


if __name__ == "__main__":
    main()
