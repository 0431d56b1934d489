"""Quality evaluation that needs no network: perplexity on a shipped corpus, exact-match accuracy on shipped tasks,
and greedy agreement with a baseline config. `inferlab eval` (eval_cli.py) is a view of these functions; the lab's
experiment runner reads the JSON they produce.

Everything here talks to the model through three calls the offline `LLM` provides (so tests can use small fakes):
`llm.tokenizer.encode`, `llm.generate(prompts, SamplingParams)` and `llm.score(token_ids)`.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from inferlab.engine.prompt import bos_prefix
from inferlab.engine.sampling_params import SamplingParams

# --- data --------------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Document:
    name: str
    kind: str  # "prose" | "code": the file-name prefix
    text: str


@dataclass(slots=True)
class Task:
    id: str
    category: str
    question: str
    answers: list[str]


def _data_dir() -> Path:
    return Path(str(resources.files("inferlab") / "data"))


def load_corpus(path: str | Path | None = None) -> list[Document]:
    """The corpus documents: every file in `path` (default: the shipped data/corpus), kind = name prefix."""
    root = Path(path) if path else _data_dir() / "corpus"
    if not root.is_dir():
        raise FileNotFoundError(f"corpus folder {root} does not exist")
    docs = [Document(p.name, p.name.split("_", 1)[0], p.read_text(encoding="utf-8"))
            for p in sorted(root.iterdir()) if p.is_file() and not p.name.startswith(".")]
    if not docs:
        raise ValueError(f"corpus folder {root} has no files")
    return docs


def load_tasks(path: str | Path | None = None) -> list[Task]:
    """Tasks from a JSON-lines file (default: the shipped data/tasks.jsonl); each line names what is wrong."""
    p = Path(path) if path else _data_dir() / "tasks.jsonl"
    tasks = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            t = Task(str(d["id"]), str(d.get("category", "")), str(d["question"]), [str(a) for a in d["answers"]])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{p}:{i}: a task needs id, question and a list of answers ({e})") from None
        if not t.answers:
            raise ValueError(f"{p}:{i}: task {t.id} has no accepted answers")
        tasks.append(t)
    return tasks


class EvalModel(Protocol):
    """What the evaluation needs from a model (the offline `LLM` has it)."""

    tokenizer: Any

    def generate(self, prompts: list, params: SamplingParams) -> list: ...

    def score(self, token_ids: list[int]) -> list[float]: ...


# --- perplexity --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    num_tokens: int  # tokens scored
    window: int
    by_kind: dict[str, float] = field(default_factory=dict)  # perplexity per document kind
    by_document: dict[str, float] = field(default_factory=dict)


def chunk_windows(ids: list[int], window: int) -> list[list[int]]:
    """Consecutive windows of at most `window` tokens, each starting with the previous window's last token: every
    token after the document's first is scored exactly once, with 1..window-1 tokens of context from its own
    window (chunked evaluation: cheaper than a sliding window, and slightly pessimistic at window starts)."""
    if window < 2:
        raise ValueError(f"the perplexity window must be at least 2 tokens, got {window}")
    step = window - 1
    return [ids[i : i + window] for i in range(0, max(len(ids) - 1, 1), step) if len(ids[i : i + window]) >= 2]


def perplexity(llm: EvalModel, docs: list[Document], window: int = 512) -> PerplexityResult:
    """exp(mean NLL) over every scored token of every document (see `chunk_windows`), plus per kind/document."""
    per_doc: dict[str, tuple[float, int]] = {}
    kind_of = {d.name: d.kind for d in docs}
    # Each window starts with the model's BOS where its tokenizer adds one (Gemma), which is context, not scored.
    prefix = bos_prefix(llm.tokenizer)
    for d in docs:
        ids = llm.tokenizer.encode(d.text, add_special_tokens=False)
        nll, n = 0.0, 0
        for w in chunk_windows(ids, window):
            lps = llm.score(prefix + w)[len(prefix):]
            nll -= sum(lps)
            n += len(lps)
        per_doc[d.name] = (nll, n)
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, (nll, n) in per_doc.items():
        kinds[kind_of[name]][0] += nll
        kinds[kind_of[name]][1] += n
    total = sum(n for _, n in per_doc.values())
    if total == 0:
        raise ValueError("the corpus has no scorable tokens (every document is shorter than 2 tokens)")
    mean = sum(nll for nll, _ in per_doc.values()) / total
    return PerplexityResult(
        perplexity=math.exp(mean), nll=mean, num_tokens=total, window=window,
        by_kind={k: math.exp(v[0] / v[1]) for k, v in sorted(kinds.items()) if v[1]},
        by_document={k: math.exp(v[0] / v[1]) for k, v in per_doc.items() if v[1]},
    )


# --- tasks -------------------------------------------------------------------------------------------------------

TASK_SYSTEM = "Answer with only the final answer: a number, a word or a short phrase."
# Few-shot turns fix the answer format (a 135M model otherwise explains instead of answering); none of them is
# a task in tasks.jsonl.
TASK_SHOTS = [("What is 2 + 2?", "4"), ("What is the capital of Italy?", "Rome"),
              ("How many hours are in a day?", "24"), ("What does len('abc') return in Python?", "3")]


def task_messages(task: Task) -> list[dict]:
    msgs = [{"role": "system", "content": TASK_SYSTEM}]
    for q, a in TASK_SHOTS:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": task.question}]


_LEAD_INS = re.compile(r"^(the )?(final )?answer( is)?\s*[:=]?\s*")


def normalize_answer(text: str) -> str:
    """Lower case, no markdown emphasis or quotes around the whole answer, no trailing punctuation, no thousands
    separators in numbers, no leading "answer:" / "the answer is", collapsed whitespace."""
    s = text.strip().lower().replace("**", "").replace("`", "")
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)
    s = _LEAD_INS.sub("", s)
    s = re.sub(r"\s+", " ", s).strip().rstrip(".!;,").strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        s = s[1:-1]
    return s


def answer_candidates(output: str) -> list[str]:
    """What counts as the model's answer: the first non-empty line, normalised, and the part after its last
    " is " or "=" (so "The capital of France is Paris." and "7 + 5 = 12" are read as their final span)."""
    line = next((ln for ln in output.splitlines() if ln.strip()), "")
    first = normalize_answer(line)
    out = [first]
    for sep in (" is ", "="):
        if sep in first:
            out.append(normalize_answer(first.rsplit(sep, 1)[1]))
    return out


def is_correct(output: str, answers: list[str]) -> bool:
    accepted = {normalize_answer(a) for a in answers}
    return any(c in accepted for c in answer_candidates(output))


@dataclass(slots=True)
class TaskResult:
    accuracy: float
    correct: int
    total: int
    by_category: dict[str, float]
    items: list[dict]  # {id, category, output, correct, token_ids}


def task_text(task: Task) -> str:
    """The few-shot turns as plain text, for a base model without a chat template (Gemma 3 270M's GGUF)."""
    shots = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in TASK_SHOTS)
    return f"{TASK_SYSTEM}\n\n{shots}Question: {task.question}\nAnswer:"


def run_tasks(llm: EvalModel, tasks: list[Task], max_tokens: int = 16) -> TaskResult:
    """Greedy answers in the few-shot chat format (plain text, each answer ending at its line, where the model has no
    chat template), scored by exact match after normalisation."""
    if getattr(llm.tokenizer, "chat_template", None):
        prompts, params = [task_messages(t) for t in tasks], SamplingParams(temperature=0.0, max_tokens=max_tokens)
    else:
        prompts = [task_text(t) for t in tasks]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=["\n"])
    outs = llm.generate(prompts, params)
    items, cats = [], defaultdict(lambda: [0, 0])
    for t, o in zip(tasks, outs):
        ok = is_correct(o.text, t.answers)
        items.append({"id": t.id, "category": t.category, "output": o.text, "correct": ok,
                      "token_ids": list(o.token_ids)})
        cats[t.category][0] += ok
        cats[t.category][1] += 1
    correct = sum(i["correct"] for i in items)
    return TaskResult(accuracy=correct / len(items) if items else 0.0, correct=correct, total=len(items),
                      by_category={c: v[0] / v[1] for c, v in sorted(cats.items())}, items=items)


# --- greedy agreement --------------------------------------------------------------------------------------------


def continuation_prompts(llm: EvalModel, docs: list[Document], count: int = 24, context: int = 48) -> list[list[int]]:
    """`count` plain-text prompts of `context` tokens cut from the corpus, spread evenly over its documents."""
    per_doc = [llm.tokenizer.encode(d.text, add_special_tokens=False) for d in docs]
    starts = [(i, s) for i, ids in enumerate(per_doc) for s in range(0, len(ids) - context, context)]
    if not starts:
        return []
    n = min(count, len(starts))
    pick = [starts[round(j * (len(starts) - 1) / max(n - 1, 1))] for j in range(n)]
    prefix = bos_prefix(llm.tokenizer)  # the model's BOS where its tokenizer adds one (see perplexity)
    return [prefix + per_doc[i][s : s + context] for i, s in pick]


def generate_continuations(llm: EvalModel, prompts: list[list[int]], tokens: int = 32) -> list[list[int]]:
    """Exactly `tokens` greedy tokens per prompt (EOS ignored, so every comparison has the same length)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def first_divergence(a: list[int], b: list[int], n: int) -> int | None:
    """Index of the first differing token within the first n, or None when the first n are identical (a sequence
    that ends earlier than the other diverges where it ends)."""
    a, b = a[:n], b[:n]
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(slots=True)
class Agreement:
    agreement: float  # share of prompts whose first `tokens` generated tokens are identical to the baseline's
    mean_first_divergence: float  # mean index of the first differing token; identical prompts count as `tokens`
    num_prompts: int
    tokens: int


def greedy_agreement(candidate: list[list[int]], baseline: list[list[int]], tokens: int) -> Agreement:
    if len(candidate) != len(baseline):
        raise ValueError(f"cannot compare {len(candidate)} generations with {len(baseline)} baseline generations "
                         "(the two runs used different prompt sets)")
    if not candidate:
        raise ValueError("no generations to compare")
    divs = [first_divergence(a, b, tokens) for a, b in zip(candidate, baseline)]
    return Agreement(agreement=sum(d is None for d in divs) / len(divs),
                     mean_first_divergence=sum(tokens if d is None else d for d in divs) / len(divs),
                     num_prompts=len(divs), tokens=tokens)


# --- one config, and a comparison ---------------------------------------------------------------------------------


@dataclass(slots=True)
class EvalSettings:
    window: int = 512  # perplexity window (tokens)
    task_max_tokens: int = 16
    max_prompts: int | None = None  # cap on tasks and on continuation prompts (quick runs)
    continuation_prompts: int = 24
    continuation_tokens: int = 32  # N of the greedy agreement
    corpus: str | None = None  # folder; None = the shipped corpus
    tasks: str | None = None  # JSON-lines file; None = the shipped tasks


def evaluate(llm: EvalModel, settings: EvalSettings | None = None) -> dict:
    """Perplexity, task accuracy and the greedy continuations (kept for agreement) of one loaded model."""
    s = settings or EvalSettings()
    docs, tasks = load_corpus(s.corpus), load_tasks(s.tasks)
    n_cont = s.continuation_prompts
    if s.max_prompts is not None:
        tasks, n_cont = tasks[: s.max_prompts], min(n_cont, s.max_prompts)
    t0 = time.perf_counter()
    ppl = perplexity(llm, docs, s.window)
    t1 = time.perf_counter()
    task_res = run_tasks(llm, tasks, s.task_max_tokens)
    t2 = time.perf_counter()
    prompts = continuation_prompts(llm, docs, n_cont)
    conts = generate_continuations(llm, prompts, s.continuation_tokens)
    t3 = time.perf_counter()
    return {
        "perplexity": asdict(ppl),
        "tasks": asdict(task_res),
        "continuations": {"tokens": s.continuation_tokens, "prompts": prompts, "token_ids": conts},
        "settings": asdict(s),
        "seconds": {"perplexity": t1 - t0, "tasks": t2 - t1, "continuations": t3 - t2},
    }


def compare(result: dict, baseline: dict) -> dict:
    """Agreement of `result` with `baseline` (two `evaluate` outputs) and the quality deltas."""
    c, b = result["continuations"], baseline["continuations"]
    if c["prompts"] != b["prompts"]:
        raise ValueError("the candidate and the baseline were continued from different prompts (different corpus, "
                         "tokenizer or --max-prompts): their greedy agreement is meaningless")
    agr = greedy_agreement(c["token_ids"], b["token_ids"], min(c["tokens"], b["tokens"]))
    ti = {i["id"]: i for i in baseline["tasks"]["items"]}
    same = [i["token_ids"] == ti[i["id"]]["token_ids"] for i in result["tasks"]["items"] if i["id"] in ti]
    p, pb = result["perplexity"]["perplexity"], baseline["perplexity"]["perplexity"]
    return {
        "agreement": {**asdict(agr), "task_answers_identical": sum(same) / len(same) if same else None},
        "deltas": {"perplexity_rel": p / pb - 1, "accuracy": result["tasks"]["accuracy"] - baseline["tasks"]["accuracy"]},
    }


@dataclass(slots=True)
class Gate:
    """Quality floor relative to the baseline (None = not checked)."""

    max_ppl_increase: float | None = None  # relative, 0.02 = +2%
    max_accuracy_drop: float | None = None  # absolute, 0.05 = 5 points
    min_agreement: float | None = None  # share of identical continuations

    def check(self, report: dict) -> list[str]:
        """The failures, each a sentence; empty when the report meets the floor."""
        fails = []
        d, a = report.get("deltas"), report.get("agreement")
        if (self.max_ppl_increase is not None or self.max_accuracy_drop is not None or self.min_agreement is not None) \
                and d is None:
            return ["no baseline to compare with: give --baseline (the gate's limits are relative to it)"]
        if self.max_ppl_increase is not None and d["perplexity_rel"] > self.max_ppl_increase:
            fails.append(f"perplexity rose {d['perplexity_rel']:+.2%} over the baseline (limit +{self.max_ppl_increase:.2%})")
        if self.max_accuracy_drop is not None and -d["accuracy"] > self.max_accuracy_drop:
            fails.append(f"task accuracy fell {-d['accuracy']:.1%} (limit {self.max_accuracy_drop:.1%})")
        if self.min_agreement is not None and a["agreement"] < self.min_agreement:
            fails.append(f"greedy agreement {a['agreement']:.1%} is below {self.min_agreement:.1%}")
        return fails
