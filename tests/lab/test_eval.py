"""inferlab eval on small fakes: the metrics, the scoring, the comparison, the gate and the CLI.

The fake model is a character bigram whose logits come from one nn.Linear (weight = log P(next | prev), counted
on the shipped corpus), so perplexity has a known value and a real `quantize_model` can quantize (and break) it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import inferlab
from inferlab.lab import eval as ev
from inferlab.lab import eval_cli
from inferlab.quant import quantize_model

V = 128


class CharTokenizer:
    chat_template = "(a chat model)"  # the evaluation sends it chat messages

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [min(ord(c), V - 1) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


@dataclass
class FakeOutput:
    text: str
    token_ids: list[int] = field(default_factory=list)


class BigramLLM:
    """The three calls the evaluation makes, over a bigram model held in `self.net.lm` (an nn.Linear)."""

    def __init__(self, quantization: str = "none", model: str | None = None, **_):
        counts = torch.ones(V, V)  # add-one smoothing
        for d in ev.load_corpus():
            ids = torch.tensor(CharTokenizer().encode(d.text))
            counts.index_put_((ids[1:], ids[:-1]), torch.ones(len(ids) - 1), accumulate=True)
        self.net = nn.Module()
        self.net.lm = nn.Linear(V, V, bias=False)
        with torch.no_grad():
            self.net.lm.weight.copy_((counts / counts.sum(0, keepdim=True)).log())  # [next, prev]
        path = quantize_model(self.net, quantization, 32)
        if model == "broken":  # the deliberately broken quantization: every scale zeroed
            self.net.lm.scales.zero_()
        self.tokenizer = CharTokenizer()
        self.engine = SimpleNamespace(quant_path=path, weight_bytes=sum(
            t.numel() * t.element_size() for t in list(self.net.parameters()) + list(self.net.buffers())))

    def _logits(self, prev: list[int]) -> torch.Tensor:
        return self.net.lm(nn.functional.one_hot(torch.tensor(prev), V).float())

    def score(self, ids: list[int]) -> list[float]:
        lp = self._logits(ids[:-1]).log_softmax(-1)
        return lp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()

    def generate(self, prompts: list, params) -> list[FakeOutput]:
        outs = []
        for p in prompts:
            ids = p["prompt_token_ids"] if isinstance(p, dict) else self.tokenizer.encode(p[-1]["content"])
            new = []
            for _ in range(params.max_tokens):
                new.append(int(self._logits([(new or ids)[-1]])[0].argmax()))
            outs.append(FakeOutput(self.tokenizer.decode(new), new))
        return outs


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """The first 1,500 characters of one prose and one code document: enough text, a fast test."""
    root = tmp_path_factory.mktemp("corpus")
    for d in ev.load_corpus():
        if d.name in ("prose_bread.txt", "code_algorithms.py"):
            (root / d.name).write_text(d.text[:1500])
    return str(root)


@pytest.fixture
def small(small_corpus):
    return ev.EvalSettings(window=64, max_prompts=6, continuation_prompts=6, continuation_tokens=12,
                           task_max_tokens=4, corpus=small_corpus)


def test_chunk_windows_score_every_token_once():
    ids = list(range(10))
    ws = ev.chunk_windows(ids, 4)
    assert ws == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert sum(len(w) - 1 for w in ws) == len(ids) - 1
    assert ev.chunk_windows(list(range(5)), 4) == [[0, 1, 2, 3], [3, 4]]
    with pytest.raises(ValueError, match="at least 2"):
        ev.chunk_windows(ids, 1)


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size(small_corpus):
    llm = BigramLLM()
    with torch.no_grad():
        llm.net.lm.weight.zero_()
    r = ev.perplexity(llm, ev.load_corpus(small_corpus), window=100)
    assert r.perplexity == pytest.approx(V, rel=1e-5)
    assert set(r.by_kind) == {"code", "prose"}


def test_perplexity_matches_a_direct_computation(small_corpus):
    llm = BigramLLM()
    docs = ev.load_corpus(small_corpus)
    r = ev.perplexity(llm, docs, window=50)
    nll = n = 0
    for d in docs:  # the whole document at once: windows must not change a bigram's score
        lps = llm.score(CharTokenizer().encode(d.text))
        nll, n = nll - sum(lps), n + len(lps)
    assert r.num_tokens == n and r.perplexity == pytest.approx(math.exp(nll / n), rel=1e-9)
    assert 3 < r.perplexity < 30  # a bigram of characters on English text and code


@pytest.mark.parametrize("output,answers,ok", [
    ("12", ["12"], True),
    ("  **Paris**.\nParis is the capital", ["Paris"], True),
    ("The capital of France is Paris.", ["Paris"], True),
    ("7 + 5 = 12", ["12"], True),
    ("Answer: 1,440", ["1440"], True),
    ("'ababab'", ["ababab"], True),
    ("New Delhi", ["New Delhi"], True),
    ("Delhi", ["New Delhi"], False),
    ("120", ["12"], False),
    ("12 or 13", ["12"], False),
    ("\n\nmice", ["mice"], True),
    ("", ["0"], False),
    ("The spider has 8 legs.", ["8"], False),  # exact match: an answer inside a sentence does not count
])
def test_answer_scoring(output, answers, ok):
    assert ev.is_correct(output, answers) is ok


def test_shipped_data_loads_and_is_consistent():
    tasks = ev.load_tasks()
    assert len(tasks) >= 100 and len({t.id for t in tasks}) == len(tasks)
    assert {t.category for t in tasks} == {"arithmetic", "capitals", "units", "code", "words"}
    shots = {q for q, _ in ev.TASK_SHOTS}
    assert not shots & {t.question for t in tasks}  # no task is answered by its own few-shot example
    for t in tasks:  # every accepted answer must be reachable by the scorer
        assert all(ev.is_correct(a, t.answers) for a in t.answers), t.id
    docs = ev.load_corpus()
    assert {d.kind for d in docs} == {"prose", "code"} and sum(len(d.text) for d in docs) > 10_000


def test_continuation_prompts_are_distinct_and_spread(small_corpus):
    llm = BigramLLM()
    docs = ev.load_corpus(small_corpus)
    ps = ev.continuation_prompts(llm, docs, count=5, context=40)
    assert len(ps) == 5 and all(len(p) == 40 for p in ps) and len({tuple(p) for p in ps}) == 5
    every = ev.continuation_prompts(llm, docs, count=1000, context=40)  # more than there are: each once
    assert len({tuple(p) for p in every}) == len(every) == sum(len(d.text) // 40 - (len(d.text) % 40 == 0)
                                                               for d in docs)
    assert ps[0] == every[0] and ps[-1] == every[-1]


def test_task_messages_are_few_shot_chat():
    m = ev.task_messages(ev.Task("x", "c", "What is 1 + 1?", ["2"]))
    assert m[0]["role"] == "system" and m[-1] == {"role": "user", "content": "What is 1 + 1?"}
    assert len(m) == 2 + 2 * len(ev.TASK_SHOTS)


def test_run_tasks_counts_per_category():
    class Canned:
        tokenizer = CharTokenizer()

        def generate(self, prompts, params):
            assert params.temperature == 0.0
            return [FakeOutput({"Q1": "4", "Q2": "Rome is the answer", "Q3": "rome"}[p[-1]["content"]], [1])
                    for p in prompts]

    tasks = [ev.Task("a", "math", "Q1", ["4"]), ev.Task("b", "geo", "Q2", ["Rome"]), ev.Task("c", "geo", "Q3", ["Rome"])]
    r = ev.run_tasks(Canned(), tasks)
    assert (r.correct, r.total) == (2, 3) and r.by_category == {"geo": 0.5, "math": 1.0}
    assert [i["correct"] for i in r.items] == [True, False, True]


def test_run_tasks_without_a_chat_template_sends_few_shot_text():
    """A base model (Gemma 3 270M's GGUF has no chat template) gets the same shots as text, each answer one line."""
    class Base:
        tokenizer = SimpleNamespace(chat_template=None)

        def generate(self, prompts, params):
            assert params.stop == ["\n"]
            return [FakeOutput(" 4" if p.endswith("Question: Q1\nAnswer:") else " no", [1]) for p in prompts]

    r = ev.run_tasks(Base(), [ev.Task("a", "math", "Q1", ["4"]), ev.Task("b", "geo", "Q2", ["Rome"])])
    assert (r.correct, r.total) == (1, 2)
    text = ev.task_text(ev.Task("a", "math", "Q1", ["4"]))
    assert text.startswith(ev.TASK_SYSTEM) and all(f"Question: {q}\nAnswer: {a}\n" in text for q, a in ev.TASK_SHOTS)


def test_first_divergence_and_agreement():
    assert ev.first_divergence([1, 2, 3], [1, 2, 3], 3) is None
    assert ev.first_divergence([1, 2, 3, 9], [1, 2, 3, 8], 3) is None  # only the first n count
    assert ev.first_divergence([1, 5, 3], [1, 2, 3], 3) == 1
    assert ev.first_divergence([1, 2], [1, 2, 3], 3) == 2  # one stopped early
    a = ev.greedy_agreement([[1, 2, 3], [1, 2, 3], [7, 2, 3], [1, 2]], [[1, 2, 3]] * 4, 3)
    assert a.agreement == 0.25 + 0.25 and a.mean_first_divergence == (3 + 3 + 0 + 2) / 4
    with pytest.raises(ValueError, match="different prompt sets"):
        ev.greedy_agreement([[1]], [[1], [2]], 3)


def test_healthy_int8_passes_and_zeroed_scales_are_caught(small):
    gate = ev.Gate(max_ppl_increase=0.02, min_agreement=0.5)
    base = ev.evaluate(BigramLLM(), small)
    good = ev.evaluate(BigramLLM("int8"), small)
    broken = ev.evaluate(BigramLLM("int8", model="broken"), small)
    rg, rb = {**good, **ev.compare(good, base)}, {**broken, **ev.compare(broken, base)}
    assert gate.check(rg) == []
    assert abs(rg["deltas"]["perplexity_rel"]) < 0.02 and rg["agreement"]["agreement"] > 0.5
    fails = gate.check(rb)
    assert len(fails) == 2 and "perplexity rose" in fails[0] and "greedy agreement" in fails[1]
    assert rb["perplexity"]["perplexity"] == pytest.approx(V, rel=1e-4)


def test_gate_without_a_baseline_says_so():
    assert "no baseline" in ev.Gate(max_ppl_increase=0.1).check({"perplexity": {}})[0]
    assert ev.Gate().check({}) == []


def test_compare_refuses_different_prompt_sets(small):
    r = ev.evaluate(BigramLLM(), small)
    other = json.loads(json.dumps(r))
    other["continuations"]["prompts"][0] = [1, 2, 3]
    with pytest.raises(ValueError, match="different prompts"):
        ev.compare(r, other)


def _cli(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser()
    eval_cli.add_arguments(p)
    return eval_cli.run(p.parse_args(argv))


SMALL_FLAGS = ["--window", "64", "--max-prompts", "4", "--continuation-tokens", "8", "--task-max-tokens", "4"]


def test_cli_compares_with_a_baseline_and_writes_json(tmp_path, monkeypatch, capsys, small_corpus):
    monkeypatch.setattr(inferlab, "LLM", BigramLLM, raising=False)
    out = tmp_path / "eval.json"
    code = _cli(["--quantization", "int8", "--baseline", "--quantization none", "--json-out", str(out),
                 "--max-ppl-increase", "0.05", *SMALL_FLAGS, "--corpus", small_corpus])
    assert code == 0
    d = json.loads(out.read_text())
    assert d["config"]["quantization"] == "int8" and d["baseline"]["config"]["quantization"] == "none"
    assert d["quant_path"].startswith("int8") and d["weight_bytes"] < d["baseline"]["weight_bytes"]
    assert 0 <= d["agreement"]["agreement"] <= 1 and d["gate"]["passed"] is True
    assert len(d["tasks"]["items"]) == 4 and d["perplexity"]["window"] == 64
    shown = capsys.readouterr().out
    assert "perplexity" in shown and "greedy agreement" in shown and "quality gate passed" in shown

    # The same file as a stored baseline: a broken candidate fails the gate with exit status 1.
    out2 = tmp_path / "broken.json"
    code = _cli(["--quantization", "int8", "--model", "broken", "--baseline-result", str(out), "--json-out",
                 str(out2), "--max-ppl-increase", "0.05", *SMALL_FLAGS, "--corpus", small_corpus])
    assert code == 1
    assert json.loads(out2.read_text())["gate"]["failures"][0].startswith("perplexity rose")


def test_cli_rejects_bad_baseline_flags(monkeypatch, capsys):
    monkeypatch.setattr(inferlab, "LLM", BigramLLM, raising=False)
    assert _cli(["--baseline", "--quantization int3", *SMALL_FLAGS]) == 2
    assert _cli(["--baseline", "--frobnicate 3", *SMALL_FLAGS]) == 2
    err = capsys.readouterr().err
    assert "int3" in err and "not engine flags: --frobnicate 3" in err
