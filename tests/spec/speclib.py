"""Helpers for the speculative-decoding tests: prompts, and a context that swaps a proposer onto an engine."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

from inferlab import SamplingParams
from inferlab.spec import SpecPolicy, make_proposer

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ALWAYS = SpecPolicy(always=True)  # speculate every step: every step verifies

TEXTS = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\ndef fib_memo(n, memo={}):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "Rewrite this sentence in the passive voice: The committee approved the new budget on Tuesday.",
    "In mathematics, a prime number is",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Dear team, thank you for your hard work this quarter. Our results show that",
    '{"name": "Ada", "age": 36, "city": "London"}\n{"name": "Alan", "age": 41, "city":',
    "Photosynthesis is the process by which plants",
    "import numpy as np\n\nx = np.linspace(0, 1, 100)\ny = np.sin(x)\nz = np.cos(x)\nw = np.",
    "Summarise: The lighthouse keeper climbed the stairs each night to light the lamp. The lamp guided ships.",
    "Q: What is the capital of France?\nA: Paris\nQ: What is the capital of Italy?\nA: Rome\nQ: What is the",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n",
    "Once upon a time",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY age;\nSELECT name, city FROM users WHERE",
    "red green blue red green blue red green",
    "The mitochondria is the powerhouse of the cell. Explain why:",
]


@contextmanager
def speculating(llm, policy: SpecPolicy = ALWAYS, **options):
    """Run the block with a proposer built by make_proposer (LLMEngine.__init__'s path); afterwards check that
    speculation ran, its counters are consistent and no KV block leaked."""
    eng = llm.engine
    eng.proposer = proposer = make_proposer(replace(eng.config, **options), eng.runner, eng.tokenizer, policy)
    try:
        yield proposer
    finally:
        eng.proposer = None
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.block_tables
    c = proposer.counters
    assert 0 < c.num_drafts and c.num_accepted_tokens <= c.num_draft_tokens


def generate(llm, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)
